"""The data plane: how the bytes of one version reach an engine, one module per transport.

`broadcast` (gloo and nccl, one code path, SGLang-compatible), `shm` (a shared-memory file on the
engine's host), `snapshot` (a checked gRPC stream from the service; reaches any engine) and
`cuda_ipc` (device to device on the trainer's GPU) each hold a `base.Receiver` and what the
sending side needs. `make_receiver(transport)` is the factory the engine client calls for
whatever `UpdateInstruction` the service sends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kuberl.common.weights import lazy_exports
from kuberl.common.weights.transports.names import TRANSPORT_NAMES, transport_name, transport_value

if TYPE_CHECKING:
    from kuberl.common.weights.transports.base import (
        Allocator,
        BufferPool,
        Receiver,
        fresh_buffer,
    )

__getattr__ = lazy_exports(
    __name__,
    {"Allocator": "base", "BufferPool": "base", "Receiver": "base", "fresh_buffer": "base"},
)

__all__ = [
    "TRANSPORT_NAMES",
    "Allocator",
    "BufferPool",
    "Receiver",
    "fresh_buffer",
    "make_receiver",
    "transport_name",
    "transport_value",
]


def make_receiver(
    transport: str | int,
    *,
    device: str = "cpu",
    address: str = "",
    engine_id: str = "",
    chunk_bytes: int = 0,
    shm_in_place: bool = False,
) -> Receiver:
    """The receiver for a transport name or `pb.Transport` value (`address`: the weight-sync
    service, for snapshots whose instruction names no other endpoint)."""
    from kuberl.common.weights.chunks import DEFAULT_CHUNK_BYTES
    from kuberl.common.weights.transports.broadcast import BroadcastReceiver
    from kuberl.common.weights.transports.cuda_ipc import CudaIpcReceiver
    from kuberl.common.weights.transports.shm import ShmReceiver
    from kuberl.common.weights.transports.snapshot import SnapshotReceiver

    name = transport_name(transport_value(transport))
    if name in ("gloo", "nccl"):
        return BroadcastReceiver(device if name == "nccl" else "cpu")
    if name == "shm":
        return ShmReceiver(in_place=shm_in_place)
    if name == "snapshot":
        return SnapshotReceiver(address, engine_id, chunk_bytes or DEFAULT_CHUNK_BYTES)
    if name == "cuda_ipc":
        return CudaIpcReceiver(device)
    raise ValueError(f"no receiver for transport {name!r}")
