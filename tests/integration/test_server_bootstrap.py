"""The shared gRPC server bootstrap, run for real in a subprocess: health transitions, calls
refused until the service has started (in a real rollout replica too), a SIGTERM while starting
(real rollout and trainer processes too), reflection, message-size limits, error mapping with
metrics, and the SIGTERM drain."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kuberl.api.reward.v1 import reward_pb2, reward_pb2_grpc
from kuberl.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from kuberl.common.channels import health_status, sync_channel
from kuberl.common.modelbuild import build_model
from tests.support import REPO, ServiceProcess, scratch_shm_dir

APP = [sys.executable, str(REPO / "tests" / "integration" / "bootstrap_app.py")]
SERVICE = "kuberl.reward.v1.RewardService"


def _start(tmp_path: Path, *extra: str) -> ServiceProcess:
    return ServiceProcess([*APP, *extra], tmp_path, "app").wait_listening()


def _score(
    channel: grpc.Channel, sample_id: str, timeout: float = 10.0
) -> reward_pb2.ScoreResponse:
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    return stub.Score(
        reward_pb2.ScoreRequest(samples=[reward_pb2.Sample(sample_id=sample_id)]), timeout=timeout
    )


@pytest.fixture
def app(tmp_path: Path):
    with _start(tmp_path) as proc:
        proc.wait_serving()
        with sync_channel(proc.address) as channel:
            yield proc, channel


def test_health_is_not_serving_until_the_service_is_ready(tmp_path: Path) -> None:
    with _start(tmp_path, "--ready-delay", "2") as proc, sync_channel(proc.address) as channel:
        early = {health_status(channel), health_status(channel, SERVICE)}
        proc.wait_serving(timeout=20)
        late = {health_status(channel), health_status(channel, SERVICE)}
    assert (early, late) == ({"NOT_SERVING"}, {"SERVING"})


def test_calls_before_the_service_is_ready_are_unavailable_with_a_retry_hint(
    tmp_path: Path,
) -> None:
    # The handler ran before start() had returned: a service answered from state it had not
    # set up yet (weight-sync guarded eight of its methods by hand, the others did not).
    with _start(tmp_path, "--ready-delay", "3") as proc, sync_channel(proc.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _score(channel, "early")
        proc.wait_serving(timeout=20)
        later = _score(channel, "later").scores[0].reward
    answer = (err.value.code(), dict(err.value.trailing_metadata()).get("retry-after-seconds"))
    assert (answer, later) == ((grpc.StatusCode.UNAVAILABLE, "1.000"), 1.0)


LOCAL = {"host": "127.0.0.1", "port": 0, "metrics_port": 0}


@contextlib.contextmanager
def _nowhere() -> Iterator[str]:
    """An address bound but never listening: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def _job(tmp_path: Path, endpoints: dict[str, str], **sections: Any) -> Path:
    """A job file for one `kuberl serve` process, on a tiny locally built model."""
    model = build_model(tmp_path / "model", arch="qwen2", size="tiny", tokenizer="digits", seed=0)
    doc = {"model": {"path": str(model)}, "endpoints": endpoints, **sections}
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(doc))
    return job


def _wait_logged(proc: ServiceProcess, event: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while f"event={event}" not in proc.log_path.read_text(errors="replace"):
        assert proc.proc.poll() is None and time.monotonic() < deadline, proc.log()
        time.sleep(0.05)


def _sigterm(proc: ServiceProcess, timeout: float = 20.0) -> tuple[int | None, float]:
    """SIGTERM the process, and again every 10 ms while it exits (the local supervisor sends a
    second one to a process still running); its exit code (None: still running after
    `timeout`) and the seconds it took."""
    started = time.monotonic()
    while proc.proc.poll() is None and time.monotonic() < started + timeout:
        proc.signal(signal.SIGTERM)
        time.sleep(0.01)
    return proc.proc.poll(), time.monotonic() - started


def test_a_rollout_replica_still_starting_answers_unavailable(tmp_path: Path) -> None:
    # Its start() loads the model, then waits for its buffer and reward, which never answer
    # here. Its GetStatus answered (state STARTING) before the replica had a worker.
    with _nowhere() as absent:
        endpoints = dict.fromkeys(("buffer", "reward", "weight_sync", "trainer"), absent)
        rollout = {"server": LOCAL, "engine": {"kind": "torch"}, "weight_sync": False}
        job = _job(tmp_path, endpoints, rollout=rollout)
        with ServiceProcess.kuberl("rollout", job, tmp_path) as proc:
            proc.wait_listening(120)
            with sync_channel(proc.address) as channel:
                stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                with pytest.raises(grpc.RpcError) as err:
                    stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10)
                health = health_status(channel)
    assert (err.value.code(), health) == (grpc.StatusCode.UNAVAILABLE, "NOT_SERVING")


# -- SIGTERM while starting -------------------------------------------------------------------
# A pod stopped while its start still waits must be gone within its grace period, its stop()
# run: Kubernetes SIGKILLs it after that, and the local supervisor after 5 s.


def test_sigterm_while_the_start_works_in_a_thread_stops_the_service_and_exits_0_at_once(
    tmp_path: Path,
) -> None:
    # A thread cannot be interrupted (a model being loaded): the process waited for it to end.
    stopped = tmp_path / "stopped"
    args = ("--ready-delay", "60", "--delay-in-thread", "--stopped-file", str(stopped))
    with _start(tmp_path, *args) as proc:
        time.sleep(0.5)  # the start is in its thread
        code, seconds = _sigterm(proc)
        log = proc.log_path.read_text()
    assert (code, seconds < 5, stopped.exists()) == (0, True, True), (seconds, log)


@pytest.mark.parametrize(
    ("service", "waiting"), [("rollout", "replica.engine_ready"), ("trainer", "dist.ready")]
)
def test_sigterm_ends_a_service_waiting_for_its_dependencies_within_seconds(
    tmp_path: Path, service: str, waiting: str
) -> None:
    # Their buffer never answers: each waited for it in a thread for up to 300 s, and a
    # SIGTERM waited for that thread (a replica took 300.8 s to exit).
    with _nowhere() as absent:
        endpoints = dict.fromkeys(("buffer", "reward", "weight_sync", "trainer"), absent)
        sections = {service: {"server": LOCAL}}
        if service == "rollout":
            sections["rollout"] |= {"engine": {"kind": "torch"}, "weight_sync": False}
        with ServiceProcess.kuberl(
            service, _job(tmp_path, endpoints, **sections), tmp_path
        ) as proc:
            _wait_logged(proc, waiting)
            time.sleep(0.5)  # waiting for the buffer
            code, seconds = _sigterm(proc)
            log = proc.log_path.read_text()
    assert (code, seconds < 5, "start_left_behind" in log) == (0, True, False), (seconds, log)


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[str]:
    """A server whose health says SERVING: the buffer and reward a replica's start waits for."""
    folder = tmp_path / "stand-in"
    folder.mkdir()
    with _start(folder) as proc:
        yield proc.wait_serving().address


def test_sigterm_ends_a_replica_catching_up_to_weight_sync_within_seconds(
    tmp_path: Path, stand_in: str
) -> None:
    # Weight-sync's current version never loads (its tensors are not the model's): the replica
    # waited for it in a thread for all of rollout.catch_up_seconds, and so did its SIGTERM.
    import torch

    from kuberl.common.weights import WeightPublisher

    sync_config = {
        "server": LOCAL,
        "heartbeat_seconds": 0.5,
        "shm_dir": scratch_shm_dir("kuberl-bootstrap-test"),
        "advertise_host": "127.0.0.1",
    }
    rollout = {
        "server": LOCAL,
        "engine": {"kind": "torch"},
        "weight_sync": True,
        "catch_up_seconds": 120,
    }
    with _nowhere() as absent:
        endpoints = {"buffer": stand_in, "reward": stand_in, "trainer": absent}
        job = _job(tmp_path, {**endpoints, "weight_sync": absent}, weight_sync=sync_config)
        with ServiceProcess.kuberl("weight_sync", job, tmp_path, name="weight-sync") as sync:
            sync.wait_serving(60)
            with WeightPublisher(sync.address) as publisher:
                publisher.publish(1, iter({"not.in.the.model": torch.zeros(4)}.items()))
            endpoints["weight_sync"] = sync.address
            job = _job(tmp_path, endpoints, weight_sync=sync_config, rollout=rollout)
            with ServiceProcess.kuberl("rollout", job, tmp_path) as proc:
                _wait_logged(proc, "engine.registered")
                time.sleep(0.5)  # catching up
                code, seconds = _sigterm(proc)
                log = proc.log_path.read_text()
    assert (code, seconds < 5, "start_left_behind" in log) == (0, True, False), (seconds, log)


def test_reflection_lists_and_describes_the_services(app) -> None:
    _, channel = app
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names
    assert described.file_descriptor_response.file_descriptor_proto


def test_a_message_over_the_limit_is_rejected_and_the_server_keeps_answering(app) -> None:
    _, channel = app
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    huge = reward_pb2.ScoreRequest(samples=[reward_pb2.Sample(response="x" * (2 * 1024 * 1024))])
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(huge, timeout=10)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _score(channel, "ok").scores[0].reward == 1.0


@pytest.mark.parametrize(
    ("sample_id", "code", "text"),
    [
        ("invalid:", grpc.StatusCode.INVALID_ARGUMENT, "response is empty"),
        ("bug:", grpc.StatusCode.INTERNAL, "RuntimeError: boom"),
        ("busy:", grpc.StatusCode.RESOURCE_EXHAUSTED, "too many samples"),
    ],
)
def test_exceptions_become_status_codes_with_their_message(app, sample_id, code, text) -> None:
    _, channel = app
    with pytest.raises(grpc.RpcError) as err:
        _score(channel, sample_id)
    assert (err.value.code(), text in err.value.details()) == (code, True)


def test_backpressure_carries_a_retry_after_trailer(app) -> None:
    _, channel = app
    with pytest.raises(grpc.RpcError) as err:
        _score(channel, "busy:")
    assert dict(err.value.trailing_metadata())["retry-after-seconds"] == "1.500"


def test_rejections_are_counted_in_prometheus_metrics(app) -> None:
    proc, channel = app
    for _ in range(2):
        with pytest.raises(grpc.RpcError):
            _score(channel, "invalid:")
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics").read().decode()
    line = 'kuberl_bootstraptest_rpc_errors_total{code="INVALID_ARGUMENT",method="Score"} 2.0'
    assert line in text


def test_sigterm_drains_in_flight_calls_then_exits_cleanly(tmp_path: Path) -> None:
    marker = tmp_path / "call-started"  # the app touches it when the slow call begins
    with _start(tmp_path) as proc:
        proc.wait_serving()
        result: dict[str, object] = {}
        with sync_channel(proc.address) as channel:

            def slow_call() -> None:
                try:
                    result["reward"] = _score(channel, f"sleep:2:{marker}").scores[0].reward
                except grpc.RpcError as exc:
                    result["error"] = exc.code()

            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=20
            )
            before = next(watch).status
            caller = threading.Thread(target=slow_call)
            caller.start()
            deadline = time.monotonic() + 30
            while not marker.exists() and time.monotonic() < deadline:  # the call is in flight
                time.sleep(0.02)
            proc.signal(signal.SIGTERM)
            during = next(watch).status
            watch.cancel()
            caller.join(10)
        code = proc.proc.wait(15)
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    assert (before, during, result, code) == (serving, not_serving, {"reward": 1.0}, 0)
