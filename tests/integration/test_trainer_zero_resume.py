"""A DeepSpeed checkpoint of ZeRO stage 1, 2 or 3 on two gloo ranks, loaded into fresh engines in
fresh processes, takes exactly the step the uninterrupted engines took.

Two `torchrun --nproc-per-node 2` runs of this module (`--worker`), each building one engine per
stage in turn in the same two processes (DeepSpeed's start-up is paid once per run):

- `first`: step on batch A, `TrainEngine.save` (the trainer's layout: `<step>/policy/<step>`),
  step on batch B; the loss and grad norm of B and the weights after it are the uninterrupted
  run's.
- `resume`: new processes, a new engine from the untrained model, `TrainEngine.load` of that
  checkpoint (the trainer's restricted `torch.load(weights_only=True)`, so every class in
  DeepSpeed's ZeRO shards must be on its allowlist), then the same step on B.

B's loss and grad norm depend on the restored weights; the weights after B also on the restored
Adam moments and the learning-rate schedule (warm-up, so the second step's rate differs from the
first's). The trainer's SFT loss runs over token-budget micro-batches as in
tests/integration/test_trainer_zero.py, with torch's AdamW (no DeepSpeed op build).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support import REPO

STAGES = (1, 2, 3)
LR = 1e-2
EPS = 1e-4  # as in test_trainer_zero: Adam's update smooth in the gradient
BUDGET = 24
TAG = "step-000001"


def _samples(seed: int):  # type: ignore[no-untyped-def]
    from kuberl.trainer.batching import TrainingSequence

    rng = np.random.default_rng(seed)
    return [
        TrainingSequence(
            prompt_ids=rng.integers(5, 90, size=3 + i % 4),
            response_ids=rng.integers(5, 90, size=2 + (i * 3) % 7),
            loss_mask=np.ones(2 + (i * 3) % 7, dtype=np.float32),
            index=i,
        )
        for i in range(8)
    ]


def _worker(phase: str, root: Path, model_dir: Path) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from kuberl.common.config import TrainerConfig
    from kuberl.trainer.batching import collate, micro_batches, shard
    from kuberl.trainer.distributed import barrier, init_distributed
    from kuberl.trainer.engine import (
        PolicyModel,
        TrainEngine,
        iter_full_parameters,
        load_causal_lm,
        run_micro_batches,
    )
    from kuberl.trainer.sft import sft_loss_fn

    info = init_distributed()

    def step(engine: TrainEngine, seed: int) -> tuple[float, float]:
        samples = _samples(seed)
        total = sum(int(s.loss_mask.sum()) for s in samples)
        mine = shard(samples, info.rank, info.world_size)
        mbs = [collate(g, 0, info.device) for g in micro_batches(mine, BUDGET)]
        grad_norm, records = run_micro_batches(
            engine, mbs, sft_loss_fn(total, info.world_size), pad_id=0
        )
        loss = torch.tensor([sum(m["loss_share"] for m, _ in records)])
        dist.all_reduce(loss)
        return loss.item(), grad_norm

    def weights(engine: TrainEngine) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for bucket in iter_full_parameters(engine.module, 64 * 1024, info, "hf."):
            out.update(dict(bucket))
        return out

    for stage in STAGES:
        cfg = TrainerConfig(
            zero_stage=stage,
            micro_batch_tokens=BUDGET,
            optimizer={"lr": LR, "eps": EPS, "grad_clip": 1.0, "warmup_steps": 3},
        )
        engine = TrainEngine(
            PolicyModel(load_causal_lm(model_dir, torch.float32)), cfg, info, torch.float32
        )
        checkpoint = root / f"stage{stage}" / TAG / "policy"
        if phase == "first":
            step(engine, seed=1)
            engine.save(checkpoint, TAG)
            barrier(info)
            before = weights(engine)
        else:
            engine.load(checkpoint, TAG)
        loss, grad_norm = step(engine, seed=2)
        after = weights(engine)
        if info.is_main:
            save_file(after, str(root / f"stage{stage}-{phase}.safetensors"))
            result = {"loss": loss, "grad_norm": grad_norm, "lr": engine.lr()}
            if phase == "first":
                result["moved"] = max((after[k] - before[k]).abs().max().item() for k in after)
            (root / f"stage{stage}-{phase}.json").write_text(json.dumps(result))
        del engine
    # Leave together: a rank still in gloo while the other exits was aborted once under load
    # ("terminate called without an active exception", exit -6).
    barrier(info)
    dist.destroy_process_group()


def _torchrun(phase: str, root: Path, model_dir: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
        "-m", "tests.integration.test_trainer_zero_resume", "--worker", phase, str(root),
        str(model_dir),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{phase}: " + proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kuberl.common.modelbuild import build_model

    root = tmp_path_factory.mktemp("zero-resume")
    model_dir = build_model(root / "model", tokenizer="digits", seed=3)
    _torchrun("first", root, model_dir)
    _torchrun("resume", root, model_dir)
    return root


def _run(root: Path, stage: int, phase: str):  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    result = json.loads((root / f"stage{stage}-{phase}.json").read_text())
    return result, load_file(str(root / f"stage{stage}-{phase}.safetensors"))


@pytest.mark.parametrize("stage", STAGES)
def test_a_zero_checkpoint_resumed_in_fresh_processes_takes_the_uninterrupted_next_step(
    root: Path, stage: int
) -> None:
    first, first_weights = _run(root, stage, "first")
    resumed, resumed_weights = _run(root, stage, "resume")
    worst = max((resumed_weights[k] - first_weights[k]).abs().max().item() for k in first_weights)
    assert first["moved"] > 1e-3  # the step after the checkpoint really changed the weights
    assert set(resumed_weights) == set(first_weights)
    assert (resumed["loss"], resumed["grad_norm"], resumed["lr"]) == pytest.approx(
        (first["loss"], first["grad_norm"], first["lr"]), rel=1e-6
    )
    assert worst < 1e-6, f"max weight difference {worst}"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
        from kuberl.trainer.distributed import leave

        leave(0)  # not the interpreter's exit: see `leave`
