"""The `cuda_ipc` transport: the trainer exports CUDA IPC handles of its GPU buckets as JSON
(`export_cuda_ipc`, never pickle), one set per engine; an engine on the same GPU opens its set and
copies device to device (`CudaIpcReceiver`). `parse_cuda_ipc` checks a set without touching CUDA.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.weights.manifest import Manifest
from kuberl.common.weights.transports.base import Allocator, Receiver, fresh_buffer

#: Bytes of a cudaIpcEventHandle_t (and of the cudaIpcMemHandle_t inside a memory handle).
CUDA_IPC_HANDLE_BYTES = 64
#: Upper bound on torch's shareable memory handle. It is not a bare cudaIpcMemHandle_t: torch
#: (2.5 on) writes a version byte and a kind byte first (66 bytes for a cudaMalloc block), and a
#: block of an expandable segment carries its segment's description instead, longer.
MAX_MEMORY_HANDLE_BYTES = 1 << 16


def gpu_uuid(device: str | torch.device) -> str:
    """The UUID of a CUDA device ("" for the CPU): what tells two processes they share a GPU,
    whatever CUDA_VISIBLE_DEVICES numbers it in each."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return ""
    return str(torch.cuda.get_device_properties(dev).uuid)


def _cuda_ipc_bucket(tensor: torch.Tensor) -> dict[str, Any]:
    """One bucket's handle. Every call takes a fresh reference on the producer's memory that the
    one consumer which opens it releases (torch's CUDA IPC reference counting), so a set of
    handles must be opened by exactly one engine."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ValueError("CUDA IPC buckets must be flat uint8 CUDA tensors")
    # torch's CUDA reduction: (tensor cls, size, stride, offset, storage cls, dtype, device,
    # handle, storage bytes, storage offset, requires_grad, ref-counter handle, its offset,
    # event handle, event sync required)
    args = reduce_tensor(tensor)[1]
    size, stride, offset, handle = args[1], args[2], args[3], args[7]
    storage_bytes, storage_offset, ref_handle, ref_offset = args[8], args[9], args[11], args[12]
    event_handle, event_sync = args[13], args[14]
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "dtype": "uint8",
        "handle": base64.b64encode(handle).decode(),
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "ref_handle": base64.b64encode(ref_handle).decode(),
        "ref_offset": int(ref_offset),
        "event_handle": base64.b64encode(event_handle).decode() if event_handle else "",
        "event_sync": bool(event_sync),
    }


def export_cuda_ipc(buckets: Sequence[torch.Tensor], sets: int = 1) -> str:
    """`sets` independent sets of CUDA IPC handles of the given GPU buckets, as JSON:
    `{"gpu_uuid": ..., "sets": [{"buckets": [...]}, ...]}`, one set per engine that will open
    them. Keep the buckets alive until those engines have loaded them; torch then keeps the
    memory (its IPC "limbo") until every opened set is released, even after the trainer lets
    go. A set nobody opens holds its memory until the trainer exits, so export only as many sets
    as the service counted engines (`PublishResponse.cuda_ipc_engines`)."""
    if not buckets:
        raise ValueError("no buckets to export")
    uuid = gpu_uuid(buckets[0].device)
    return json.dumps(
        {
            "gpu_uuid": uuid,
            "sets": [{"buckets": [_cuda_ipc_bucket(t) for t in buckets]} for _ in range(sets)],
        }
    )


@dataclass(frozen=True)
class CudaIpcBucket:
    size: int
    offset: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_handle: bytes
    ref_offset: int
    event_handle: bytes | None
    event_sync: bool


@dataclass(frozen=True)
class CudaIpcSet:
    """One engine's handles to the GPU buckets of one version (validated, CUDA not touched)."""

    gpu_uuid: str
    buckets: list[CudaIpcBucket]

    def to_json(self) -> str:
        return json.dumps(
            {
                "gpu_uuid": self.gpu_uuid,
                "buckets": [
                    {
                        "size": [b.size],
                        "stride": [1],
                        "offset": b.offset,
                        "dtype": "uint8",
                        "handle": base64.b64encode(b.handle).decode(),
                        "storage_bytes": b.storage_bytes,
                        "storage_offset": b.storage_offset,
                        "ref_handle": base64.b64encode(b.ref_handle).decode(),
                        "ref_offset": b.ref_offset,
                        "event_handle": (
                            base64.b64encode(b.event_handle).decode() if b.event_handle else ""
                        ),
                        "event_sync": b.event_sync,
                    }
                    for b in self.buckets
                ],
            }
        )


def _b64(value: Any, where: str, length: int | None = None) -> bytes:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a base64 string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where} is not valid base64") from None
    if length is not None and len(raw) != length:
        raise ValueError(f"{where} has {len(raw)} bytes, expected {length}")
    return raw


def _memory_handle(value: Any, where: str) -> bytes:
    raw = _b64(value, where)
    if not 0 < len(raw) <= MAX_MEMORY_HANDLE_BYTES:
        raise ValueError(f"{where} has {len(raw)} bytes, expected 1 to {MAX_MEMORY_HANDLE_BYTES}")
    return raw


def _int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where} must be a non-negative integer, got {value!r}")
    return value


def _parse_set(data: Any, uuid: str, manifest: Manifest | None, where: str) -> CudaIpcSet:
    if not isinstance(data, dict) or not isinstance(data.get("buckets"), list):
        raise ValueError(f"{where} must be an object with a list of buckets")
    raw_buckets = data["buckets"]
    if not raw_buckets:
        raise ValueError(f"{where} lists no buckets")
    if manifest is not None and len(raw_buckets) != manifest.num_buckets:
        raise ValueError(
            f"{where}: {len(raw_buckets)} buckets for the manifest's {manifest.num_buckets}"
        )
    buckets = []
    for i, b in enumerate(raw_buckets):
        at = f"{where} bucket {i}"
        if not isinstance(b, dict):
            raise ValueError(f"{at} must be an object")
        if b.get("dtype") != "uint8" or b.get("stride") != [1]:
            raise ValueError(f"{at} must be a flat uint8 tensor (dtype uint8, stride [1])")
        size = b.get("size")
        if not isinstance(size, list) or len(size) != 1:
            raise ValueError(f"{at} size must be [bytes]")
        nbytes = _int(size[0], f"{at} size")
        if manifest is not None and nbytes != manifest.bucket_sizes[i]:
            raise ValueError(f"{at} has {nbytes} bytes, the manifest {manifest.bucket_sizes[i]}")
        offset = _int(b.get("offset"), f"{at} offset")
        storage_bytes = _int(b.get("storage_bytes"), f"{at} storage_bytes")
        if offset + nbytes > storage_bytes:
            raise ValueError(f"{at} reaches past its storage ({offset}+{nbytes}>{storage_bytes})")
        event = b.get("event_handle")
        buckets.append(
            CudaIpcBucket(
                size=nbytes,
                offset=offset,
                handle=_memory_handle(b.get("handle"), f"{at} handle"),
                storage_bytes=storage_bytes,
                storage_offset=_int(b.get("storage_offset"), f"{at} storage_offset"),
                ref_handle=_b64(b.get("ref_handle"), f"{at} ref_handle"),
                ref_offset=_int(b.get("ref_offset"), f"{at} ref_offset"),
                event_handle=(
                    _b64(event, f"{at} event_handle", CUDA_IPC_HANDLE_BYTES) if event else None
                ),
                event_sync=bool(b.get("event_sync")),
            )
        )
    return CudaIpcSet(uuid, buckets)


def _load_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None


def parse_cuda_ipc(handles_json: str, manifest: Manifest | None = None) -> CudaIpcSet:
    """One engine's set, `{"gpu_uuid", "buckets"}` (an UpdateInstruction's `handles_json`),
    checked field by field against the manifest; ValueError names the first problem."""
    data = _load_json(handles_json, "CUDA IPC handles")
    if not isinstance(data, dict) or not isinstance(data.get("gpu_uuid"), str):
        raise ValueError("CUDA IPC handles must be an object with a gpu_uuid string")
    return _parse_set(data, data["gpu_uuid"], manifest, "CUDA IPC handles")


def split_cuda_ipc(handles_json: str, manifest: Manifest | None = None) -> list[CudaIpcSet]:
    """The per-engine sets of an export (`export_cuda_ipc`), each checked like `parse_cuda_ipc`."""
    data = _load_json(handles_json, "CUDA IPC export")
    if not isinstance(data, dict) or not isinstance(data.get("gpu_uuid"), str):
        raise ValueError("a CUDA IPC export must be an object with a gpu_uuid string")
    if not data["gpu_uuid"]:
        raise ValueError("a CUDA IPC export must name its GPU (gpu_uuid)")
    sets = data.get("sets")
    if not isinstance(sets, list) or not sets:
        raise ValueError("a CUDA IPC export must list at least one set of handles")
    return [
        _parse_set(s, data["gpu_uuid"], manifest, f"CUDA IPC set {i}") for i, s in enumerate(sets)
    ]


def import_cuda_ipc(handles: CudaIpcSet | str, device: str | torch.device) -> list[torch.Tensor]:
    """The GPU buckets behind one set of handles, opened on `device` (the same GPU as the
    trainer's, in this process's numbering). Drop them after copying: that releases them."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    h = parse_cuda_ipc(handles) if isinstance(handles, str) else handles
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return [
        rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size([b.size]),
            (1,),
            b.offset,
            torch.storage.UntypedStorage,
            torch.uint8,
            index,
            b.handle,
            b.storage_bytes,
            b.storage_offset,
            False,
            b.ref_handle,
            b.ref_offset,
            b.event_handle,
            b.event_sync,
        )
        for b in h.buckets
    ]


class CudaIpcReceiver(Receiver):
    """Copies the trainer's GPU buckets device to device into the engine's own GPU buffer."""

    def __init__(self, device: str = "cuda") -> None:
        self.device = device

    def receive(
        self, instruction: pb.UpdateInstruction, allocate: Allocator = fresh_buffer
    ) -> tuple[Manifest, torch.Tensor]:
        manifest = Manifest.from_proto(instruction.manifest)
        handles = parse_cuda_ipc(instruction.handles_json, manifest)
        if torch.device(self.device).type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"CUDA IPC needs a CUDA device; this engine has {self.device}")
        mine = gpu_uuid(self.device)
        if handles.gpu_uuid != mine:
            raise ValueError(
                f"the trainer's buckets are on GPU {handles.gpu_uuid}, this engine is on {mine}"
            )
        buckets = import_cuda_ipc(handles, self.device)
        try:
            flat = allocate(manifest.total_bytes, str(buckets[0].device))
            for b, src in enumerate(buckets):
                manifest.bucket_view(flat, b).copy_(src)
            torch.cuda.synchronize(flat.device)
        finally:
            del buckets  # releases the trainer's memory (torch's IPC reference counting)
        return manifest, flat
