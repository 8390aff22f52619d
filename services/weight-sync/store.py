"""Where the weight-sync service keeps versions: one flat payload file per version.

The folder is in shared memory (/dev/shm) when it can be, so a trainer on the same host writes a
version straight into it and same-host engines read it with one copy; otherwise it is on disk. A
committed version is memory-mapped once and served from that mapping to every transport (the
broadcast senders, the snapshot streams). Only the newest `retain` versions are kept; deleting an
older file never disturbs a reader that still maps it (Linux keeps the pages until unmapped).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kuberl.common.logs import get_logger
from kuberl.common.weights.manifest import Manifest

log = get_logger(__name__)


@dataclass
class StoredVersion:
    version: int
    manifest: Manifest
    path: str
    #: The payload as a flat uint8 tensor over the file's mapping (no copy).
    flat: torch.Tensor


class VersionStore:
    """Payload files `v<version>.bin` in one folder, newest `retain` kept."""

    def __init__(self, directory: str | Path, retain: int = 2) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.retain = retain
        self.versions: dict[int, StoredVersion] = {}
        for stale in self.directory.glob("v*.*"):  # left by a previous run of this job
            stale.unlink(missing_ok=True)

    @property
    def in_shared_memory(self) -> bool:
        return str(self.directory.resolve()).startswith("/dev/shm/")

    def path(self, version: int, suffix: str = "bin") -> str:
        return str(self.directory / f"v{version}.{suffix}")

    def open_upload(self, version: int) -> int:
        """A fresh file descriptor to write an uploaded payload into (`pwrite`)."""
        path = self.path(version, "upload")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def discard(self, version: int) -> None:
        """Forget a version that never completed (failed upload, superseded publish)."""
        if version in self.versions:
            return
        for suffix in ("upload", "bin"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(version, suffix))

    def commit(self, version: int, manifest: Manifest, uploaded: bool) -> StoredVersion:
        """Adopt the written payload of `version`; ValueError if its size is wrong."""
        path = self.path(version)
        if uploaded:
            os.replace(self.path(version, "upload"), path)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise ValueError(f"version {version}: no payload was written at {path}") from None
        if size != manifest.total_bytes:
            raise ValueError(
                f"version {version}: payload has {size} bytes, the manifest says "
                f"{manifest.total_bytes}"
            )
        with open(path, "rb") as f:
            # A private mapping is writable for torch (no copy is made unless written to).
            mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        flat = (
            torch.frombuffer(mapping, dtype=torch.uint8)
            if mapping is not None
            else torch.empty(0, dtype=torch.uint8)
        )
        stored = StoredVersion(version, manifest, path, flat)
        self.versions[version] = stored
        self._prune()
        return stored

    def _prune(self) -> None:
        for version in sorted(self.versions)[: -self.retain]:
            stored = self.versions.pop(version)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stored.path)
            log.info("store.pruned", version=version)

    def latest(self) -> StoredVersion | None:
        return self.versions[max(self.versions)] if self.versions else None

    def get(self, version: int) -> StoredVersion | None:
        return self.versions.get(version)

    def close(self) -> None:
        for stored in self.versions.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stored.path)
        self.versions.clear()
        with contextlib.suppress(OSError):
            for leftover in self.directory.glob("v*.*"):
                leftover.unlink(missing_ok=True)
            self.directory.rmdir()
