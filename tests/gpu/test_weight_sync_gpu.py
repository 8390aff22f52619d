"""The weight-sync service's GPU transports end to end: `kuberl serve weight_sync`, a trainer and
an engine as their own processes, tensors compared bit for bit.

- CUDA IPC: trainer and engine on the same GPU (one GPU is enough). The trainer publishes CUDA
  tensors; the service sends the colocated engine the trainer's handles; the engine copies
  device to device.
- NCCL: the relay broadcasts from one GPU to an engine on another. Two processes cannot share a
  GPU in one NCCL group ("Duplicate GPU detected"), so this needs two GPUs and skips otherwise.

Both skip cleanly without CUDA. On the first GPU runs (2026-11-26, an H100 and an H200, one GPU
each) the CUDA IPC test failed on torch's 66-byte handles (weight-sync expected 64; fixed in commit
f9b0bcb, not yet re-run on a GPU) and the NCCL test skipped (see docs/weight-sync.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_weight_sync import (
    _bit_identical,
    _engine,
    _history,
    _holding,
    _publish,
    _service,
    _status,
    _stop,
    _wait,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_an_engine_on_the_trainers_gpu_loads_a_version_by_cuda_ipc_bit_identical(
    tmp_path: Path,
) -> None:
    for svc in _service(tmp_path, ["cuda_ipc", "shm", "snapshot"]):
        engine = _engine(
            svc, tmp_path, "colocated", "--device", "cuda:0",
            "--transports", "cuda_ipc", "shm", "snapshot",
        )  # fmt: skip
        try:
            _wait(lambda: len(_status(svc).engines) == 1, "engine registered", svc)  # noqa: B023
            sent = _publish(
                svc, tmp_path, 5, 5, 8, "--device", "cuda:0", "--hold-until-loaded",
                "--transports", "cuda_ipc", "shm", "snapshot",
            )  # fmt: skip
            _wait(lambda: "colocated" in _holding(svc, 5), "engine at v5", svc)  # noqa: B023
            history = _history(tmp_path, "colocated")
            identical = _bit_identical(tmp_path, "colocated", 5, 5, mb=8)
        finally:
            _stop(engine)
        assert (sent["cuda_ipc_sets"], history, identical) == (1, [(5, "cuda_ipc")], True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between processes needs 2 GPUs")
def test_the_relay_broadcasts_over_nccl_to_an_engine_on_another_gpu_bit_identical(
    tmp_path: Path,
) -> None:
    for svc in _service(tmp_path, ["nccl", "snapshot"], device="cuda:0"):
        engine = _engine(
            svc, tmp_path, "gpu1", "--device", "cuda:1", "--transports", "nccl", "snapshot"
        )
        try:
            _wait(lambda: len(_status(svc).engines) == 1, "engine registered", svc)  # noqa: B023
            _publish(svc, tmp_path, 3, 3, 8)  # 9 buckets of 1 MiB through the relay's GPU
            _wait(lambda: "gpu1" in _holding(svc, 3), "engine at v3", svc)  # noqa: B023
            history = _history(tmp_path, "gpu1")
            identical = _bit_identical(tmp_path, "gpu1", 3, 3, mb=8)
        finally:
            _stop(engine)
        assert (history, identical) == ([(3, "nccl")], True)
