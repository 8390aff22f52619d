"""The data plane: how the bytes of one version reach an engine, one class per transport.

Every transport ends the same way: the engine holds the version's flat uint8 payload (its own
memory) and `Manifest.views` names the tensors in it. `make_receiver(transport)` is the factory
the engine client uses for whatever `UpdateInstruction` the service sends:

- `gloo` / `nccl` (`BroadcastReceiver`, `BroadcastSender`): a torch.distributed group formed for
  one version, rank 0 the sender, one broadcast of a flat uint8 tensor per bucket. The fields are
  SGLang's (`/init_weights_update_group`: master_address, master_port, rank_offset, world_size,
  group_name, backend; `/update_weights_from_distributed` with `load_format="flattened_bucket"`:
  names, dtypes, shapes per bucket), so an SGLang server joins the same group natively
  (`kuberl.common.weights.sglang` builds those requests). Groups are built on a TCPStore with
  explicit timeouts, never on torch's global default group (the trainer may own that one).
- `shm` (`ShmReceiver`, `ShmWriter`): the payload is a file in shared memory (/dev/shm); the
  engine reads it into its own buffer with one kernel copy.
- `snapshot` (`SnapshotReceiver`): the payload streamed over gRPC by `StreamSnapshot` in
  CRC32C-checked chunks with a final SHA-256 (`kuberl.common.weights.chunks`).
- `cuda_ipc` (`export_cuda_ipc`, `CudaIpcReceiver`): CUDA IPC handles of the trainer's GPU
  buckets, as JSON (never pickle); the engine on the same GPU copies device to device.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import torch
import torch.distributed as dist

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
from kuberl.common.channels import DEFAULT_MAX_MESSAGE_BYTES, sync_channel
from kuberl.common.weights.chunks import DEFAULT_CHUNK_BYTES, ChunkReceiver
from kuberl.common.weights.manifest import Manifest

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


class Receiver(ABC):
    """Receives one version as instructed; returns the manifest and the flat payload."""

    @abstractmethod
    def receive(self, instruction: pb.UpdateInstruction) -> tuple[Manifest, torch.Tensor]: ...


# ---------------------------------------------------------------- broadcast (gloo, nccl)


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 1.0))


def new_group(backend: str, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> Any:
    """A process group of its own (not the global default group) on `store`."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, _timeout(timeout_s))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _timeout(timeout_s)
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"unknown broadcast backend {backend!r}; expected gloo or nccl")


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float) -> None:
    """One broadcast from rank 0 of `group`, raising on a broken peer or after the timeout."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = _timeout(timeout_s)
    group.broadcast([tensor], opts).wait()


class BroadcastSender:
    """Rank 0 of a group formed for one version: hosts the TCPStore and sends every bucket.

    Create it, hand `group` (with the engine's rank) to the engine, then call `send`, which
    blocks until the peers joined and every bucket left (or raises on timeout / dead peer)."""

    def __init__(
        self,
        *,
        backend: str,
        advertise_host: str,
        world_size: int,
        group_name: str,
        timeout_s: float,
        device: str = "cpu",
    ) -> None:
        self.backend, self.timeout_s, self.device = backend, timeout_s, device
        self.world_size = world_size
        self.store = dist.TCPStore(
            "0.0.0.0", 0, world_size, True, _timeout(timeout_s), wait_for_workers=False
        )
        self.group = pb.BroadcastGroup(
            group_name=group_name,
            backend=backend,
            master_address=advertise_host,
            master_port=int(self.store.port),
            world_size=world_size,
        )

    def send(
        self, manifest: Manifest, flat: torch.Tensor, on_bucket: Callable[[int], None] | None = None
    ) -> None:
        group = new_group(
            self.backend,
            dist.PrefixStore(self.group.group_name, self.store),
            0,
            self.world_size,
            self.timeout_s,
        )
        try:
            for b in range(manifest.num_buckets):
                bucket = manifest.bucket_view(flat, b)
                if self.device != "cpu":
                    bucket = bucket.to(self.device)
                broadcast(group, bucket, self.timeout_s)
                if on_bucket is not None:
                    on_bucket(b)
        finally:
            del group

    def close(self) -> None:
        del self.store


class BroadcastReceiver(Receiver):
    """Joins the instructed group at its rank and receives every bucket into one flat buffer."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def receive(self, instruction: pb.UpdateInstruction) -> tuple[Manifest, torch.Tensor]:
        manifest = Manifest.from_proto(instruction.manifest)
        g = instruction.group
        timeout_s = instruction.deadline_seconds or 60.0
        store = dist.TCPStore(
            g.master_address, g.master_port, g.world_size, False, _timeout(timeout_s)
        )
        group = new_group(
            g.backend, dist.PrefixStore(g.group_name, store), instruction.rank, g.world_size,
            timeout_s,
        )  # fmt: skip
        try:
            flat = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=self.device)
            for b in range(manifest.num_buckets):
                broadcast(group, manifest.bucket_view(flat, b), timeout_s)
        finally:
            del group, store
        return manifest, flat


# ---------------------------------------------------------------- shared memory


class ShmWriter:
    """Writes a version's payload into a shared-memory file, tensor by tensor (trainer side)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
        view = data.data
        while view.nbytes:
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def abort(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def read_file_into(path: str, size: int) -> torch.Tensor:
    """The first `size` bytes of a file as a new flat uint8 tensor (one kernel copy)."""
    flat = torch.empty(size, dtype=torch.uint8)
    view = flat.numpy().data
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"{path}: only {got} of {size} bytes (truncated shared memory)")
            got += n
    return flat


class ShmReceiver(Receiver):
    def receive(self, instruction: pb.UpdateInstruction) -> tuple[Manifest, torch.Tensor]:
        manifest = Manifest.from_proto(instruction.manifest)
        handle = json.loads(instruction.handles_json)
        return manifest, read_file_into(handle["path"], manifest.total_bytes)


# ---------------------------------------------------------------- snapshot (gRPC stream)


def download_snapshot(
    address: str,
    version: int = 0,
    *,
    engine_id: str = "",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> tuple[int, Manifest, torch.Tensor]:
    """Stream a version (0 = the latest) from the service; checks every chunk and the SHA-256."""
    state: dict[str, Any] = {}

    def allocate(manifest: Manifest) -> None:
        state["flat"] = torch.empty(manifest.total_bytes, dtype=torch.uint8)
        state["np"] = state["flat"].numpy()

    def write(offset: int, data: bytes) -> None:
        state["np"][offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)

    receiver = ChunkReceiver(write, on_manifest=allocate)
    request = pb.StreamSnapshotRequest(
        version=version, engine_id=engine_id, chunk_bytes=chunk_bytes
    )
    with sync_channel(address, max(max_message_bytes, 2 * chunk_bytes)) as channel:
        stub = pb_grpc.WeightSyncServiceStub(channel)
        for chunk in stub.StreamSnapshot(request, timeout=timeout_s):
            receiver.feed(chunk)
    manifest = receiver.finish()
    assert receiver.version is not None
    return receiver.version, manifest, state["flat"]


class SnapshotReceiver(Receiver):
    """Streams the instructed version from `snapshot_endpoint` (empty: `address`, the
    weight-sync service the engine registered with)."""

    def __init__(
        self, address: str = "", engine_id: str = "", chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> None:
        self.address, self.engine_id, self.chunk_bytes = address, engine_id, chunk_bytes

    def receive(self, instruction: pb.UpdateInstruction) -> tuple[Manifest, torch.Tensor]:
        address = instruction.snapshot_endpoint or self.address
        try:
            version, manifest, flat = download_snapshot(
                address,
                instruction.version,
                engine_id=self.engine_id,
                chunk_bytes=self.chunk_bytes,
                timeout_s=instruction.deadline_seconds or None,
            )
        except grpc.RpcError as exc:
            raise RuntimeError(
                f"snapshot of version {instruction.version} from {address}: "
                f"{exc.code().name}: {exc.details()}"
            ) from None
        if version != instruction.version:
            raise ValueError(f"asked for version {instruction.version}, received {version}")
        return manifest, flat


# ---------------------------------------------------------------- CUDA IPC


def export_cuda_ipc(buckets: list[torch.Tensor]) -> str:
    """CUDA IPC handles of the given GPU buckets as JSON. Keep the tensors alive until every
    engine has loaded them (torch's IPC reference counting frees them only after that)."""
    from torch.multiprocessing.reductions import reduce_tensor

    out = []
    for tensor in buckets:
        if not tensor.is_cuda:
            raise ValueError("CUDA IPC needs CUDA tensors")
        # torch's CUDA reduction: (tensor cls, size, stride, offset, storage cls, dtype, device,
        # handle, storage bytes, storage offset, requires_grad, ref-counter handle, its offset,
        # event handle, event sync required)
        args = reduce_tensor(tensor)[1]
        size, stride, offset, dtype, device, handle = (args[i] for i in (1, 2, 3, 5, 6, 7))
        storage_bytes, storage_offset, ref_handle, ref_offset = args[8], args[9], args[11], args[12]
        event_handle, event_sync = args[13], args[14]
        out.append(
            {
                "size": list(size),
                "stride": list(stride),
                "offset": offset,
                "dtype": str(dtype).removeprefix("torch."),
                "device": device,
                "handle": base64.b64encode(handle).decode(),
                "storage_bytes": storage_bytes,
                "storage_offset": storage_offset,
                "ref_handle": base64.b64encode(ref_handle).decode(),
                "ref_offset": ref_offset,
                "event_handle": base64.b64encode(event_handle).decode() if event_handle else "",
                "event_sync": bool(event_sync),
            }
        )
    return json.dumps({"buckets": out})


def import_cuda_ipc(handles_json: str) -> list[torch.Tensor]:
    """The GPU buckets behind handles from `export_cuda_ipc` (same GPU, another process)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    tensors = []
    for h in json.loads(handles_json)["buckets"]:
        tensors.append(
            rebuild_cuda_tensor(
                torch.Tensor,
                torch.Size(h["size"]),
                tuple(h["stride"]),
                h["offset"],
                torch.storage.UntypedStorage,
                getattr(torch, h["dtype"]),
                h["device"],
                base64.b64decode(h["handle"]),
                h["storage_bytes"],
                h["storage_offset"],
                False,
                base64.b64decode(h["ref_handle"]),
                h["ref_offset"],
                base64.b64decode(h["event_handle"]) if h["event_handle"] else None,
                h["event_sync"],
            )
        )
    return tensors


class CudaIpcReceiver(Receiver):
    """Copies the trainer's GPU buckets device to device into one flat buffer of its own."""

    def receive(self, instruction: pb.UpdateInstruction) -> tuple[Manifest, torch.Tensor]:
        manifest = Manifest.from_proto(instruction.manifest)
        buckets = import_cuda_ipc(instruction.handles_json)
        if len(buckets) != manifest.num_buckets:
            raise ValueError(f"{len(buckets)} IPC buckets for {manifest.num_buckets} in manifest")
        flat = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=buckets[0].device)
        for b, src in enumerate(buckets):
            manifest.bucket_view(flat, b).copy_(src)
        torch.cuda.synchronize(flat.device)
        return manifest, flat


def make_receiver(
    transport: str | int,
    *,
    device: str = "cpu",
    address: str = "",
    engine_id: str = "",
    chunk_bytes: int = 0,
) -> Receiver:
    """The receiver for a transport name or `pb.Transport` value (`address`: the weight-sync
    service, for snapshots whose instruction names no other endpoint)."""
    name = transport_name(transport_value(transport))
    if name in ("gloo", "nccl"):
        return BroadcastReceiver(device if name == "nccl" else "cpu")
    if name == "shm":
        return ShmReceiver()
    if name == "snapshot":
        return SnapshotReceiver(address, engine_id, chunk_bytes or DEFAULT_CHUNK_BYTES)
    if name == "cuda_ipc":
        return CudaIpcReceiver()
    raise ValueError(f"no receiver for transport {name!r}")
