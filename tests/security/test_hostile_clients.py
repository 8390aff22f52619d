"""Hostile and buggy clients against a real running job: it keeps training and loses nothing.

`kuberl run` of examples/demo.yaml (shortened: no warm start, small groups, plaintext loopback as
in local mode) trains while the tests below, in file order, each send the well-formed request a
buggy or hostile client could send: a Publish never followed by its bytes, SFT groups in an RL
job, a reader that is not the trainer, groups from a version the trainer has not reached, a policy
version beyond the published weights, catastrophic regexes, groups without a lease or outside the
model's limits, a release of 5,000 ids. Each is refused with INVALID_ARGUMENT or
FAILED_PRECONDITION (never UNAVAILABLE), counted by reason, or made harmless; the job must then
finish every step with `prompts_lost: 0` and no group trained beyond `max_staleness` in its
summary.json. docs/security.md lists the invariant each of them checks. Each client sends its
request under the identity that may call the method (the run's token of a rollout replica or of
the trainer, from the run folder): a compromised component's reach. Without the right identity
(no token, a forged one, a rollout's token for the trainer's methods) the same calls are
PERMISSION_DENIED and counted, the local-mode roles of kuberl.common.roles.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import yaml

from kuberl.api.buffer.v1 import buffer_pb2 as bpb
from kuberl.api.buffer.v1 import buffer_pb2_grpc
from kuberl.api.common.v1 import trajectory_pb2 as tpb
from kuberl.api.reward.v1 import reward_pb2, reward_pb2_grpc
from kuberl.api.weight_sync.v1 import weight_sync_pb2 as wpb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc
from kuberl.common.channels import sync_channel
from kuberl.common.trajectory import encode_array
from tests.integration.buffer_support import make_group
from tests.support import REPO, short_demo_job

GROUP_SIZE = 4
TOTAL_STEPS = 300
HOSTILE = "hostile-client"
ROLLOUT, TRAINER, FORGED = "rollout-0", "trainer", "forged"
TRAIN = tpb.STREAM_KIND_TRAIN
TRANSPORT = wpb.TRANSPORT_SNAPSHOT


@dataclass
class RunningJob:
    proc: subprocess.Popen[str]
    run_dir: Path
    endpoints: dict[str, str]

    def steps(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return max((int(r.get("step", 0)) for r in rows if r.get("kind") == "rl"), default=0)

    def wait_for(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            assert self.proc.poll() is None, f"the job exited while waiting for {what}"
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}")

    def keeps_training(self, steps: int = 3, timeout: float = 60) -> None:
        """The trainer completes `steps` more steps (or the job completes)."""
        start = self.steps()
        self.wait_for(
            lambda: self.steps() >= min(start + steps, TOTAL_STEPS), timeout, "more steps"
        )

    def token(self, process: str) -> str:
        """The run's role token of `process` (`kuberl run` writes them owner-only)."""
        return (self.run_dir / "roles" / f"{process}.token").read_text()

    def stub(self, service: str, caller: str) -> Any:
        """A stub calling as `caller`: a process of the run (its token), FORGED (a token of
        nobody's) or "" (no token)."""
        address = self.endpoints[service]
        if caller in ("", FORGED):
            token = secrets.token_urlsafe(32) if caller else ""
        else:
            token = self.token(caller)
        channel = sync_channel(address, token=token)
        stubs = {
            "buffer": buffer_pb2_grpc.BufferServiceStub,
            "weight_sync": weight_sync_pb2_grpc.WeightSyncServiceStub,
            "reward": reward_pb2_grpc.RewardServiceStub,
        }
        return stubs[service](channel)

    def metrics(self, service: str) -> str:
        log = (self.run_dir / "logs" / f"{service}.log").read_text()
        port = re.search(r"event=server\.listening .*?metrics_port=(\d+)", log)
        assert port, f"no metrics port in {service}.log"
        url = f"http://127.0.0.1:{port.group(1)}/metrics"
        import urllib.request

        return urllib.request.urlopen(url, timeout=10).read().decode()


def _job(tmp: Path) -> Path:
    return short_demo_job(
        tmp, "hostile", max_inflight_groups=16, total_steps=TOTAL_STEPS, checkpoint_every=0
    )


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningJob]:
    tmp = tmp_path_factory.mktemp("hostile")
    run_dir = tmp / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kuberl.cli", "run", str(_job(tmp)), "--run-dir", str(run_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    running = RunningJob(proc, run_dir, {})
    try:

        def endpoints() -> dict[str, str] | None:
            path = run_dir / "job.yaml"
            found = yaml.safe_load(path.read_text()).get("endpoints", {}) if path.exists() else {}
            return found if found.get("trainer", "").split(":")[-1] != "50054" else None

        running.endpoints = running.wait_for(endpoints, 300, "the job's endpoints")
        running.wait_for(lambda: running.steps() >= 2, 300, "the first RL steps")
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _lease(buffer: Any, n: int = 1) -> list[tpb.Prompt]:
    """Prompts leased as a rollout replica would (retried while backpressure holds them)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            request = bpb.LeasePromptsRequest(max_prompts=n, consumer=HOSTILE, wait_seconds=2)
            prompts = list(buffer.LeasePrompts(request, timeout=30).prompts)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            prompts = []
        if prompts:
            return prompts
        time.sleep(0.2)


def _release(buffer: Any, prompts: list[tpb.Prompt]) -> None:
    request = bpb.ReleasePromptsRequest(lease_ids=[p.lease_id for p in prompts], consumer=HOSTILE)
    buffer.ReleasePrompts(request, timeout=30)


def _put(buffer: Any, groups: list[tpb.Group], leases: list[str], kind: int = TRAIN) -> Any:
    request = bpb.PutTrajectoriesRequest(groups=groups, lease_ids=leases, kind=kind)
    return buffer.PutTrajectories(request, timeout=30)


def _refused_put(job: RunningJob, build: Callable[[tpb.Prompt], tpb.Group], kind: int = TRAIN):  # type: ignore[no-untyped-def]
    """Lease a prompt, put what `build` makes of it, give the lease back: the put's code."""
    buffer = job.stub("buffer", ROLLOUT)
    (prompt,) = _lease(buffer)
    try:
        return _code(lambda: _put(buffer, [build(prompt)], [prompt.lease_id], kind))
    finally:
        _release(buffer, [prompt])


# 1 ------------------------------------------------------------------------------------------


def test_a_publish_never_followed_by_its_bytes_does_not_stop_publishing(job: RunningJob) -> None:
    ws = job.stub("weight_sync", TRAINER)
    current = ws.GetVersion(wpb.GetVersionRequest(), timeout=10).version
    request = wpb.PublishRequest(version=current + 10**6, transports=[wpb.TRANSPORT_SNAPSHOT])
    ws.Publish(request, timeout=10)
    job.wait_for(
        lambda: ws.GetVersion(wpb.GetVersionRequest(), timeout=10).version > current + 3,
        90,
        "weight-sync to take the trainer's next versions",
    )


# 2 ------------------------------------------------------------------------------------------


def test_sft_groups_in_an_rl_job_are_refused(job: RunningJob) -> None:
    code = _refused_put(
        job, lambda p: make_group(p.prompt_id, p.epoch, size=2), kind=tpb.STREAM_KIND_SFT
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    job.keeps_training()


# 3 ------------------------------------------------------------------------------------------


def test_a_reader_that_is_not_the_trainer_cannot_take_its_groups(job: RunningJob) -> None:
    request = bpb.GetBatchRequest(num_groups=16, consumer="anything-else", max_staleness=-1)
    assert _code(lambda: job.stub("buffer", TRAINER).GetBatch(request, timeout=30)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


# 4 ------------------------------------------------------------------------------------------


def test_groups_from_versions_the_trainer_has_not_reached_are_never_trained(
    job: RunningJob,
) -> None:
    buffer = job.stub("buffer", ROLLOUT)
    huge = _refused_put(job, lambda p: make_group(p.prompt_id, p.epoch, version=2**62))
    (prompt,) = _lease(buffer)
    ahead = job.steps() + 1000  # below 2**53: stored, then dropped by GetBatch (and re-queued)
    answer = _put(
        buffer, [make_group(prompt.prompt_id, prompt.epoch, version=ahead)], [prompt.lease_id]
    )
    assert (huge, answer.results[0].status) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        bpb.PUT_STATUS_ACCEPTED,
    )
    job.keeps_training()


# 5 ------------------------------------------------------------------------------------------


def test_a_policy_version_beyond_the_published_weights_is_refused(job: RunningJob) -> None:
    buffer = job.stub("buffer", TRAINER)
    request = bpb.SetPolicyVersionRequest(version=2**53 - 1)
    code = _code(lambda: buffer.SetPolicyVersion(request, timeout=10))
    version = buffer.GetStats(bpb.GetStatsRequest(), timeout=10).policy_version
    assert (code, version < TOTAL_STEPS + 2) == (grpc.StatusCode.FAILED_PRECONDITION, True)
    job.keeps_training()


# 6 ------------------------------------------------------------------------------------------


def test_catastrophic_regexes_do_not_hold_the_reward_service(job: RunningJob) -> None:
    samples = [
        reward_pb2.Sample(
            sample_id=f"h{i}",
            response="a" * 40 + "b",
            metadata_json=json.dumps({"regex": r"(a+)+$"}),
            verifiers=["regex"],
        )
        for i in range(8)
    ]
    started = time.monotonic()
    scores = (
        job.stub("reward", ROLLOUT)
        .Score(reward_pb2.ScoreRequest(samples=samples), timeout=60)
        .scores
    )
    assert ({s.error for s in scores}, time.monotonic() - started < 2.0) == ({""}, True)
    job.keeps_training()


# 7 ------------------------------------------------------------------------------------------


def _positive_logprobs(p: tpb.Prompt) -> tpb.Group:
    group = make_group(p.prompt_id, p.epoch)
    group.trajectories[0].rollout_logprobs.CopyFrom(encode_array(np.full(8, 0.5, np.float32)))
    return group


@pytest.mark.parametrize(
    "defect",
    [
        lambda p: make_group(p.prompt_id, p.epoch, length=6000),  # the model has 2,048 positions
        _positive_logprobs,
        lambda p: make_group(p.prompt_id, p.epoch, length=0),  # empty, not aborted
    ],
    ids=["too_long", "positive_logprob", "empty_response"],
)
def test_groups_outside_the_models_limits_are_refused(
    job: RunningJob, defect: Callable[[tpb.Prompt], tpb.Group]
) -> None:
    assert _refused_put(job, defect) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_put_without_its_prompts_lease_is_refused(job: RunningJob) -> None:
    buffer = job.stub("buffer", ROLLOUT)
    (prompt,) = _lease(buffer)  # held here, so nobody completes it meanwhile
    group = make_group(prompt.prompt_id, prompt.epoch)
    try:
        without = _code(lambda: _put(buffer, [group], []))
        guessed = _code(lambda: _put(buffer, [group], ["1-0"]))  # a handle it never had
    finally:
        _release(buffer, [prompt])
    assert (without, guessed) == (grpc.StatusCode.INVALID_ARGUMENT,) * 2
    job.keeps_training()


# 8 ------------------------------------------------------------------------------------------


def test_a_release_of_more_ids_than_one_lease_hands_out_is_invalid(job: RunningJob) -> None:
    request = bpb.ReleasePromptsRequest(lease_ids=[f"1-{i}" for i in range(5000)], consumer="x")
    assert _code(lambda: job.stub("buffer", ROLLOUT).ReleasePrompts(request, timeout=30)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


# roles ----------------------------------------------------------------------------------------

TRAINERS = [
    ("buffer", "GetBatch", bpb.GetBatchRequest(num_groups=1, consumer="trainer")),
    ("buffer", "SetPolicyVersion", bpb.SetPolicyVersionRequest(version=1)),
    ("weight_sync", "Publish", wpb.PublishRequest(version=10**6, transports=[TRANSPORT])),
]
ROLLOUTS = [
    ("buffer", "LeasePrompts", bpb.LeasePromptsRequest(max_prompts=1, consumer=HOSTILE)),
    ("buffer", "PutTrajectories", bpb.PutTrajectoriesRequest(kind=TRAIN)),
    ("weight_sync", "Heartbeat", wpb.HeartbeatRequest(engine_id="rollout-0")),
]


def _codes(job: RunningJob, caller: str, calls: list[tuple[str, str, Any]]) -> dict[str, Any]:
    codes = {}
    for service, method, request in calls:
        call = getattr(job.stub(service, caller), method)
        codes[method] = _code(functools.partial(call, request, timeout=30))
    return codes


@pytest.mark.parametrize("caller", ["", FORGED, ROLLOUT])
def test_only_the_trainers_identity_may_call_the_trainers_methods(
    job: RunningJob, caller: str
) -> None:
    codes = _codes(job, caller, TRAINERS)
    assert codes == {method: grpc.StatusCode.PERMISSION_DENIED for _, method, _ in TRAINERS}


@pytest.mark.parametrize("caller", ["", FORGED, TRAINER])
def test_only_a_replicas_identity_may_call_the_rollouts_methods(
    job: RunningJob, caller: str
) -> None:
    codes = _codes(job, caller, ROLLOUTS)
    assert codes == {method: grpc.StatusCode.PERMISSION_DENIED for _, method, _ in ROLLOUTS}


def test_a_replica_acts_for_its_own_engine_only(job: RunningJob) -> None:
    request = wpb.HeartbeatRequest(engine_id="rollout-1")
    code = _code(lambda: job.stub("weight_sync", ROLLOUT).Heartbeat(request, timeout=30))
    assert code == grpc.StatusCode.PERMISSION_DENIED


def test_reads_stay_open_without_a_token(job: RunningJob) -> None:
    stats = job.stub("buffer", "").GetStats(bpb.GetStatsRequest(), timeout=30)
    assert stats.job == "hostile"


def test_the_jobs_redis_refuses_a_caller_without_the_runs_password(job: RunningJob) -> None:
    import redis

    url = yaml.safe_load((job.run_dir / "job.yaml").read_text())["redis"]["url"]
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            client.hgetall(
                f"kuberl:{{{job.stub('buffer', '').GetStats(bpb.GetStatsRequest()).job}}}:state"
            )
    finally:
        client.close()
    # The password is neither in the job file nor on Redis's command line (`ps`).
    password = (job.run_dir / "redis" / "auth.conf").read_text().split()[1]
    assert (job.run_dir / "redis" / "auth.conf").stat().st_mode & 0o077 == 0
    cmdlines = [p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline") if p.exists()]
    assert not any(password.encode() in c for c in cmdlines)
    assert password not in (job.run_dir / "job.yaml").read_text()


def _denied(job: RunningJob, service: str) -> set[tuple[str, str]]:
    metric = f"kuberl_{service}_permission_denied_total"
    text = job.metrics(service.replace("_", "-"))  # its process (and log): weight-sync
    return {
        (method, role)
        for method, role, value in re.findall(
            metric + r'\{method="(\w+)",role="(\w+)"\} ([0-9.e+]+)', text
        )
        if float(value) > 0
    }


def test_every_denial_is_counted_by_method_and_role(job: RunningJob) -> None:
    found = _denied(job, "buffer") | _denied(job, "weight_sync")
    assert {
        ("GetBatch", "none"),
        ("GetBatch", "rollout"),
        ("SetPolicyVersion", "rollout"),
        ("Publish", "none"),
        ("Publish", "rollout"),
        ("LeasePrompts", "none"),
        ("LeasePrompts", "trainer"),
        ("PutTrajectories", "trainer"),
        ("Heartbeat", "trainer"),
    } - found == set()


# the job --------------------------------------------------------------------------------------

REFUSALS = {
    ("PutTrajectories", "kind_not_read"),
    ("GetBatch", "foreign_consumer"),
    ("PutTrajectories", "version_out_of_range"),
    ("SetPolicyVersion", "version_ahead"),
    ("PutTrajectories", "too_long"),
    ("PutTrajectories", "positive_logprob"),
    ("PutTrajectories", "empty_response"),
    ("PutTrajectories", "no_lease"),
    ("ReleasePrompts", "too_many"),
}


def test_every_refusal_is_counted_by_its_reason(job: RunningJob) -> None:
    found = {
        (method, reason)
        for method, reason, value in re.findall(
            r'kuberl_buffer_rejections_total\{method="(\w+)",reason="(\w+)"\} ([0-9.e+]+)',
            job.metrics("buffer"),
        )
        if float(value) > 0
    }
    assert REFUSALS - found == set()


@pytest.mark.timeout(900)
def test_the_job_trains_every_step_loses_nothing_and_stays_within_max_staleness(
    job: RunningJob,
) -> None:
    output, _ = job.proc.communicate(timeout=600)
    summary = json.loads((job.run_dir / "summary.json").read_text())
    picked = {
        k: summary.get(k)
        for k in ("status", "steps", "prompts_lost", "groups_trained_over_max_staleness")
    }
    assert (job.proc.returncode, picked) == (
        0,
        {
            "status": "completed",
            "steps": TOTAL_STEPS,
            "prompts_lost": 0,
            "groups_trained_over_max_staleness": 0,
        },
    ), output[-3000:]
    assert summary["groups_dropped"].get("train:dropped:future_version", 0) >= 1
