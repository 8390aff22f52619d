"""Transport names and their `pb.Transport` values, without torch: the weight-sync service, which
moves bytes and never tensors, names transports too."""

from __future__ import annotations

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb

TRANSPORT_NAMES: dict[str, int] = {
    "nccl": pb.TRANSPORT_NCCL,
    "gloo": pb.TRANSPORT_GLOO,
    "cuda_ipc": pb.TRANSPORT_CUDA_IPC,
    "snapshot": pb.TRANSPORT_SNAPSHOT,
    "shm": pb.TRANSPORT_SHM,
}
_BY_VALUE: dict[int, str] = {v: k for k, v in TRANSPORT_NAMES.items()}


def transport_value(name: str | int) -> int:
    """ "gloo" -> pb.TRANSPORT_GLOO (ints pass through after a check)."""
    if isinstance(name, int):
        if name not in _BY_VALUE:
            raise ValueError(f"unknown transport {name}")
        return name
    if name not in TRANSPORT_NAMES:
        raise ValueError(f"unknown transport {name!r}; expected one of {sorted(TRANSPORT_NAMES)}")
    return TRANSPORT_NAMES[name]


def transport_name(value: int) -> str:
    return _BY_VALUE.get(value, "unspecified")
