"""The engine-side client against a scripted weight-sync service (an in-process gRPC server): a
version whose snapshot arrives damaged is never handed to the engine, the version the engine
holds stays whole, the failure is reported, and the next good version loads; an update that
finishes after a newer version was loaded is not loaded over it.

The real service never sends a damaged stream, which is why the service here is a stand-in: it
speaks the real protocol (RegisterEngine, Heartbeat long polls, StreamSnapshot, ReportLoaded) and
damages one version's chunks the way a broken network or disk would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
from kuberl.common.weights import EngineClient, Manifest, plan
from kuberl.common.weights.chunks import iter_chunks

KB = 1024
SHAPES = {"w": (256, 128), "b": (128,)}  # fp32: 128 KiB + 512 B, 3 chunks of 64 KiB


def _tensors(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def _payload(version: int) -> tuple[Manifest, bytes]:
    tensors = _tensors(version)
    manifest = plan([(n, t.dtype, t.shape) for n, t in tensors.items()], 64 * KB)
    flat = torch.empty(manifest.total_bytes, dtype=torch.uint8)
    for name, view in manifest.views(flat).items():
        view.copy_(tensors[name])
    return manifest, flat.numpy().tobytes()


def _damage(chunks: list[pb.SnapshotChunk], how: str) -> list[pb.SnapshotChunk]:
    if how == "flipped byte":  # in the last chunk: everything before it was already written
        data = bytearray(chunks[-1].data)
        data[3] ^= 0x01
        chunks[-1].data = bytes(data)
    elif how == "truncated":  # the stream ends before its last chunk
        chunks = chunks[:-1]
    elif how == "no manifest":  # a download carries it on its first chunk
        chunks[0].ClearField("manifest")
    else:  # a chunk missing in the middle
        del chunks[1]
    return chunks


class ScriptedService(pb_grpc.WeightSyncServiceServicer):
    """Offers versions one by one (`offer`); version `damaged` is streamed with `damage`."""

    def __init__(self, damaged: int = 0, damage: str = "", latest: int = 0) -> None:
        self.damaged, self.damage = damaged, damage
        #: What a request for "the latest" (version 0) streams, once `release_latest` is set.
        self.latest, self.release_latest = latest, threading.Event()
        self.offered: pb.UpdateInstruction | None = None
        self.reports: list[tuple[int, bool, str]] = []
        self.reported = threading.Condition()

    def offer(self, version: int) -> None:
        manifest, _ = _payload(version)
        self.offered = pb.UpdateInstruction(
            version=version, transport=pb.TRANSPORT_SNAPSHOT, manifest=manifest.to_proto(),
            deadline_seconds=10,
        )  # fmt: skip

    def wait_reports(self, n: int) -> list[tuple[int, bool, str]]:
        with self.reported:
            self.reported.wait_for(lambda: len(self.reports) >= n, timeout=20)
            return list(self.reports)

    def wait_report_of(self, version: int) -> list[tuple[int, bool, str]]:
        """Every report so far, once one for `version` has come."""
        with self.reported:
            self.reported.wait_for(lambda: any(v == version for v, _, _ in self.reports), 20)
            return list(self.reports)

    def RegisterEngine(self, request, context):  # type: ignore[no-untyped-def]
        return pb.RegisterEngineResponse(engine_id="e", heartbeat_seconds=0.2)

    def Heartbeat(self, request, context):  # type: ignore[no-untyped-def]
        answer = pb.HeartbeatResponse(known=True)
        offered = self.offered
        if offered is not None and offered.version > request.loaded_version:
            answer.pending.CopyFrom(offered)
        else:
            time.sleep(min(request.wait_seconds, 0.2))
        return answer

    def StreamSnapshot(self, request, context) -> Iterator[pb.SnapshotChunk]:  # type: ignore[no-untyped-def]
        version = request.version
        if not version:
            self.release_latest.wait(20)
            version = self.latest
        manifest, payload = _payload(version)
        chunks = list(iter_chunks(version, [payload], chunk_bytes=64 * KB, manifest_first=manifest))
        if version == self.damaged:
            chunks = _damage(chunks, self.damage)
        yield from chunks

    def ReportLoaded(self, request, context):  # type: ignore[no-untyped-def]
        with self.reported:
            self.reports.append((request.version, request.ok, request.error))
            if self.offered is not None and request.version >= self.offered.version:
                self.offered = None  # the update is over, as the service ends an assignment
            self.reported.notify_all()
        return pb.ReportLoadedResponse()

    def LeaveEngine(self, request, context):  # type: ignore[no-untyped-def]
        return pb.LeaveEngineResponse()


def _serve(service: ScriptedService) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_WeightSyncServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "missing chunk", "no manifest"])
def test_a_damaged_snapshot_never_reaches_the_engine_which_keeps_its_version_whole(
    damage: str,
) -> None:
    service = ScriptedService(damaged=2, damage=damage)
    server, address = _serve(service)
    loads: list[tuple[int, dict[str, torch.Tensor]]] = []

    def load(tensors: dict[str, torch.Tensor], version: int) -> None:
        loads.append((version, tensors))  # the views the engine serves from until the next load

    client = EngineClient(address, load=load, engine_id="e", transports=["snapshot"])
    try:
        client.start()
        service.offer(1)
        service.wait_reports(1)
        service.offer(2)  # damaged on the wire
        reports = service.wait_report_of(2)
        held_after_failure = (client.version, [v for v, _ in loads])
        intact = all(torch.equal(loads[0][1][n], t) for n, t in _tensors(1).items())
        service.offer(3)
        reports = service.wait_report_of(3)
        latest = all(torch.equal(loads[-1][1][n], t) for n, t in _tensors(3).items())
    finally:
        client.stop()
        server.stop(0)
    # A heartbeat answered while v2 was being received can offer v2 again just after its failure
    # was reported, and the client retries it (as it would a service's retry): one outcome each.
    outcomes = list(dict.fromkeys((v, ok) for v, ok, _ in reports))
    assert outcomes == [(1, True), (2, False), (3, True)]
    assert reports[1][2].startswith("CorruptSnapshot: ")  # the reason, for GetStatus
    assert held_after_failure == (1, [1])  # v2 was never loaded, v1 still served
    assert intact  # the damaged v2 was received into the other half of the double buffer
    assert (client.version, [v for v, _ in loads], latest) == (3, [1, 3], True)


def test_an_update_that_finishes_after_a_newer_version_was_loaded_is_not_loaded_over_it() -> None:
    # sync_now downloads the latest (v3) and holds the receive lock while it does; v2, offered
    # meanwhile, waits for the lock and is received after v3 was loaded.
    service = ScriptedService(latest=3)
    server, address = _serve(service)
    loaded: list[int] = []
    client = EngineClient(
        address, load=lambda tensors, v: loaded.append(v), engine_id="e", transports=["snapshot"]
    )
    try:
        client.start()
        service.offer(1)
        service.wait_reports(1)
        sync = threading.Thread(target=client.sync_now)
        sync.start()
        service.offer(2)
        deadline = time.monotonic() + 10
        while client._busy != 2 and time.monotonic() < deadline:  # v2 waits for the lock
            time.sleep(0.01)
        time.sleep(0.2)
        service.release_latest.set()
        sync.join(20)
        reports = service.wait_reports(2)
        time.sleep(0.3)  # the worker would call load right before reporting
    finally:
        client.stop()
        server.stop(0)
    assert (loaded, client.version, [v for v, _, _ in reports]) == ([1, 3], 3, [1, 2])
