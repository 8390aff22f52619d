"""Exactly-once training across a trainer crash, and filtered prompts that keep their reason.

**Trainer.** A trainer (`kuberl serve trainer`, checkpoint every step) trains batch 1 and writes
its checkpoint, and then its Ack never reaches the buffer: the test sits between the two as a
gRPC proxy that forwards every call but holds acknowledgements (an Ack, or a GetBatch carrying
`ack_batch_id`, the way the trainer acknowledges), and SIGKILLs the trainer while one is
held (the crash window "optimizer step and checkpoint done, Ack not"). The buffer re-delivers
batch 1 with its id after the ack timeout; the restarted trainer resumes from the checkpoint,
which names batch 1 as trained, so it acknowledges it without training and trains batch 2 next.
Every prompt is in the final weights exactly once, as the trainer's own record shows.

**Buffer.** A group a filter drops for good keeps its idempotency record with the reason
(`dropped:<reason>` in `accepted:<kind>`), which is what `kuberl run --chaos` reads to tell a
filtered prompt from a lost one; a stale group's prompt is re-queued and has no record.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import redis
import yaml

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.common.trajectory import Group, Trajectory
from kuberl.local.accounting import read_rows, trained_lineage
from tests.integration.buffer_support import Client, start_buffer, write_job
from tests.support import ServiceProcess

GROUP_SIZE = 4
ACK_METHOD = "/kuberl.buffer.v1.BufferService/Ack"
GET_BATCH_METHOD = "/kuberl.buffer.v1.BufferService/GetBatch"


def _acknowledges(method: str, request: bytes) -> bool:
    if method == GET_BATCH_METHOD:
        return bool(bpb.GetBatchRequest.FromString(request).ack_batch_id)
    return method == ACK_METHOD


def _group(prompt: tpb.Prompt, seed: int) -> tpb.Group:
    """A group of in-vocabulary tokens (the digits tokenizer) with mixed rewards."""
    rng = np.random.default_rng(seed)
    trajectories = [
        Trajectory(
            prompt_token_ids=rng.integers(10, 90, 4),
            response_token_ids=rng.integers(10, 90, 5),
            rollout_logprobs=np.log(rng.uniform(0.005, 0.02, 5)).astype(np.float32),
            prompt_id=prompt.prompt_id,
            epoch=prompt.epoch,
            sample_index=i,
            reward=float(i % 2),
        )
        for i in range(GROUP_SIZE)
    ]
    return Group(prompt.prompt_id, prompt.epoch, trajectories).to_proto()


class AckHoldingProxy(grpc.GenericRpcHandler):
    """Forwards every unary call to the buffer as raw bytes, except acknowledgements (Ack, or
    GetBatch with `ack_batch_id`), which it records and never forwards (the caller waits until
    it gives up or dies). With `forget_first`, the first GetBatch acknowledgement is forwarded
    instead, naming a batch the buffer never issued (what a buffer whose Redis lost the batch
    answers), and everything after it goes through unchanged. With `stall_reply`, only calls
    it picks are recorded, and they are forwarded (the buffer acts on them) but never answered;
    everything else goes through. `holds` picks the calls held (default: acknowledgements)."""

    def __init__(
        self,
        target: str,
        forget_first: bool = False,
        stall_reply: Callable[[str, bytes], bool] | None = None,
        holds: Callable[[str, bytes], bool] | None = None,
    ) -> None:
        self.forget_first = forget_first
        self.stall_reply = stall_reply
        self.holds = holds or _acknowledges
        self.channel = grpc.insecure_channel(target)
        self.acks: list[bytes] = []
        self.release = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self.server.add_generic_rpc_handlers((self,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        call = self.channel.unary_unary(method)

        def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
            if self.forget_first and method == GET_BATCH_METHOD and not self.acks:
                get = bpb.GetBatchRequest.FromString(request)
                if get.ack_batch_id:
                    self.acks.append(request)
                    get.ack_batch_id = "train-" + "0" * 32
                    request = get.SerializeToString()
            elif self.stall_reply is not None:
                if self.stall_reply(method, request):
                    call(request, timeout=context.time_remaining())
                    self.acks.append(request)
                    self.release.wait(120)
                    context.abort(grpc.StatusCode.UNAVAILABLE, "reply held by the test")
            elif not self.forget_first and self.holds(method, request):
                self.acks.append(request)
                self.release.wait(120)
                context.abort(grpc.StatusCode.UNAVAILABLE, "Ack held by the test")
            try:
                return call(request, timeout=context.time_remaining())
            except grpc.RpcError as exc:  # the buffer's answer, status and all
                context.abort(exc.code(), exc.details())
                raise

        return grpc.unary_unary_rpc_method_handler(forward)

    def close(self) -> None:
        self.release.set()
        self.server.stop(0)
        self.channel.close()


@contextlib.contextmanager
def _eight_groups(
    tmp: Path, count: int = 8, sft: int = 0
) -> Iterator[tuple[Path, ServiceProcess, Client, list[tpb.Prompt]]]:
    """A buffer on its own Redis holding one group for each of 8 (`count`) prompts, put one
    by one (so the first batch of four is the first four prompts), the first `sft` of them as
    SFT groups (rejection sampling's): (job file, buffer, client, prompts)."""
    from kuberl.common.redis_server import EmbeddedRedis

    with EmbeddedRedis(tmp / "redis", die_with_parent=True) as redis_server:
        base = write_job(
            tmp,
            redis_server.url,
            prompts=count,
            batch_ack_timeout_seconds=2,
            job=f"eo{uuid.uuid4().hex[:8]}",
        )
        if sft:  # the buffer takes SFT groups only in a job that reads them
            doc = yaml.safe_load(base.read_text())
            doc["trainer"] = {"mode": "rl", "sft_steps": 1}
            base.write_text(yaml.safe_dump(doc))
        with start_buffer(base, tmp) as buffer, Client(buffer.address) as client:
            prompts = list(client.lease(count).prompts)
            for i, p in enumerate(prompts):
                kind = tpb.STREAM_KIND_SFT if i < sft else tpb.STREAM_KIND_TRAIN
                client.put([_group(p, i)], [p.lease_id], kind=kind)
            yield base, buffer, client, prompts


def _trainer_job(
    tmp: Path, base: Path, model: Path, buffer: str, name: str, **trainer: Any
) -> Path:
    doc = yaml.safe_load(base.read_text())
    doc["model"] = {"path": str(model)}
    doc["endpoints"] = {"buffer": buffer}
    doc["trainer"] = {
        "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
        "mode": "rl",
        "total_steps": 2,
        "groups_per_step": GROUP_SIZE,
        "batch_wait_seconds": 1.0,
        "checkpoint_every": 1,
        "export_hf": False,
        "checkpoint_dir": str(tmp / "ckpt"),
        "publish_weights": False,
        "linger_seconds": 0.2,
        "max_staleness": -1,
        "optimizer": {"lr": 1e-3},
        **trainer,
    }
    path = tmp / name
    path.write_text(yaml.safe_dump(doc))
    return path


def _wait(predicate: Any, timeout: float, what: str, proc: ServiceProcess) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.proc.poll() is not None:
            raise AssertionError(f"{proc.name} exited while waiting for {what}:\n{proc.log()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout}s:\n{proc.log()}")
        time.sleep(0.05)


def kill_then_resume(
    tmp: Path,
    paths: tuple[Path, Path, str],
    proxy: AckHoldingProxy,
    what: str,
    at_stall: Callable[[], Any] | None = None,
    after_kill: Callable[[], None] | None = None,
    **trainer: Any,
) -> dict[str, Any]:
    """Trainer 1 talks to the buffer through `proxy`; once the proxy has stalled a call
    (`what`), `at_stall()` runs, trainer 1 is SIGKILLed, `after_kill()` runs, and trainer 2,
    straight to the buffer, runs the job to its end. `paths`: (job file, model, buffer
    address). Returns `latest` at the kill, what `at_stall` returned, trainer 2's exit code
    and log, and both trainers' record of what they trained (`rows`)."""
    base, model, buffer = paths
    record = tmp / "trained.jsonl"
    env = {"KUBERL_TRAINED_JSONL": str(record)}
    try:
        job1 = _trainer_job(tmp, base, model, f"127.0.0.1:{proxy.port}", "t1.yaml", **trainer)
        first = ServiceProcess.kuberl("trainer", job1, tmp, name="trainer-1", env=env)
        try:
            _wait(lambda: proxy.acks, 240, what, first)
            seen = at_stall() if at_stall else None
            latest = (tmp / "ckpt" / "latest").read_text().strip()
            os.killpg(first.proc.pid, signal.SIGKILL)
            first.proc.wait(30)
        finally:
            first.stop()
    finally:
        proxy.close()
    if after_kill is not None:
        after_kill()
    job2 = _trainer_job(tmp, base, model, buffer, "t2.yaml", **trainer)
    second = ServiceProcess.kuberl("trainer", job2, tmp, name="trainer-2", env=env)
    try:
        code = second.proc.wait(240)
        log = second.log()
    finally:
        second.stop()
    rows = read_rows(record)
    return {"latest": latest, "at_stall": seen, "code": code, "log": log, "rows": rows}


@pytest.fixture(scope="module")
def crash_between_checkpoint_and_ack(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from kuberl.common.modelbuild import build_model

    tmp = tmp_path_factory.mktemp("exactly-once")
    model = build_model(tmp / "model", tokenizer="digits", seed=2)
    with _eight_groups(tmp) as (base, buffer, client, prompts):
        run = kill_then_resume(
            tmp,
            (base, model, buffer.address),
            AckHoldingProxy(buffer.address),
            "Ack of batch 1",
            # past batch 1's ack deadline: the buffer re-delivers it first
            after_kill=lambda: time.sleep(2.5),
        )
        stats = client.stats()
    return {
        **run,
        "counters": dict(stats.counters),
        "prompts": sorted(f"{p.prompt_id}@{p.epoch}" for p in prompts),
    }


@pytest.mark.slow
def test_the_killed_trainer_had_checkpointed_batch_1_before_its_ack(
    crash_between_checkpoint_and_ack: dict[str, Any],
) -> None:
    run = crash_between_checkpoint_and_ack
    steps = [r for r in run["rows"] if r["event"] == "step"]
    assert (run["latest"], steps[0]["step"]) == ("step-000001", 1)


@pytest.mark.slow
def test_the_resumed_trainer_acknowledges_the_redelivered_batch_without_training_it(
    crash_between_checkpoint_and_ack: dict[str, Any],
) -> None:
    run = crash_between_checkpoint_and_ack
    assert run["code"] == 0, run["log"][-3000:]
    events = [(r["event"], r.get("step"), r.get("batch_id")) for r in run["rows"]]
    batch1 = events[1][2]
    assert [(e, s) for e, s, _ in events] == [
        ("start", 0),
        ("step", 1),
        ("start", 1),
        ("already_trained", None),
        ("step", 2),
    ], events
    assert events[3][2] == batch1 and events[4][2] != batch1


@pytest.mark.slow
def test_every_prompt_is_in_the_final_weights_exactly_once(
    crash_between_checkpoint_and_ack: dict[str, Any],
) -> None:
    run = crash_between_checkpoint_and_ack
    lineage = trained_lineage(run["rows"])
    keys = [g["key"] for row in lineage["steps"].values() for g in row["groups"]]
    assert sorted(keys) == run["prompts"]


@pytest.mark.slow
def test_the_buffer_saw_two_acknowledged_batches_of_eight_groups(
    crash_between_checkpoint_and_ack: dict[str, Any],
) -> None:
    counters = crash_between_checkpoint_and_ack["counters"]
    assert (counters["train:acked_batches"], counters["train:trained_groups"]) == (2, 8)


def test_a_trainer_whose_ack_the_buffer_does_not_know_goes_on_and_the_batch_comes_back(
    tmp_path: Path,
) -> None:
    # The buffer answers the trainer's GetBatch(ack_batch_id=<batch 1>) with NOT_FOUND (as one
    # whose Redis lost that batch would): the trainer logs it, fetches without the ack, trains
    # step 2 and ends. Batch 1 was really never acknowledged: the buffer hands it out again.
    from kuberl.common.modelbuild import build_model

    model = build_model(tmp_path / "model", tokenizer="digits", seed=3)
    with _eight_groups(tmp_path) as (base, buffer, client, _):
        proxy = AckHoldingProxy(buffer.address, forget_first=True)
        try:
            job = _trainer_job(tmp_path, base, model, f"127.0.0.1:{proxy.port}", "t.yaml")
            trainer = ServiceProcess.kuberl("trainer", job, tmp_path, name="trainer")
            try:
                code = trainer.proc.wait(240)
                log = trainer.log()
            finally:
                trainer.stop()
        finally:
            proxy.close()
        forgotten = bpb.GetBatchRequest.FromString(proxy.acks[0]).ack_batch_id
        time.sleep(2.5)  # past batch 1's ack deadline
        again = client.get(4)
        counters = dict(client.stats().counters)
    assert code == 0, log[-3000:]
    assert "buffer.ack_unknown" in log, log[-3000:]
    assert (again.batch_id, again.redelivered) == (forgotten, True)
    assert (counters["train:acked_batches"], counters["train:trained_groups"]) == (1, 4)


def test_a_filtered_group_keeps_its_reason_and_a_stale_one_is_requeued(tmp_path: Path) -> None:
    from kuberl.common.redis_server import EmbeddedRedis

    job = f"dr{uuid.uuid4().hex[:8]}"
    with EmbeddedRedis(tmp_path / "redis", die_with_parent=True) as redis_server:
        config = write_job(
            tmp_path,
            redis_server.url,
            prompts=2,
            job=job,
            filters=["tests.reliability.chaos_filter:every_seventh"],
        )
        with start_buffer(config, tmp_path) as buffer, Client(buffer.address) as client:
            prompts = sorted(client.lease(2).prompts, key=lambda p: p.prompt_id)
            # Row 0 is a multiple of 7: the filter drops it; row 1 is kept but too old.
            client.put([_fresh(prompts[0], 5)], [prompts[0].lease_id])
            client.put([_stale(prompts[1])], [prompts[1].lease_id])
            batch = client.get(2, max_staleness=0, version=5)
            r = redis.Redis.from_url(redis_server.url)
            accepted = {k.decode(): v.decode() for k, v in r.hgetall(_key(job)).items()}
            r.close()
    assert (len(batch.groups), accepted) == (
        0,
        {
            f"{prompts[0].prompt_id}@0": (
                "dropped:filter:tests.reliability.chaos_filter:every_seventh"
            )
        },
    )


def _fresh(prompt: tpb.Prompt, version: int) -> tpb.Group:
    group = _group(prompt, 0)
    for t in group.trajectories:
        t.policy_version_start = t.policy_version_end = version
    return group


def _stale(prompt: tpb.Prompt) -> tpb.Group:
    group = _group(prompt, 1)
    for t in group.trajectories:
        t.policy_version_start = t.policy_version_end = 0
    return group


def _key(job: str) -> str:
    return f"kuberl:{{{job}}}:accepted:train"


def _killed_at_the_third_ack(tmp: Path, count: int, sft: int = 0, **steps: Any) -> dict[str, Any]:
    """A trainer (`checkpoint_every: 2`) on one group for each of `count` prompts, the first
    `sft` of them SFT groups, that trains batches 1 and 2, checkpoints, trains batch 3 and holds
    it with the GetBatch that fetches batch 4; that call reaches the buffer but its reply never
    comes back (the proxy stalls it), and the trainer is SIGKILLed there: step 3's weights are
    lost, and the buffer holds its batch. A second trainer then runs the job to its end."""
    from kuberl.common.modelbuild import build_model

    model = build_model(tmp / "model", tokenizer="digits", seed=4)
    steps["checkpoint_every"] = 2
    acks: list[str] = []

    def third_ack(method: str, request: bytes) -> bool:
        # GetBatch acknowledges (or holds) batches 1, 2 and 3 as it fetches 2, 3 and 4.
        if method != GET_BATCH_METHOD or not _acknowledges(method, request):
            return False
        acks.append(method)
        return len(acks) == 3

    with _eight_groups(tmp, count, sft) as (base, buffer, client, prompts):
        run = kill_then_resume(
            tmp,
            (base, model, buffer.address),
            AckHoldingProxy(buffer.address, stall_reply=third_ack),
            "the hold of batch 3",
            at_stall=client.stats,
            **steps,
        )
        stats = client.stats()
    return {
        **run,
        "held": run["at_stall"],
        "stats": stats,
        "prompts": sorted(f"{p.prompt_id}@{p.epoch}" for p in prompts),
    }


@pytest.fixture(scope="module")
def crash_between_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Four RL steps of four groups, killed after step 3 (`_killed_at_the_third_ack`)."""
    return _killed_at_the_third_ack(tmp_path_factory.mktemp("between"), 16, total_steps=4)


@pytest.mark.slow
def test_a_batch_trained_after_the_last_checkpoint_is_held_not_acknowledged(
    crash_between_checkpoints: dict[str, Any],
) -> None:
    run = crash_between_checkpoints
    held = run["held"]
    assert (run["latest"], held.batches_held, held.groups_held) == ("step-000002", 1, 4)
    assert (held.counters["train:acked_batches"], held.batches_unacked) == (2, 1)


@pytest.mark.slow
def test_the_resumed_trainer_gets_the_held_batch_back_and_trains_it_again(
    crash_between_checkpoints: dict[str, Any],
) -> None:
    run = crash_between_checkpoints
    assert run["code"] == 0, run["log"][-3000:]
    events = [(r["event"], r.get("step"), r.get("batch_id")) for r in run["rows"]]
    assert [(e, s) for e, s, _ in events] == [
        ("start", 0),
        ("step", 1),
        ("step", 2),
        ("step", 3),
        ("start", 2),
        ("step", 3),
        ("step", 4),
    ], events
    assert events[5][2] == events[3][2]  # the same batch, by id


@pytest.mark.slow
def test_every_prompt_is_in_the_final_weights_exactly_once_between_checkpoints(
    crash_between_checkpoints: dict[str, Any],
) -> None:
    run = crash_between_checkpoints
    lineage = trained_lineage(run["rows"])
    keys = [g["key"] for row in lineage["steps"].values() for g in row["groups"]]
    assert (sorted(keys), len(lineage["discarded"])) == (run["prompts"], 1)
    stats = run["stats"]
    counters = stats.counters
    assert (counters["train:acked_batches"], counters["train:trained_groups"]) == (4, 16)
    assert (counters["train:batches_reopened"], stats.batches_held, stats.exhausted) == (
        1,
        0,
        True,
    )


@pytest.fixture(scope="module")
def crash_in_a_buffer_fed_warm_up(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An RL job whose SFT warm-up (four steps) reads the buffer's SFT stream, killed after
    warm-up step 3 (`_killed_at_the_third_ack`); then one RL step. The warm-up counts its own
    steps (`sft_step`; `step` stays 0), which the holding must follow."""
    tmp = tmp_path_factory.mktemp("warm-up")
    return _killed_at_the_third_ack(tmp, 20, sft=16, total_steps=1, sft_steps=4)


@pytest.mark.slow
def test_a_warm_up_batch_trained_after_a_warm_up_checkpoint_is_held_and_trained_again(
    crash_in_a_buffer_fed_warm_up: dict[str, Any],
) -> None:
    run = crash_in_a_buffer_fed_warm_up
    assert run["code"] == 0, run["log"][-3000:]
    held = run["held"].counters
    assert (held["sft:batches_held"], held["sft:groups_held"], held["sft:acked_batches"]) == (
        1,
        4,
        2,
    )
    starts = [i for i, r in enumerate(run["rows"]) if r["event"] == "start"]
    first, second = run["rows"][starts[0] : starts[1]], run["rows"][starts[1] :]
    assert len(starts) == 2
    trained1 = [r["batch_id"] for r in first if r["event"] == "step"]
    trained2 = [r["batch_id"] for r in second if r["event"] == "step"]
    assert [b.split("-")[0] for b in trained1 + trained2] == ["sft"] * 5 + ["train"]
    assert trained2[0] == trained1[2]  # warm-up batch 3, handed back by its id
    counters = run["stats"].counters
    assert (counters["sft:acked_batches"], counters["sft:trained_groups"]) == (4, 16)
    assert (counters["sft:batches_reopened"], counters["sft:groups_held"]) == (1, 0)
    assert counters["train:acked_batches"] == 1


def test_a_warm_up_whose_last_acks_died_with_the_trainer_leaves_nothing_held(
    tmp_path: Path,
) -> None:
    # A buffer-fed warm-up of two steps, checkpointed at its end; the plain Ack of warm-up
    # batch 1 (held until then) never reaches the buffer, and the trainer is SIGKILLed there,
    # batch 2 still unacknowledged. The resumed trainer is past the warm-up and never reads the
    # SFT stream again: it acknowledges the warm-up batches its checkpoint names, so neither
    # stays in Redis (held, or in the backpressure window) for the rest of the job.
    from kuberl.common.modelbuild import build_model

    model = build_model(tmp_path / "model", tokenizer="digits", seed=6)
    steps = {"total_steps": 1, "sft_steps": 2, "checkpoint_every": 2}
    with _eight_groups(tmp_path, 12, sft=8) as (base, buffer, client, _):
        proxy = AckHoldingProxy(buffer.address, holds=lambda method, _: method == ACK_METHOD)
        run = kill_then_resume(
            tmp_path,
            (base, model, buffer.address),
            proxy,
            "the Ack after the warm-up's checkpoint",
            at_stall=client.stats,
            **steps,
        )
        counters = client.stats().counters
    assert run["code"] == 0, run["log"][-3000:]
    at_kill = run["at_stall"].counters
    assert (at_kill["sft:batches_held"], at_kill["sft:batches_unacked"]) == (1, 1)
    assert (run["latest"], counters["sft:acked_batches"], counters["sft:trained_groups"]) == (
        "step-000000",
        2,
        8,
    )
    assert (counters["sft:batches_held"], counters["sft:batches_unacked"]) == (0, 0)
    assert counters["train:acked_batches"] == 1
