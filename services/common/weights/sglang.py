"""SGLang's native weight-update requests for an `UpdateInstruction` (rollout's SGLang engine).

`kuberl.rollout.engine.sglang` posts what these functions build: for a broadcast (`nccl`),
`/init_weights_update_group`, one `/update_weights_from_distributed` per bucket while the
trainer broadcasts it, `/destroy_weights_update_group`; for CUDA IPC (an SGLang server on the
trainer's GPU), one `/update_weights_from_tensor` per bucket, its payload made from the
instruction's JSON handle set without opening it. Buckets use `load_format="flattened_bucket"`
(the layout of `kuberl.common.weights.manifest`); only the last one flushes the cache, so SGLang
serves the new version once it holds all of it. The payload format and why it is made here:
docs/rollout.md, "CUDA IPC to SGLang".
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.weights.manifest import Manifest, TensorEntry, torch_dtype
from kuberl.common.weights.transports.cuda_ipc import (
    CUDA_IPC_HANDLE_BYTES,
    CudaIpcBucket,
    parse_cuda_ipc,
)


def init_group_request(instruction: pb.UpdateInstruction) -> dict[str, Any]:
    """Body of POST /init_weights_update_group: the engine's TP ranks start at `rank`."""
    g = instruction.group
    return {
        "master_address": g.master_address,
        "master_port": g.master_port,
        "rank_offset": instruction.rank,
        "world_size": g.world_size,
        "group_name": g.group_name,
        "backend": g.backend,
    }


def update_requests(
    instruction: pb.UpdateInstruction, *, flush_cache: bool = True
) -> list[dict[str, Any]]:
    """Bodies of POST /update_weights_from_distributed, one per bucket, in broadcast order.

    Each call blocks inside SGLang until its bucket's broadcast completes, so post them one at a
    time; only the last flushes the cache (the engine then serves the new version whole)."""
    manifest = Manifest.from_proto(instruction.manifest)
    bodies = []
    for b in range(manifest.num_buckets):
        entries = manifest.bucket_entries(b)
        bodies.append(
            {
                "names": [e.name for e in entries],
                "dtypes": [e.dtype for e in entries],
                "shapes": [list(e.shape) for e in entries],
                "group_name": instruction.group.group_name,
                "load_format": "flattened_bucket",
                "flush_cache": flush_cache and b == manifest.num_buckets - 1,
                "weight_version": str(instruction.version),
            }
        )
    return bodies


def destroy_group_request(instruction: pb.UpdateInstruction) -> dict[str, Any]:
    """Body of POST /destroy_weights_update_group (groups are formed per version)."""
    return {"group_name": instruction.group.group_name}


class SharedCudaBucket:
    """One GPU bucket of the trainer, named by its CUDA IPC handle (never opened here).

    Pickled, it is exactly what torch's `reduce_tensor` writes for a flat uint8 CUDA tensor:
    `rebuild_cuda_tensor(Tensor, size, stride, offset, TypedStorage, uint8, device, handle,
    storage bytes, storage offset, requires_grad, ref-counter handle, its offset, event handle,
    event sync)`, with the device as the GPU's UUID (SGLang's patched `rebuild_cuda_tensor`
    maps it to its own device index). Not opened because torch refuses to share a CUDA storage
    received from another process (`_share_cuda_`), so passing it on would need a clone; and
    SGLang, the one process that opens it, releases its reference exactly once."""

    def __init__(self, bucket: CudaIpcBucket, gpu_uuid: str) -> None:
        if not gpu_uuid:
            raise ValueError("a CUDA IPC bucket for SGLang must name its GPU (gpu_uuid)")
        self.bucket, self.gpu_uuid = bucket, gpu_uuid

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        b = self.bucket
        event = b.event_handle if b.event_handle is not None else bytes(CUDA_IPC_HANDLE_BYTES)
        return rebuild_cuda_tensor, (
            torch.Tensor, torch.Size([b.size]), (1,), b.offset, torch.storage.TypedStorage,
            torch.uint8, self.gpu_uuid, b.handle, b.storage_bytes, b.storage_offset, False,
            b.ref_handle, b.ref_offset, event, b.event_sync,
        )  # fmt: skip


def flattened_bucket_payload(bucket: Any, entries: Sequence[TensorEntry]) -> str:
    """One tensor-parallel rank's entry of `serialized_named_tensors` with
    `load_format="flattened_bucket"`: base64 of SGLang's `MultiprocessingSerializer` format
    (`ForkingPickler`) for the bucket and its tensors' places in it (`entries`, offsets inside
    the bucket). `bucket`: a `SharedCudaBucket`, or any tensor torch's reductions can share
    with another process (the tests pass CPU tensors in shared memory); what it names must stay
    alive, unchanged, until SGLang has loaded it. The metadata entries are `SimpleNamespace`s:
    SGLang reads their six attributes and its `SafeUnpickler` admits that type. This is the one
    pickle kuberl writes, for SGLang's own API on the replica's loopback hop; it never reads one."""
    metadata = [
        SimpleNamespace(
            name=e.name,
            shape=torch.Size(e.shape),
            dtype=torch_dtype(e.dtype),
            start_idx=e.offset,
            end_idx=e.offset + e.nbytes,
            numel=e.nbytes,
        )
        for e in entries
    ]
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": bucket, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode()


def tensor_update_bodies(
    manifest: Manifest, buckets: Sequence[Any], version: int, *, flush_cache: bool = True
) -> list[dict[str, Any]]:
    """Bodies of POST /update_weights_from_tensor, one per bucket of `manifest`, for an SGLang
    server with one tensor-parallel rank (one payload per body). `buckets[b]` is what SGLang
    opens as bucket b (see `flattened_bucket_payload`)."""
    if len(buckets) != manifest.num_buckets:
        raise ValueError(f"{len(buckets)} buckets for the manifest's {manifest.num_buckets}")
    last = manifest.num_buckets - 1
    bodies: list[dict[str, Any]] = []
    for b, bucket in enumerate(buckets):
        body: dict[str, Any] = {
            "serialized_named_tensors": [
                flattened_bucket_payload(bucket, manifest.bucket_entries(b))
            ],
            "load_format": "flattened_bucket",
            "flush_cache": flush_cache and b == last,
        }
        if b == last:
            body["weight_version"] = str(version)
        bodies.append(body)
    return bodies


def tensor_update_requests(
    instruction: pb.UpdateInstruction, *, flush_cache: bool = True
) -> list[dict[str, Any]]:
    """Bodies of POST /update_weights_from_tensor for a CUDA IPC instruction, one per bucket,
    naming the trainer's buckets by the instruction's handle set. The set is checked against
    the manifest first (ValueError naming the problem, before anything is sent). Post every
    body, in order, to the one SGLang server on the trainer's GPU: each handle carries one
    reference to the trainer's memory, released when SGLang lets go of the bucket it opened, so
    a set can be opened once."""
    manifest = Manifest.from_proto(instruction.manifest)
    handles = parse_cuda_ipc(instruction.handles_json, manifest)
    shared = [SharedCudaBucket(b, handles.gpu_uuid) for b in handles.buckets]
    return tensor_update_bodies(manifest, shared, instruction.version, flush_cache=flush_cache)
