"""The trainer's process group (gloo on CPU, NCCL on GPU) and the few collectives the training
loop needs: bytes from rank 0 (`broadcast_bytes`: protobuf batches, control messages) and
per-rank metrics as JSON (`gather_json`), so nothing is pickled.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from kuberl.common.logs import get_logger
from kuberl.common.redis_server import free_port

if TYPE_CHECKING:
    from kuberl.common.config import JobConfig

log = get_logger(__name__)


def leave(code: int) -> NoReturn:
    """End a process that ran torch.distributed without the interpreter's finalization, once its
    work is done and written (`kuberl serve trainer` after the service stopped cleanly, and the
    ZeRO test and benchmark workers). gloo's worker threads may still be destroying finished
    collectives that hold Python tensors; one that needs the GIL while the interpreter
    finalizes is made to exit inside a C++ destructor and the process dies in std::terminate,
    so a finished job would be reported as failed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the training world."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def collective_timeout_seconds(config: JobConfig) -> float:
    """How long a rank may wait in one collective. Ranks other than 0 wait in a barrier while
    rank 0 runs a whole eval round (up to `trainer.eval_timeout_seconds`), so DeepSpeed's
    default of 10 minutes, equal to that timeout's default, let a slow round kill the job."""
    return max(1800.0, config.trainer.eval_timeout_seconds + 600.0)


def init_distributed(timeout_seconds: float | None = None) -> DistInfo:
    """Join the torchrun world (its c10d rendezvous sets RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT on every worker of every node) or, for a plain `kuberl serve
    trainer`, make a world of one in an in-memory store (no port), and pick this rank's device;
    `timeout_seconds` bounds each collective (DeepSpeed's default: 10 minutes)."""
    import deepspeed
    import torch.distributed as dist

    alone = "RANK" not in os.environ
    if alone:
        # DeepSpeed wants torchrun's variables even for a world of one (without them it looks for
        # MPI); the port is never bound: the process group below lives in an in-memory store.
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if backend == "gloo":
        skip_cpu_op_builds()
    if alone and not dist.is_initialized():
        # No TCP store: a port picked now and bound later could be taken in between by another
        # process on the machine (a local run starts several at once). DeepSpeed adopts the group.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not dist.is_initialized():
        kwargs = {} if timeout_seconds is None else {"timeout": timedelta(seconds=timeout_seconds)}
        deepspeed.init_distributed(dist_backend=backend, verbose=False, **kwargs)
    info = DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)
    log.info("dist.ready", rank=info.rank, world_size=info.world_size, backend=backend)
    return info


def skip_cpu_op_builds() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory all-reduce op at start.

    DeepSpeed's torch backend builds `deepspeed_shm_comm` with ninja/g++ the first time a CPU
    process group starts (about a minute, then cached in ~/.cache/torch_extensions). Only its
    tensor-parallel inference all-reduce uses it; training collectives go through gloo either
    way. `deepspeed.ops.__compatible_ops__` is a cached dict
    that DeepSpeed consults before building.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _comm_device(info: DistInfo) -> torch.device:
    return info.device if info.device.type == "cuda" else torch.device("cpu")


def broadcast_bytes(data: bytes | None, info: DistInfo) -> bytes:
    """Rank 0's `data` on every rank."""
    import torch.distributed as dist

    if info.world_size == 1:
        assert data is not None
        return data
    dev = _comm_device(info)
    size = torch.tensor([len(data) if info.is_main and data is not None else 0], device=dev)
    dist.broadcast(size, 0)
    n = int(size.item())
    if info.is_main:
        assert data is not None
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if n else None
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=dev)
    if n == 0:
        return b""
    assert buf is not None
    dist.broadcast(buf, 0)
    return bytes(buf.cpu().numpy().tobytes())


def gather_json(value: Any, info: DistInfo) -> list[Any]:
    """Every rank's JSON-serialisable `value`, in rank order, on every rank."""
    import torch.distributed as dist

    if info.world_size == 1:
        return [value]
    dev = _comm_device(info)
    raw = json.dumps(value).encode()
    size = torch.tensor([len(raw)], device=dev)
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=dev)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(info.world_size)]
    dist.all_gather(out, buf)
    return [json.loads(bytes(t.cpu().numpy().tobytes()).rstrip(b"\0")) for t in out]


def all_reduce_max(value: int, info: DistInfo) -> int:
    import torch.distributed as dist

    if info.world_size == 1:
        return value
    t = torch.tensor([value], device=_comm_device(info))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def barrier(info: DistInfo) -> None:
    import torch.distributed as dist

    if info.world_size > 1:
        dist.barrier()
