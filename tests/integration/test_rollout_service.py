"""The rollout loop against REAL buffer and reward services (`kuberl serve` subprocesses on an
embedded Redis) with the torch engine on a tiny locally built Qwen2.

One scenario runs replicas as real processes: replica A leases prompts and is SIGKILLed while it
holds them, replica B finishes the whole dataset (A's prompts come back after the buffer's lease
timeout) and then exits on SIGTERM. Other tests run `RolloutWorker` in this process against the
real services, to steer it (weight updates mid-generation, drain, backpressure, modes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import yaml

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.buffer.v1 import buffer_pb2_grpc
from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.api.reward.v1 import reward_pb2_grpc
from kuberl.api.rollout.v1 import rollout_pb2 as rpb
from kuberl.api.rollout.v1 import rollout_pb2_grpc
from kuberl.common.buffer_client import BufferStub
from kuberl.common.channels import aio_channel, sync_channel
from kuberl.common.config import SGLangEngineConfig, load_job_config
from kuberl.common.modelbuild import build_model, load_tokenizer
from kuberl.common.redis_server import EmbeddedRedis, PortReservation
from kuberl.common.trajectory import Group
from kuberl.rollout import metrics as m
from kuberl.rollout.engine.base import Engine, EngineUnavailable
from kuberl.rollout.engine.sglang import SGLangEngine
from kuberl.rollout.engine.torch_engine import TorchEngine
from kuberl.rollout.tools import format_tool_response
from kuberl.rollout.worker import RolloutWorker
from tests.integration.sglang_standin import SGLangStandIn
from tests.integration.test_rollout_plugins import BETWEEN_CALLS, FAILED_CALLS, MARKER_ENV
from tests.support import ServiceProcess, scratch_shm_dir
from tests.tiny_models import build_tokenizer
from tests.unit.test_rollout_multiturn import CALL as TOOL_CALL
from tests.unit.test_rollout_multiturn import FINAL as TOOL_FINAL
from tests.unit.test_rollout_multiturn import PROMPT as TOOL_PROMPT
from tests.unit.test_rollout_multiturn import train_tool_caller

PLUGINS = "tests.integration.test_rollout_plugins"
GROUP = 2


@dataclass
class Env:
    tmp: Path
    redis_url: str
    model: Path
    reward: ServiceProcess


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """A 1M-parameter model on a shared 2-core box: one intra-op thread is ~20x faster than two
    spinning OpenMP threads (measured), as `rollout.engine.num_threads: 1` does in the replicas."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("rollout")
    model = build_model(tmp / "model", arch="qwen2", size="tiny", tokenizer="digits", seed=0)
    with EmbeddedRedis(tmp / "redis") as redis:
        config = _write_job(tmp, "reward", redis.url, model)
        with ServiceProcess.kuberl("reward", config, tmp, name="reward") as reward:
            reward.wait_serving(120)
            yield Env(tmp, redis.url, model, reward)


def _write_job(
    tmp: Path,
    name: str,
    redis_url: str,
    model: Path,
    *,
    prompts: int = 4,
    questions: list[str] | None = None,
    eval_prompts: int = 0,
    buffer: dict[str, Any] | None = None,
    rollout: dict[str, Any] | None = None,
    weight_sync: dict[str, Any] | None = None,
) -> Path:
    folder = tmp / name
    folder.mkdir(exist_ok=True)

    def dataset(file: str, n: int, texts: list[str] | None = None) -> str:
        path = folder / file
        rows = [{"question": f"What is {i} plus {i}?", "answer": f"#### {2 * i}"} for i in range(n)]
        if texts is not None:
            rows = [{"question": text, "answer": ""} for text in texts]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    data: dict[str, Any] = {
        "train": [
            {"path": dataset("train.jsonl", prompts, questions), "columns": {"prompt": "question"}}
        ]
    }
    if eval_prompts:
        data["eval"] = [
            {"path": dataset("eval.jsonl", eval_prompts), "columns": {"prompt": "question"}}
        ]
    local = {"host": "127.0.0.1", "port": 0, "metrics_port": 0}
    job = {
        "job": {"name": f"r{uuid.uuid4().hex[:10]}", "seed": 3},
        "redis": {"url": redis_url},
        "model": {"path": str(model)},
        "data": data,
        "buffer": {"server": local, "lease_timeout_seconds": 60, **(buffer or {})},
        "reward": {
            "server": local,
            "workers": 1,
            "verifiers": {"parity": 1.0},
            "custom": {"parity": {"function": f"{PLUGINS}:parity_reward"}},
        },
        "rollout": {
            "server": local,
            "group_size": GROUP,
            "prompts_per_batch": 2,
            "batches_in_flight": 2,
            "sampling": {"max_new_tokens": 12, "temperature": 1.0},
            "engine": {"kind": "torch", "num_threads": 1},
            "weight_sync": weight_sync is not None,
            "drain_seconds": 5,
            "retry_initial_seconds": 0.05,
            "idle_poll_seconds": 0.1,
            **(rollout or {}),
        },
    }
    if weight_sync is not None:
        job["weight_sync"] = weight_sync
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


class Buffer:
    def __init__(self, address: str) -> None:
        self.channel = sync_channel(address)
        self.stub = buffer_pb2_grpc.BufferServiceStub(self.channel)

    def stats(self) -> bpb.GetStatsResponse:
        return self.stub.GetStats(bpb.GetStatsRequest(), timeout=30)

    def take(self, n: int, kind: int = tpb.STREAM_KIND_TRAIN, wait: float = 1.0) -> list[Group]:
        """Up to n groups from a stream (acknowledged, as a trainer would)."""
        batch = self.stub.GetBatch(
            bpb.GetBatchRequest(
                num_groups=n, max_staleness=-1, consumer="trainer", wait_seconds=wait, kind=kind
            ),
            timeout=60,
        )
        if batch.batch_id:
            self.stub.Ack(bpb.AckRequest(batch_id=batch.batch_id), timeout=30)
        return [Group.from_proto(g) for g in batch.groups]

    def take_all(
        self, n: int, kind: int = tpb.STREAM_KIND_TRAIN, timeout: float = 90
    ) -> list[Group]:
        groups: list[Group] = []
        deadline = time.monotonic() + timeout
        while len(groups) < n and time.monotonic() < deadline:
            groups += self.take(n - len(groups), kind)
        return groups


@pytest.fixture
def job(env: Env, request: pytest.FixtureRequest):
    """Start a buffer for a job file written with the test's options; yield (config, buffer)."""
    started: list[ServiceProcess] = []

    def make(**options: Any) -> tuple[Path, Buffer, str]:
        path = _write_job(
            env.tmp, f"job-{uuid.uuid4().hex[:6]}", env.redis_url, env.model, **options
        )
        proc = ServiceProcess.kuberl("buffer", path, path.parent, name="buffer").wait_serving(60)
        started.append(proc)
        return path, Buffer(proc.address), proc.address

    yield make
    for proc in started:
        proc.stop()


# -- replicas as processes: kill -9, then finish and SIGTERM ----------------------------------


@dataclass
class Scenario:
    groups: list[Group]
    held_by_killed: set[str]
    stats: bpb.GetStatsResponse
    b_exit: int
    b_log: str
    status: rpb.GetStatusResponse  # replica B once the dataset was finished
    versions_seen: list[int]  # B's policy version after the trainer published version 1
    control: list[int]  # B's state after Pause, then after Resume
    bad_notify: grpc.StatusCode
    drained: rpb.DrainResponse


PROMPTS = 8


def _control(
    env: Env, b: ServiceProcess, weight_sync: str
) -> tuple[rpb.GetStatusResponse, list[int], list[int], Any]:
    """Replica B's control API once the dataset is done: status, a published weight version
    arriving through weight-sync, pause / resume, and a malformed weight notification."""
    from kuberl.common.weights import WeightPublisher

    with sync_channel(b.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        status = stub.GetStatus(rpb.GetStatusRequest(), timeout=10)
        tensors = _other_weights(env)
        with WeightPublisher(weight_sync) as publisher:
            publisher.publish(1, iter(tensors.items()))
        seen = [status.policy_version]
        deadline = time.monotonic() + 60
        while seen[-1] != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
            seen.append(stub.GetStatus(rpb.GetStatusRequest(), timeout=10).policy_version)
        stub.Pause(rpb.PauseRequest(abort_in_flight=False), timeout=30)
        control = [stub.GetStatus(rpb.GetStatusRequest(), timeout=10).state]
        stub.Resume(rpb.ResumeRequest(), timeout=30)
        control.append(stub.GetStatus(rpb.GetStatusRequest(), timeout=10).state)
        with pytest.raises(grpc.RpcError) as err:
            stub.NotifyWeightsUpdate(rpb.NotifyWeightsUpdateRequest(), timeout=10)
    return status, [seen[0], seen[-1]], control, err.value.code()


@pytest.fixture(scope="module")
def scenario(env: Env) -> Iterator[Scenario]:
    path = _write_job(
        env.tmp,
        "kill",
        env.redis_url,
        env.model,
        prompts=PROMPTS,
        buffer={"lease_timeout_seconds": 3},
        weight_sync={
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
            "heartbeat_seconds": 0.5,
            "shm_dir": scratch_shm_dir("kuberl-rollout-test"),
            "advertise_host": "127.0.0.1",
            "bucket_bytes": 1024 * 1024,
        },
    )
    work = path.parent
    with (
        ServiceProcess.kuberl("buffer", path, work, name="buffer") as buffer_proc,
        ServiceProcess.kuberl("weight_sync", path, work, name="weight-sync") as sync_proc,
    ):
        buffer_proc.wait_serving(60)
        sync_proc.wait_serving(60)
        endpoints = {
            "KUBERL_ENDPOINTS__BUFFER": buffer_proc.address,
            "KUBERL_ENDPOINTS__REWARD": env.reward.address,
            "KUBERL_ENDPOINTS__WEIGHT_SYNC": sync_proc.address,
        }
        marker = work / "held.txt"
        a = ServiceProcess.kuberl(
            "rollout",
            path,
            work,
            name="replica-a",
            env={
                **endpoints,
                MARKER_ENV: str(marker),
                "KUBERL_ROLLOUT__REPLICA_ID": "replica-a",
                "KUBERL_ROLLOUT__ROLLOUT_FUNCTION": f"{PLUGINS}:stuck_rollout",
            },
        )
        deadline = time.monotonic() + 120
        while not (marker.exists() and len(marker.read_text().split()) >= 4):
            assert a.proc.poll() is None, a.log()
            assert time.monotonic() < deadline, f"replica A never leased:\n{a.log()}"
            time.sleep(0.1)
        a.signal(signal.SIGKILL)
        a.proc.wait(30)
        held = set(marker.read_text().split())
        b = ServiceProcess.kuberl(
            "rollout",
            path,
            work,
            name="replica-b",
            env={**endpoints, "KUBERL_ROLLOUT__REPLICA_ID": "replica-b"},
        )
        with b:
            buffer = Buffer(buffer_proc.address)
            groups = buffer.take_all(PROMPTS, timeout=150)
            b.wait_serving(30)
            status, seen, control, bad = _control(env, b, sync_proc.address)
            with sync_channel(b.address) as channel:
                drained = rollout_pb2_grpc.RolloutServiceStub(channel).Drain(
                    rpb.DrainRequest(timeout_seconds=5), timeout=60
                )
            b_exit = b.proc.wait(60)  # Drain answers, then the replica SIGTERMs itself
            stats = buffer.stats()
            log = b.log_path.read_text()
    yield Scenario(groups, held, stats, b_exit, log, status, seen, control, bad, drained)


def test_a_replica_finishes_a_small_dataset_with_every_prompt_accounted_for(scenario) -> None:
    ids = sorted(g.prompt_id for g in scenario.groups)
    assert ids == sorted({f"train:{i}" for i in range(PROMPTS)})
    for g in scenario.groups:
        g.validate(GROUP)
        for t in g.trajectories:
            assert len(t.rollout_logprobs) == len(t.response_token_ids) > 0
            assert all(math.isfinite(x) and x <= 0 for x in t.rollout_logprobs)
            assert (t.policy_version_start, t.policy_version_end) == (0, 0)
            assert t.generate_seconds > 0 and t.score_seconds > 0
    assert (scenario.stats.prompts_leased, scenario.stats.exhausted) == (0, True)


def test_a_replica_killed_mid_batch_loses_no_prompt(scenario) -> None:
    by_id = {g.prompt_id: g for g in scenario.groups}
    assert len(scenario.held_by_killed) == 4
    for pid in scenario.held_by_killed:
        meta = by_id[pid].trajectories[0].metadata
        assert (meta["replica"], meta["delivery_count"] >= 2) == ("replica-b", True)


def test_get_status_reports_the_replica_and_its_work(scenario) -> None:
    s = scenario.status
    assert (s.replica_id, s.engine, s.state, s.prompts_in_flight) == (
        "replica-b",
        "torch",
        rpb.REPLICA_STATE_RUNNING,
        0,
    )
    assert s.groups_put == PROMPTS and s.generated_tokens > 0


def test_a_version_published_by_the_trainer_reaches_the_replica_through_weight_sync(
    scenario,
) -> None:
    assert scenario.versions_seen == [0, 1]


def test_pause_and_resume_change_the_replica_state(scenario) -> None:
    assert scenario.control == [rpb.REPLICA_STATE_PAUSED, rpb.REPLICA_STATE_RUNNING]


def test_a_weight_notification_without_an_instruction_is_invalid(scenario) -> None:
    assert scenario.bad_notify == grpc.StatusCode.INVALID_ARGUMENT


def test_drain_answers_then_the_replica_leaves_through_its_sigterm_path(scenario) -> None:
    # Drain sends SIGTERM to its own process: the same handler as a SIGTERM from Kubernetes.
    assert (scenario.drained.finished, scenario.drained.released, scenario.b_exit) == (0, 0, 0)
    assert "event=server.draining" in scenario.b_log
    assert "event=server.stopped" in scenario.b_log


# -- replicas as processes: a published version mid-generation, SIGTERM, multi-turn ----------


def _status(address: str) -> rpb.GetStatusResponse:
    with sync_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        return stub.GetStatus(rpb.GetStatusRequest(), timeout=10)


def _wait_generating(replicas: list[ServiceProcess], prompts: int, timeout: float = 120) -> None:
    """Until every replica holds `prompts` leased prompts and has put no group yet: its first
    batches are generating (with hundreds of tokens per sample, generation is nearly all of a
    batch's time)."""
    for replica in replicas:
        replica.wait_serving(timeout)  # GetStatus is UNAVAILABLE until the replica has started
    deadline = time.monotonic() + timeout
    while True:
        statuses = [_status(r.address) for r in replicas]
        if all((s.prompts_in_flight, s.groups_put) == (prompts, 0) for s in statuses):
            return
        for r in replicas:
            assert r.proc.poll() is None, r.log()
        assert time.monotonic() < deadline, f"the replicas never all generated: {statuses}"
        time.sleep(0.05)


POLICIES = ("finish", "abort")
UPDATE_PROMPTS = 4


@pytest.fixture(scope="module")
def weight_update(env: Env) -> Iterator[dict[str, list[Group]]]:
    """One replica process per `on_weight_update` policy, each with a buffer and a weight-sync
    service of its own job; version 1 is published to each replica's weight-sync while that
    replica generates its first batch of 2 prompts (4 prompts each, one batch at a time), and
    the test takes every group each replica puts.

    The replicas start one after the other, each published to as soon as it generates: two
    started together were not always in their first batches at the same moment (on a loaded
    machine one could finish its first batch before the other had imported torch)."""
    from kuberl.common.weights import WeightPublisher

    def sync(policy: str) -> dict[str, object]:
        return {
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
            "heartbeat_seconds": 0.5,
            "shm_dir": scratch_shm_dir(f"kuberl-rollout-test-{policy}"),
            "advertise_host": "127.0.0.1",
            "bucket_bytes": 1024 * 1024,
        }

    paths = {
        policy: _write_job(
            env.tmp,
            f"update-{policy}",
            env.redis_url,
            env.model,
            prompts=UPDATE_PROMPTS,
            weight_sync=sync(policy),
            rollout={
                "on_weight_update": policy,
                "batches_in_flight": 1,
                # Long generations, so version 1 surely lands while the first batch runs.
                "sampling": {"max_new_tokens": 600, "ignore_eos": True},
            },
        )
        for policy in POLICIES
    }
    tensors = _other_weights(env)
    with contextlib.ExitStack() as stack:

        def start(service: str, policy: str, name: str, **env_: str) -> ServiceProcess:
            path = paths[policy]
            proc = ServiceProcess.kuberl(service, path, path.parent, name=name, env=env_)
            return stack.enter_context(proc)

        buffers = {p: start("buffer", p, "buffer") for p in POLICIES}
        syncs = {p: start("weight_sync", p, "weight-sync") for p in POLICIES}
        for proc in (*buffers.values(), *syncs.values()):
            proc.wait_serving(60)
        replicas = []
        for p in POLICIES:
            replica = start(
                "rollout",
                p,
                "replica",
                KUBERL_ENDPOINTS__BUFFER=buffers[p].address,
                KUBERL_ENDPOINTS__REWARD=env.reward.address,
                KUBERL_ENDPOINTS__WEIGHT_SYNC=syncs[p].address,
                KUBERL_ROLLOUT__REPLICA_ID=f"replica-{p}",
            )
            replicas.append(replica)
            _wait_generating([replica], 2)
            with WeightPublisher(syncs[p].address) as publisher:
                publisher.publish(1, iter(tensors.items()))
        groups = {
            p: Buffer(buffers[p].address).take_all(UPDATE_PROMPTS, timeout=240) for p in POLICIES
        }
        for proc in (*replicas, *syncs.values(), *buffers.values()):  # all at once
            proc.signal(signal.SIGTERM)
    yield groups  # with every process gone: idle replicas would poll through the later tests


def _update_records(groups: list[Group]) -> Counter[tuple[str, tuple[int, ...], tuple[int, int]]]:
    """How many trajectories record each (weight_update, versions it names, (start, end))."""
    records: Counter[tuple[str, tuple[int, ...], tuple[int, int]]] = Counter()
    for t in (t for g in groups for t in g.trajectories):
        meta = t.metadata
        named = meta.get("updated_to_versions") or meta.get("aborted_by_versions") or []
        versions = (t.policy_version_start, t.policy_version_end)
        records[(meta.get("weight_update", "none"), tuple(named), versions)] += 1
    return records


def test_a_replica_process_finishes_running_groups_on_the_old_weights_when_a_version_lands(
    weight_update,
) -> None:
    # The first batch (2 groups) ends on version 0 and says so; the second runs on version 1.
    assert _update_records(weight_update["finish"]) == {
        ("finished_on_old_weights", (1,), (0, 0)): 2 * GROUP,
        ("none", (), (1, 1)): 2 * GROUP,
    }


def test_a_replica_process_aborts_and_regenerates_running_groups_when_a_version_lands(
    weight_update,
) -> None:
    # The first batch is aborted and regenerated from scratch on version 1; the second runs on 1.
    assert _update_records(weight_update["abort"]) == {
        ("aborted_and_regenerated", (1,), (1, 1)): 2 * GROUP,
        ("none", (), (1, 1)): 2 * GROUP,
    }


def test_a_weight_update_mid_generation_loses_no_prompt(weight_update) -> None:
    ids = [f"train:{i}" for i in range(UPDATE_PROMPTS)]
    assert {p: sorted(g.prompt_id for g in groups) for p, groups in weight_update.items()} == {
        p: ids for p in POLICIES
    }


DRAIN_SECONDS = 2.0
LEASE_TIMEOUT = 60.0


@dataclass
class Terminated:
    exit_code: int
    exit_seconds: float  # from SIGTERM to the process's exit
    put: list[str]  # prompt ids of the groups the replica put
    leased_again: list[tuple[str, int]]  # (prompt id, delivery count) leased by another consumer
    leased_again_seconds: float  # from SIGTERM to that lease


@pytest.fixture(scope="module")
def terminated(env: Env) -> Iterator[Terminated]:
    """A replica process holding all 4 prompts of its job (two batches of 800-token samples) gets
    SIGTERM; then another consumer leases whatever the buffer has."""
    path = _write_job(
        env.tmp,
        "sigterm",
        env.redis_url,
        env.model,
        prompts=4,
        buffer={"lease_timeout_seconds": LEASE_TIMEOUT},
        rollout={
            "drain_seconds": DRAIN_SECONDS,
            "sampling": {"max_new_tokens": 800, "ignore_eos": True},
        },
    )
    with ServiceProcess.kuberl("buffer", path, path.parent, name="buffer") as buffer_proc:
        buffer_proc.wait_serving(60)
        endpoints = {
            "KUBERL_ENDPOINTS__BUFFER": buffer_proc.address,
            "KUBERL_ENDPOINTS__REWARD": env.reward.address,
        }
        with ServiceProcess.kuberl(
            "rollout", path, path.parent, name="replica", env=endpoints
        ) as r:
            _wait_generating([r], 4)
            sent = time.monotonic()
            r.signal(signal.SIGTERM)
            exit_code = r.proc.wait(60)
            exit_seconds = time.monotonic() - sent
        buffer = Buffer(buffer_proc.address)
        again = buffer.stub.LeasePrompts(
            bpb.LeasePromptsRequest(max_prompts=10, consumer="another-replica"), timeout=30
        )
        leased_again_seconds = time.monotonic() - sent
        put = [g.prompt_id for g in buffer.take(4, wait=0.2)]
    yield Terminated(
        exit_code,
        exit_seconds,
        put,
        [(p.prompt_id, p.delivery_count) for p in again.prompts],
        leased_again_seconds,
    )


def test_sigterm_mid_generation_ends_the_replica_process_cleanly_within_its_drain_time(
    terminated,
) -> None:
    # drain_seconds for in-flight batches, then the abort, the release and the engine's close:
    # a few seconds at most, far below the 10 s of gRPC grace plus a timed-out lease.
    assert (terminated.exit_code, terminated.exit_seconds < DRAIN_SECONDS + 8) == (0, True)


def test_sigterm_puts_or_releases_every_leased_prompt_well_before_the_lease_timeout(
    terminated,
) -> None:
    # Without a release the buffer would hold the prompts for the lease timeout (60 s) and the
    # lease right after the exit would find none.
    accounted = terminated.put + [pid for pid, n in terminated.leased_again if n == 2]
    assert (sorted(accounted), terminated.leased_again_seconds < LEASE_TIMEOUT / 2) == (
        [f"train:{i}" for i in range(4)],
        True,
    )


@pytest.fixture(scope="module")
def multi_turn(env: Env) -> Iterator[list[Group]]:
    """A replica process with multi-turn tool calling on a tiny model trained to call the
    calculator (as in tests/unit/test_rollout_multiturn.py); the groups it puts for 2 prompts."""
    tokenizer = build_tokenizer()
    model = env.tmp / "tool-model"
    train_tool_caller(tokenizer).save_pretrained(model)
    tokenizer.save_pretrained(model)
    path = _write_job(
        env.tmp,
        "multi-turn",
        env.redis_url,
        model,
        questions=[TOOL_PROMPT, TOOL_PROMPT],
        rollout={
            "multi_turn": {"enabled": True, "tools": ["calculator"]},
            "sampling": {"temperature": 0.0, "max_new_tokens": 200},
        },
    )
    with ServiceProcess.kuberl("buffer", path, path.parent, name="buffer") as buffer_proc:
        buffer_proc.wait_serving(60)
        endpoints = {
            "KUBERL_ENDPOINTS__BUFFER": buffer_proc.address,
            "KUBERL_ENDPOINTS__REWARD": env.reward.address,
        }
        with ServiceProcess.kuberl("rollout", path, path.parent, name="replica", env=endpoints):
            groups = Buffer(buffer_proc.address).take_all(2, timeout=120)
    yield groups


def test_multi_turn_groups_in_the_buffer_mask_tool_output_out_of_the_loss(multi_turn) -> None:
    tokenizer = build_tokenizer()
    call, tool, final = (
        len(tokenizer.encode(text, add_special_tokens=False))
        for text in (TOOL_CALL, format_tool_response("84"), TOOL_FINAL)
    )
    expected = [1] * call + [0] * tool + [1] * (final + 1)  # + EOS
    masks = [
        None if t.loss_mask is None else t.loss_mask.tolist()
        for g in multi_turn
        for t in g.trajectories
    ]
    assert masks == [expected] * 2 * GROUP


def test_multi_turn_groups_in_the_buffer_record_the_tool_calls(multi_turn) -> None:
    calls = [
        (t.metadata.get("tool_calls"), t.metadata.get("turns"))
        for g in multi_turn
        for t in g.trajectories
    ]
    assert calls == [([{"turn": 0, "name": "calculator", "outcome": "ok"}], 2)] * 2 * GROUP


# -- the loop in this process against the real services ----------------------------------------


class Loop:
    """A RolloutWorker in this process with a torch engine, talking to the real services."""

    def __init__(
        self,
        env: Env,
        config_path: Path,
        buffer_address: str,
        engine: Engine | None = None,
        reward_address: str | None = None,
    ) -> None:
        self.config = load_job_config(config_path, env={})
        self.env = env
        self.buffer_address = buffer_address
        self.engine = engine
        self.reward_address = reward_address or env.reward.address

    async def __aenter__(self) -> RolloutWorker:
        if self.engine is None:
            self.engine = TorchEngine.from_pretrained(self.env.model, max_batch_size=64)
        self.channels = [aio_channel(self.buffer_address), aio_channel(self.reward_address)]
        self.worker = RolloutWorker(
            self.config,
            self.engine,
            load_tokenizer(self.env.model),
            buffer=BufferStub(self.channels[0]),
            reward=reward_pb2_grpc.RewardServiceStub(self.channels[1]),
            replica_id=f"test-{uuid.uuid4().hex[:6]}",
        )
        self.task = asyncio.create_task(self.worker.run())
        return self.worker

    async def __aexit__(self, *exc: object) -> None:
        await self.worker.drain(5)
        await self.task
        await self.engine.close()
        for c in self.channels:
            await c.close()


async def _until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _metric(name: str, **labels: str) -> float:
    """A counter of this process's registry (the Loop's worker runs here)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def _other_weights(env: Env) -> dict[str, Any]:
    path = build_model(env.tmp / "model-v1", arch="qwen2", size="tiny", tokenizer="digits", seed=1)
    return dict(TorchEngine.from_pretrained(path).model.state_dict())


@pytest.mark.parametrize("policy", ["finish", "abort"])
def test_a_weight_update_mid_generation_follows_on_weight_update(env, job, policy) -> None:
    config, buffer, address = job(
        prompts=4,
        rollout={
            "on_weight_update": policy,
            "batches_in_flight": 1,
            "sampling": {"max_new_tokens": 300, "ignore_eos": True},
        },
    )
    new = _other_weights(env)

    counters = [
        ("kuberl_rollout_pauses_total", {"reason": "weight_update"}),
        ("kuberl_rollout_aborted_requests_total", {"reason": "weight_update"}),
    ]

    async def go() -> tuple[set[str], int, list[float]]:
        before = [_metric(name, **labels) for name, labels in counters]
        async with Loop(env, config, address) as worker:
            await _until(lambda: worker._generating, what="a generation in flight")
            in_flight = {g.item.prompt_id for g in worker._generating}
            await worker.apply_weight_update(1, lambda: worker.engine.load_weights(new, 1))
            await _until(lambda: worker.groups_put == 4, 120, "all groups")
            counted = [_metric(n, **lb) - b for (n, lb), b in zip(counters, before, strict=True)]
            return in_flight, worker.engine.version, counted

    in_flight, version, counted = asyncio.run(go())
    groups = {g.prompt_id: g for g in buffer.take_all(4)}
    expected = {
        "finish": ("finished_on_old_weights", (0, 0)),
        "abort": ("aborted_and_regenerated", (1, 1)),
    }[policy]
    # One pause for the update; `abort` aborts both in-flight prompts' samples (GROUP each).
    assert counted == [1.0, 0.0 if policy == "finish" else 2.0 * GROUP]
    assert version == 1 and len(in_flight) == 2
    for pid, g in groups.items():
        t = g.trajectories[0]
        versions = (t.policy_version_start, t.policy_version_end)
        if pid in in_flight:
            assert (t.metadata["weight_update"], versions) == expected
        else:
            assert ("weight_update" in t.metadata, versions) == (False, (1, 1))


def test_resume_frees_a_finish_update_that_waits_on_generations_paused_in_place(env, job) -> None:
    # Pause in place holds the generations; a `finish` update then waits for them under its lock.
    # Resume must let them run (or the update, and with it the replica, waits forever).
    config, buffer, address = job(
        prompts=2,
        rollout={
            "on_weight_update": "finish",
            "batches_in_flight": 1,
            "sampling": {"max_new_tokens": 300, "ignore_eos": True},
        },
    )
    new = _other_weights(env)

    async def go() -> tuple[int, str, float]:
        async with Loop(env, config, address) as worker:
            await _until(lambda: worker._generating, what="a generation in flight")
            pauses = _metric("kuberl_rollout_pauses_total", reason="rpc")
            await worker.pause(abort_in_flight=False)
            update = asyncio.create_task(
                worker.apply_weight_update(1, lambda: worker.engine.load_weights(new, 1))
            )
            await asyncio.sleep(0.5)
            assert not update.done()  # paused: the update waits for the held generations
            await worker.resume()
            await asyncio.wait_for(update, 60)
            await _until(lambda: worker.groups_put == 2, 120, "both groups")
            paused = _metric("kuberl_rollout_pauses_total", reason="rpc") - pauses
            return worker.engine.version, worker.state, paused

    assert asyncio.run(go()) == (1, "running", 1.0)
    assert len(buffer.take_all(2)) == 2


def test_a_prompt_whose_function_fails_is_released_and_retried_with_backoff(env, job) -> None:
    # One prompt per batch; the function raises at once for train:0. The replica puts the other
    # groups, releases train:0 each time (it comes back: nothing lost), and backs off between
    # failures (retry_initial_seconds 0.2, doubling up to 0.8) instead of spinning.
    config, buffer, address = job(
        prompts=3,
        rollout={
            "rollout_function": f"{PLUGINS}:failing_rollout",
            "prompts_per_batch": 1,
            "batches_in_flight": 1,
            "retry_initial_seconds": 0.2,
            "retry_max_seconds": 0.8,
        },
    )
    FAILED_CALLS.clear()
    errors = ("kuberl_rollout_failures_total", {"stage": "generate"})

    async def go() -> tuple[int, int, float, float]:
        before = _metric(errors[0], **errors[1])
        async with Loop(env, config, address) as worker:
            await _until(lambda: worker.groups_put == 2, 60, "the two good groups")
            # A success resets the backoff; measure once it has climbed to its 0.8 s ceiling
            # (the third failure in a row), so the 0.2 s and 0.4 s steps fall outside the window.
            await _until(lambda: worker._gen_errors >= 3, 60, "three failures in a row")
            started = time.monotonic()
            seen = len(FAILED_CALLS)
            await asyncio.sleep(4.0)
            window = time.monotonic() - started
            failures = len(FAILED_CALLS) - seen
            return worker.groups_put, failures, window, _metric(errors[0], **errors[1]) - before

    put, failures, window, counted = asyncio.run(go())
    stats = buffer.stub.GetStats(bpb.GetStatsRequest(), timeout=10)
    # Backing off 0.8 s between failures allows at most window / 0.8 + 1 of them in the window
    # (a load only spaces them further); a spinning replica makes dozens.
    assert (put, failures <= window / 0.8 + 1, counted >= 3) == (2, True, True), failures
    assert stats.counters["train:released"] >= 3 and "train:0" not in {
        g.prompt_id for g in buffer.take_all(2)
    }


def test_samples_a_trajectory_cannot_hold_fail_their_own_group_and_not_the_batch(env, job) -> None:
    # One batch of 4: train:0's samples say finish_reason "eos", train:1's metadata is a set.
    # Those two groups fail (counted, released, retried with backoff); the other two are put.
    # Once, either raised outside the group's own handling: the whole batch was released,
    # uncounted and without backoff, thousands of leases a second.
    config, buffer, address = job(
        prompts=4,
        rollout={
            "rollout_function": f"{PLUGINS}:misreported_rollout",
            "prompts_per_batch": 4,
            "batches_in_flight": 1,
            "retry_initial_seconds": 0.5,
            "retry_max_seconds": 0.5,
        },
    )
    errors = ("kuberl_rollout_failures_total", {"stage": "generate"})

    async def go() -> tuple[int, float]:
        before = _metric(errors[0], **errors[1])
        async with Loop(env, config, address) as worker:
            await _until(lambda: worker.groups_put == 2, 60, "the two good groups")
            await asyncio.sleep(1.0)
            return worker.groups_put, _metric(errors[0], **errors[1]) - before

    put, failed = asyncio.run(go())
    stats = buffer.stub.GetStats(bpb.GetStatsRequest(), timeout=10)
    assert {g.prompt_id for g in buffer.take_all(2)} == {"train:2", "train:3"}
    # Backing off 0.5 s a batch: a handful of failed groups in ~1-2 s, not thousands.
    assert (put, 2 <= failed <= 16) == (2, True), failed
    assert stats.counters["train:leased"] <= 40


def test_samples_without_policy_versions_get_the_engines(env, job) -> None:
    # A custom function that builds its samples without versions: they were stamped 0, which
    # the buffer drops as stale once the trainer is max_staleness past it, again and again.
    config, buffer, address = job(
        prompts=2, rollout={"rollout_function": f"{PLUGINS}:unversioned_rollout"}
    )
    engine = TorchEngine.from_pretrained(env.model, max_batch_size=64)

    async def go() -> None:
        await engine.load_weights(_other_weights(env), 3)
        async with Loop(env, config, address, engine=engine) as worker:
            await _until(lambda: worker.groups_put == 2, what="both groups")

    asyncio.run(go())
    versions = {
        (t.policy_version_start, t.policy_version_end)
        for g in buffer.take_all(2)
        for t in g.trajectories
    }
    assert versions == {(3, 3)}


def test_an_engine_that_fails_to_resume_after_an_update_does_not_stop_generation(env, job) -> None:
    # An SGLang server that restarts during an update: it comes back unpaused, but the call to
    # continue generation fails (a stand-in: the real torch engine resumes, then the call
    # raises). Resume in the update's `finally` used to raise there, before the generation gate
    # was opened: every group waited on it for good, holding its lease.
    config, buffer, address = job(
        prompts=4,
        rollout={
            "on_weight_update": "abort",
            "batches_in_flight": 1,
            "sampling": {"max_new_tokens": 300, "ignore_eos": True},
        },
    )
    engine = TorchEngine.from_pretrained(env.model, max_batch_size=64)
    new = _other_weights(env)
    real_resume = engine.resume

    async def restarted_resume() -> None:
        await real_resume()
        raise EngineUnavailable("POST /continue_generation failed after 4 attempt(s)")

    failures = ("kuberl_rollout_failures_total", {"stage": "resume"})

    async def go() -> tuple[int, str, float]:
        before = _metric(failures[0], **failures[1])
        async with Loop(env, config, address, engine=engine) as worker:
            await _until(lambda: worker._generating, what="a generation in flight")
            engine.resume = restarted_resume  # type: ignore[method-assign]
            await worker.apply_weight_update(1, lambda: engine.load_weights(new, 1))
            engine.resume = real_resume  # type: ignore[method-assign]
            await _until(lambda: worker.groups_put == 4, 120, "all groups")
            return worker.groups_put, worker.state, _metric(failures[0], **failures[1]) - before

    assert asyncio.run(go()) == (4, "running", 1.0)
    assert len(buffer.take_all(4)) == 4


def test_drain_releases_in_flight_prompts_even_when_the_engine_cannot_abort(env, job) -> None:
    # An engine that is down cannot abort: drain used to raise there, releasing nothing and
    # skipping the replica's LeaveEngine and channel closing. Now it cancels the batches, which
    # release their prompts, at once.
    config, buffer, address = job(
        prompts=4, rollout={"sampling": {"max_new_tokens": 800, "ignore_eos": True}}
    )
    engine = TorchEngine.from_pretrained(env.model, max_batch_size=64)

    async def unreachable() -> int:
        raise EngineUnavailable("POST /abort_request failed after 4 attempt(s)")

    async def go() -> tuple[int, int, float]:
        loop = Loop(env, config, address, engine=engine)
        worker = await loop.__aenter__()
        await _until(lambda: len(worker._generating) == 4, what="both batches generating")
        engine.abort_all = unreachable  # type: ignore[method-assign]
        started = time.monotonic()
        result = await worker.drain(0)
        seconds = time.monotonic() - started
        await loop.__aexit__()
        return (*result, seconds)

    finished, released, seconds = asyncio.run(go())
    again = buffer.stub.LeasePrompts(
        bpb.LeasePromptsRequest(max_prompts=10, consumer="another-replica"), timeout=30
    )
    # Released, not left to the 60 s lease timeout: another replica gets all four at once.
    assert (finished, released, seconds < 5, len(again.prompts)) == (0, 4, True, 4), seconds


def test_an_abort_update_regenerates_a_group_caught_between_engine_calls(env, job) -> None:
    # A group whose rollout is between engine calls (a tool running) has nothing in the engine to
    # abort: its next call would run on the new weights after the first ran on the old ones.
    config, buffer, address = job(
        prompts=1,
        rollout={"on_weight_update": "abort", "rollout_function": f"{PLUGINS}:two_call_rollout"},
    )
    new = _other_weights(env)

    async def go() -> None:
        async with Loop(env, config, address) as worker:
            await _until(lambda: "train:0" in BETWEEN_CALLS, what="a group between engine calls")
            await worker.apply_weight_update(1, lambda: worker.engine.load_weights(new, 1))
            await _until(lambda: worker.groups_put == 1, what="the group")

    asyncio.run(go())
    assert _update_records(buffer.take_all(1)) == {("aborted_and_regenerated", (1,), (1, 1)): GROUP}


def test_drain_releases_in_flight_prompts_to_the_buffer_at_once(env, job) -> None:
    config, buffer, address = job(
        prompts=4, rollout={"sampling": {"max_new_tokens": 800, "ignore_eos": True}}
    )

    async def go() -> tuple[int, int]:
        loop = Loop(env, config, address)
        worker = await loop.__aenter__()
        await _until(lambda: len(worker._generating) == 4, what="both batches generating")
        result = await worker.drain(0)
        await loop.__aexit__()
        return result

    started = time.monotonic()
    finished, released = asyncio.run(go())
    again = buffer.stub.LeasePrompts(
        bpb.LeasePromptsRequest(max_prompts=10, consumer="another-replica"), timeout=30
    )
    # Released, not timed out: the lease timeout is 60 s.
    assert time.monotonic() - started < 60
    assert (finished, released) == (0, 4)
    assert sorted((p.prompt_id, p.delivery_count) for p in again.prompts) == [
        (f"train:{i}", 2) for i in range(4)
    ]


def test_backpressure_waits_for_the_trainer_and_then_finishes(env, job) -> None:
    config, buffer, address = job(
        prompts=6,
        buffer={"max_inflight_groups": 2, "backpressure_retry_seconds": 0.2},
        rollout={"lease_wait_seconds": 0},
    )
    refused_before = m.BACKPRESSURE._value.get()

    async def go() -> tuple[int, list[Group]]:
        async with Loop(env, config, address) as worker:
            await _until(lambda: m.BACKPRESSURE._value.get() > refused_before, what="a refusal")
            put_while_refused = worker.groups_put
            taken: list[Group] = []
            while len(taken) < 6:
                taken += await asyncio.to_thread(buffer.take, 2)
            return put_while_refused, taken

    put_while_refused, taken = asyncio.run(go())
    assert put_while_refused <= 2
    assert sorted(g.prompt_id for g in taken) == [f"train:{i}" for i in range(6)]


def test_a_full_window_holds_the_lease_at_the_buffer_instead_of_refusing_it(env, job) -> None:
    # lease_wait_seconds: the replica's lease waits at the buffer and starts when the trainer
    # acknowledges a batch, so it is never refused and never sleeps a retry-after.
    config, buffer, address = job(
        prompts=6,
        buffer={"max_inflight_groups": 2, "backpressure_retry_seconds": 30},
        rollout={"lease_wait_seconds": 20, "prompts_per_batch": 2},
    )
    refused_before = m.BACKPRESSURE._value.get()

    async def go() -> tuple[list[Group], float]:
        async with Loop(env, config, address) as worker:
            taken: list[Group] = []
            started = time.monotonic()
            while len(taken) < 6:
                taken += await asyncio.to_thread(buffer.take, 2)
            await _until(lambda: worker.groups_put == 6, what="all groups")
            return taken, time.monotonic() - started

    taken, seconds = asyncio.run(go())
    assert sorted(g.prompt_id for g in taken) == [f"train:{i}" for i in range(6)]
    assert m.BACKPRESSURE._value.get() == refused_before
    assert seconds < 20, f"{seconds:.1f}s: a lease slept the 30 s retry-after"


def test_eval_mode_puts_groups_to_the_eval_stream_only(env, job) -> None:
    config, buffer, address = job(prompts=2, eval_prompts=3, rollout={"mode": "eval"})

    async def go() -> None:
        async with Loop(env, config, address) as worker:
            await _until(lambda: worker.groups_put == 3, what="eval groups")
            await asyncio.sleep(0.3)

    asyncio.run(go())
    evals = buffer.take_all(3, tpb.STREAM_KIND_EVAL)
    assert sorted(g.prompt_id.split(":")[0] for g in evals) == ["eval"] * 3
    assert buffer.take(5, wait=0.2) == []


def test_rejection_sampling_puts_only_samples_at_or_above_the_threshold(env, job) -> None:
    # A sample is kept when its first character has an odd code point: about half of them on
    # the seeded model, so 32 samples make "none kept" and "all kept" ~1e-9 each (with 12 they
    # were ~1e-3 together: sampling varies with how the engine batches rows).
    prompts = 16
    config, buffer, address = job(
        prompts=prompts, rollout={"mode": "rejection_sampling", "rejection_threshold": 1.0}
    )

    async def go() -> None:
        async with Loop(env, config, address) as worker:
            # Every lease completes, one with no kept sample by an empty group.
            await _until(lambda: worker.groups_put == prompts, what="all groups")

    asyncio.run(go())
    kept = [t for g in buffer.take(2 * prompts, tpb.STREAM_KIND_SFT) for t in g.trajectories]
    assert 0 < len(kept) < prompts * GROUP
    assert all(t.reward >= 1.0 and ord(t.response_text[0]) % 2 == 1 for t in kept)
    assert buffer.take(12, wait=0.2) == []  # nothing went to the training stream


def test_the_loop_runs_unchanged_on_the_sglang_engine(env, job) -> None:
    """Against the SGLang API stand-in (not SGLang): the loop is engine-agnostic."""
    config, buffer, address = job(prompts=3)

    async def go(url: str) -> None:
        engine = SGLangEngine(SGLangEngineConfig(url=url))
        async with Loop(env, config, address, engine) as worker:
            await _until(lambda: worker.groups_put == 3, what="all groups")

    with SGLangStandIn(vocab_size=90) as server:
        asyncio.run(go(server.url))
        # A group is a prefill-only request, then one batch sampling all of it.
        generated = [
            b for _, p, b in server.requests if p == "/generate" and b.get("return_logprob")
        ]
    groups = buffer.take_all(3)
    t = groups[0].trajectories[1]
    assert (len(groups), len(generated)) == (3, 3)
    assert t.rollout_logprobs.tolist() == pytest.approx(
        [-0.01 * (i + 1) - 0.001 for i in range(len(t.response_token_ids))]
    )


def test_a_reward_outage_is_retried_then_the_prompts_go_back_to_the_buffer(env, job) -> None:
    config, buffer, address = job(prompts=2, rollout={"max_attempts": 3, "batches_in_flight": 1})
    held = PortReservation()  # bound, never listening, and no other process can take it
    dead = f"127.0.0.1:{held.take()}"  # connections refused: the reward service is down
    retries = m.RPC_RETRIES.labels("Score", "UNAVAILABLE")
    failures = m.FAILURES.labels("score")
    before = (retries._value.get(), failures._value.get())

    async def go() -> None:
        async with Loop(env, config, address, reward_address=dead) as worker:
            await _until(lambda: worker.prompts_released >= 2, what="the prompts released")

    started = time.monotonic()
    try:
        asyncio.run(go())
    finally:
        held.release()
    again = buffer.stub.LeasePrompts(
        bpb.LeasePromptsRequest(max_prompts=10, consumer="another-replica"), timeout=30
    )
    assert time.monotonic() - started < 60  # released, not timed out (lease timeout 60 s)
    assert retries._value.get() - before[0] >= 2 and failures._value.get() - before[1] >= 1
    assert sorted(p.prompt_id for p in again.prompts) == ["train:0", "train:1"]
    assert min(p.delivery_count for p in again.prompts) >= 2


OUTCOMES = ("loaded", "timed_out")


@pytest.mark.parametrize("update", [True, False])
def test_a_batch_leased_on_weights_too_old_to_train_waits_for_the_update(env, job, update) -> None:
    # The trainer is at version 3 and drops groups older than max_staleness (1) versions: an
    # engine still at 0 would make groups that are only ever dropped. The batch waits for
    # version 2 or later; without an update it goes ahead when version_wait_seconds are up.
    wait = 30.0 if update else 1.0
    config, buffer, address = job(
        prompts=2,
        rollout={"weight_sync": True, "batches_in_flight": 1, "version_wait_seconds": wait},
    )
    buffer.stub.SetPolicyVersion(bpb.SetPolicyVersionRequest(version=3), timeout=10)
    new = _other_weights(env)

    async def go() -> tuple[int, float, float]:
        before = [_metric("kuberl_rollout_version_waits_total", outcome=o) for o in OUTCOMES]
        async with Loop(env, config, address) as worker:
            await _until(lambda: worker._inflight, what="a lease")
            if update:
                await asyncio.sleep(0.5)
                assert (worker._generating, worker.groups_put) == (set(), 0)  # held
                await worker.apply_weight_update(2, lambda: worker.engine.load_weights(new, 2))
            await _until(lambda: worker.groups_put == 2, 60, "both groups")
            after = [_metric("kuberl_rollout_version_waits_total", outcome=o) for o in OUTCOMES]
            return worker.engine.version, after[0] - before[0], after[1] - before[1]

    version, loaded, timed_out = asyncio.run(go())
    starts = {t.policy_version_start for g in buffer.take_all(2) for t in g.trajectories}
    assert (version, starts, loaded, timed_out) == (
        (2, {2}, 1.0, 0.0) if update else (0, {0}, 0.0, 1.0)
    )
