"""Exactly-once training across a Redis host crash that loses the tail of the AOF.

Under `appendfsync everysec` a host crash loses up to the last second of writes Redis had
acknowledged (docs/reliability.md, "What a Redis failure can lose"). When those include the issue
of a batch and its Ack, its groups come back in a batch with a new id, which the trainer's dedup
by batch id (`Cursor.trained_batches`) cannot recognise; the checkpoint's cursor also names the
trained groups (`Cursor.trained_groups`), and the trainer leaves those out of a batch.

The crash is emulated on a real Redis by cutting the AOF back to an earlier prefix. A buffer holds
one group for each of 8 prompts and the AOF, once it holds all of them, is copied: what the disk
had when the host died. A trainer (`kuberl serve trainer`, checkpoint every step) trains batch 1
(the first four prompts) and checkpoints it, and its Ack reaches the buffer. The trainer talks to
the buffer through `AckHoldingProxy`, which holds the trainer's acknowledging GetBatch (the one
call that would also take batch 2); the test sends that Ack itself, so the buffer acknowledges
batch 1 and hands out nothing else. Then the trainer and Redis are SIGKILLed, the copy replaces
the AOF, and Redis restarts on the same port and folder: the same buffer process reconnects to a
Redis with the 8 groups pending and no record of batch 1. The trainer resumed from its checkpoint
gets the first four groups in a batch with a new id, leaves them out as already trained,
acknowledges that batch, and trains the other four as step 2.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.local.accounting import trained_lineage
from tests.integration.buffer_support import Client, start_buffer, write_job
from tests.reliability.test_exactly_once import AckHoldingProxy, _group, kill_then_resume


def _copy_aof_once_written(url: str, aof: Path, dest: Path, timeout: float = 20.0) -> bytes:
    """Copy the AOF once it holds every write Redis has acknowledged (no AOF buffer or rewrite
    pending, the file as long as Redis says): what the disk holds after the next fsync, whatever
    comes later. The copied bytes."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            # (redis-py types every reply as possibly awaitable; this client is synchronous)
            info = cast(dict[str, Any], client.info("persistence"))
            written = (
                info["aof_buffer_length"] == 0
                and info["aof_rewrite_in_progress"] == 0
                and info["aof_current_size"] == aof.stat().st_size
            )
            if written:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"the AOF did not settle within {timeout}s: {info}")
            time.sleep(0.05)
    finally:
        client.close()
    shutil.copyfile(aof, dest)
    return dest.read_bytes()


@pytest.fixture(scope="module")
def redis_host_crash_after_batch_1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from kuberl.common.modelbuild import build_model
    from kuberl.common.redis_server import EmbeddedRedis

    tmp = tmp_path_factory.mktemp("redis-host-crash")
    model = build_model(tmp / "model", tokenizer="digits", seed=2)
    with EmbeddedRedis(tmp / "redis", die_with_parent=True) as redis_server:
        base = write_job(tmp, redis_server.url, prompts=8, job=f"hc{uuid.uuid4().hex[:8]}")
        with start_buffer(base, tmp) as buffer, Client(buffer.address) as client:
            prompts = list(client.lease(8).prompts)
            for i, p in enumerate(prompts):  # one by one: batch 1 is the first four prompts
                client.put([_group(p, i)], [p.lease_id])
            on_disk = _copy_aof_once_written(
                redis_server.url, redis_server.aof_path, tmp / "on-disk.aof"
            )

            proxy = AckHoldingProxy(buffer.address)
            crash: dict[str, Any] = {}

            def deliver_the_ack() -> str:
                batch1 = bpb.GetBatchRequest.FromString(proxy.acks[0]).ack_batch_id
                client.ack(batch1)  # the trainer's Ack, delivered without taking batch 2
                return batch1

            def host_crash() -> None:
                crash["acked_before"] = dict(client.stats().counters)
                redis_server.kill()  # SIGKILL: no shutdown fsync, no rewrite
                crash["at_crash"] = redis_server.aof_path.read_bytes()
                shutil.copyfile(tmp / "on-disk.aof", redis_server.aof_path)
                redis_server.start()  # same port and folder: the buffer reconnects
                crash["acked_after"] = dict(client.stats().counters)

            run = kill_then_resume(
                tmp,
                (base, model, buffer.address),
                proxy,
                "Ack of batch 1",
                at_stall=deliver_the_ack,
                after_kill=host_crash,
            )
    return {
        **run,
        "batch1": run["at_stall"],
        "on_disk": on_disk,
        "at_crash": crash["at_crash"],
        "acked_before": crash["acked_before"].get("train:acked_batches", 0),
        "acked_after": crash["acked_after"].get("train:acked_batches", 0),
        "prompts": [f"{p.prompt_id}@{p.epoch}" for p in prompts],
    }


@pytest.mark.slow
def test_the_first_trainer_checkpointed_batch_1_and_the_buffer_acknowledged_it(
    redis_host_crash_after_batch_1: dict[str, Any],
) -> None:
    run = redis_host_crash_after_batch_1
    assert (run["latest"], run["acked_before"]) == ("step-000001", 1)


@pytest.mark.slow
def test_the_crash_loses_the_aof_tail_that_issued_and_acknowledged_batch_1(
    redis_host_crash_after_batch_1: dict[str, Any],
) -> None:
    # What the restarted Redis replays is a prefix of the crashed AOF; the lost tail is the one
    # that named batch 1, and with it went the Ack.
    run = redis_host_crash_after_batch_1
    on_disk, at_crash, batch1 = run["on_disk"], run["at_crash"], run["batch1"].encode()
    assert (
        at_crash.startswith(on_disk),
        batch1 in at_crash[len(on_disk) :],
        batch1 in on_disk,
        run["acked_after"],
    ) == (True, True, False, 0)


@pytest.mark.slow
def test_the_resumed_trainer_leaves_the_groups_of_batch_1_out_as_already_trained(
    redis_host_crash_after_batch_1: dict[str, Any],
) -> None:
    run = redis_host_crash_after_batch_1
    assert run["code"] == 0, run["log"][-3000:]
    rows = run["rows"]
    assert [(r["event"], r.get("step")) for r in rows] == [
        ("start", 0),
        ("step", 1),
        ("start", 1),
        ("rejected", 1),
        ("step", 2),
    ], rows
    trained, left_out = rows[1], rows[3]
    assert (trained["batch_id"], [g["key"] for g in trained["groups"]]) == (
        run["batch1"],
        run["prompts"][:4],
    )
    assert left_out["batch_id"] not in ("", run["batch1"])
    assert (left_out["groups"], left_out["rejected"]) == (
        [],
        [{"key": key, "reason": "already_trained"} for key in run["prompts"][:4]],
    )


@pytest.mark.slow
def test_every_prompt_is_in_the_final_weights_exactly_once(
    redis_host_crash_after_batch_1: dict[str, Any],
) -> None:
    run = redis_host_crash_after_batch_1
    lineage = trained_lineage(run["rows"])
    keys = [g["key"] for row in lineage["steps"].values() for g in row["groups"]]
    assert sorted(keys) == sorted(run["prompts"])
