"""Where the weight-sync service keeps versions: a few payload files reused across versions.

The folder is in shared memory (/dev/shm) when it can be, so a trainer on the same host writes a
version straight into it and same-host engines map it and copy from it; otherwise it is on disk.
Versions live in segments (`seg<N>.bin`), recycled rather than created per version: writing 1 GB
into a fresh tmpfs file costs page allocation, several times slower than rewriting the pages of
a used one, which is a plain copy. A segment is reused only when it holds no retained version
(the newest `retain` are kept) and nothing reads it (`pin`: an engine's shm update until the
engine reports, a broadcast, a snapshot stream), so no reader ever sees a version change under
it; when all are busy a new segment is made. A committed segment is memory-mapped once and the
mapping kept while the file keeps its identity and size.

Restarts: once a version is committed, `seal` writes a record beside its segment (`seg<N>.json`:
version, manifest, SHA-256 of the payload; written to a temporary file and renamed, so it is
whole or absent). A segment's record is deleted before the segment is handed out for a new write,
so a record only ever vouches for bytes that were complete when it was written. A store opened
with `restore=True` (the service's start after a crash) takes back the newest version whose
payload still has its record's size and SHA-256, and deletes everything else; a truncated,
rewritten or corrupt payload is skipped for the next older one, or for nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import mmap
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format
from pydantic import BaseModel, Field, ValidationError

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.logs import get_logger
from kuberl.common.weights.manifest import Manifest

log = get_logger(__name__)

#: Bytes hashed per call: hashlib releases the GIL for each, the page cache streams them.
_HASH_PIECE = 64 * 1024 * 1024


def payload_sha256(flat: np.ndarray) -> str:
    """SHA-256 of a flat uint8 payload, the digest the trainer's upload carries."""
    data = flat.data
    sha = hashlib.sha256()
    for at in range(0, len(data), _HASH_PIECE):
        sha.update(data[at : at + _HASH_PIECE])
    return sha.hexdigest()


class SealRecord(BaseModel):
    """What `seg<N>.json` says about the payload in `seg<N>.bin` (read back after a restart)."""

    version: int = Field(gt=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    #: The manifest as protobuf JSON (`kuberl.weight_sync.v1.Manifest`).
    manifest: dict[str, Any]
    sealed_unix: float = 0.0


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
    #: False for a segment taken back after a restart: an engine of the previous run may still
    #: serve from it in place, unknown to this one, so it is deleted once pruned, never rewritten.
    recycle: bool = True
    _map_key: tuple[int, int, int] | None = None
    _flat: np.ndarray | None = None

    @property
    def free(self) -> bool:
        return not (self.version or self.writing or self.readers)

    @property
    def record(self) -> Path:
        """Where the seal record of the version in this segment is kept."""
        return Path(self.path).with_suffix(".json")

    def mapped(self) -> np.ndarray:
        """The whole file as a flat uint8 array over one mapping, kept while the file stays."""
        st = os.stat(self.path)
        key = (st.st_dev, st.st_ino, st.st_size)
        if self._flat is None or self._map_key != key:
            self._flat = None
            if st.st_size:
                with open(self.path, "rb") as f:
                    # A private mapping is writable, which torch wants of a broadcast's
                    # tensor; the service never writes, so it shares the file's pages and
                    # sees them rewritten in place.
                    mapping = mmap.mmap(f.fileno(), st.st_size, access=mmap.ACCESS_COPY)
                self._flat = np.frombuffer(mapping, dtype=np.uint8)
            else:
                self._flat = np.empty(0, dtype=np.uint8)
            self._map_key = key
        return self._flat


@dataclass
class StoredVersion:
    version: int
    manifest: Manifest
    path: str
    #: The payload as a flat uint8 array over the segment's mapping (no copy).
    flat: np.ndarray
    segment: Segment
    #: CUDA IPC handle sets the trainer exported for colocated engines, each given to one engine
    #: (`kuberl.common.weights.transports.cuda_ipc.CudaIpcSet`), and where they can be opened.
    cuda_ipc_sets: list[Any] = field(default_factory=list)
    cuda_ipc_host: str = ""
    cuda_ipc_gpu: str = ""
    #: SHA-256 of the payload when known (checked at commit, or the upload's), else "".
    sha256: str = ""


class VersionStore:
    """Committed versions in recycled segment files; the newest `retain` versions are kept.

    `restore=True` first takes back the newest sealed version a previous process of this job
    left in `directory` (hashing its payload: about 1 s per GB on one core); without it, or
    when none checks out, whatever was left is deleted."""

    def __init__(
        self,
        directory: str | Path,
        retain: int = 2,
        *,
        restore: bool = False,
        max_version_bytes: int = 0,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.retain = retain
        #: The configured cap per version (`weight_sync.max_version_bytes`; 0: none).
        self.cap = max_version_bytes
        self.versions: dict[int, StoredVersion] = {}
        self.segments: list[Segment] = []
        self._names = itertools.count()
        restored = self._restore() if restore else None
        keep = {restored.segment.path, str(restored.segment.record)} if restored else set()
        for pattern in ("v*.*", "seg*"):  # left by a previous run of this job
            for stale in self.directory.glob(pattern):
                if str(stale) not in keep:
                    stale.unlink(missing_ok=True)

    @property
    def in_shared_memory(self) -> bool:
        return str(self.directory.resolve()).startswith("/dev/shm/")

    @property
    def filesystem_version_bytes(self) -> int:
        """The largest version this folder's filesystem can keep: its size shared by the
        `retain` versions kept and the one being written. A larger one would fill it (tmpfs:
        memory) by the time that many are there."""
        fs = os.statvfs(self.directory)
        return fs.f_blocks * fs.f_frsize // (self.retain + 1)

    @property
    def max_version_bytes(self) -> int:
        """The largest version kept here, so the bound of an upload: the filesystem's share,
        or the configured cap when smaller (a volume allowed less than its filesystem holds,
        e.g. a disk-backed emptyDir whose sizeLimit the kubelet enforces by eviction)."""
        bound = self.filesystem_version_bytes
        return min(bound, self.cap) if self.cap else bound

    def reserve(self, version: int) -> str:
        """A segment for `version`'s bytes (a free one if any, else a new file); its path."""
        existing = self._writing(version)
        if existing is not None:
            return existing.path
        segment = next((s for s in self.segments if s.free), None)
        if segment is not None:
            # Before any byte changes: a record must never vouch for a half-rewritten segment.
            segment.record.unlink(missing_ok=True)
        else:
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
            self._delete(segment)

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
            digest = hashlib.sha256(flat.data).hexdigest()
            if digest != sha256:
                raise DigestMismatch(f"version {version}: SHA-256 {digest} != {sha256}")
        segment.writing, segment.version = 0, version
        stored = StoredVersion(version, manifest, segment.path, flat, segment, sha256=sha256)
        self.versions[version] = stored
        self._prune()
        return stored

    def seal(self, stored: StoredVersion) -> None:
        """Write the record that lets a restarted service take `stored` back (see the module
        docs). Slow (hashes the payload unless its SHA-256 is known, syncs it to disk), so
        it runs off the event loop, with `stored` pinned by the caller so its segment cannot
        be handed out meanwhile. OSError if the folder is gone (the service stopped)."""
        started = time.monotonic()
        if not stored.sha256:
            stored.sha256 = payload_sha256(stored.flat)
        # On a disk folder, the bytes reach the disk before the record that vouches for them
        # (a host crash otherwise leaves a record over lost pages; tmpfs makes this free).
        with open(stored.path, "rb") as f:
            os.fsync(f.fileno())
        record = SealRecord(
            version=stored.version,
            sha256=stored.sha256,
            manifest=json_format.MessageToDict(stored.manifest.to_proto()),
            sealed_unix=time.time(),
        )
        final = stored.segment.record
        partial = final.with_suffix(".json.tmp")
        with open(partial, "w") as f:
            f.write(record.model_dump_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, final)
        log.info(
            "store.sealed", version=stored.version, path=str(final),
            seconds=round(time.monotonic() - started, 3),
        )  # fmt: skip

    def _restore(self) -> StoredVersion | None:
        """The newest sealed version whose payload checks out, adopted as committed."""
        records: list[tuple[int, Path, SealRecord]] = []
        for path in self.directory.glob("seg*.json"):
            try:
                record = SealRecord.model_validate_json(path.read_bytes())
            except (OSError, ValidationError) as exc:
                log.warning("store.restore_skipped", path=str(path), reason=str(exc)[:300])
                continue
            records.append((record.version, path, record))
        for version, path, record in sorted(records, key=lambda r: r[0], reverse=True):
            segment = Segment(str(path.with_suffix(".bin")), version=version, recycle=False)
            started = time.monotonic()
            try:
                proto = json_format.ParseDict(record.manifest, pb.Manifest())
                manifest = Manifest.from_proto(proto)
                size = os.stat(segment.path).st_size
                if size != manifest.total_bytes:
                    raise ValueError(
                        f"payload has {size} bytes, its manifest says {manifest.total_bytes}"
                    )
                flat = segment.mapped()[: manifest.total_bytes]
                digest = payload_sha256(flat)
                if digest != record.sha256:
                    raise ValueError(f"payload SHA-256 {digest} != {record.sha256} when sealed")
            except (OSError, ValueError, json_format.ParseError) as exc:
                log.warning(
                    "store.restore_skipped", version=version, path=segment.path,
                    reason=str(exc)[:300],
                )  # fmt: skip
                continue
            stored = StoredVersion(version, manifest, segment.path, flat, segment, sha256=digest)
            self.segments.append(segment)
            self.versions[version] = stored
            # New segments are named after it, never over it.
            index = re.fullmatch(r"seg(\d+)\.bin", Path(segment.path).name)
            self._names = itertools.count(int(index.group(1)) + 1 if index else 0)
            log.info(
                "store.restored", version=version, path=segment.path,
                bytes=manifest.total_bytes, seconds=round(time.monotonic() - started, 3),
            )  # fmt: skip
            return stored
        return None

    def pin(self, stored: StoredVersion) -> None:
        """Someone reads `stored`'s segment: it is not reused until `unpin`."""
        stored.segment.readers += 1

    def unpin(self, stored: StoredVersion) -> None:
        stored.segment.readers = max(0, stored.segment.readers - 1)

    def retire(self, segment: Segment) -> None:
        """An engine this service no longer hears from may still serve from `segment` in place:
        never rewrite it; delete it once its version is pruned (now, if it was already)."""
        segment.recycle = False
        if segment in self.segments and not (segment.version or segment.writing):
            self._delete(segment)  # its readers keep their mappings

    def _prune(self) -> None:
        for version in sorted(self.versions)[: -self.retain]:
            stored = self.versions.pop(version)
            if stored.segment.version == version:
                stored.segment.version = 0  # reusable once its readers are done
                if not stored.segment.recycle:
                    self._delete(stored.segment)  # readers keep their mappings
            log.info("store.pruned", version=version, readers=stored.segment.readers)

    def latest(self) -> StoredVersion | None:
        return self.versions[max(self.versions)] if self.versions else None

    def get(self, version: int) -> StoredVersion | None:
        return self.versions.get(version)

    def _delete(self, segment: Segment) -> None:
        self.segments.remove(segment)
        for path in (Path(segment.path), segment.record):
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Delete every version: a graceful stop gives its memory back (only a crash leaves
        versions for `restore`)."""
        self.versions.clear()
        for segment in list(self.segments):
            self._delete(segment)
        with contextlib.suppress(OSError):
            for leftover in self.directory.glob("seg*"):
                leftover.unlink(missing_ok=True)
            self.directory.rmdir()
