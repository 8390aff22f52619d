"""The `gloo` and `nccl` transports: a torch.distributed group formed for one version, rank 0 the
sender (`BroadcastSender`), the engines the other ranks (`BroadcastReceiver`), one broadcast of a
flat uint8 tensor per bucket. Both backends run this one code path, so the gloo tests cover the
logic NCCL runs. Groups are formed as SGLang forms its own (`new_group`), so an SGLang server
joins natively (`kuberl.common.weights.sglang` builds its requests), and never as torch's default
group, which the trainer may own.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from kuberl.api.weight_sync.v1 import weight_sync_pb2 as pb
from kuberl.common.weights.manifest import Manifest
from kuberl.common.weights.transports.base import Allocator, Receiver, fresh_buffer, same_device


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
    `PrefixStore(group_name, store)` directly would never meet an SGLang peer: each side would
    time out waiting for keys the other never writes. So we call the same helper with the same
    arguments; the group is registered in torch's process-wide table, not
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
        on_device = same_device(flat.device, self.device) and not self.stage
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
