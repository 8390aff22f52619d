"""The buffer's Lua scripts: every state change that must be atomic across buffer replicas.

Two (or more) buffer replicas serve one job at once, so every read-check-write on the job's Redis
keys runs inside one script (Redis runs a script with nothing interleaved). `kuberl.buffer.store`
calls them with the keys declared in KEYS; all keys of a job share the `{job}` hash tag, so the
scripts also work on Redis Cluster. Stream entry fields: prompts `p` (prompt id), `e` (epoch),
`rq` (present on re-queued entries); groups `p`, `e`, `v` (oldest policy version of the group),
`z` ("1" when all rewards agree), `k` (field of the group's bytes in the `payloads:<kind>` hash).

Group bytes (~150 KB for 8 x 2k tokens) never pass through Lua: copying them into and out of the
Lua VM made a put cost three times a plain XADD. The service writes them with HSET in the same
MULTI/EXEC transaction as the PUT script (so both apply or neither does), and reads them back
with HMGET; scripts only add and remove the hash fields.
"""

from __future__ import annotations

# Shared helpers, prepended to every script.
_PRELUDE = """
local function fieldmap(f)
  local m = {}
  for i = 1, #f, 2 do m[f[i]] = f[i + 1] end
  return m
end
local function num(v, default)
  if v then return tonumber(v) end
  return default
end
-- stream ids 'ms-seq': a before b
local function id_before(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end
-- Groups of `kind` still to be trained: those in its stream but not in held batches (trained,
-- kept until the trainer's next checkpoint; see _ACK_FN).
local function untrained(groups, state, kind)
  return redis.call('XLEN', groups) - num(redis.call('HGET', state, kind .. ':held_groups'), 0)
end
-- The one place `<kind>:held_groups` changes: by a batch's groups, as it is held (sign 1) or
-- leaves `held` (-1: acknowledged, or issued again by REOPEN).
local function count_held(batch, state, kind, sign)
  local n = tonumber(redis.call('HGET', batch, 'n') or '0')
  redis.call('HINCRBY', state, kind .. ':held_groups', sign * n)
end
local function unhold(batch, held, state, batch_id, kind)
  redis.call('ZREM', held, batch_id)
  count_held(batch, state, kind, -1)
end
"""

# Acknowledge a batch: its groups are trained and leave the stream. Idempotent. A function, so
# that TAKE can acknowledge the trainer's previous batch in the same call (GetBatch's
# `ack_batch_id`: one round trip per training step instead of two).
# With `hold` ('1'), hold it instead: trained, but not in a checkpoint yet. Its groups stay in
# the stream (still pending for the trainer group) and the batch stays re-deliverable, but it
# leaves the ack deadlines (no re-delivery to a live trainer that is merely checkpointing
# rarely) for `held` (scored by issue time), and `<kind>:held_groups` in state takes its groups
# out of the backpressure count and of `exhausted`. An Ack without hold, after the checkpoint,
# acknowledges it as usual; REOPEN hands it out again to a restarted trainer.
# Returns 1 acked (held) now, 0 acked (held or acked) before, -1 unknown.
_ACK_FN = """
local function ack_batch(batch, groups, deadlines, held, state, payloads, batch_id, kind, ttl,
                         hold)
  local st = redis.call('HGET', batch, 'state')
  if st == 'acked' then return 0 end
  if st ~= 'issued' and st ~= 'held' then return -1 end
  if hold == '1' then
    if st == 'held' then return 0 end
    redis.call('HSET', batch, 'state', 'held')
    redis.call('ZREM', deadlines, batch_id)
    redis.call('ZADD', held, redis.call('HGET', batch, 'issued_ms') or '0', batch_id)
    count_held(batch, state, kind, 1)
    redis.call('HINCRBY', state, 'c:' .. kind .. ':held_batches', 1)
    return 1
  end
  if st == 'held' then unhold(batch, held, state, batch_id, kind) end
  local ids = redis.call('HGET', batch, 'entries') or ''
  local n = 0
  for id in string.gmatch(ids, '%S+') do
    local e = redis.call('XRANGE', groups, id, id)
    if e[1] then redis.call('HDEL', payloads, fieldmap(e[1][2]).k) end
    redis.call('XACK', groups, 'trainer', id)
    redis.call('XDEL', groups, id)
    n = n + 1
  end
  redis.call('HSET', batch, 'state', 'acked')
  -- Kept (for `ttl`) only to answer a repeated Ack: the entry list is of no use any more.
  redis.call('HDEL', batch, 'entries')
  redis.call('PEXPIRE', batch, ttl)
  redis.call('ZREM', deadlines, batch_id)
  redis.call('HINCRBY', state, 'c:' .. kind .. ':acked_batches', 1)
  redis.call('HINCRBY', state, 'c:' .. kind .. ':trained_groups', n)
  return 1
end
"""

# Lease up to n prompts: first re-deliver leases idle for longer than the lease timeout
# (XAUTOCLAIM), then new entries, as far as backpressure allows.
# One XAUTOCLAIM looks at no more than COUNT*10 pending entries (every Redis that has it: 6.2,
# the embedded one, and 7.x), and the pending list is in entry-id order, not expiry order: a
# lease re-delivered earlier (an old id, a fresh deadline) sits in front of later ones.
# So the script carries XAUTOCLAIM's cursor: it goes on from where the last call stopped
# (`<kind>:claim_cursor` in state), wraps around once, and stops when it has n prompts, has
# seen the whole pending list, or has spent the scan budget (ARGV[7] entries; the next call
# goes on from there, so no expired lease waits forever behind live ones).
# KEYS: prompt stream, state, prompt data, accepted, lease map, train groups, sft groups
# ARGV: n, consumer, lease timeout ms, max in flight (-1: none), kind, requeue (0/1),
#       scan budget (pending entries), count a refusal (0/1: 0 while a long poll looks again)
# Returns {"busy", inflight} or {"ok", exhausted, need_fill, policy_version,
#          id, prompt id, epoch, deliveries, payload, ...}
LEASE = (
    _PRELUDE
    + """
local stream, state, data, accepted, leasemap = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local n, consumer, kind = tonumber(ARGV[1]), ARGV[2], ARGV[5]
local limit = tonumber(ARGV[4])
local out = {}
local function done(id)
  redis.call('XACK', stream, 'rollout', id)
  redis.call('XDEL', stream, id)
end
-- 1. expired leases (a dead or slow rollout replica) go to this consumer.
local cursor_field = kind .. ':claim_cursor'
local start = redis.call('HGET', state, cursor_field) or '0-0'
local cursor, budget, reclaimed = start, tonumber(ARGV[7]), 0
-- lap 1 runs from start to the end of the pending list, lap 2 from its head up to start.
local lap = 1
if start == '0-0' then lap = 2 end
while #out < n and budget > 0 do
  local want = n - #out
  local claimed = redis.call('XAUTOCLAIM', stream, 'rollout', consumer, ARGV[3], cursor,
                             'COUNT', want)
  budget = budget - want * 10
  for _, e in ipairs(claimed[2]) do
    if e and e[2] then
      local f = fieldmap(e[2])
      if redis.call('HEXISTS', accepted, f.p .. '@' .. f.e) == 1 then
        done(e[1])
      else
        local pend = redis.call('XPENDING', stream, 'rollout', e[1], e[1], 1)
        local deliveries = 1
        if pend[1] then deliveries = pend[1][4] end
        table.insert(out, {e[1], f.p, f.e, deliveries, redis.call('HGET', data, f.p) or ''})
        reclaimed = reclaimed + 1
      end
    end
  end
  cursor = claimed[1]
  if cursor == '0-0' then
    if lap == 2 then break end
    lap = 2
  elseif lap == 2 and start ~= '0-0' and not id_before(cursor, start) then
    break
  end
end
if cursor ~= start then redis.call('HSET', state, cursor_field, cursor) end
-- 2. backpressure: leased prompts plus accepted-but-untrained groups stay <= limit (the
--    groups of held batches are trained: they stay in the streams but do not count).
local room = n - #out
if limit >= 0 then
  local inflight = redis.call('XPENDING', stream, 'rollout')[1]
    + untrained(KEYS[6], state, 'train') + untrained(KEYS[7], state, 'sft')
  if limit - inflight < room then room = limit - inflight end
  if room <= 0 and #out == 0 then
    if ARGV[8] ~= '0' then
      redis.call('HINCRBY', state, 'c:' .. kind .. ':lease_refused', 1)
    end
    return {'busy', inflight}
  end
end
-- 3. new entries.
local need_fill, fresh, read = 0, 0, 0
if room > 0 then
  local r = redis.call('XREADGROUP', 'GROUP', 'rollout', consumer, 'COUNT', room,
                       'STREAMS', stream, '>')
  if r then
    for _, e in ipairs(r[1][2]) do
      read = read + 1
      local f = fieldmap(e[2])
      if redis.call('HEXISTS', accepted, f.p .. '@' .. f.e) == 1 then
        done(e[1])
      else
        table.insert(out, {e[1], f.p, f.e, 1, redis.call('HGET', data, f.p) or ''})
        fresh = fresh + 1
        if not f.rq then
          local ep = tonumber(f.e)
          if ep > num(redis.call('HGET', state, kind .. ':epoch'), -1) then
            redis.call('HSET', state, kind .. ':epoch', ep, kind .. ':cursor', 0)
          end
          redis.call('HINCRBY', state, kind .. ':cursor', 1)
        end
      end
    end
  end
  if read < room then
    local filled = num(redis.call('HGET', state, kind .. ':filled'), -1)
    local epochs = num(redis.call('HGET', state, kind .. ':epochs'), 0)
    if filled < epochs - 1 or redis.call('HEXISTS', state, kind .. ':fill_at') == 1 then
      need_fill = 1
    end
  end
end
if fresh > 0 then redis.call('HINCRBY', state, 'c:' .. kind .. ':leased', fresh) end
if reclaimed > 0 then redis.call('HINCRBY', state, 'c:' .. kind .. ':redelivered', reclaimed) end
-- 4. exhausted: nothing left to hand out, nothing outstanding, nothing that could come back
--    (a group of a held batch is trained: it cannot come back as stale).
local exhausted = 0
if #out == 0 and need_fill == 0 and room > 0 then
  if redis.call('XPENDING', stream, 'rollout')[1] == 0
     and (ARGV[6] == '0' or untrained(KEYS[6], state, 'train') == 0) then
    exhausted = 1
  end
end
local res = {'ok', exhausted, need_fill, num(redis.call('HGET', state, 'policy_version'), 0)}
for _, item in ipairs(out) do
  for _, v in ipairs(item) do table.insert(res, v) end
end
return res
"""
)

# Append the next slice of an epoch (or eval round) to a prompt stream, once: only if it is the
# next slice, so replicas that race to fill queue each prompt once. The first slice of an epoch
# records it as filled (groups of it may be put from then on) and the datasets it is drawn from;
# `<kind>:fill_at` (the next slice's offset) exists while the epoch is partly queued.
# KEYS: prompt stream, state, lease map
# ARGV: kind, epoch, offset, epoch size, datasets (JSON, first slice only), prompt ids...
FILL = """
local kind, epoch, offset, total = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local filled = tonumber(redis.call('HGET', KEYS[2], kind .. ':filled') or '-1')
local at = redis.call('HGET', KEYS[2], kind .. ':fill_at')
if offset == 0 then
  if filled ~= epoch - 1 or at then return -1 end
  redis.call('HSET', KEYS[2], kind .. ':filled', epoch, kind .. ':fill_sets', ARGV[5])
elseif filled ~= epoch or tonumber(at or '-1') ~= offset then
  return -1
end
for i = 6, #ARGV do
  local id = redis.call('XADD', KEYS[1], '*', 'p', ARGV[i], 'e', epoch)
  redis.call('HSET', KEYS[3], ARGV[i] .. '@' .. epoch, id)
end
local upto = offset + #ARGV - 5
if upto >= total then
  redis.call('HDEL', KEYS[2], kind .. ':fill_at')
else
  redis.call('HSET', KEYS[2], kind .. ':fill_at', upto)
end
return #ARGV - 5
"""

# Accept whole groups, at most one per prompt and epoch, and complete their leases. Runs in one
# MULTI/EXEC after the HSET of the groups' bytes into the payloads hash; the bytes of a group
# that is not accepted (duplicate, or the request is refused) are removed again.
# KEYS: group stream, accepted, prompt stream of the leases, lease map, state, prompt data,
#       payloads
# ARGV: kind, lease kind, count, then per group: prompt id, epoch, version, zero-variance,
#       payload field ('' = an empty SFT group: complete the lease, store nothing), lease id
# Returns {"ok", status...} with 1 accepted / 2 duplicate, or {"unknown_prompt", i},
# {"bad_epoch", i, filled}, {"not_queued", i}, {"foreign_lease", i, owner prompt, owner epoch},
# {"no_lease", i}.
PUT = (
    _PRELUDE
    + """
local groups, accepted, prompts, leasemap, state, data, payloads =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local kind, lease_kind, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
local filled = num(redis.call('HGET', state, lease_kind .. ':filled'), -1)
local function refuse(res)
  for i = 0, count - 1 do
    local field = ARGV[4 + i * 6 + 4]
    if field ~= '' then redis.call('HDEL', payloads, field) end
  end
  return res
end
-- Check every group before changing anything: a rejected request stores nothing.
for i = 0, count - 1 do
  local b = 4 + i * 6
  local pid, ep, lease = ARGV[b], tonumber(ARGV[b + 1]), ARGV[b + 5]
  if redis.call('HEXISTS', data, pid) == 0 then return refuse({'unknown_prompt', i}) end
  if ep < 0 or ep > filled then return refuse({'bad_epoch', i, filled}) end
  -- Handed out by this stream (queued and not yet accepted, or accepted or dropped before):
  -- an eval prompt put as a training group, or an epoch its dataset never had, is not.
  local key = pid .. '@' .. ARGV[b + 1]
  local done_before = redis.call('HEXISTS', accepted, key) == 1
  if redis.call('HEXISTS', leasemap, key) == 0 and not done_before then
    return refuse({'not_queued', i})
  end
  local entry = redis.call('XRANGE', prompts, lease, lease)
  if entry[1] then
    local f = fieldmap(entry[1][2])
    if f.p ~= pid or tonumber(f.e) ~= ep then
      return refuse({'foreign_lease', i, f.p, f.e})
    end
  end
  -- A group is taken only against a live lease of its prompt (leased and not completed), or
  -- as the duplicate of one accepted before: nobody can put groups for prompts nobody leased.
  if not done_before and not (entry[1] and redis.call('XPENDING', prompts, 'rollout', lease,
                                                      lease, 1)[1]) then
    return refuse({'no_lease', i})
  end
end
local function complete(id)
  if id and id ~= '' then
    redis.call('XACK', prompts, 'rollout', id)
    redis.call('XDEL', prompts, id)
  end
end
local res = {'ok'}
local n_acc, n_dup, n_empty = 0, 0, 0
for i = 0, count - 1 do
  local b = 4 + i * 6
  local pid, ep, field = ARGV[b], ARGV[b + 1], ARGV[b + 4]
  local key = pid .. '@' .. ep
  complete(ARGV[b + 5])
  if redis.call('HSETNX', accepted, key, 1) == 1 then
    if field ~= '' then
      redis.call('XADD', groups, '*', 'p', pid, 'e', ep, 'v', ARGV[b + 2], 'z', ARGV[b + 3],
                 'k', field)
    else
      n_empty = n_empty + 1
    end
    local mapped = redis.call('HGET', leasemap, key)
    if mapped then
      complete(mapped)
      redis.call('HDEL', leasemap, key)
    end
    n_acc = n_acc + 1
    table.insert(res, 1)
  else
    if field ~= '' then redis.call('HDEL', payloads, field) end
    n_dup = n_dup + 1
    table.insert(res, 2)
  end
end
if n_acc > 0 then redis.call('HINCRBY', state, 'c:' .. kind .. ':accepted', n_acc) end
if n_dup > 0 then redis.call('HINCRBY', state, 'c:' .. kind .. ':duplicate', n_dup) end
if n_empty > 0 then redis.call('HINCRBY', state, 'c:' .. kind .. ':empty', n_empty) end
return res
"""
)

# Give leases back: make them claimable at once by the next LeasePrompts.
# KEYS: prompt stream, state; ARGV: consumer, idle ms to set, kind, lease ids...
RELEASE = """
local n = 0
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], 'rollout', ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[1] then
    redis.call('XCLAIM', KEYS[1], 'rollout', ARGV[1], 0, ARGV[i], 'IDLE', ARGV[2], 'JUSTID')
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[2], 'c:' .. ARGV[3] .. ':released', n) end
return n
"""

# Read new groups for a batch being assembled and note them in the batch record, so that a
# buffer replica dying mid-assembly leaves a record another replica can recover. First, in the
# same call, (a) acknowledge the trainer's previous batch when ARGV[6] names one (unknown:
# nothing is taken) and (b) when ARGV[8] is a time, claim the oldest batch whose ack deadline
# has passed instead of taking anything (pushing its deadline to ARGV[9], so no other replica
# claims it too): an un-acked batch is re-delivered before any new group.
# KEYS: group stream, batch record, deadlines, state, payloads, acked batch's record (any key
#       when none), held batches
# ARGV: consumer, count, batch id, deadline ms, kind, acked batch id or '', acked-batch ttl ms,
#       now ms or '', reclaimed batch's new deadline ms, hold the acked batch ('1') or not
# Returns {"ack_unknown"}, {"reclaim", ack, batch id} or {last stream id, ack, id, prompt id,
# epoch, version, zero-variance, payload field, ...}; ack: 1 acked now, 0 before, -2 none asked.
TAKE = (
    _PRELUDE
    + _ACK_FN
    + """
local acked = -2
if ARGV[6] ~= '' then
  acked = ack_batch(KEYS[6], KEYS[1], KEYS[3], KEYS[7], KEYS[4], KEYS[5], ARGV[6], ARGV[5],
                    ARGV[7], ARGV[10])
  if acked < 0 then return {'ack_unknown'} end
end
if ARGV[8] ~= '' then
  local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', ARGV[8], 'LIMIT', 0, 1)
  if due[1] then
    redis.call('ZADD', KEYS[3], ARGV[9], due[1])
    return {'reclaim', acked, due[1]}
  end
end
local r = redis.call('XREADGROUP', 'GROUP', 'trainer', ARGV[1], 'COUNT', ARGV[2],
                     'STREAMS', KEYS[1], '>')
local res = {'0-0', acked}
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if last[1] then res[1] = last[1][1] end
local ids = {}
if r then
  for _, e in ipairs(r[1][2]) do
    local f = fieldmap(e[2])
    for _, v in ipairs({e[1], f.p, f.e, f.v, f.z, f.k}) do table.insert(res, v) end
    table.insert(ids, e[1])
  end
end
if #ids > 0 then
  local taken = table.concat(ids, ' ')
  local before = redis.call('HGET', KEYS[2], 'taken')
  if before then taken = before .. ' ' .. taken end
  redis.call('HSET', KEYS[2], 'taken', taken, 'kind', ARGV[5])
  redis.call('HSETNX', KEYS[2], 'state', 'assembling')
  redis.call('ZADD', KEYS[3], ARGV[4], ARGV[3])
end
return res
"""
)

# Drop groups (stale, filtered): they leave the stream; stale ones may re-queue their prompt,
# the others keep their `accepted` record with the value `dropped:<reason>`.
# KEYS: group stream, accepted, train prompt stream, train lease map, state, payloads
# ARGV: kind, count, then per group: id, prompt id, epoch, reason, requeue (0/1), payload field
DROP = """
local kind, count = ARGV[1], tonumber(ARGV[2])
for i = 0, count - 1 do
  local b = 3 + i * 6
  local id, pid, ep, reason = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
  redis.call('XACK', KEYS[1], 'trainer', id)
  if redis.call('XDEL', KEYS[1], id) == 1 then
    redis.call('HDEL', KEYS[6], ARGV[b + 5])
    redis.call('HINCRBY', KEYS[5], 'c:' .. kind .. ':dropped:' .. reason, 1)
    local key = pid .. '@' .. ep
    if ARGV[b + 4] == '1' then
      redis.call('HDEL', KEYS[2], key)
      local nid = redis.call('XADD', KEYS[3], '*', 'p', pid, 'e', ep, 'rq', 1)
      redis.call('HSET', KEYS[4], key, nid)
      redis.call('HINCRBY', KEYS[5], 'c:' .. kind .. ':requeued', 1)
    else
      -- The idempotency record stays (no second group for this prompt and epoch) and says why
      -- the group was never trained: the per-prompt ground truth of `kuberl run --chaos`.
      redis.call('HSET', KEYS[2], key, 'dropped:' .. reason)
    end
  end
end
return count
"""

# Issue an assembled batch (or discard an empty one). Groups that were taken for it but neither
# kept nor dropped (a lost reply, a crashed replica) are put back as new entries, so nothing
# stays stuck in the trainer group's pending list.
# KEYS: batch record, deadlines, group stream, state
# ARGV: batch id, deadline ms, kind, now ms, kept ids...
FINALIZE = (
    _PRELUDE
    + """
local kept = {}
for i = 5, #ARGV do kept[ARGV[i]] = true end
local taken = redis.call('HGET', KEYS[1], 'taken') or ''
local returned = 0
for id in string.gmatch(taken, '%S+') do
  if not kept[id] then
    local e = redis.call('XRANGE', KEYS[3], id, id)
    if e[1] then
      redis.call('XADD', KEYS[3], '*', unpack(e[1][2]))
      redis.call('XACK', KEYS[3], 'trainer', id)
      redis.call('XDEL', KEYS[3], id)
      returned = returned + 1
    end
  end
end
if returned > 0 then redis.call('HINCRBY', KEYS[4], 'c:' .. ARGV[3] .. ':reinserted', returned) end
local n = #ARGV - 4
if n == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'issued', 'kind', ARGV[3], 'n', n,
           'entries', table.concat(ARGV, ' ', 5), 'issued_ms', ARGV[4], 'deliveries', 1)
redis.call('HDEL', KEYS[1], 'taken')
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('HINCRBY', KEYS[4], 'c:' .. ARGV[3] .. ':batches', 1)
redis.call('HINCRBY', KEYS[4], 'c:' .. ARGV[3] .. ':groups_delivered', n)
return n
"""
)

# Read a claimed batch for re-delivery. KEYS: batch record, deadlines, group stream, state
# ARGV: batch id, kind. Returns {state, id, prompt id, epoch, version, zero-variance, field...}
# or {"gone"} when the batch was acknowledged, held or removed meanwhile.
FETCH = (
    _PRELUDE
    + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st or st == 'acked' or st == 'held' then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return {'gone'}
end
local ids = redis.call('HGET', KEYS[1], st == 'issued' and 'entries' or 'taken') or ''
local res = {st}
for id in string.gmatch(ids, '%S+') do
  local e = redis.call('XRANGE', KEYS[3], id, id)
  if e[1] then
    local f = fieldmap(e[1][2])
    for _, v in ipairs({id, f.p, f.e, f.v, f.z, f.k}) do table.insert(res, v) end
  end
end
if st == 'issued' then
  redis.call('HINCRBY', KEYS[1], 'deliveries', 1)
  redis.call('HINCRBY', KEYS[4], 'c:' .. ARGV[2] .. ':batches_redelivered', 1)
end
return res
"""
)

# Take an issued batch back to assembling (its groups too old for the trainer now): its entries
# become the taken ones, so the next FINALIZE issues what the filters keep and puts back the
# rest. KEYS: batch record; returns 1, or 0 when it is no longer issued (acknowledged, held).
REASSEMBLE = """
if redis.call('HGET', KEYS[1], 'state') ~= 'issued' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'assembling',
           'taken', redis.call('HGET', KEYS[1], 'entries') or '')
redis.call('HDEL', KEYS[1], 'entries')
return 1
"""

# Acknowledge (or hold) a batch (see _ACK_FN).
# KEYS: batch record, group stream, deadlines, state, payloads, held batches
# ARGV: batch id, kind, ttl ms, hold ('1') or not
ACK = (
    _PRELUDE
    + _ACK_FN
    + """
return ack_batch(KEYS[1], KEYS[2], KEYS[3], KEYS[6], KEYS[4], KEYS[5], ARGV[1], ARGV[2], ARGV[3],
                 ARGV[4])
"""
)

# Hand a held batch out again (the trainer restarted from a checkpoint that may predate it): it
# is issued again, due at once, in issue order (its score in `held`), so the next GetBatch
# re-delivers it with its id before any new group. KEYS: batch record, held batches, deadlines,
# state; ARGV: batch id, kind. Returns 1 reopened, 0 not held (acknowledged meanwhile, gone).
REOPEN = (
    _PRELUDE
    + """
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if redis.call('HGET', KEYS[1], 'state') ~= 'held' then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
unhold(KEYS[1], KEYS[2], KEYS[4], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'issued')
redis.call('ZADD', KEYS[3], score or '0', ARGV[1])
redis.call('HINCRBY', KEYS[4], 'c:' .. ARGV[2] .. ':batches_reopened', 1)
return 1
"""
)

# Monotonic policy version. KEYS: state; ARGV: version. Returns {1, v} or {0, current}.
SET_VERSION = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'policy_version') or '0')
local v = tonumber(ARGV[1])
if v < cur then return {0, cur} end
redis.call('HSET', KEYS[1], 'policy_version', ARGV[1])
return {1, v}
"""

# Raise a count in the state hash (`<kind>:epochs` to queue, `eval:asked`), never lower it.
# KEYS: state; ARGV: field, count. Returns {previous, new}.
RAISE_COUNT = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local want = tonumber(ARGV[2])
if want > cur then redis.call('HSET', KEYS[1], ARGV[1], want) return {cur, want} end
return {cur, cur}
"""
