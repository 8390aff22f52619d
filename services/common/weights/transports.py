"""The data plane: how the bytes of one version reach an engine, one class per transport.

Every transport ends the same way: the engine holds the version's flat uint8 payload in a buffer
of its own and `Manifest.views` names the tensors in it. `make_receiver(transport)` is the
factory the engine client uses for whatever `UpdateInstruction` the service sends; receivers
write into a buffer the caller hands them (`Allocator`), which is how `BufferPool` double-buffers
an engine across versions: a version is received into the buffer the engine does not serve from,
and no page is allocated after the first two versions.

- `gloo` / `nccl` (`BroadcastReceiver`, `BroadcastSender`): a torch.distributed group formed for
  one version, rank 0 the sender, one broadcast of a flat uint8 tensor per bucket. One code path
  for both backends (the backend and the device are parameters), so the gloo tests cover the
  logic NCCL runs. The fields are SGLang's (`/init_weights_update_group`: master_address,
  master_port, rank_offset, world_size, group_name, backend; `/update_weights_from_distributed`
  with `load_format="flattened_bucket"`: names, dtypes, shapes per bucket), so an SGLang server
  joins the same group natively (`kuberl.common.weights.sglang` builds those requests). Both
  ends form the group the way SGLang's `init_custom_process_group` does (`new_group`: the same
  store prefixes, the same rendezvous keys), never as torch's global default group (the trainer
  may own that one). An NCCL collective that does not finish in time is aborted by us
  (`ProcessGroup.abort`), not left to NCCL's watchdog, which would end the whole process.
- `shm` (`ShmReceiver`, `ShmWriter`): the payload is a file in shared memory (/dev/shm) that the
  trainer wrote once; every engine maps it read-only (the mapping is kept across versions, since
  the service reuses its files) and copies it into its own buffer.
- `snapshot` (`SnapshotReceiver`): the payload streamed over gRPC by `StreamSnapshot` in
  CRC32C-checked chunks with a final SHA-256 (`kuberl.common.weights.chunks`).
- `cuda_ipc` (`export_cuda_ipc`, `CudaIpcReceiver`): CUDA IPC handles of the trainer's GPU
  buckets, as JSON (never pickle); the engine on the same GPU copies device to device, nothing
  goes through the host. `parse_cuda_ipc` checks a handle set without touching CUDA.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import datetime
import inspect
import json
import mmap
import os
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.api.weight_sync.v1 import weight_sync_pb2_grpc as pb_grpc
from kuberl.common.channels import DEFAULT_MAX_MESSAGE_BYTES, sync_channel
from kuberl.common.weights.chunks import DEFAULT_CHUNK_BYTES, ChunkReceiver, CorruptSnapshot
from kuberl.common.weights.manifest import Manifest

TRANSPORT_NAMES: dict[str, int] = {
    "nccl": pb.TRANSPORT_NCCL,
    "gloo": pb.TRANSPORT_GLOO,
    "cuda_ipc": pb.TRANSPORT_CUDA_IPC,
    "snapshot": pb.TRANSPORT_SNAPSHOT,
    "shm": pb.TRANSPORT_SHM,
}
_BY_VALUE: dict[int, str] = {v: k for k, v in TRANSPORT_NAMES.items()}

#: `allocate(nbytes, device)`: the flat uint8 buffer a receiver writes one version into.
Allocator = Callable[[int, str], torch.Tensor]


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


def fresh_buffer(nbytes: int, device: str) -> torch.Tensor:
    """The default `Allocator`: a new buffer for every version."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _same_device(have: torch.device, want: str) -> bool:
    target = torch.device(want)
    return have.type == target.type and (target.index is None or have.index == target.index)


class BufferPool:
    """Two flat buffers reused across versions (double buffering), one engine's receive memory.

    `spare(nbytes, device)` is the buffer the engine does not hold: the next version is received
    into it while the engine keeps serving the one it holds, untouched. `hold(buffer)` after the
    engine loaded a version from it makes it the held one. A failed update never becomes held,
    so the retry lands in the same spare buffer and the held version stays whole. After the
    first two versions nothing is allocated any more (fresh memory costs page faults: on the
    2-core test VM, ~0.2 GB/s for new pages against several GB/s for a copy into touched ones).
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
            if buf is None or buf.numel() < nbytes or not _same_device(buf.device, device):
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


# ---------------------------------------------------------------- broadcast (gloo, nccl)


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 1.0))


def group_store(
    master_address: str, master_port: int, world_size: int, timeout_s: float
) -> dist.TCPStore:
    """A client of a group's TCPStore (hosted by rank 0), made the way torch's `tcp://`
    rendezvous makes it for the other ranks: what an SGLang server does on
    /init_weights_update_group, and what our engines do."""
    store = dist.TCPStore(
        master_address, master_port, world_size, False, _timeout(timeout_s), multi_tenant=True
    )
    store.set_timeout(_timeout(timeout_s))
    return store


def _helper_options_name() -> str:
    # torch 2.6 renamed the helper's `pg_options` to `backend_options`.
    params = inspect.signature(c10d._new_process_group_helper).parameters
    return "backend_options" if "backend_options" in params else "pg_options"


def new_group(
    backend: str,
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout_s: float,
    group_name: str,
) -> Any:
    """A weight-update group formed exactly as SGLang forms its own (`init_custom_process_group`
    in sglang/srt/utils/common.py, after OpenRLHF), so that both ends wait for the same keys.

    The rendezvous keys of a group come from the stores it is built on: SGLang puts the
    group's TCPStore behind `PrefixStore(group_name)` and hands that to torch's
    `_new_process_group_helper`, which adds `<group_name>/` and then `<device>/` (`cpu/` for
    gloo, `cuda/` for NCCL) before the backend's own keys, and for gloo has rank 0 publish the
    group's sequence number there, which every other rank waits for. A group built on
    `PrefixStore(group_name, store)` directly (our earlier code) therefore never meets an SGLang
    peer: each side times out waiting for keys the other never writes. So we call the same
    helper with the same arguments; the group is registered in torch's process-wide table, not
    as the default group, and `leave_group` must release it (its name can be reused after).
    `timeout_s` bounds gloo's collectives; an NCCL group gets twice that, because `wait_work`
    aborts a stuck collective first and NCCL's own watchdog would end the whole process."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown broadcast backend {backend!r}; expected gloo or nccl")
    timeout = _timeout(2 * timeout_s if backend == "nccl" else timeout_s)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],  # no global ranks: a group of its own, not a subgroup of a default group
        dist.Backend(backend),
        dist.PrefixStore(group_name, store),
        group_name=c10d.GroupName(group_name),
        timeout=timeout,
        **{_helper_options_name(): None},
    )
    # What torch.distributed's collectives look up to map a group rank to a global one.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_group(group: Any) -> None:
    """Release a group made by `new_group` (its name in torch's table, its backend)."""
    # After a failed or aborted collective the backend may refuse to shut down cleanly; the
    # caller is already reporting that failure. A name left registered then blocks nothing:
    # group names are unique per version and engine.
    with contextlib.suppress(Exception):
        dist.destroy_process_group(group)


def wait_work(work: Any, group: Any, backend: str, timeout_s: float) -> None:
    """Wait for a collective. gloo honours its own timeout; for NCCL, `Work.wait` only orders
    streams, so poll completion on the CPU and abort the group (freeing the GPU kernel) when a
    peer does not take part in time."""
    if backend != "nccl":
        work.wait()
        return
    deadline = time.monotonic() + max(timeout_s, 1.0)
    while not work.is_completed():
        if time.monotonic() > deadline:
            with contextlib.suppress(Exception):
                group.abort()
            raise TimeoutError(f"NCCL broadcast not finished after {timeout_s:.0f}s; aborted")
        time.sleep(0.0005)
    work.wait()  # raises what the collective failed with, if anything


def broadcast(group: Any, tensor: torch.Tensor, timeout_s: float, backend: str = "gloo") -> None:
    """One broadcast from rank 0 of `group`, raising on a broken peer or after the timeout."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = _timeout(timeout_s)
    wait_work(group.broadcast([tensor], opts), group, backend, timeout_s)


def _on_device(device: str) -> contextlib.AbstractContextManager[Any]:
    """Make `device` this thread's current CUDA device (NCCL binds a communicator to it)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.device(torch.device(device))
    return contextlib.nullcontext()


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(torch.device(device))


class BroadcastSender:
    """Rank 0 of a group formed for one version: hosts the TCPStore and sends every bucket.

    Create it, hand `group` (with the engine's rank) to the engine, then call `send`, which
    blocks until the peers joined and every bucket left (or raises on timeout / dead peer). When
    the payload is not on `device` (host memory for an NCCL broadcast from `device="cuda:N"`, or
    `stage=True`) each bucket is first copied into one reused staging buffer there; the stream
    orders the next staging copy after the previous broadcast."""

    def __init__(
        self,
        *,
        backend: str,
        advertise_host: str,
        world_size: int,
        group_name: str,
        timeout_s: float,
        device: str = "cpu",
        stage: bool = False,
    ) -> None:
        if backend == "nccl" and torch.device(device).type != "cuda":
            raise ValueError(f"an NCCL broadcast needs a CUDA device, got {device!r}")
        self.backend, self.timeout_s, self.device = backend, timeout_s, device
        self.world_size, self.stage = world_size, stage
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
        on_device = _same_device(flat.device, self.device) and not self.stage
        with _on_device(self.device):
            group = new_group(
                self.backend, self.store, 0, self.world_size, self.timeout_s,
                self.group.group_name,
            )  # fmt: skip
            try:
                self._send(group, manifest, flat, on_device, on_bucket)
            finally:
                leave_group(group)

    def _send(
        self,
        group: Any,
        manifest: Manifest,
        flat: torch.Tensor,
        on_device: bool,
        on_bucket: Callable[[int], None] | None,
    ) -> None:
        staging: torch.Tensor | None = None
        try:
            for b in range(manifest.num_buckets):
                bucket = manifest.bucket_view(flat, b)
                if not on_device:
                    if staging is None:
                        staging = torch.empty(
                            max(manifest.bucket_sizes), dtype=torch.uint8, device=self.device
                        )
                    bucket = staging[: bucket.numel()].copy_(bucket)
                broadcast(group, bucket, self.timeout_s, self.backend)
                if on_bucket is not None:
                    on_bucket(b)
            _synchronize(self.device)
        finally:
            del staging

    def close(self) -> None:
        del self.store


class BroadcastReceiver(Receiver):
    """Joins the instructed group at its rank and receives every bucket into one flat buffer
    (host memory for gloo, `device` for NCCL)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def receive(
        self, instruction: pb.UpdateInstruction, allocate: Allocator = fresh_buffer
    ) -> tuple[Manifest, torch.Tensor]:
        manifest = Manifest.from_proto(instruction.manifest)
        g = instruction.group
        if g.backend == "nccl" and torch.device(self.device).type != "cuda":
            raise ValueError(
                f"an NCCL broadcast needs a CUDA device; this engine has {self.device}"
            )
        device = self.device if g.backend == "nccl" else "cpu"
        timeout_s = instruction.deadline_seconds or 60.0
        with _on_device(device):
            return self._receive(instruction, manifest, device, timeout_s, allocate)

    def _receive(
        self,
        instruction: pb.UpdateInstruction,
        manifest: Manifest,
        device: str,
        timeout_s: float,
        allocate: Allocator,
    ) -> tuple[Manifest, torch.Tensor]:
        g = instruction.group
        store = group_store(g.master_address, g.master_port, g.world_size, timeout_s)
        group = new_group(g.backend, store, instruction.rank, g.world_size, timeout_s, g.group_name)
        try:
            flat = allocate(manifest.total_bytes, device)
            for b in range(manifest.num_buckets):
                broadcast(group, manifest.bucket_view(flat, b), timeout_s, g.backend)
            _synchronize(device)
        finally:
            leave_group(group)
            del group, store
        return manifest, flat


# ---------------------------------------------------------------- shared memory


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


# ---------------------------------------------------------------- snapshot (gRPC stream)


def download_snapshot(
    address: str,
    version: int = 0,
    *,
    engine_id: str = "",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    allocate: Allocator = fresh_buffer,
) -> tuple[int, Manifest, torch.Tensor]:
    """Stream a version (0 = the latest) from the service; checks every chunk and the SHA-256."""
    state: dict[str, Any] = {}

    def on_manifest(manifest: Manifest) -> None:
        state["flat"] = allocate(manifest.total_bytes, "cpu")
        state["np"] = state["flat"].numpy()

    def write(offset: int, data: bytes) -> None:
        if "np" not in state:  # the buffer is sized by the manifest, which must come first
            raise CorruptSnapshot(f"data at offset {offset} before the manifest (first chunk)")
        state["np"][offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)

    receiver = ChunkReceiver(write, on_manifest=on_manifest)
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

    def receive(
        self, instruction: pb.UpdateInstruction, allocate: Allocator = fresh_buffer
    ) -> tuple[Manifest, torch.Tensor]:
        address = instruction.snapshot_endpoint or self.address
        try:
            version, manifest, flat = download_snapshot(
                address,
                instruction.version,
                engine_id=self.engine_id,
                chunk_bytes=self.chunk_bytes,
                timeout_s=instruction.deadline_seconds or None,
                allocate=allocate,
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
