"""The per-version bound of weight-sync's store with `weight_sync.max_version_bytes` set: the
smaller of that cap and the filesystem's share applies, and an upload whose manifest has not come
yet is refused at the chunk that would cross it (the chart sets the cap from the volume's size
limit, docs/weight-sync.md "Upload size"). The service runs in this process, its handlers called
directly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest
import torch

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.config import WeightSyncConfig
from kuberl.common.errors import InvalidArgument
from kuberl.common.weights import plan
from kuberl.common.weights.chunks import iter_chunks
from kuberl.weight_sync.server import WeightSyncService
from kuberl.weight_sync.store import VersionStore

KB = 1024


@pytest.mark.parametrize(
    ("cap", "applies"), [(8 * KB, "cap"), (1 << 62, "filesystem")], ids=["below", "above"]
)
def test_the_store_bounds_a_version_by_the_smaller_of_its_cap_and_its_filesystem_share(
    tmp_path: Path, cap: int, applies: str
) -> None:
    store = VersionStore(tmp_path / "store", retain=2, max_version_bytes=cap)
    expected = {"cap": cap, "filesystem": store.filesystem_version_bytes}[applies]
    assert store.max_version_bytes == expected
    store.close()


async def _stream(
    chunks: Iterable[pb.SnapshotChunk], sent: list[int]
) -> AsyncIterator[pb.SnapshotChunk]:
    for chunk in chunks:
        sent.append(len(chunk.data))
        yield chunk


def test_an_upload_past_the_configured_cap_is_refused_at_the_crossing_chunk_keeping_the_rest(
    tmp_path: Path,
) -> None:
    # On the chart's disk-backed emptyDir the filesystem is the node's disk: its share allowed
    # versions larger than the volume's sizeLimit, and the kubelet evicted the pod for them.
    config = WeightSyncConfig(
        transports=["snapshot"],
        retain_versions=2,
        max_version_bytes=8 * KB,
        shm_dir=str(tmp_path / "shm"),
        notify_engines=False,
    )
    manifest = plan([(f"w{i}", torch.uint8, (KB,)) for i in range(4)], KB)
    kept = bytes(range(256)) * (manifest.total_bytes // 256)
    sent: list[int] = []

    async def scenario() -> tuple[str, int, bytes, int]:
        service = WeightSyncService(config, job="bound")
        await service.start()
        announce = pb.PublishRequest(version=1, transports=[pb.TRANSPORT_SNAPSHOT])
        await service.Publish(announce, None)  # type: ignore[arg-type]
        v1 = iter_chunks(1, [kept], chunk_bytes=KB, manifest_last=lambda: manifest)
        await service.UploadSnapshot(_stream(v1, []), None)  # type: ignore[arg-type]
        await asyncio.gather(*service._tasks)  # v1 sealed
        announce = pb.PublishRequest(version=2, transports=[pb.TRANSPORT_SNAPSHOT])
        await service.Publish(announce, None)  # type: ignore[arg-type]
        v2 = iter_chunks(2, (bytes(KB) for _ in range(16)), chunk_bytes=KB)  # no manifest
        try:
            await service.UploadSnapshot(_stream(v2, sent), None)  # type: ignore[arg-type]
            refused = "accepted"
        except InvalidArgument as exc:
            refused = str(exc)
        assert service.store is not None
        latest = service.store.latest()
        assert latest is not None
        retried = await service.Publish(announce, None)  # type: ignore[arg-type]
        await service.stop()
        return refused, latest.version, latest.flat.tobytes(), retried.version

    refused, current, held, retried = asyncio.run(scenario())
    # Refused at the ninth 1 KiB chunk, the one that would cross 8 KiB; v1 untouched, and v2
    # forgotten so that the trainer's retry of it is announced again.
    assert (
        "refused at 8192 bytes" in refused,
        "weight_sync.max_version_bytes=8192" in refused,
        sum(sent),
        (current, held == kept, retried),
    ) == (True, True, 9 * KB, (1, True, 2))
