"""What the weight-sync service says about its pool: `GetStatus` and the Prometheus metrics, checked
value by value against a sequence of joins, publishes, loads, a leave and a silent engine dropped.

A real `kuberl serve weight_sync` in a subprocess with its own metrics (exact counts, not deltas);
the engines are `EngineClient`s in this process plus one engine driven by hand over gRPC (it holds
an older version, then goes silent), all over `snapshot`, so no engine process starts torch.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
from kuberl.common.channels import sync_channel
from kuberl.common.weights import EngineClient, WeightPublisher, download_snapshot, plan
from tests.integration.test_weight_sync import MB, _job_file, _metric, _status, _wait, make_tensors
from tests.support import ServiceProcess

P = "kuberl_weight_sync"


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServiceProcess]:
    # heartbeat 0.5 s, 3 missed: a silent engine is dropped after 1.5 s; bucket_bytes 1 MiB
    config = _job_file(tmp_path, ["snapshot"], broadcast_timeout=60)
    with ServiceProcess.kuberl("weight_sync", config, tmp_path) as proc:
        proc.wait_serving()
        yield proc


def _holds(svc: ServiceProcess) -> tuple[dict[str, int], dict[int, int]]:
    """GetStatus as {engine: version held} and {version: engines holding it}."""
    status = _status(svc)
    return (
        {e.engine_id: e.loaded_version for e in status.engines},
        dict(status.engines_per_version),
    )


def _metrics(svc: ServiceProcess) -> dict[str, float]:
    names = [
        f'{P}_engines{{version="1"}}',
        f'{P}_engines{{version="2"}}',
        f"{P}_engine_joins_total",
        f'{P}_engine_leaves_total{{reason="leave"}}',
        f'{P}_engine_leaves_total{{reason="dropped"}}',
        f'{P}_timeouts_total{{kind="heartbeat"}}',
        f'{P}_timeouts_total{{kind="update"}}',
        f'{P}_publish_seconds_count{{transport="snapshot"}}',
        f'{P}_engine_update_seconds_count{{transport="snapshot"}}',
        f'{P}_bytes_total{{direction="in",transport="snapshot"}}',  # labels sorted by name
        f'{P}_bytes_total{{direction="out",transport="snapshot"}}',
    ]
    values = {n.removeprefix(f"{P}_"): _metric(svc, n) for n in names}
    for direction in ("in", "out"):  # a rate: only that it was measured
        labels = f'{{direction="{direction}",transport="snapshot"}}'
        rate = _metric(svc, f"{P}_bandwidth_bytes_per_second{labels}")
        values[f"bandwidth {direction} > 0"] = float(rate > 0)
    return values


def _reported(svc: ServiceProcess) -> float:
    """Updates the engines reported loaded (the service's view, not the clients')."""
    return _metric(svc, f'{P}_engine_update_seconds_count{{transport="snapshot"}}')


def _loader(loaded: list[int]):  # type: ignore[no-untyped-def]
    def load(tensors: dict[str, torch.Tensor], version: int) -> None:
        loaded.append(version)

    return load


def test_status_and_metrics_say_which_engine_holds_which_version_and_count_every_event(
    service: ServiceProcess,
) -> None:
    tensors = {1: make_tensors(1, 3), 2: make_tensors(2, 3)}
    nbytes = plan([(k, v.dtype, v.shape) for k, v in tensors[1].items()], MB).total_bytes
    history: dict[str, list[int]] = {"a": [], "b": []}
    a, b = (
        EngineClient(
            service.address, load=_loader(history[n]), engine_id=n, transports=["snapshot"]
        )
        for n in ("a", "b")
    )
    running = [a, b]
    silent = threading.Event()
    with sync_channel(service.address) as channel, WeightPublisher(service.address) as pub:
        stub = pb_grpc.WeightSyncServiceStub(channel)

        def beat_c() -> None:  # engine "c" is alive until `silent` is set
            while not silent.wait(0.1):
                stub.Heartbeat(pb.HeartbeatRequest(engine_id="c", loaded_version=1), timeout=5)

        try:
            a.start()
            b.start()
            pub.publish(1, iter(tensors[1].items()))
            _wait(lambda: _reported(service) == 2, "a and b reported v1", service)
            manifest = stub.GetVersion(pb.GetVersionRequest(), timeout=5).manifest
            after_v1 = (_holds(service), _metrics(service))
            running.remove(b)
            b.stop()  # leaves
            # c joins by hand: it is told to catch up to v1 by snapshot, downloads it and says so
            joined = stub.RegisterEngine(
                pb.RegisterEngineRequest(
                    engine=pb.EngineInfo(
                        engine_id="c", transports=[pb.TRANSPORT_SNAPSHOT], host=socket.gethostname()
                    )
                ),
                timeout=5,
            )
            version, _, _ = download_snapshot(service.address, joined.pending.version)
            stub.ReportLoaded(
                pb.ReportLoadedRequest(engine_id="c", version=version, ok=True), timeout=5
            )
            beating = threading.Thread(target=beat_c)
            beating.start()
            pub.publish(2, iter(tensors[2].items()))  # c is sent v2 and never takes it
            _wait(lambda: _reported(service) == 4, "a reported v2", service)
            mixed = (_holds(service), _metrics(service))
            silent.set()
            beating.join(5)
            _wait(lambda: "c" not in _holds(service)[0], "the silent engine dropped", service)
            after_drop = (_holds(service), _metrics(service))
        finally:
            silent.set()
            for client in running:
                client.stop()
    # The configured bucket size (1 MiB) decided the layout the trainer's publish used.
    assert (manifest.bucket_bytes, manifest.num_buckets, manifest.total_bytes) == (
        MB,
        plan([(k, v.dtype, v.shape) for k, v in tensors[1].items()], MB).num_buckets,
        nbytes,
    )
    assert manifest.num_buckets > 1
    assert (history, joined.pending.version, joined.pending.transport) == (
        {"a": [1, 2], "b": [1]}, 1, pb.TRANSPORT_SNAPSHOT,
    )  # fmt: skip
    counts = {
        "engines{version=\"1\"}": 0.0, "engines{version=\"2\"}": 0.0, "engine_joins_total": 2.0,
        "engine_leaves_total{reason=\"leave\"}": 0.0,
        "engine_leaves_total{reason=\"dropped\"}": 0.0,
        "timeouts_total{kind=\"heartbeat\"}": 0.0, "timeouts_total{kind=\"update\"}": 0.0,
        "publish_seconds_count{transport=\"snapshot\"}": 1.0,
        "engine_update_seconds_count{transport=\"snapshot\"}": 2.0,
        "bytes_total{direction=\"in\",transport=\"snapshot\"}": float(nbytes),
        "bytes_total{direction=\"out\",transport=\"snapshot\"}": 2.0 * nbytes,
        "bandwidth in > 0": 1.0, "bandwidth out > 0": 1.0,
    }  # fmt: skip
    assert after_v1 == (({"a": 1, "b": 1}, {1: 2}), {**counts, 'engines{version="1"}': 2.0})
    # a holds v2 while c, alive, still holds v1: both GetStatus and the gauge say so.
    counts.update({
        'engines{version="1"}': 1.0, 'engines{version="2"}': 1.0, "engine_joins_total": 3.0,
        'engine_leaves_total{reason="leave"}': 1.0,
        'publish_seconds_count{transport="snapshot"}': 2.0,
        'engine_update_seconds_count{transport="snapshot"}': 4.0,  # a v1, b v1, c v1, a v2
        'bytes_total{direction="in",transport="snapshot"}': 2.0 * nbytes,
        'bytes_total{direction="out",transport="snapshot"}': 4.0 * nbytes,
    })  # fmt: skip
    assert mixed == (({"a": 2, "c": 1}, {2: 1, 1: 1}), counts)
    # c, silent for 3 heartbeats, is dropped: a heartbeat timeout and a leave, not an update
    # timeout; the gauge no longer counts it.
    counts.update({
        'engines{version="1"}': 0.0, 'engine_leaves_total{reason="dropped"}': 1.0,
        'timeouts_total{kind="heartbeat"}': 1.0,
    })  # fmt: skip
    assert after_drop == (({"a": 2}, {2: 1}), counts)
