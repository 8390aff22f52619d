"""Weight-sync's edges found by review (2026-11-26): a lost ReportLoaded, a publish retried after
it never committed, a refused upload that must not touch another publish of its version; and
(2026-11-27) calls while the last version is restored, and an upload whose manifest never comes.
A real `kuberl serve weight_sync` in a subprocess; the engine and the trainer's calls are made
by hand over gRPC, so the sequence is exact."""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
from kuberl.common.channels import sync_channel
from kuberl.common.weights import WeightPublisher, download_snapshot
from kuberl.common.weights.chunks import iter_chunks
from tests.integration.test_weight_sync import MB, _chunks, _job_file, _next_version, make_tensors
from tests.support import ServiceProcess


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    tmp = tmp_path_factory.mktemp("ws-edges")
    with ServiceProcess.kuberl("weight_sync", _job_file(tmp, ["shm", "snapshot"]), tmp) as proc:
        proc.wait_serving()
        yield proc


@pytest.fixture
def stub(service: ServiceProcess) -> Iterator[pb_grpc.WeightSyncServiceStub]:
    with sync_channel(service.address) as channel:
        yield pb_grpc.WeightSyncServiceStub(channel)


def test_an_engine_whose_report_was_lost_gets_the_next_version(
    service: ServiceProcess, stub: pb_grpc.WeightSyncServiceStub
) -> None:
    # Its heartbeat says it holds v; its ReportLoaded never arrived. The assignment stayed open:
    # handed out again at every heartbeat, and v+1's fan-out left the engine out.
    engine = pb.EngineInfo(engine_id="lost-report", transports=[pb.TRANSPORT_SNAPSHOT])
    stub.RegisterEngine(pb.RegisterEngineRequest(engine=engine), timeout=10)
    v = _next_version(service)
    with WeightPublisher(service.address, transports=("snapshot",)) as pub:
        pub.publish(v, iter(make_tensors(1, 1).items()))

        def beat(loaded: int) -> pb.HeartbeatResponse:
            request = pb.HeartbeatRequest(engine_id="lost-report", loaded_version=loaded)
            return stub.Heartbeat(request, timeout=10)

        sent = beat(v - 1).pending.version
        after_loading = beat(v)
        pub.publish(v + 1, iter(make_tensors(2, 1).items()))
        following = beat(v).pending.version
    stub.LeaveEngine(pb.LeaveEngineRequest(engine_id="lost-report"), timeout=10)
    assert (sent, after_loading.HasField("pending"), following) == (v, False, v + 1)


def test_a_publish_that_never_committed_can_be_retried(
    service: ServiceProcess, stub: pb_grpc.WeightSyncServiceStub
) -> None:
    # The trainer's shared-memory write failed (or its CommitPublish was lost): its retry of the
    # same version was refused as "not above the latest", and after a few the version was lost.
    v = _next_version(service)
    stub.Publish(pb.PublishRequest(version=v, transports=[pb.TRANSPORT_SNAPSHOT]), timeout=10)
    with WeightPublisher(service.address, transports=("snapshot",)) as pub:
        pub.publish(v, iter(make_tensors(3, 1).items()))
    assert stub.GetVersion(pb.GetVersionRequest(), timeout=10).version == v


def test_a_refused_upload_leaves_another_publish_of_its_version_alone(
    service: ServiceProcess, stub: pb_grpc.WeightSyncServiceStub
) -> None:
    # v is announced for shared memory; a stray snapshot upload of v is refused at its first
    # chunk, and once forgot v's announcement and deleted its segment under the trainer.
    v = _next_version(service)
    answer = stub.Publish(
        pb.PublishRequest(
            version=v,
            transports=[pb.TRANSPORT_SHM, pb.TRANSPORT_SNAPSHOT],
            trainer_host=socket.gethostname(),
        ),
        timeout=10,
    )
    assert answer.send.transport == pb.TRANSPORT_SHM
    segment = Path(json.loads(answer.send.handles_json)["path"])
    with pytest.raises(grpc.RpcError) as err:
        stub.UploadSnapshot(iter(_chunks(v)), timeout=10)
    assert (err.value.code(), segment.exists()) == (grpc.StatusCode.FAILED_PRECONDITION, True)


def test_the_segment_a_dropped_copying_engine_may_still_read_is_never_rewritten(
    service: ServiceProcess, stub: pb_grpc.WeightSyncServiceStub
) -> None:
    # An engine that copies out of shared memory (not in place) is sent v and stalls mid-copy
    # (SIGSTOP, a VM pause): silent, it is dropped and its pins released. Its segment was then
    # handed to a later version, and the engine, back, loaded that mix as v.
    host = socket.gethostname()
    spec = pb.TensorSpec(name="a", dtype="uint8", shape=[8], bucket=0, offset=0, nbytes=8)

    def publish(version: int) -> str:
        answer = stub.Publish(
            pb.PublishRequest(version=version, transports=[pb.TRANSPORT_SHM], trainer_host=host),
            timeout=10,
        )
        path = json.loads(answer.send.handles_json)["path"]
        with open(path, "r+b") as f:
            f.write(bytes([version % 256]) * 8)
            f.truncate(8)
        manifest = pb.Manifest(tensors=[spec])
        stub.CommitPublish(pb.CommitPublishRequest(version=version, manifest=manifest), timeout=10)
        return str(path)

    v = _next_version(service)
    engine = pb.EngineInfo(
        engine_id="copier", host=host, transports=[pb.TRANSPORT_SHM], loaded_version=v - 1
    )
    stub.RegisterEngine(pb.RegisterEngineRequest(engine=engine), timeout=10)
    publish(v)
    beat = pb.HeartbeatRequest(engine_id="copier", loaded_version=v - 1)
    sent = stub.Heartbeat(beat, timeout=10)
    copying = json.loads(sent.pending.handles_json)["path"]
    status = pb.GetStatusRequest()
    deadline = time.monotonic() + 30
    while any(e.engine_id == "copier" for e in stub.GetStatus(status, timeout=10).engines):
        assert time.monotonic() < deadline, "the silent engine was never dropped"
        time.sleep(0.2)
    later = [publish(v + i) for i in (1, 2, 3)]
    assert (sent.pending.version, sent.pending.transport) == (v, pb.TRANSPORT_SHM)
    assert copying not in later


def _answer(call: Callable[[], Any]) -> tuple[str, bool]:
    """The status of a call, and whether it says the service is restoring its last version."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code().name, "restoring its last version" in (exc.details() or "")
    return "OK", False


def _write_when_read(fifo: Path, proc: ServiceProcess, data: bytes) -> None:
    """Hand `data` to the service once it opens `fifo` for reading (not before: it would never
    see it); gives up when the service has exited."""
    deadline = time.monotonic() + 60
    while proc.proc.poll() is None and time.monotonic() < deadline:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
            time.sleep(0.02)
            continue
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return


def test_every_call_is_unavailable_while_the_last_version_is_restored(tmp_path: Path) -> None:
    # start() takes back the last sealed version (hashing it: ~1 s per GB) before health says
    # SERVING. Eight methods refused calls meanwhile by hand; GetStatus and LeaveEngine answered.
    # A seal record that is a FIFO holds the restore until the test writes into it.
    job = _job_file(tmp_path, ["snapshot"])
    store = Path(json.loads(job.read_text())["weight_sync"]["shm_dir"]) / "wstest"
    store.mkdir(parents=True)
    os.mkfifo(store / "seg0.json")
    early = pb.EngineInfo(engine_id="early", transports=[pb.TRANSPORT_SNAPSHOT])
    with ServiceProcess.kuberl("weight_sync", job, tmp_path) as proc:
        try:
            proc.wait_listening()
            with sync_channel(proc.address) as channel:
                stub = pb_grpc.WeightSyncServiceStub(channel)
                calls: dict[str, Callable[[], Any]] = {
                    "RegisterEngine": lambda: stub.RegisterEngine(
                        pb.RegisterEngineRequest(engine=early), timeout=5
                    ),
                    "Heartbeat": lambda: stub.Heartbeat(
                        pb.HeartbeatRequest(engine_id="early"), timeout=5
                    ),
                    "LeaveEngine": lambda: stub.LeaveEngine(
                        pb.LeaveEngineRequest(engine_id="early"), timeout=5
                    ),
                    "ReportLoaded": lambda: stub.ReportLoaded(
                        pb.ReportLoadedRequest(engine_id="early", version=1, ok=True), timeout=5
                    ),
                    "Publish": lambda: stub.Publish(
                        pb.PublishRequest(version=1, transports=[pb.TRANSPORT_SNAPSHOT]),
                        timeout=5,
                    ),
                    "UploadSnapshot": lambda: stub.UploadSnapshot(iter(_chunks(1)), timeout=5),
                    "CommitPublish": lambda: stub.CommitPublish(
                        pb.CommitPublishRequest(version=1), timeout=5
                    ),
                    "StreamSnapshot": lambda: list(
                        stub.StreamSnapshot(pb.StreamSnapshotRequest(), timeout=5)
                    ),
                    "GetVersion": lambda: stub.GetVersion(pb.GetVersionRequest(), timeout=5),
                    "GetStatus": lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=5),
                }
                answers = {name: _answer(call) for name, call in calls.items()}
        finally:
            _write_when_read(store / "seg0.json", proc, b"not a seal record")
        proc.wait_serving()
    methods = pb.DESCRIPTOR.services_by_name["WeightSyncService"].methods_by_name
    assert answers == dict.fromkeys(methods, ("UNAVAILABLE", True))


def test_an_upload_whose_manifest_never_comes_stops_at_what_the_store_keeps_per_version(
    tmp_path: Path,
) -> None:
    # The trainer's manifest rides on its last chunk, so the bytes before it were not bounded:
    # a stream that never sent one wrote on into /dev/shm for as long as it went on. The bound
    # is the store's filesystem shared by the versions it keeps and the one being written; so
    # many are kept here that each may have about 4 MiB.
    fs = os.statvfs("/dev/shm")
    retain = fs.f_blocks * fs.f_frsize // (4 * MB) - 1
    job = _job_file(tmp_path, ["snapshot"], retain=retain)

    def without_manifest(version: int) -> Iterator[pb.SnapshotChunk]:
        return iter_chunks(version, (bytes(MB) for _ in range(16)), chunk_bytes=MB)

    with ServiceProcess.kuberl("weight_sync", job, tmp_path) as proc:
        proc.wait_serving()
        with WeightPublisher(proc.address, transports=("snapshot",)) as pub:
            pub.publish(1, iter(make_tensors(61, 1).items()))
            _, _, kept = download_snapshot(proc.address)
            with sync_channel(proc.address) as channel:
                stub = pb_grpc.WeightSyncServiceStub(channel)
                stub.Publish(
                    pb.PublishRequest(version=2, transports=[pb.TRANSPORT_SNAPSHOT]), timeout=10
                )
                with pytest.raises(grpc.RpcError) as err:
                    stub.UploadSnapshot(without_manifest(2), timeout=30)
            current, _, flat = download_snapshot(proc.address)
            retried = pub.publish(2, iter(make_tensors(62, 1).items())).version
    refused = (err.value.code(), "may have at most" in (err.value.details() or ""))
    assert (refused, current, torch.equal(flat, kept), retried) == (
        (grpc.StatusCode.INVALID_ARGUMENT, True),
        1,
        True,
        2,
    )
