"""Rollout engines: the interface (`base`), the in-process `torch` engine, the `sglang` client
and the model-free `simulated` engine of the scale benchmark.

`create_engine` builds the one a job's `rollout.engine` section names; engines import their heavy
dependencies (torch, transformers, httpx) only when built.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kuberl.common.config import JobConfig
from kuberl.rollout.engine.base import (
    Completion,
    Engine,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    SamplingParams,
)

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "EngineRejected",
    "EngineTimeout",
    "EngineUnavailable",
    "SamplingParams",
    "create_engine",
]


def replica_seed(seed: int, replica_id: str) -> int:
    """A replica's own sampling seed: replicas seeded alike would draw the same random numbers
    (the same samples for the same prompt, and in the simulation batches that end together)."""
    if not replica_id:
        return seed
    digest = hashlib.blake2b(f"{seed}/{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch.Generator takes < 2**63


def create_engine(config: JobConfig, model_path: Path, replica_id: str = "") -> Engine:
    """The engine of `config.rollout.engine` serving the model at `model_path` for the rollout
    replica `replica_id`, which draws from its own seed (`replica_seed`)."""
    engine = config.rollout.engine

    def seed(engine_seed: int | None) -> int:  # the engine's own seed, else the job's
        return replica_seed(config.job.seed if engine_seed is None else engine_seed, replica_id)

    if engine.kind == "torch":
        import torch

        from kuberl.rollout.engine.torch_engine import TorchEngine

        if engine.num_threads:
            torch.set_num_threads(engine.num_threads)

        return TorchEngine.from_pretrained(
            model_path,
            device=engine.device,
            dtype=config.model.dtype,
            max_batch_size=engine.max_batch_size,
            seed=seed(engine.seed),
            attn_implementation=engine.attn_implementation,
            batch_wait_seconds=engine.batch_wait_seconds,
            adapters=config.model.lora,
        )
    if engine.kind == "simulated":
        from kuberl.rollout.engine.simulated import SimulatedEngine

        return SimulatedEngine(engine, seed=seed(engine.seed))
    from kuberl.rollout.engine.sglang import SGLangEngine

    return SGLangEngine(engine, model_path=str(model_path), lora=config.model.lora)
