"""How the trainer offers its weights to weight-sync: on a CUDA device CUDA IPC first with that
device (so `kuberl run --device cuda` hands a colocated engine its versions device to device),
on the CPU exactly `WeightPublisher`'s defaults (shared memory, else the gRPC upload).

The publisher is replaced by a recorder: no CUDA and no service are needed to see what the
trainer would build. tests/gpu/test_local_run_cuda.py checks the real thing on a GPU."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from kuberl.common import weights
from kuberl.common.config import JobConfig
from kuberl.common.weights.publisher import WeightPublisher
from kuberl.trainer.distributed import DistInfo
from kuberl.trainer.loop import Trainer


def _publisher_built_by_a_trainer_on(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    built: dict[str, Any] = {}

    class Recorder:
        def __init__(self, address: str, **kwargs: Any) -> None:
            built.update(address=address, **kwargs)

    monkeypatch.setattr(weights, "WeightPublisher", Recorder)
    config = JobConfig.model_validate({"endpoints": {"weight_sync": "127.0.0.1:1"}})
    trainer = Trainer(config, DistInfo(rank=0, world_size=1, local_rank=0, device=device))
    trainer._connect()
    trainer._channel.close()
    return built


def test_a_trainer_on_a_cuda_device_offers_cuda_ipc_first_from_that_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built = _publisher_built_by_a_trainer_on(torch.device("cuda", 1), monkeypatch)
    assert built == {
        "address": "127.0.0.1:1",
        "transports": ("cuda_ipc", "shm", "snapshot"),
        "device": "cuda:1",
    }


def test_a_trainer_on_the_cpu_offers_the_publishers_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built = _publisher_built_by_a_trainer_on(torch.device("cpu"), monkeypatch)
    defaults = inspect.signature(WeightPublisher).parameters
    assert built == {
        "address": "127.0.0.1:1",
        "transports": defaults["transports"].default,
        "device": defaults["device"].default,
    }
