"""The `snapshot` transport: the version streamed by the service's `StreamSnapshot` in
CRC32C-checked chunks with a final SHA-256 (`kuberl.common.weights.chunks`). It reaches any
engine the service can reach, so it is every other transport's fallback and a late joiner's way in.
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import torch

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
from kuberl.common.channels import DEFAULT_MAX_MESSAGE_BYTES, sync_channel
from kuberl.common.weights.chunks import DEFAULT_CHUNK_BYTES, ChunkReceiver, CorruptSnapshot
from kuberl.common.weights.manifest import Manifest
from kuberl.common.weights.transports.base import Allocator, Receiver, fresh_buffer


def download_snapshot(
    address: str,
    version: int = 0,
    *,
    engine_id: str = "",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    allocate: Allocator = fresh_buffer,
) -> tuple[int, Manifest, torch.Tensor]:
    """Stream a version (0 = the latest) from the service; checks every chunk and the SHA-256."""
    state: dict[str, Any] = {}

    def on_manifest(manifest: Manifest) -> None:
        state["flat"] = allocate(manifest.total_bytes, "cpu")
        state["np"] = state["flat"].numpy()

    def write(offset: int, data: bytes) -> None:
        if "np" not in state:  # the buffer is sized by the manifest, which must come first
            raise CorruptSnapshot(f"data at offset {offset} before the manifest (first chunk)")
        state["np"][offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)

    receiver = ChunkReceiver(write, on_manifest=on_manifest)
    request = pb.StreamSnapshotRequest(
        version=version, engine_id=engine_id, chunk_bytes=chunk_bytes
    )
    with sync_channel(address, max(max_message_bytes, 2 * chunk_bytes)) as channel:
        stub = pb_grpc.WeightSyncServiceStub(channel)
        for chunk in stub.StreamSnapshot(request, timeout=timeout_s):
            receiver.feed(chunk)
    manifest = receiver.finish()
    assert receiver.version is not None
    return receiver.version, manifest, state["flat"]


class SnapshotReceiver(Receiver):
    """Streams the instructed version from `snapshot_endpoint` (empty: `address`, the
    weight-sync service the engine registered with)."""

    def __init__(
        self, address: str = "", engine_id: str = "", chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> None:
        self.address, self.engine_id, self.chunk_bytes = address, engine_id, chunk_bytes

    def receive(
        self, instruction: pb.UpdateInstruction, allocate: Allocator = fresh_buffer
    ) -> tuple[Manifest, torch.Tensor]:
        address = instruction.snapshot_endpoint or self.address
        try:
            version, manifest, flat = download_snapshot(
                address,
                instruction.version,
                engine_id=self.engine_id,
                chunk_bytes=self.chunk_bytes,
                timeout_s=instruction.deadline_seconds or None,
                allocate=allocate,
            )
        except grpc.RpcError as exc:
            raise RuntimeError(
                f"snapshot of version {instruction.version} from {address}: "
                f"{exc.code().name}: {exc.details()}"
            ) from None
        if version != instruction.version:
            raise ValueError(f"asked for version {instruction.version}, received {version}")
        return manifest, flat
