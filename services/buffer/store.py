"""The job's buffer state in Redis: key layout, and every operation the gRPC service performs.

`BufferStore` is the only code that talks to Redis; `kuberl.buffer.server` validates requests and
turns results into protos, this module makes them durable. Everything lives under the job's keys
(`kuberl:{<job>}:...`), so any number of buffer replicas can serve one job; each state change that
must be atomic is one Lua script (`kuberl.buffer.scripts`).

Layout (`<kind>` is train, eval or sft; sft has no prompt stream of its own, its groups come from
train prompts), each key prefixed by `kuberl:{<job>}:`:

- `state` (hash): policy_version, seed, `<kind>:epochs` (epochs to queue), `<kind>:filled`
  (last epoch queued, or being queued: `<kind>:fill_at` is then the next slice's offset and
  `<kind>:fill_sets` the datasets of that epoch), `<kind>:epoch` / `<kind>:cursor` (epoch
  being handed out, prompts of it handed out so far), `<kind>:claim_cursor` (where the next
  scan for expired leases goes on), `<kind>:held_groups` (groups of held batches), `eval:asked`
  (eval rounds a trainer asked for with StartEval: the highest + 1), and the job's counters
  `c:<kind>:<name>`.
- `datasets` (hash): dataset name -> JSON {path, kind, num_prompts, num_epochs}.
- `prompt_data` (hash): prompt id (`<dataset>:<row>`) -> JSON {t: text, a: answer, m: metadata}.
- `prompts:<kind>` (stream, consumer group `rollout`): one entry per prompt and epoch, queued one
  epoch at a time in that epoch's seeded order; an entry stays pending while leased.
- `leases:<kind>` (hash): `<prompt>@<epoch>` -> the entry that currently stands for it.
- `groups:<kind>` (stream, consumer group `trainer`): one entry per accepted group.
- `payloads:<kind>` (hash): the serialized `kuberl.common.v1.Group` of each entry of `groups`.
- `accepted:<kind>` (hash): `<prompt>@<epoch>` of every accepted group (the idempotency record).
- `batch:<id>` (hash): state (assembling, issued, held, acked) and the entry ids of a batch.
- `batches:<kind>` (sorted set): batch id -> deadline in ms, for re-delivery after the timeout.
- `held:<kind>` (sorted set): batch id -> issue time in ms of each held batch (trained, kept
  until the trainer's next checkpoint; re-issued in this order when the trainer restarts).

Requests that find Redis unreachable (a restart, a failover) are retried with backoff for up to
`redis.connect_timeout_seconds`, then answered UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import BusyLoadingError, NoScriptError, OutOfMemoryError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kuberl.buffer import scripts
from kuberl.buffer.cache import Payload, PayloadCache
from kuberl.common.config import JobConfig
from kuberl.common.datasets import SHUFFLE_STREAM, PromptRow, epoch_sets_order
from kuberl.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from kuberl.common.logs import get_logger
from kuberl.common.tls import redis_options

log = get_logger(__name__)

KINDS = ("train", "eval", "sft")
PROMPT_KINDS = ("train", "eval")
_TRANSIENT = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ConnectionError, OSError)
_ENTRY_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")  # fullmatch; ASCII digits only


def is_entry_id(text: str) -> bool:
    """A Redis stream entry id Redis accepts: `<ms>-<seq>`, each below 2**64 (a lease handle).
    `\\d` and `$` once let Unicode digits, a trailing newline and overflowing numbers through,
    which Redis then refused inside a script: INTERNAL, and a put's payload left behind."""
    if not _ENTRY_ID.fullmatch(text):
        return False
    ms, seq = text.split("-")
    return int(ms) < 2**64 and int(seq) < 2**64


#: Retry hint when Redis is at its maxmemory.
REDIS_FULL_RETRY_SECONDS = 1.0
DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def lease_kind(kind: str) -> str:
    """The prompt stream whose leases groups of `kind` complete (sft groups come from train)."""
    return "train" if kind == "sft" else kind


@dataclass(frozen=True)
class Keys:
    """Redis key names of one job."""

    job: str

    @property
    def prefix(self) -> str:
        return f"kuberl:{{{self.job}}}:"

    @property
    def state(self) -> str:
        return self.prefix + "state"

    @property
    def datasets(self) -> str:
        return self.prefix + "datasets"

    @property
    def prompt_data(self) -> str:
        return self.prefix + "prompt_data"

    def prompts(self, kind: str) -> str:
        return f"{self.prefix}prompts:{lease_kind(kind)}"

    def leases(self, kind: str) -> str:
        return f"{self.prefix}leases:{lease_kind(kind)}"

    def groups(self, kind: str) -> str:
        return f"{self.prefix}groups:{kind}"

    def accepted(self, kind: str) -> str:
        return f"{self.prefix}accepted:{kind}"

    def payloads(self, kind: str) -> str:
        return f"{self.prefix}payloads:{kind}"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}batch:{batch_id}"

    def batches(self, kind: str) -> str:
        return f"{self.prefix}batches:{kind}"

    def held(self, kind: str) -> str:
        return f"{self.prefix}held:{kind}"


@dataclass(frozen=True)
class LeasedPrompt:
    lease_id: str
    prompt_id: str
    epoch: int
    deliveries: int
    payload: dict[str, str]


@dataclass
class LeaseResult:
    prompts: list[LeasedPrompt] = field(default_factory=list)
    policy_version: int = 0
    exhausted: bool = False
    busy: bool = False
    inflight: int = 0


@dataclass(frozen=True)
class PutItem:
    """One validated group ready to store."""

    prompt_id: str
    epoch: int
    version: int
    zero_variance: bool
    payload: bytes | memoryview  # b"" = empty SFT group: complete the lease, store nothing
    lease_id: str = ""


@dataclass(frozen=True)
class StoredGroup:
    """A group entry of a trajectory stream as read back for a batch."""

    entry_id: str
    prompt_id: str
    epoch: int
    version: int
    zero_variance: bool
    payload_key: str  # its field in the payloads hash
    payload: Payload = b""  # the serialized Group; b"" if it is missing


@dataclass(frozen=True)
class Taken:
    """What one TAKE did: the acknowledgement asked for (1 now, 0 before, -1 unknown: nothing
    else was done, -2 none asked), a claimed overdue batch (then nothing was taken), or the
    groups taken (metadata only) and the stream's last id."""

    ack: int
    reclaimed: str | None = None
    last_id: str = "0-0"
    groups: list[StoredGroup] = field(default_factory=list)


@dataclass(frozen=True)
class Drop:
    group: StoredGroup
    reason: str
    requeue: bool


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _groups_from(flat: Sequence[Any]) -> list[StoredGroup]:
    return [
        StoredGroup(
            entry_id=_s(flat[i]),
            prompt_id=_s(flat[i + 1]),
            epoch=int(flat[i + 2]),
            version=int(flat[i + 3]),
            zero_variance=flat[i + 4] in (b"1", "1"),
            payload_key=_s(flat[i + 5]),
        )
        for i in range(0, len(flat), 6)
    ]


def now_ms() -> int:
    return int(time.time() * 1000)


class BufferStore:
    """One job's buffer state in Redis. All methods are safe to call from several replicas."""

    # Pending leases one LeasePrompts may look at for expired ones (XAUTOCLAIM's COUNT*10 per
    # call, see LEASE). Bounds the time the script holds Redis when many prompts are leased; a
    # scan cut short goes on from there at the next call.
    claim_scan_budget = 10_000

    def __init__(
        self,
        client: aioredis.Redis,
        job: str,
        *,
        lease_timeout_seconds: float,
        max_inflight_groups: int,
        batch_ack_timeout_seconds: float,
        requeue_stale: bool,
        acked_batch_ttl_seconds: float,
        retry_seconds: float = 30.0,
        payload_cache_bytes: int = 0,
        queue_slice_prompts: int = 1024,
    ) -> None:
        self.r = client
        self.keys = Keys(job)
        self.job = job
        self.lease_timeout_ms = max(1, int(lease_timeout_seconds * 1000))
        self.max_inflight_groups = max_inflight_groups
        self.batch_ack_timeout_ms = max(1, int(batch_ack_timeout_seconds * 1000))
        self.requeue_stale = requeue_stale
        self.acked_batch_ttl_ms = max(1, int(acked_batch_ttl_seconds * 1000))
        self.retry_seconds = retry_seconds
        # The bytes of groups this replica accepted, until a batch here takes them (cache.py).
        self.cache = PayloadCache(payload_cache_bytes)
        self.queue_slice = queue_slice_prompts
        self._order_key: tuple[str, int, str, int] | None = None
        self._order: list[str] = []
        self._scripts = {
            name: client.register_script(getattr(scripts, name))
            for name in (
                "LEASE",
                "FILL",
                "PUT",
                "RELEASE",
                "TAKE",
                "DROP",
                "FINALIZE",
                "FETCH",
                "ACK",
                "REOPEN",
                "REASSEMBLE",
                "SET_VERSION",
                "RAISE_COUNT",
            )
        }

    @classmethod
    def connect(
        cls, url: str, password: str | None = None, tls: dict[str, Any] | None = None, **kw: Any
    ) -> BufferStore:
        """A store on a new client for url (no I/O yet; see `wait_ready`)."""
        client = aioredis.Redis.from_url(
            url,
            password=password or None,
            retry=Retry(NoBackoff(), 0),  # `_retry` below is deadline-based instead
            socket_connect_timeout=5,
            health_check_interval=10,
            **(tls or {}),  # rediss://: CA and client certificate (kuberl.common.tls)
        )
        return cls(client, **kw)

    @classmethod
    def from_config(cls, config: JobConfig) -> BufferStore:
        """The store of config's job on `redis.url` (password from `redis.password_env`)."""
        url = config.redis.url
        if not url:
            raise Unavailable(
                "redis.url is not set: the buffer keeps all state in Redis. Set redis.url (or "
                "KUBERL_REDIS__URL); `kuberl run` starts an embedded Redis and sets it for you."
            )
        cfg = config.buffer
        return cls.connect(
            url,
            os.environ.get(config.redis.password_env) or None,
            redis_options(config.redis),
            job=config.job.name,
            lease_timeout_seconds=cfg.lease_timeout_seconds,
            max_inflight_groups=cfg.max_inflight_groups,
            batch_ack_timeout_seconds=cfg.batch_ack_timeout_seconds,
            requeue_stale=cfg.requeue_stale,
            acked_batch_ttl_seconds=cfg.acked_batch_ttl_seconds,
            retry_seconds=config.redis.connect_timeout_seconds,
            payload_cache_bytes=cfg.payload_cache_mib * 2**20,
            queue_slice_prompts=cfg.queue_slice_prompts,
        )

    async def close(self) -> None:
        await self.r.aclose()

    # -- plumbing -----------------------------------------------------------------------------

    async def _retry(self, op: Callable[[], Awaitable[Any] | Any], what: str) -> Any:
        """Run op, retrying while Redis is unreachable or loading, up to retry_seconds."""
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.05
        regrouped = False
        while True:
            try:
                return await op()
            except _TRANSIENT as exc:
                if time.monotonic() + delay > deadline:
                    raise Unavailable(
                        f"Redis unreachable for {self.retry_seconds:.0f}s during {what}: {exc}"
                    ) from exc
                log.warning("redis.retry", op=what, error=str(exc), delay=round(delay, 3))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
            except OutOfMemoryError as exc:
                # Redis at its maxmemory (noeviction) refuses growing writes; acknowledgements,
                # which free memory, still run. Backpressure, not a failure.
                log.warning("redis.full", op=what, error=str(exc)[:200])
                raise ResourceExhausted(
                    f"Redis is full (its maxmemory) during {what}: writes that grow it are "
                    f"refused until training frees room; retry in {REDIS_FULL_RETRY_SECONDS:g}s",
                    retry_after_seconds=REDIS_FULL_RETRY_SECONDS,
                ) from None
            except ResponseError as exc:
                # A Redis that lost its data (no AOF) has no consumer groups; recreate them once.
                if "NOGROUP" in str(exc) and not regrouped:
                    regrouped = True
                    log.warning("redis.nogroup", op=what)
                    await self.ensure_groups()
                    continue
                raise

    async def _multi(self, queue: Callable[[Any], None], what: str) -> list[Any]:
        """Run the commands `queue(pipe)` adds (scripts by EVALSHA among them) as one MULTI/EXEC
        transaction, one round trip; the replies in order. Loads the scripts once if Redis has
        lost them (a restart empties its script cache)."""
        for _attempt in range(2):
            pipe = self.r.pipeline(transaction=True)
            queue(pipe)
            try:
                return list(await pipe.execute())
            except NoScriptError:
                await self.load_scripts()
        raise Unavailable(f"the scripts of {what} could not be loaded into Redis")

    async def _script(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        script = self._scripts[name]
        return await self._retry(lambda: script(keys=list(keys), args=list(args)), name.lower())

    async def wait_ready(self, timeout: float) -> None:
        """Block until Redis answers PING (it may start after us), else raise Unavailable."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self.r.ping()
                return
            except _TRANSIENT as exc:
                if time.monotonic() > deadline:
                    raise Unavailable(f"Redis not reachable after {timeout:.0f}s: {exc}") from exc
                await asyncio.sleep(0.2)

    async def load_scripts(self) -> None:
        """Load every script into Redis' script cache (done at start and after a restart)."""
        for name in self._scripts:
            await self.r.script_load(getattr(scripts, name))

    async def ensure_groups(self) -> None:
        """Create the streams and consumer groups of the job if missing (idempotent)."""
        pairs = [(self.keys.prompts(k), "rollout") for k in PROMPT_KINDS]
        pairs += [(self.keys.groups(k), "trainer") for k in KINDS]
        for stream, group in pairs:
            try:
                await self.r.xgroup_create(stream, group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # -- datasets and epochs ------------------------------------------------------------------

    async def load_dataset(
        self,
        name: str,
        path: str,
        kind: str,
        rows: Sequence[PromptRow],
        num_epochs: int,
        seed: int,
    ) -> tuple[int, bool]:
        """Store a dataset's prompts once per name; (number of prompts, loaded now)."""
        if kind not in PROMPT_KINDS:
            raise InvalidArgument(f"datasets are loaded as TRAIN or EVAL prompts, not {kind}")
        known = await self.loaded_dataset(name, path, kind, num_epochs)
        if known is not None:
            return known, False
        record = json.dumps(
            {"path": path, "kind": kind, "num_prompts": len(rows), "num_epochs": num_epochs}
        )

        async def write() -> Any:
            pipe = self.r.pipeline(transaction=True)
            chunk = 2000
            for start in range(0, len(rows), chunk):
                pipe.hset(
                    self.keys.prompt_data,
                    mapping={
                        f"{name}:{start + i}": row.payload()
                        for i, row in enumerate(rows[start : start + chunk])
                    },
                )
            pipe.hsetnx(self.keys.state, "seed", str(seed))
            pipe.hsetnx(self.keys.datasets, name, record)
            return await pipe.execute()

        # Payloads are a pure function of the file, so two replicas writing them is harmless;
        # HSETNX on the dataset record decides which load counts.
        result = await self._retry(write, "load")
        loaded = bool(result[-1])
        await self._raise_epochs(kind, num_epochs)
        log.info("dataset.loaded", name=name, kind=kind, prompts=len(rows), new=loaded)
        return len(rows), loaded

    async def loaded_dataset(self, name: str, path: str, kind: str, num_epochs: int) -> int | None:
        """The number of prompts of dataset `name` if it is loaded already (None if not), its
        epochs raised to `num_epochs`: the job's count and the dataset's own, which decides
        whether the new epochs queue its prompts: raising only the job's would queue them
        empty."""
        existing = await self._retry(lambda: self.r.hget(self.keys.datasets, name), "load")
        if existing is None:
            return None
        info = json.loads(existing)
        if info["kind"] != kind:
            raise FailedPrecondition(
                f"dataset {name!r} is already loaded as {info['kind']} prompts, not {kind}"
            )
        if info.get("path") != path:
            log.warning("dataset.path_changed", dataset=name, loaded=info.get("path"), now=path)
        if num_epochs > int(info["num_epochs"]):
            info["num_epochs"] = num_epochs
            record = json.dumps(info)
            await self._retry(lambda: self.r.hset(self.keys.datasets, name, record), "load")
        await self._raise_epochs(kind, num_epochs)
        return int(info["num_prompts"])

    async def _raise_epochs(self, kind: str, epochs: int) -> tuple[int, int]:
        return await self._raise_count(f"{kind}:epochs", epochs)

    async def _raise_count(self, name: str, count: int) -> tuple[int, int]:
        prev, new = await self._script("RAISE_COUNT", [self.keys.state], [name, count])
        return int(prev), int(new)

    async def _datasets(self) -> dict[str, dict[str, Any]]:
        raw = await self._retry(lambda: self.r.hgetall(self.keys.datasets), "datasets")
        return {_s(k): json.loads(v) for k, v in raw.items()}

    async def _epoch_sets(self, kind: str, epoch: int) -> list[tuple[str, int]]:
        """The datasets (name, prompts) an epoch of kind draws from, by name."""
        sets = []
        for name, info in sorted((await self._datasets()).items()):
            if info["kind"] != kind:
                continue
            # Eval rounds are queued on request (StartEval), every eval dataset in each.
            if kind == "train" and epoch >= int(info["num_epochs"]):
                continue
            sets.append((name, int(info["num_prompts"])))
        return sets

    def _epoch_order(self, kind: str, epoch: int, sets_json: str, seed: int) -> list[str]:
        """An epoch's prompt ids in their seeded order, kept for the epoch's later slices."""
        key = (kind, epoch, sets_json, seed)
        if self._order_key != key:
            sets = [(str(n), int(c)) for n, c in json.loads(sets_json)]
            self._order = epoch_sets_order(sets, seed, epoch, SHUFFLE_STREAM[kind])
            self._order_key = key
        return self._order

    async def fill_next(self, kind: str) -> int:
        """Queue the next slice of a prompt stream's epoch if one is due; return prompts queued
        (0 when none is due, or another replica queued that slice first).

        An epoch goes in slices of `queue_slice_prompts` as leases reach its end: each slice is
        one script, so Redis serves other calls between them. Its later slices come from the
        datasets its first one recorded (`fill_sets`), so a dataset loaded meanwhile cannot
        change the order of an epoch half queued."""
        fields = [
            f"{kind}:filled",
            f"{kind}:epochs",
            "seed",
            f"{kind}:fill_at",
            f"{kind}:fill_sets",
        ]
        state = await self._retry(lambda: self.r.hmget(self.keys.state, fields), "fill")
        filled = int(state[0]) if state[0] is not None else -1
        seed = int(state[2] or 0)
        if state[3] is not None:
            epoch, offset, sets_json = filled, int(state[3]), _s(state[4] or b"[]")
        elif filled < int(state[1] or 0) - 1:
            epoch, offset = filled + 1, 0
            sets_json = json.dumps(await self._epoch_sets(kind, epoch))
        else:
            return 0
        order = self._epoch_order(kind, epoch, sets_json, seed)
        chunk = order[offset : offset + self.queue_slice]
        n = await self._script(
            "FILL",
            [self.keys.prompts(kind), self.keys.state, self.keys.leases(kind)],
            [kind, epoch, offset, len(order), sets_json, *chunk],
        )
        if int(n) >= 0 and offset + int(n) >= len(order):
            log.info("epoch.queued", kind=kind, epoch=epoch, prompts=len(order))
        return max(0, int(n))

    async def start_eval(self, round_: int) -> tuple[int, bool, int]:
        """Make sure eval rounds 0..round are queued; (rounds, asked for the first time, prompts
        per round). A round asked for before (or below one asked for) may have had its groups
        read by a trainer since killed: not a whole round any more.
        Without eval prompts nothing changes (0 prompts): a refused StartEval once still raised
        the round count, so an eval dataset loaded later queued rounds nobody asked for."""
        num = sum(count for _, count in await self._epoch_sets("eval", round_))
        if num == 0:
            return 0, False, 0
        asked, _ = await self._raise_count("eval:asked", round_ + 1)
        _, rounds = await self._raise_epochs("eval", round_ + 1)
        return rounds, round_ >= asked, num

    # -- prompts ------------------------------------------------------------------------------

    async def lease(
        self, kind: str, n: int, consumer: str, *, count_refusal: bool = True
    ) -> LeaseResult:
        """Up to n prompts for consumer: expired leases first, then new ones (see LEASE).
        `count_refusal=False` leaves the lease_refused counter alone when it is busy (a long
        poll that will look again)."""
        limit = self.max_inflight_groups if kind == "train" else -1
        requeue = "1" if kind == "train" and self.requeue_stale else "0"
        keys = [
            self.keys.prompts(kind),
            self.keys.state,
            self.keys.prompt_data,
            self.keys.accepted(kind),
            self.keys.leases(kind),
            self.keys.groups("train"),
            self.keys.groups("sft"),
        ]
        result = LeaseResult()
        for _ in range(8):
            want = n - len(result.prompts)
            res = await self._script(
                "LEASE",
                keys,
                [
                    want,
                    consumer,
                    self.lease_timeout_ms,
                    limit,
                    kind,
                    requeue,
                    self.claim_scan_budget,
                    "1" if count_refusal else "0",
                ],
            )
            if res[0] == b"busy":
                if not result.prompts:
                    result.busy, result.inflight = True, int(res[1])
                break
            result.exhausted = bool(res[1])
            need_fill = bool(res[2])
            result.policy_version = int(res[3])
            for i in range(4, len(res), 5):
                payload = json.loads(res[i + 4]) if res[i + 4] else {}
                result.prompts.append(
                    LeasedPrompt(
                        lease_id=_s(res[i]),
                        prompt_id=_s(res[i + 1]),
                        epoch=int(res[i + 2]),
                        deliveries=int(res[i + 3]),
                        payload=payload,
                    )
                )
            if not need_fill or len(result.prompts) >= n:
                break
            await self.fill_next(kind)
        if result.prompts:
            result.exhausted = False
        return result

    async def release(self, kind: str, consumer: str, lease_ids: Sequence[str]) -> int:
        """Hand consumer's leases back so the next LeasePrompts re-delivers them at once."""
        ids = [i for i in lease_ids if is_entry_id(i)]
        if not ids:
            return 0
        idle = self.lease_timeout_ms + 86_400_000
        n = await self._script(
            "RELEASE", [self.keys.prompts(kind), self.keys.state], [consumer, idle, kind, *ids]
        )
        return int(n)

    # -- groups -------------------------------------------------------------------------------

    async def put(self, kind: str, items: Sequence[PutItem]) -> list[bool]:
        """Store groups atomically; per group True = accepted, False = duplicate.

        InvalidArgument (nothing stored) when a group names an unknown prompt, an epoch that was
        never queued, a lease that belongs to another prompt, or no live lease of its prompt
        (unless it is the duplicate of a group accepted before)."""
        for i, item in enumerate(items):
            if not is_entry_id(item.lease_id):
                raise InvalidArgument(
                    f"groups[{i}]: lease_id {item.lease_id!r} is not a lease handle: put each "
                    "group with the lease_id LeasePrompts gave its prompt"
                )
        keys = [
            self.keys.groups(kind),
            self.keys.accepted(kind),
            self.keys.prompts(kind),
            self.keys.leases(kind),
            self.keys.state,
            self.keys.prompt_data,
            self.keys.payloads(kind),
        ]
        sha = self._scripts["PUT"].sha
        stored: list[str] = []  # the fields of the attempt whose reply came back

        async def op() -> Any:
            # Fresh fields on every attempt: if an attempt was applied but its reply lost, the
            # retry's copies are the duplicates the script removes, not the accepted ones.
            fields = [uuid.uuid4().hex if it.payload else "" for it in items]
            stored[:] = fields
            args: list[Any] = [kind, lease_kind(kind), len(items)]
            for it, f in zip(items, fields, strict=True):
                zv = "1" if it.zero_variance else "0"
                args += [it.prompt_id, it.epoch, it.version, zv, f, it.lease_id]
            mapping = {f: it.payload for it, f in zip(items, fields, strict=True) if f}

            def queue(pipe: Any) -> None:
                if mapping:
                    pipe.hset(self.keys.payloads(kind), mapping=mapping)
                pipe.evalsha(sha, len(keys), *keys, *args)

            return (await self._multi(queue, "PUT"))[-1]

        try:
            res = await self._retry(op, "put")
        except (ResponseError, ResourceExhausted):
            # The script failed after the bytes were written in its transaction (MULTI does
            # not roll back), or Redis was full: nothing may keep them.
            if any(stored):
                fields = [f for f in stored if f]
                await self._retry(lambda: self.r.hdel(self.keys.payloads(kind), *fields), "put")
            raise
        status = _s(res[0])
        if status == "unknown_prompt":
            i = int(res[1])
            raise InvalidArgument(
                f"groups[{i}]: prompt {items[i].prompt_id!r} is not a prompt of job {self.job!r}"
            )
        if status == "bad_epoch":
            i = int(res[1])
            raise InvalidArgument(
                f"groups[{i}]: epoch {items[i].epoch} of prompt {items[i].prompt_id!r} was never "
                f"handed out (epochs queued: 0..{int(res[2])})"
            )
        if status == "not_queued":
            i = int(res[1])
            raise InvalidArgument(
                f"groups[{i}]: prompt {items[i].prompt_id!r} epoch {items[i].epoch} was never "
                f"handed out by the {lease_kind(kind)} prompt stream (a prompt of another "
                "stream, or an epoch its dataset does not have)"
            )
        if status == "no_lease":
            i = int(res[1])
            raise InvalidArgument(
                f"groups[{i}]: lease {items[i].lease_id} of prompt {items[i].prompt_id!r} epoch "
                f"{items[i].epoch} is not live (never handed out, or completed or given back): "
                "lease the prompt again"
            )
        if status == "foreign_lease":
            i = int(res[1])
            raise InvalidArgument(
                f"groups[{i}]: lease {items[i].lease_id} is for prompt {_s(res[2])!r} epoch "
                f"{_s(res[3])}, not {items[i].prompt_id!r} epoch {items[i].epoch}"
            )
        accepted = [int(x) == 1 for x in res[1:]]
        whole = all(accepted)
        for it, key, ok in zip(items, stored, accepted, strict=True):
            if ok:
                # A slice of the request's bytes keeps all of them alive: copied unless the
                # whole request is kept anyway.
                self.cache.add(key, it.payload if whole else bytes(it.payload))
        return accepted

    async def take(
        self,
        kind: str,
        consumer: str,
        count: int,
        batch_id: str,
        deadline_ms: int,
        *,
        ack_batch_id: str = "",
        hold: bool = False,
        reclaim: bool = False,
    ) -> Taken:
        """Read up to `count` new groups into an assembling batch (metadata only: `payloads`
        reads their bytes). In the same script, first acknowledge `ack_batch_id` (a batch of
        this kind; unknown: nothing is taken; with `hold`, hold it instead) and, with
        `reclaim`, claim a batch past its ack deadline instead of taking anything."""
        now = now_ms()
        keys = [
            self.keys.groups(kind),
            self.keys.batch(batch_id),
            self.keys.batches(kind),
            self.keys.state,
            self.keys.payloads(kind),
            self.keys.batch(ack_batch_id) if ack_batch_id else self.keys.batch(batch_id),
            self.keys.held(kind),
        ]
        args = [consumer, count, batch_id, deadline_ms, kind, ack_batch_id]
        args += [self.acked_batch_ttl_ms, now if reclaim else "", now + self.batch_ack_timeout_ms]
        args += ["1" if hold else "0"]
        res = await self._script("TAKE", keys, args)
        head = _s(res[0])
        if head == "ack_unknown":
            return Taken(ack=-1)
        if head == "reclaim":
            return Taken(ack=int(res[1]), reclaimed=_s(res[2]))
        return Taken(ack=int(res[1]), last_id=head, groups=_groups_from(res[2:]))

    async def payloads(self, kind: str, groups: list[StoredGroup]) -> list[StoredGroup]:
        """The groups with their bytes: from this replica's cache, else read from the payloads
        hash (one HMGET)."""
        groups = self._from_cache(groups)
        unread = [g for g in groups if not g.payload]
        if not unread:
            return groups
        fields = [g.payload_key for g in unread]
        raw = await self._retry(lambda: self.r.hmget(self.keys.payloads(kind), fields), "payloads")
        read = iter(self._attach(kind, unread, raw))
        return [g if g.payload else next(read) for g in groups]

    def _from_cache(self, groups: list[StoredGroup]) -> list[StoredGroup]:
        """The groups, those without bytes given the cached ones (which leave the cache)."""
        out = []
        for g in groups:
            payload = None if g.payload else self.cache.take(g.payload_key)
            out.append(g if payload is None else replace(g, payload=payload))
        return out

    @staticmethod
    def _attach(kind: str, groups: list[StoredGroup], raw: Sequence[Any]) -> list[StoredGroup]:
        out = []
        for g, payload in zip(groups, raw, strict=True):
            if payload is None:
                log.error("group.payload_missing", kind=kind, entry=g.entry_id, prompt=g.prompt_id)
            out.append(replace(g, payload=payload or b""))
        return out

    async def finish(
        self, kind: str, batch_id: str, kept: list[StoredGroup], drops: Sequence[Drop]
    ) -> tuple[int, list[StoredGroup]]:
        """Drop `drops`, issue the batch with `kept` (FINALIZE; none kept: discard it) and read
        the bytes of the kept groups that lack them, in one transaction (one round trip).
        Returns (groups issued, kept with their bytes)."""
        finalize = self._finalize_call(kind, batch_id, [g.entry_id for g in kept])
        drop = self._drop_call(kind, drops) if drops else None
        self._forget(drops)
        kept = self._from_cache(kept)
        unread = [g for g in kept if not g.payload]
        scripts = self._scripts

        def queue(pipe: Any) -> None:
            if drop is not None:
                pipe.evalsha(scripts["DROP"].sha, len(drop[0]), *drop[0], *drop[1])
            pipe.evalsha(scripts["FINALIZE"].sha, len(finalize[0]), *finalize[0], *finalize[1])
            if unread:
                pipe.hmget(self.keys.payloads(kind), [g.payload_key for g in unread])

        replies = await self._retry(lambda: self._multi(queue, "GetBatch"), "finish")
        issued = int(replies[1 if drop is not None else 0])
        read = iter(self._attach(kind, unread, replies[-1]) if unread else [])
        return issued, [g if g.payload else next(read) for g in kept]

    async def fetch(self, kind: str, batch_id: str) -> tuple[str, list[StoredGroup]] | None:
        """A claimed batch for re-delivery with its groups' bytes: (state, groups), or None when
        it was acknowledged or removed meanwhile."""
        keys = [
            self.keys.batch(batch_id),
            self.keys.batches(kind),
            self.keys.groups(kind),
            self.keys.state,
        ]
        res = await self._script("FETCH", keys, [batch_id, kind])
        state = _s(res[0])
        if state == "gone":
            return None
        return state, await self.payloads(kind, _groups_from(res[1:]))

    async def reassemble(self, kind: str, batch_id: str) -> bool:
        """Take a claimed issued batch back to assembling (REASSEMBLE); False when it is no
        longer issued."""
        return bool(await self._script("REASSEMBLE", [self.keys.batch(batch_id)], []))

    async def wait_for_groups(self, kind: str, after_id: str, timeout: float) -> None:
        """Block until a group newer than after_id arrives or timeout passes."""
        ms = int(timeout * 1000)
        if ms <= 0:
            return
        try:
            await self.r.xread({self.keys.groups(kind): after_id}, count=1, block=ms)
        except _TRANSIENT:
            await asyncio.sleep(min(timeout, 0.2))

    async def drop(self, kind: str, drops: Sequence[Drop]) -> None:
        """Remove dropped groups from the stream (stale ones may re-queue their prompt)."""
        self._forget(drops)
        await self._script("DROP", *self._drop_call(kind, drops))

    def _forget(self, drops: Sequence[Drop]) -> None:
        """Dropped groups' bytes leave the cache (DROP deletes them in Redis)."""
        for d in drops:
            self.cache.discard(d.group.payload_key)

    def _drop_call(self, kind: str, drops: Sequence[Drop]) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of the DROP script for `drops`."""
        args: list[Any] = [kind, len(drops)]
        for d in drops:
            g = d.group
            args += [
                g.entry_id,
                g.prompt_id,
                g.epoch,
                d.reason,
                "1" if d.requeue else "0",
                g.payload_key,
            ]
        keys = [
            self.keys.groups(kind),
            self.keys.accepted(kind),
            self.keys.prompts("train"),
            self.keys.leases("train"),
            self.keys.state,
            self.keys.payloads(kind),
        ]
        return keys, args

    def _finalize_call(
        self, kind: str, batch_id: str, kept: Sequence[str]
    ) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of the FINALIZE script."""
        keys = [
            self.keys.batch(batch_id),
            self.keys.batches(kind),
            self.keys.groups(kind),
            self.keys.state,
        ]
        now = now_ms()
        return keys, [batch_id, now + self.batch_ack_timeout_ms, kind, now, *kept]

    async def ack(self, kind: str, batch_id: str, *, hold: bool = False) -> int:
        """1 acknowledged (with `hold`: held) now, 0 before, -1 unknown batch."""
        keys = [
            self.keys.batch(batch_id),
            self.keys.groups(kind),
            self.keys.batches(kind),
            self.keys.state,
            self.keys.payloads(kind),
            self.keys.held(kind),
        ]
        args = [batch_id, kind, self.acked_batch_ttl_ms, "1" if hold else "0"]
        return int(await self._script("ACK", keys, args))

    async def reopen_held(self, kind: str) -> int:
        """Hand every held batch of `kind` out again (REOPEN, one batch per script, oldest
        first): the number reopened."""
        held = await self._retry(lambda: self.r.zrange(self.keys.held(kind), 0, -1), "held")
        reopened = 0
        for batch_id in map(_s, held):
            keys = [
                self.keys.batch(batch_id),
                self.keys.held(kind),
                self.keys.batches(kind),
                self.keys.state,
            ]
            reopened += int(await self._script("REOPEN", keys, [batch_id, kind]))
        return reopened

    # -- job state ----------------------------------------------------------------------------

    async def set_policy_version(self, version: int) -> tuple[bool, int]:
        ok, v = await self._script("SET_VERSION", [self.keys.state], [version])
        return bool(ok), int(v)

    async def exhausted(self, kind: str) -> bool:
        """No group of kind is left and none can come: see GetBatchResponse.exhausted. The
        groups of held batches are trained: they do not count."""
        src = lease_kind(kind)

        async def read() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            pipe.hmget(
                self.keys.state,
                [f"{src}:filled", f"{src}:epochs", f"{kind}:held_groups", f"{src}:fill_at"],
            )
            pipe.xinfo_stream(self.keys.prompts(src))
            pipe.xinfo_groups(self.keys.prompts(src))
            pipe.xlen(self.keys.groups(kind))
            return list(await pipe.execute())

        (filled, epochs, held, fill_at), info, groups, in_stream = await self._retry(
            read, "exhausted"
        )
        if (int(filled) if filled is not None else -1) < int(epochs or 0) - 1:
            return False
        if fill_at is not None:  # an epoch partly queued
            return False
        rollout = next(g for g in groups if _s(g["name"]) == "rollout")
        return (
            _s(rollout["last-delivered-id"]) == _s(info["last-generated-id"])
            and int(rollout["pending"]) == 0
            and int(in_stream) - int(held or 0) == 0
        )

    async def stats(self) -> dict[str, Any]:
        """Job state and counters, one atomic snapshot (MULTI): a held batch's groups are
        subtracted from those in batches, which must not be read across its Ack."""

        async def read() -> list[Any]:
            pipe = self.r.pipeline(transaction=True)
            pipe.hgetall(self.keys.state)
            for k in PROMPT_KINDS:
                pipe.xpending(self.keys.prompts(k), "rollout")
            for k in KINDS:
                pipe.xlen(self.keys.groups(k))
                pipe.xpending(self.keys.groups(k), "trainer")
                pipe.zcard(self.keys.batches(k))
                pipe.zcard(self.keys.held(k))
            return list(await pipe.execute())

        res = await self._retry(read, "stats")
        state = {_s(k): _s(v) for k, v in res[0].items()}
        datasets = await self._datasets()
        out: dict[str, Any] = {
            "job": self.job,
            "policy_version": int(state.get("policy_version", 0)),
            "epoch": int(state.get("train:epoch", 0)),
            "cursor": int(state.get("train:cursor", 0)),
            "counters": {k[2:]: int(v) for k, v in state.items() if k.startswith("c:")},
            "kinds": {},
        }
        i = 1
        for k in PROMPT_KINDS:
            out["kinds"].setdefault(k, {})["prompts_leased"] = int(res[i]["pending"])
            out["kinds"][k]["prompts_total"] = sum(
                int(d["num_prompts"]) for d in datasets.values() if d["kind"] == k
            )
            out["kinds"][k]["epochs"] = int(state.get(f"{k}:epochs", 0))
            out["kinds"][k]["epochs_queued"] = int(state.get(f"{k}:filled", -1)) + 1
            i += 1
        for k in KINDS:
            total, in_batches, batches = int(res[i]), int(res[i + 1]["pending"]), int(res[i + 2])
            held_groups = int(state.get(f"{k}:held_groups", 0))
            entry = out["kinds"].setdefault(k, {})
            entry["groups_pending"] = total - in_batches
            entry["groups_in_batches"] = in_batches - held_groups
            entry["batches_unacked"] = batches
            entry["groups_held"] = held_groups
            entry["batches_held"] = int(res[i + 3])
            i += 4
        return out
