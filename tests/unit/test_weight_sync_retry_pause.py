"""An engine whose update failed gets the current version again only after a pause that doubles
with every failure in a row (weight-sync's `RETRY_FIRST_SECONDS`): an engine that could not
load a version (its model did not match) was sent it again at once, failed in milliseconds and
asked again, for good. The service runs in this process, its handlers called directly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.config import WeightSyncConfig
from kuberl.common.weights import plan
from kuberl.common.weights.chunks import iter_chunks
from kuberl.weight_sync import server as ws
from kuberl.weight_sync.server import WeightSyncService


async def _one(chunks: list[pb.SnapshotChunk]):  # type: ignore[no-untyped-def]
    for chunk in chunks:
        yield chunk


def test_a_failed_update_is_sent_again_after_a_pause_that_doubles_and_resets_on_success(
    tmp_path: Path,
) -> None:
    config = WeightSyncConfig(
        transports=["snapshot"], shm_dir=str(tmp_path / "shm"), notify_engines=False
    )
    manifest = plan([("w", torch.uint8, (64,))], 64)
    pause = ws.RETRY_FIRST_SECONDS

    async def scenario() -> list[tuple[str, bool]]:
        service = WeightSyncService(config, job="retry")
        await service.start()
        seen: list[tuple[str, bool]] = []

        async def publish(version: int) -> None:
            await service.Publish(pb.PublishRequest(version=version), None)  # type: ignore[arg-type]
            chunks = iter_chunks(
                version, [bytes(64)], chunk_bytes=64, manifest_last=lambda: manifest
            )
            await service.UploadSnapshot(_one(list(chunks)), None)  # type: ignore[arg-type]
            await asyncio.gather(*service._tasks)  # sealed and fanned out

        async def offered(when: str) -> None:
            beat = pb.HeartbeatRequest(engine_id="e", wait_seconds=0)
            answer = await service.Heartbeat(beat, None)  # type: ignore[arg-type]
            seen.append((when, answer.HasField("pending")))

        async def report(version: int, ok: bool) -> None:
            loaded = pb.ReportLoadedRequest(engine_id="e", version=version, ok=ok, error="no fit")
            await service.ReportLoaded(loaded, None)  # type: ignore[arg-type]

        await publish(1)
        engine = pb.EngineInfo(engine_id="e", transports=[pb.TRANSPORT_SNAPSHOT])
        await service.RegisterEngine(pb.RegisterEngineRequest(engine=engine), None)  # type: ignore[arg-type]
        await offered("registered")
        await report(1, ok=False)
        await offered("at once after a failure")
        await asyncio.sleep(pause + 0.1)
        await offered("after the pause")
        await report(1, ok=False)
        await asyncio.sleep(pause + 0.1)
        await offered("after one pause, the second failure in a row")
        await asyncio.sleep(pause)
        await offered("after two")
        await report(1, ok=True)
        await publish(2)
        await offered("the next version")
        await report(2, ok=False)
        await asyncio.sleep(pause + 0.1)
        await offered("after one pause, a success having reset the count")
        await service.stop()
        return seen

    assert asyncio.run(scenario()) == [
        ("registered", True),
        ("at once after a failure", False),
        ("after the pause", True),
        ("after one pause, the second failure in a row", False),
        ("after two", True),
        ("the next version", True),
        ("after one pause, a success having reset the count", True),
    ]
