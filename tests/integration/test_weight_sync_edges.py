"""Weight-sync's edges found by review (2026-11-26): a lost ReportLoaded, a publish retried after
it never committed, and a refused upload that must not touch another publish of its version.
A real `kuberl serve weight_sync` in a subprocess; the engine and the trainer's calls are made
by hand over gRPC, so the sequence is exact."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
from kuberl.common.channels import sync_channel
from kuberl.common.weights import WeightPublisher
from tests.integration.test_weight_sync import _chunks, _job_file, _next_version, make_tensors
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
