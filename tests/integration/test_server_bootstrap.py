"""The shared gRPC server bootstrap, run for real in a subprocess: health transitions, calls
refused until the service has started (in a real rollout replica too), reflection, message-size
limits, error mapping with metrics, and the SIGTERM drain."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kuberl.api.reward.v1 import reward_pb2, reward_pb2_grpc
from kuberl.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from kuberl.common.channels import health_status, sync_channel
from kuberl.common.modelbuild import build_model
from tests.support import REPO, ServiceProcess

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


def test_a_rollout_replica_still_starting_answers_unavailable(tmp_path: Path) -> None:
    # Its start() loads the model, then waits for its buffer and reward, which never answer
    # here. Its GetStatus answered (state STARTING) before the replica had a worker.
    model = build_model(tmp_path / "model", arch="qwen2", size="tiny", tokenizer="digits", seed=0)
    with socket.socket() as nowhere:  # bound, never listening: connections are refused
        nowhere.bind(("127.0.0.1", 0))
        absent = f"127.0.0.1:{nowhere.getsockname()[1]}"
        job = tmp_path / "job.yaml"
        local = {"host": "127.0.0.1", "port": 0, "metrics_port": 0}
        rollout = {"server": local, "engine": {"kind": "torch"}, "weight_sync": False}
        endpoints = dict.fromkeys(("buffer", "reward", "weight_sync", "trainer"), absent)
        doc = {"model": {"path": str(model)}, "endpoints": endpoints, "rollout": rollout}
        job.write_text(json.dumps(doc))
        with ServiceProcess.kuberl("rollout", job, tmp_path) as proc:
            proc.wait_listening(120)
            with sync_channel(proc.address) as channel:
                stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                with pytest.raises(grpc.RpcError) as err:
                    stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10)
                health = health_status(channel)
            proc.signal(signal.SIGKILL)  # its start waits minutes for the buffer: no drain
    assert (err.value.code(), health) == (grpc.StatusCode.UNAVAILABLE, "NOT_SERVING")


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
