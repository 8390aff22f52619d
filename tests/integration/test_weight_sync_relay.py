"""Weight-sync's relay tree end to end: a real `kuberl serve weight_sync` with
`relay_fanout: 1` and engines (real `EngineClient`s) that serve what they hold; a version reaches
every engine whole while the service streams fewer copies than engines (the star streamed it to
each) and engines stream the rest to each other."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
from kuberl.common.channels import sync_channel
from kuberl.common.roles import IDENTITIES_ENV, issue_tokens
from kuberl.common.weights import EngineClient, ManifestBuilder, WeightPublisher
from kuberl.common.weights.peer import PeerServer
from tests.integration.test_weight_sync import make_tensors
from tests.support import ServiceProcess


def _job(tmp_path: Path, fanout: int) -> Path:
    config = tmp_path / "job.yaml"
    config.write_text(
        json.dumps(
            {
                "job": {"name": "relaytest"},
                "weight_sync": {
                    "server": {"host": "127.0.0.1", "port": 0, "metrics_port": 0},
                    "transports": ["snapshot"],
                    "heartbeat_seconds": 0.5,
                    "relay_fanout": fanout,
                    "snapshot_dir": str(tmp_path / "snapshots"),
                    "shm_dir": str(tmp_path / "no-shm" / "x"),
                    "notify_engines": False,
                },
            }
        )
    )
    return config


def _counter(proc: ServiceProcess, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics").read()
    return sum(
        s.value
        for f in text_string_to_metric_families(text.decode())
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _fan_out(tmp_path: Path, fanout: int) -> tuple[float, float, list[dict[str, torch.Tensor]]]:
    """Publish one version to four engines (three serve peers, one does not); the bytes the
    service streamed, the bytes engines relayed, and what each engine loaded."""
    tensors = make_tensors(1, total_mb=2)
    loaded: list[dict[str, torch.Tensor]] = [{} for _ in range(4)]
    with ServiceProcess.kuberl("weight_sync", _job(tmp_path, fanout), tmp_path) as service:
        service.wait_serving()
        engines = [
            EngineClient(
                service.address,
                load=lambda t, v, i=i: loaded[i].update({k: x.clone() for k, x in t.items()}),
                engine_id=f"e{i}",
                transports=["snapshot"],
                peer_host="127.0.0.1" if i < 3 else "",
            )
            for i in range(4)
        ]
        try:
            for engine in engines:
                engine.start()
            WeightPublisher(service.address, transports=("snapshot",)).publish(1, tensors.items())
            assert all(e.wait_for_version(1, timeout=60) for e in engines)
            sent = _counter(service, "kuberl_weight_sync_bytes_total", direction="out")
            relayed = _counter(service, "kuberl_weight_sync_relayed_bytes_total")
        finally:
            for engine in engines:
                engine.stop()
    for got in loaded:
        assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in got)
    return sent, relayed, loaded


def test_with_a_relay_engines_pass_a_version_on_and_the_service_streams_fewer_copies(
    tmp_path: Path,
) -> None:
    size = sum(t.numel() * t.element_size() for t in make_tensors(1, total_mb=2).values())
    sent, relayed, _ = _fan_out(tmp_path, fanout=1)
    # One stream at a time from each source: the service to e0 (and to e3, which serves nobody
    # and so never waits), then e0 to one more while the service streams to another.
    assert sent <= 3 * size and relayed >= size and sent + relayed == 4 * size


def test_without_the_relay_the_service_streams_every_engine_its_copy(tmp_path: Path) -> None:
    size = sum(t.numel() * t.element_size() for t in make_tensors(1, total_mb=2).values())
    sent, relayed, _ = _fan_out(tmp_path, fanout=0)
    assert (sent, relayed) == (4 * size, 0)


def test_an_engine_whose_report_was_lost_still_serves_the_version_it_holds(
    tmp_path: Path,
) -> None:
    # Its heartbeat says it holds the version; its ReportLoaded never arrives. It becomes a
    # source all the same: the next engine is sent to it (it was sent to the service).
    with (
        ServiceProcess.kuberl("weight_sync", _job(tmp_path, 1), tmp_path) as service,
        sync_channel(service.wait_serving().address) as channel,
    ):
        stub = pb_grpc.WeightSyncServiceStub(channel)
        for name in ("first", "second"):
            engine = pb.EngineInfo(
                engine_id=name, transports=[pb.TRANSPORT_SNAPSHOT], peer_endpoint=f"{name}:1"
            )
            stub.RegisterEngine(pb.RegisterEngineRequest(engine=engine), timeout=10)
        WeightPublisher(service.address, transports=("snapshot",)).publish(
            1, make_tensors(1, total_mb=1).items()
        )

        def beat(name: str, loaded: int) -> pb.HeartbeatResponse:
            request = pb.HeartbeatRequest(engine_id=name, loaded_version=loaded)
            return stub.Heartbeat(request, timeout=10)

        first = beat("first", 0).pending
        waiting = beat("second", 0).HasField("pending")  # the service's one slot is taken
        beat("first", 1)  # holds it; no ReportLoaded
        second = beat("second", 0).pending
    # "": the service itself (the address the engine talks to)
    assert (first.version, first.snapshot_endpoint, waiting) == (1, "", False)
    assert (second.version, second.snapshot_endpoint) == (1, "first:1")


def test_under_roles_a_peer_streams_to_engines_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's peer server (a real gRPC server) checks the caller as the service does: in
    a local run's way here, by the run's tokens."""
    tokens = issue_tokens(
        tmp_path / "roles", "relaytest", {"r0": "rollout/r0", "trainer": "trainer"}
    )
    monkeypatch.setenv(IDENTITIES_ENV, str(tmp_path / "roles" / "identities.json"))
    builder = ManifestBuilder(bucket_bytes=1024)
    builder.add("w", torch.float32, [16])
    peer = PeerServer("127.0.0.1", job="relaytest").start()
    try:
        peer.hold(3, builder.build(), torch.arange(64, dtype=torch.uint8))

        def download(token: str) -> grpc.StatusCode:
            with sync_channel(peer.endpoint, token=token) as channel:
                stub = pb_grpc.WeightSyncServiceStub(channel)
                try:
                    list(stub.StreamSnapshot(pb.StreamSnapshotRequest(version=3), timeout=10))
                except grpc.RpcError as exc:
                    return exc.code()
            return grpc.StatusCode.OK

        codes = [download(token) for token in ("", tokens["trainer"], tokens["r0"])]
    finally:
        peer.stop()
    assert codes == [grpc.StatusCode.PERMISSION_DENIED] * 2 + [grpc.StatusCode.OK]
