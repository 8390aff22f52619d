"""The chaos run's accounting: what happened to every prompt, from the job's ground truth.

`kuberl run --chaos` calls `prompt_accounting` after the services have stopped and before the
embedded Redis stops, and `chaos_report` to write `chaos.json`. Nothing here is inferred from
counters alone; every prompt key (`<prompt id>@<epoch>`) is classified from three records:

- **The buffer's Redis** (read directly, the layout of `kuberl.buffer.store`): the epochs queued
  (`state`: `train:filled`) and the TRAIN datasets (`datasets`) give every key of every queued
  epoch; the prompt stream `prompts:train` and its consumer group `rollout` tell which keys were
  never handed out (entries past the group's last-delivered id that are not re-queues) and which
  are pending (leased now, or re-queued after a stale drop and waiting); the trajectory stream
  `groups:train` holds groups accepted and not yet acknowledged (pending); the idempotency hash
  `accepted:train` says `dropped:<reason>` for a group a buffer filter dropped for good.
- **The trainer's record** (`trained.jsonl`, `KUBERL_TRAINED_JSONL`): one row per trained batch
  with the key of each group, one row per start of the trainer with the step it resumed at.
  Replaying the rows gives the *lineage* of the final weights: a start at step `c` discards the
  rows of steps after `c` (their weights died with the process). A key is trained once when it
  appears in exactly one lineage step; twice when in more (`groups_trained_twice`). Groups the
  trainer itself refused (`rejected`, e.g. tokens outside the vocabulary) are filtered with the
  trainer's reason.
- **The supervisor's timeline** (`GetStatus` of every replica once a second): the policy version
  each replica reported, per replica in time order (`versions_monotonic`).

A key that was handed out is exactly one of: trained, filtered (with a reason), pending, or
**lost**: handed out, never trained in the lineage (a step discarded by a resume does not count),
not dropped with a reason, not leased, queued or waiting in the buffer (a group acknowledged by a
batch nobody trained is lost too: `prompts_lost_why`). That is the number that must be 0.
`staleness_trained` checks the lineage against `trainer.max_staleness`. `kuberl run` writes the
same accounting into summary.json, chaos or not.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kuberl.common.datasets import SHUFFLE_STREAM, epoch_sets_order
from kuberl.common.logs import get_logger

log = get_logger(__name__)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _entry_id(value: str) -> tuple[int, int]:
    ms, _, seq = value.partition("-")
    return int(ms), int(seq or 0)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON rows of a file (a torn last line, from a SIGKILL mid-write, is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def trained_lineage(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Replay the trainer's record: the steps the final weights descend from, and the rest."""
    lineage: dict[int, dict[str, Any]] = {}
    discarded: list[dict[str, Any]] = []
    rejected: dict[str, str] = {}
    starts = already = 0
    for row in rows:
        event = row.get("event")
        if event == "start":
            starts += 1
            resumed = int(row.get("step", 0))
            for step in [s for s in lineage if s > resumed]:
                discarded.append(lineage.pop(step))
        elif event == "step":
            step = int(row["step"])
            if step in lineage:  # cannot happen without a start row in between; keep both
                discarded.append(lineage.pop(step))
            lineage[step] = row
        elif event == "already_trained":
            already += 1
        if event in ("step", "rejected"):
            for item in row.get("rejected", []):
                rejected[item["key"]] = item["reason"]
    return {
        "steps": lineage,
        "discarded": discarded,
        "rejected": rejected,
        "starts": starts,
        "already_trained_batches": already,
    }


def trained_counts(lineage: dict[str, Any]) -> Counter[str]:
    """How many steps of the lineage trained each group key (prompt@epoch)."""
    return Counter(g["key"] for row in lineage["steps"].values() for g in row.get("groups", []))


def read_buffer_state(
    redis_url: str, job: str, password: str | None = None, timeout: float = 60.0
) -> dict[str, Any]:
    """Everything the accounting needs from the job's Redis, retried while Redis is still
    loading its AOF (a Redis restarted just before) or unreachable, up to timeout."""
    import redis

    deadline = time.monotonic() + timeout
    while True:
        try:
            return _read_buffer_state(redis_url, job, password)
        except (redis.exceptions.BusyLoadingError, redis.exceptions.ConnectionError) as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("accounting.redis_retry", error=str(exc))
            time.sleep(0.5)


def _read_buffer_state(redis_url: str, job: str, password: str | None) -> dict[str, Any]:
    import redis

    prefix = f"kuberl:{{{job}}}:"
    r: Any = redis.Redis.from_url(redis_url, password=password, socket_timeout=30)
    try:
        state = {_s(k): _s(v) for k, v in r.hgetall(prefix + "state").items()}
        datasets = {_s(k): json.loads(v) for k, v in r.hgetall(prefix + "datasets").items()}
        stream = prefix + "prompts:train"
        entries = [(_s(i), {_s(k): _s(v) for k, v in f.items()}) for i, f in r.xrange(stream)]
        groups = {_s(g["name"]): g for g in r.xinfo_groups(stream)} if r.exists(stream) else {}
        last_delivered = (
            _s(groups["rollout"]["last-delivered-id"]) if "rollout" in groups else "0-0"
        )
        pending = r.xpending_range(stream, "rollout", "-", "+", 1_000_000) if groups else []
        group_entries = r.xrange(prefix + "groups:train")
        accepted = {_s(k): _s(v) for k, v in r.hgetall(prefix + "accepted:train").items()}
    finally:
        r.close()
    return {
        "state": state,
        "datasets": datasets,
        "prompt_entries": entries,
        "last_delivered": last_delivered,
        "leased_ids": {_s(p["message_id"]) for p in pending},
        "group_keys": [f"{_s(f[b'p'])}@{_s(f[b'e'])}" for _, f in group_entries],
        "accepted": accepted,
    }


def prompt_accounting(buffer: dict[str, Any], lineage: dict[str, Any]) -> dict[str, Any]:
    """Classify every handed-out TRAIN key: trained once / twice, filtered, pending, lost."""
    state = buffer["state"]
    filled = int(state.get("train:filled", -1))
    partial = "train:fill_at" in state  # epoch `filled` is queued only up to `fill_at`
    queued: list[str] = []
    for name, info in sorted(buffer["datasets"].items()):
        if info["kind"] != "train":
            continue
        for epoch in range(min(filled + (0 if partial else 1), int(info["num_epochs"]))):
            queued += [f"{name}:{i}@{epoch}" for i in range(int(info["num_prompts"]))]
    if partial:
        sets = [(str(n), int(c)) for n, c in json.loads(state.get("train:fill_sets", "[]"))]
        order = epoch_sets_order(sets, int(state.get("seed", 0)), filled, SHUFFLE_STREAM["train"])
        queued += [f"{pid}@{filled}" for pid in order[: int(state["train:fill_at"])]]
    last = _entry_id(buffer["last_delivered"])
    never_leased: set[str] = set()
    leased_now: set[str] = set()
    requeued_waiting: set[str] = set()
    orphaned: set[str] = set()
    for entry_id, fields in buffer["prompt_entries"]:
        key = f"{fields['p']}@{fields['e']}"
        if entry_id in buffer["leased_ids"]:
            leased_now.add(key)
        elif _entry_id(entry_id) > last:
            # Not delivered yet: a prompt never handed out, or one re-queued to be generated
            # again (its first delivery was before `last`).
            (requeued_waiting if "rq" in fields else never_leased).add(key)
        else:
            # Delivered, not pending, not acknowledged: no read (`>` reads start after `last`,
            # XAUTOCLAIM scans only the pending list) will hand it out again. Lost.
            orphaned.add(key)
    trained = trained_counts(lineage)
    discarded = {g["key"] for row in lineage["discarded"] for g in row.get("groups", [])}
    in_stream = set(buffer["group_keys"])
    classes: dict[str, list[str]] = {
        "trained_once": [],
        "trained_twice": [],
        "filtered": [],
        "pending": [],
        "lost": [],
    }
    reasons: Counter[str] = Counter()
    pending_why: Counter[str] = Counter()
    lost_why: Counter[str] = Counter()
    lost: list[dict[str, Any]] = []
    for key in queued:
        if key in never_leased:
            continue
        accepted = buffer["accepted"].get(key)
        if trained[key] == 1:
            classes["trained_once"].append(key)
        elif trained[key] > 1:
            classes["trained_twice"].append(key)
        elif accepted and accepted.startswith("dropped:"):
            classes["filtered"].append(key)
            reasons[accepted.removeprefix("dropped:")] += 1
        elif key in lineage["rejected"]:
            classes["filtered"].append(key)
            reasons["trainer:" + lineage["rejected"][key]] += 1
        elif key in orphaned:
            classes["lost"].append(key)
            lost.append({"key": key, "accepted": accepted, "orphaned_entry": True})
            lost_why["orphaned_entry"] += 1
        elif key in leased_now or key in requeued_waiting or key in in_stream:
            classes["pending"].append(key)
            why = (
                "leased"
                if key in leased_now
                else "requeued"
                if key in requeued_waiting
                else "group_untrained"
            )
            pending_why[why] += 1
        else:
            # Accepted ("1"), out of the stream and never trained: acknowledged by a batch the
            # trainer never trained (another reader's, or a step a resume discarded).
            classes["lost"].append(key)
            lost.append(
                {
                    "key": key,
                    "accepted": accepted,
                    "trained_in_discarded_step": key in discarded,
                }
            )
            lost_why[
                "trained_in_discarded_step"
                if key in discarded
                else "acknowledged_untrained"
                if accepted == "1"
                else "never_completed"
            ] += 1
    handed_out = len(queued) - len(never_leased & set(queued))
    # Over every key the lineage trained, not only the handed-out ones the loop above classifies:
    # a key trained twice, or trained without ever being handed out, must show whatever the
    # buffer's state says (with it missing, such keys were never looked at).
    twice = sorted(k for k, n in trained.items() if n > 1)
    queued_set = set(queued) - never_leased
    not_handed_out = sorted(k for k in trained if k not in queued_set)
    return {
        "prompts_queued": len(queued),
        "prompts_handed_out": handed_out,
        "prompts_trained_once": len(classes["trained_once"]),
        "groups_trained_twice": len(twice),
        "trained_not_handed_out": len(not_handed_out),
        "prompts_filtered": {"total": len(classes["filtered"]), "reasons": dict(reasons)},
        "prompts_pending": {"total": len(classes["pending"]), "why": dict(pending_why)},
        "prompts_lost": len(classes["lost"]),
        "prompts_lost_why": dict(lost_why),
        "lost": lost[:50],
        "trained_twice": twice[:50],
        "lineage_steps": len(lineage["steps"]),
        "discarded_steps": len(lineage["discarded"]),
        "trainer_starts": lineage["starts"],
        "already_trained_batches": lineage["already_trained_batches"],
    }


def staleness_trained(lineage: dict[str, Any], max_staleness: int) -> dict[str, Any]:
    """Groups the final weights were trained on beyond `max_staleness` versions (or from a
    version the trainer had not reached): the bound the buffer's filter must keep."""
    over: list[dict[str, Any]] = []
    worst: int | None = None
    for row in lineage["steps"].values():
        trained_at = int(row.get("policy_version", 0)) - 1  # the row is written after the step
        for g in row.get("groups", []):
            staleness = trained_at - int(g.get("version_start", 0))
            worst = staleness if worst is None else max(worst, staleness)
            if staleness < 0 or (max_staleness >= 0 and staleness > max_staleness):
                over.append({"key": g["key"], "staleness": staleness, "step": row.get("step")})
    return {
        "groups_trained_over_max_staleness": len(over),
        "over_max_staleness": over[:50],
        "staleness_trained_max": worst,
    }


def replica_versions(
    timeline: list[dict[str, Any]], lineage: dict[str, Any], replicas: list[str]
) -> dict[str, Any]:
    """Per replica: the versions it reported over time, whether they never went down, and the
    versions its trained groups were generated with."""
    out: dict[str, Any] = {}
    for name in replicas:
        seen = [
            int(row["replica_versions"][name])
            for row in timeline
            if row.get("replica_versions", {}).get(name) is not None
        ]
        drops = [(a, b) for a, b in itertools.pairwise(seen) if b < a]
        groups = [
            g
            for row in lineage["steps"].values()
            for g in row.get("groups", [])
            if g.get("replica") == name
        ]
        inverted = [g["key"] for g in groups if g["version_start"] > g["version_end"]]
        out[name] = {
            "monotonic": not drops and not inverted,
            "polls": len(seen),
            "first": seen[0] if seen else None,
            "last": seen[-1] if seen else None,
            "decreases": drops[:10],
            "groups_trained": len(groups),
            "group_versions": [
                min((g["version_start"] for g in groups), default=None),
                max((g["version_end"] for g in groups), default=None),
            ],
            "groups_with_start_after_end": inverted[:10],
        }
    return out


def eval_before_after(
    eval_rows: list[dict[str, Any]], first_fault: float | None, last_recovery: float | None
) -> dict[str, Any]:
    """Eval accuracy of the last round finished before the first fault and of the last round
    finished after the last recovery (rows of the trainer's metrics JSONL, kind eval)."""
    rounds = [
        {"round": r.get("round"), "time": r.get("time"), "accuracy": r.get("eval/accuracy")}
        for r in eval_rows
    ]
    before = [r for r in rounds if first_fault is None or (r["time"] or 0) < first_fault]
    after = [r for r in rounds if last_recovery is not None and (r["time"] or 0) > last_recovery]
    return {
        "eval_accuracy_before_faults": before[-1]["accuracy"] if before else None,
        "eval_accuracy_after_faults": after[-1]["accuracy"] if after else None,
        "eval_rounds": rounds,
    }
