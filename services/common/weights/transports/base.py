"""What every transport shares: the `Receiver` interface and the buffer a
receiver writes one version's flat payload into (`Allocator`; `BufferPool` double-buffers an
engine so that nothing is allocated after the first two versions).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.weights.manifest import Manifest

#: `allocate(nbytes, device)`: the flat uint8 buffer a receiver writes one version into.
Allocator = Callable[[int, str], torch.Tensor]


def fresh_buffer(nbytes: int, device: str) -> torch.Tensor:
    """The default `Allocator`: a new buffer for every version."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def same_device(have: torch.device, want: str) -> bool:
    """Whether a tensor on `have` is on `want` ("cuda" matches any GPU, "cuda:1" only that one)."""
    target = torch.device(want)
    return have.type == target.type and (target.index is None or have.index == target.index)


class BufferPool:
    """Two flat buffers reused across versions (double buffering), one engine's receive memory.

    `spare(nbytes, device)` is the buffer the engine does not hold: the next version is received
    into it while the engine keeps serving the one it holds, untouched. `hold(buffer)` after the
    engine loaded a version from it makes it the held one. A failed update never becomes held,
    so the retry lands in the same spare buffer and the held version stays whole. After the
    first two versions nothing is allocated any more (fresh memory pages fault in, far slower than
    a copy into pages already touched).
    The tensors given to `load` therefore stay valid until the version after next is received;
    an engine that serves from them directly must switch to each new dict when it is loaded."""

    def __init__(self) -> None:
        self._slots: list[torch.Tensor | None] = [None, None]
        self._held = -1
        self._lock = threading.Lock()

    def spare(self, nbytes: int, device: str) -> torch.Tensor:
        with self._lock:
            i = 1 if self._held == 0 else 0
            buf = self._slots[i]
            if buf is None or buf.numel() < nbytes or not same_device(buf.device, device):
                self._slots[i] = None  # let the old one go before allocating the new one
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
                self._slots[i] = buf
            return buf[:nbytes]

    def hold(self, flat: torch.Tensor) -> None:
        """`flat` (from `spare`) now holds the engine's loaded version."""
        with self._lock:
            for i, buf in enumerate(self._slots):
                if buf is not None and buf.numel() and flat.data_ptr() == buf.data_ptr():
                    self._held = i

    def __call__(self, nbytes: int, device: str) -> torch.Tensor:
        return self.spare(nbytes, device)


class Receiver(ABC):
    """Receives one version as instructed; returns the manifest and the flat payload."""

    @abstractmethod
    def receive(
        self, instruction: pb.UpdateInstruction, allocate: Allocator = fresh_buffer
    ) -> tuple[Manifest, torch.Tensor]: ...
