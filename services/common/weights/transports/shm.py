"""The `shm` transport: the trainer writes a version once into a shared-memory file the service
names (`ShmWriter`); every engine on that host maps it and copies it into its own buffer, or
serves from the mapping itself (`ShmReceiver`).
"""

from __future__ import annotations

import json
import mmap
import os
import warnings
from dataclasses import dataclass

import torch

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.weights.manifest import Manifest
from kuberl.common.weights.transports.base import Allocator, Receiver, fresh_buffer


class ShmWriter:
    """Writes a version's payload into the shared-memory file the service named (trainer side).

    The service reuses its files across versions, so the pages are usually there already and a
    write is a plain copy; `close(total_bytes)` sets the exact length (the service checks it).
    The file must exist (the service made it): a write for a version the service gave up on
    fails here rather than leaving a stray file behind."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY)

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
        view = data.data
        while view.nbytes:
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def close(self, total_bytes: int | None = None) -> None:
        if self._fd >= 0:
            if total_bytes is not None:
                os.ftruncate(self._fd, total_bytes)
            os.close(self._fd)
            self._fd = -1

    def abort(self) -> None:
        self.close()


@dataclass
class _Mapping:
    key: tuple[int, int, int]  # st_dev, st_ino, st_size: the same file, not resized
    mapping: mmap.mmap
    flat: torch.Tensor


def _file_key(st: os.stat_result) -> tuple[int, int, int]:
    """What identifies a file's content for a kept mapping: a new file, or a resized one,
    differs."""
    return (st.st_dev, st.st_ino, st.st_size)


class ShmReceiver(Receiver):
    """Copies a version out of the service's shared-memory file into the engine's buffer.

    The file is mapped once and the mapping kept while the file stays the same (the service
    recycles a few files across versions), so after the first version a receive is one parallel
    memory copy with no page faults on either side. The service does not reuse a file while an
    engine's update from it is running, so the bytes cannot change under the copy.

    `in_place=True` skips the copy: the payload handed back is the mapping itself, shared by
    every engine on the host (one copy of the weights in memory, whatever the engine count).
    The service keeps that file unchanged until the engine has loaded a later version (it
    registers with `shm_in_place`). The mapping is private: a stray write stays in the engine."""

    def __init__(self, in_place: bool = False) -> None:
        self.in_place = in_place
        self._maps: dict[str, _Mapping] = {}

    def _forget_gone(self) -> None:
        """Drop the mappings of files the service deleted or replaced since (a deleted file's
        pages stay allocated while it is mapped: one model's worth each). Tensors still using
        a mapping (an in-place engine's weights) keep it alive until they are gone."""
        for path, cached in list(self._maps.items()):
            try:
                same = _file_key(os.stat(path)) == cached.key
            except FileNotFoundError:
                same = False
            if not same:
                del self._maps[path]

    def _map(self, path: str, nbytes: int) -> torch.Tensor:
        self._forget_gone()
        st = os.stat(path)
        if st.st_size < nbytes:
            raise ValueError(f"{path}: {st.st_size} of {nbytes} bytes (truncated shared memory)")
        key = _file_key(st)
        cached = self._maps.get(path)
        if cached is None or cached.key != key:
            self._maps.pop(path, None)
            with open(path, "rb") as f:
                access = mmap.ACCESS_COPY if self.in_place else mmap.ACCESS_READ
                mapping = mmap.mmap(f.fileno(), st.st_size, access=access)
            with warnings.catch_warnings():
                # Read-only memory: torch warns that writing would fail. Nothing writes to it.
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(mapping, dtype=torch.uint8)
            cached = self._maps[path] = _Mapping(key, mapping, flat)
        return cached.flat[:nbytes]

    def receive(
        self, instruction: pb.UpdateInstruction, allocate: Allocator = fresh_buffer
    ) -> tuple[Manifest, torch.Tensor]:
        manifest = Manifest.from_proto(instruction.manifest)
        handle = json.loads(instruction.handles_json)
        if not isinstance(handle, dict) or not isinstance(handle.get("path"), str):
            raise ValueError(
                f"shm handle must be {{'path': str}}, got {instruction.handles_json!r}"
            )
        src = self._map(handle["path"], manifest.total_bytes)
        if self.in_place:
            return manifest, src
        flat = allocate(manifest.total_bytes, "cpu")
        flat.copy_(src)
        return manifest, flat

    def close(self) -> None:
        self._maps.clear()  # the mappings close when their tensors are gone
