"""Where the weight-sync service keeps versions: a few payload files reused across versions.

The folder is in shared memory (/dev/shm) when it can be, so a trainer on the same host writes a
version straight into it and same-host engines map it and copy from it; otherwise it is on disk.
Versions live in segments (`seg<N>.bin`), recycled rather than created per version: writing 1 GB
into a fresh tmpfs file costs page allocation (~0.2 GB/s on the 2-core test VM), rewriting the
pages of a used one is a plain copy. A segment is reused only when it holds no retained version
(the newest `retain` are kept) and nothing reads it (`pin`: an engine's shm update until the
engine reports, a broadcast, a snapshot stream), so no reader ever sees a version change under
it; when all are busy a new segment is made. A committed segment is memory-mapped once and the
mapping kept while the file keeps its identity and size.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kuberl.common.logs import get_logger
from kuberl.common.weights.manifest import Manifest

log = get_logger(__name__)


class DigestMismatch(ValueError):
    """The payload's SHA-256 is not the one the trainer sent."""


@dataclass
class Segment:
    """One payload file and what it is used for now."""

    path: str
    #: Version committed in it (0: none); version being written into it (0: none).
    version: int = 0
    writing: int = 0
    #: Engine updates, broadcasts and snapshot streams reading it now.
    readers: int = 0
    _map_key: tuple[int, int, int] | None = None
    _flat: torch.Tensor | None = None

    @property
    def free(self) -> bool:
        return not (self.version or self.writing or self.readers)

    def mapped(self) -> torch.Tensor:
        """The whole file as a flat uint8 tensor over one mapping, kept while the file stays."""
        st = os.stat(self.path)
        key = (st.st_dev, st.st_ino, st.st_size)
        if self._flat is None or self._map_key != key:
            self._flat = None
            if st.st_size:
                with open(self.path, "rb") as f:
                    # A private mapping is writable for torch; the service never writes, so it
                    # shares the file's pages and sees them rewritten in place.
                    mapping = mmap.mmap(f.fileno(), st.st_size, access=mmap.ACCESS_COPY)
                self._flat = torch.frombuffer(mapping, dtype=torch.uint8)
            else:
                self._flat = torch.empty(0, dtype=torch.uint8)
            self._map_key = key
        return self._flat


@dataclass
class StoredVersion:
    version: int
    manifest: Manifest
    path: str
    #: The payload as a flat uint8 tensor over the segment's mapping (no copy).
    flat: torch.Tensor
    segment: Segment
    #: CUDA IPC handle sets the trainer exported for colocated engines, each given to one
    #: engine (`kuberl.common.weights.transports.CudaIpcSet`), and where they can be opened.
    cuda_ipc_sets: list[Any] = field(default_factory=list)
    cuda_ipc_host: str = ""
    cuda_ipc_gpu: str = ""


class VersionStore:
    """Committed versions in recycled segment files; the newest `retain` versions are kept."""

    def __init__(self, directory: str | Path, retain: int = 2) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.retain = retain
        self.versions: dict[int, StoredVersion] = {}
        self.segments: list[Segment] = []
        self._names = itertools.count()
        for pattern in ("v*.*", "seg*.bin"):  # left by a previous run of this job
            for stale in self.directory.glob(pattern):
                stale.unlink(missing_ok=True)

    @property
    def in_shared_memory(self) -> bool:
        return str(self.directory.resolve()).startswith("/dev/shm/")

    def reserve(self, version: int) -> str:
        """A segment for `version`'s bytes (a free one if any, else a new file); its path."""
        existing = self._writing(version)
        if existing is not None:
            return existing.path
        segment = next((s for s in self.segments if s.free), None)
        if segment is None:
            segment = Segment(str(self.directory / f"seg{next(self._names)}.bin"))
            Path(segment.path).touch()
            self.segments.append(segment)
            log.info("store.segment_created", path=segment.path, segments=len(self.segments))
        segment.writing = version
        return segment.path

    def open_upload(self, version: int) -> int:
        """A file descriptor to write an uploaded payload into (`pwrite`)."""
        return os.open(self.reserve(version), os.O_WRONLY)

    def _writing(self, version: int) -> Segment | None:
        return next((s for s in self.segments if s.writing == version), None)

    def discard(self, version: int) -> None:
        """Forget a version that never completed (failed upload, superseded publish). Its file
        is deleted rather than reused: a late writer may still hold it open."""
        if version in self.versions:
            return
        segment = self._writing(version)
        if segment is not None:
            self.segments.remove(segment)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment.path)

    def commit(
        self, version: int, manifest: Manifest, uploaded: bool, sha256: str = ""
    ) -> StoredVersion:
        """Adopt the written payload of `version`; ValueError if its size is wrong,
        `DigestMismatch` if `sha256` is given and differs. Nothing changes on an error."""
        segment = self._writing(version)
        if segment is None:
            raise ValueError(f"version {version}: no payload was written for it")
        if uploaded:  # the service wrote and counted every byte itself; drop an old tail
            os.truncate(segment.path, manifest.total_bytes)
        size = os.stat(segment.path).st_size
        if size != manifest.total_bytes:
            raise ValueError(
                f"version {version}: payload has {size} bytes, the manifest says "
                f"{manifest.total_bytes}"
            )
        flat = segment.mapped()[: manifest.total_bytes]
        if sha256:
            digest = hashlib.sha256(flat.numpy().data).hexdigest()
            if digest != sha256:
                raise DigestMismatch(f"version {version}: SHA-256 {digest} != {sha256}")
        segment.writing, segment.version = 0, version
        stored = StoredVersion(version, manifest, segment.path, flat, segment)
        self.versions[version] = stored
        self._prune()
        return stored

    def pin(self, stored: StoredVersion) -> None:
        """Someone reads `stored`'s segment: it is not reused until `unpin`."""
        stored.segment.readers += 1

    def unpin(self, stored: StoredVersion) -> None:
        stored.segment.readers = max(0, stored.segment.readers - 1)

    def _prune(self) -> None:
        for version in sorted(self.versions)[: -self.retain]:
            stored = self.versions.pop(version)
            if stored.segment.version == version:
                stored.segment.version = 0  # reusable once its readers are done
            log.info("store.pruned", version=version, readers=stored.segment.readers)

    def latest(self) -> StoredVersion | None:
        return self.versions[max(self.versions)] if self.versions else None

    def get(self, version: int) -> StoredVersion | None:
        return self.versions.get(version)

    def close(self) -> None:
        self.versions.clear()
        for segment in self.segments:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment.path)
        self.segments.clear()
        with contextlib.suppress(OSError):
            for leftover in self.directory.glob("*.bin"):
                leftover.unlink(missing_ok=True)
            self.directory.rmdir()
