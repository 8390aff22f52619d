"""The snapshot stream: a version's flat payload cut into CRC32C-checked chunks with a SHA-256.

Both directions use it: the trainer's publisher uploads a version to the weight-sync service
(`UploadSnapshot`) and engines download the latest one (`StreamSnapshot`). Chunks come in order
(`offset` is the running byte count); each carries the CRC32C of its data; the manifest rides on
the first chunk (or the last, for a sender that builds it while streaming); the last chunk carries
the SHA-256 of the whole payload. `ChunkReceiver` checks all of it and rejects a corrupt, reordered
or truncated stream with `CorruptSnapshot` (a ValueError, so servers answer INVALID_ARGUMENT).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import google_crc32c

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.weights.manifest import Manifest

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


class CorruptSnapshot(ValueError):
    """A snapshot stream failed a check (checksum, order, size, version); nothing was kept."""


class Pacer:
    """Keeps the snapshot bytes one process streams (all its streams together) under a rate,
    as a pod's share of a NIC would: `delay(n)` is how long to wait before sending n bytes."""

    def __init__(self, bytes_per_second: float = 0.0) -> None:
        self.rate = bytes_per_second  # 0: no limit
        self._next = 0.0
        self._lock = threading.Lock()

    def delay(self, nbytes: int) -> float:
        if self.rate <= 0:
            return 0.0
        with self._lock:
            now = time.monotonic()
            start = max(self._next, now)
            self._next = start + nbytes / self.rate
            return start - now


def crc32c(data: bytes | memoryview) -> int:
    return int(google_crc32c.value(bytes(data) if isinstance(data, memoryview) else data))


def iter_chunks(
    version: int,
    pieces: Iterable[bytes | memoryview],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    manifest_first: Manifest | None = None,
    manifest_last: Callable[[], Manifest] | None = None,
    cuda_ipc_last: Callable[[], str] | None = None,
) -> Iterator[pb.SnapshotChunk]:
    """Cut a payload given as consecutive byte pieces into checked chunks.

    `manifest_last` is called after the last piece (the publisher's manifest is complete only
    then), and so is `cuda_ipc_last` (CUDA IPC handles of the same version, for an upload).
    Pieces are consumed lazily, so memory holds one chunk at a time."""
    sha = hashlib.sha256()

    def blocks() -> Iterator[bytes]:
        pending = bytearray()
        for piece in pieces:
            view = memoryview(piece).cast("B")
            sha.update(view)
            at = 0
            if pending:
                at = min(chunk_bytes - len(pending), len(view))
                pending += view[:at]
                if len(pending) == chunk_bytes:
                    yield bytes(pending)
                    pending.clear()
            while len(view) - at >= chunk_bytes:
                yield bytes(view[at : at + chunk_bytes])
                at += chunk_bytes
            pending += view[at:]
        if pending:
            yield bytes(pending)

    offset = 0
    held: bytes | None = None
    # One block of look-ahead, so the last chunk carries data as well as the SHA-256.
    for block in blocks():
        if held is not None:
            yield _chunk(version, offset, held, manifest_first if offset == 0 else None)
            offset += len(held)
        held = block
    last = _chunk(version, offset, held or b"", manifest_first if offset == 0 else None)
    last.last = True
    last.sha256 = sha.hexdigest()
    if manifest_last is not None:
        last.manifest.CopyFrom(manifest_last().to_proto())
    if cuda_ipc_last is not None:
        last.cuda_ipc_handles_json = cuda_ipc_last()
    yield last


def _chunk(version: int, offset: int, data: bytes, manifest: Manifest | None) -> pb.SnapshotChunk:
    msg = pb.SnapshotChunk(version=version, offset=offset, data=data, crc32c=crc32c(data))
    if manifest is not None:
        msg.manifest.CopyFrom(manifest.to_proto())
    return msg


class ChunkReceiver:
    """Checks a chunk stream and hands each verified chunk's bytes to `write(offset, data)`.

    Call `feed` per chunk, then `finish()` (which raises if the stream ended before its last
    chunk). `on_manifest` is called as soon as the manifest is known (to size the buffer)."""

    def __init__(
        self,
        write: Callable[[int, bytes], None],
        *,
        version: int | None = None,
        on_manifest: Callable[[Manifest], None] | None = None,
    ) -> None:
        self._write = write
        self._on_manifest = on_manifest
        self.version = version
        self.manifest: Manifest | None = None
        self.received = 0
        self.sha256 = ""
        self.done = False
        self._sha = hashlib.sha256()

    def feed(self, chunk: pb.SnapshotChunk) -> None:
        if self.done:
            raise CorruptSnapshot("chunk after the last chunk")
        if self.version is None:
            self.version = chunk.version
        if chunk.version != self.version:
            raise CorruptSnapshot(f"chunk of version {chunk.version} inside version {self.version}")
        if chunk.offset != self.received:
            raise CorruptSnapshot(
                f"chunk at offset {chunk.offset}, expected {self.received} (missing or "
                "reordered chunk)"
            )
        actual = crc32c(chunk.data)
        if actual != chunk.crc32c:
            raise CorruptSnapshot(
                f"CRC32C mismatch at offset {chunk.offset}: chunk says {chunk.crc32c:#010x}, "
                f"data gives {actual:#010x}"
            )
        if chunk.HasField("manifest") and self.manifest is None:
            self._set_manifest(Manifest.from_proto(chunk.manifest))
        if self.manifest is not None and self.received + len(chunk.data) > (
            self.manifest.total_bytes
        ):
            raise CorruptSnapshot(
                f"payload exceeds the manifest's {self.manifest.total_bytes} bytes"
            )
        self._sha.update(chunk.data)
        if chunk.data:
            self._write(chunk.offset, chunk.data)
        self.received += len(chunk.data)
        if chunk.last:
            self._finish_last(chunk)

    def _set_manifest(self, manifest: Manifest) -> None:
        self.manifest = manifest
        if self._on_manifest is not None:
            self._on_manifest(manifest)

    def _finish_last(self, chunk: pb.SnapshotChunk) -> None:
        digest = self._sha.hexdigest()
        if chunk.sha256 != digest:
            raise CorruptSnapshot(
                f"SHA-256 mismatch: stream says {chunk.sha256 or '<none>'}, payload gives {digest}"
            )
        if self.manifest is None:
            raise CorruptSnapshot("stream carried no manifest")
        if self.received != self.manifest.total_bytes:
            raise CorruptSnapshot(
                f"truncated payload: {self.received} of {self.manifest.total_bytes} bytes"
            )
        self.sha256 = digest
        self.done = True

    def finish(self) -> Manifest:
        """The manifest once the whole stream checked out; CorruptSnapshot if it was cut short."""
        if not self.done or self.manifest is None:
            raise CorruptSnapshot(
                f"stream ended after {self.received} bytes without its last chunk (truncated)"
            )
        return self.manifest
