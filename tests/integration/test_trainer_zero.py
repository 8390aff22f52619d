"""DeepSpeed ZeRO 1, 2 and 3 on CPU with two gloo processes take the same step as plain torch.

One `torchrun --nproc-per-node 2` run (this module with `--worker`) builds a DeepSpeed engine for
each stage in turn, in the same two processes to pay DeepSpeed's start-up once, and takes one
optimizer step of the trainer's SFT loss over the same eight sequences: each rank gets half of
them, split into micro-batches by a small token budget (so gradient accumulation and the padding
micro-batches that keep ranks in lock-step both run). The same step runs again with
`trainer.gradient_checkpointing` on (whole layers, and selective) under ZeRO-2 and ZeRO-3, and
with selective checkpointing inside compiled decoder layers (`compile_model`) under ZeRO-2. The
test then takes the step in plain torch on one process from full logits, and compares the loss,
the gradient norm and every updated weight (gathered bucket by bucket from the ZeRO-3
partitions).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import REPO

STAGES = (1, 2, 3)
# (stage, trainer.gradient_checkpointing, trainer.compile_model) of further runs of the same step
VARIANTS = (
    (2, "selective", False),
    (3, "selective", False),
    (3, True, False),
    (2, "selective", True),
)
LR = 1e-2
# Adam's first update is about lr * sign(g) where |g| >> eps: a gradient element near zero could
# flip with summation order. A larger eps makes the update smooth in g, so weights can be compared.
EPS = 1e-4
BUDGET = 24
GATHER_BUCKET = 64 * 1024  # bytes per weight-export bucket


def _samples():  # type: ignore[no-untyped-def]
    from kuberl.trainer.batching import TrainingSequence

    rng = np.random.default_rng(0)
    return [
        TrainingSequence(
            prompt_ids=rng.integers(5, 90, size=3 + i % 4),
            response_ids=rng.integers(5, 90, size=2 + (i * 3) % 7),
            loss_mask=np.ones(2 + (i * 3) % 7, dtype=np.float32),
            index=i,
        )
        for i in range(8)
    ]


def _worker(
    out_dir: Path, model_dir: Path, stages: tuple[int, ...] = STAGES, extras: bool = True
) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch._dynamo.utils import counters

    from kuberl.common.config import TrainerConfig
    from kuberl.trainer.batching import collate, micro_batches, shard
    from kuberl.trainer.distributed import all_reduce_max, init_distributed
    from kuberl.trainer.engine import (
        TrainEngine,
        build_policy,
        enable_activation_checkpointing,
        iter_full_parameters,
        load_causal_lm,
        run_micro_batches,
    )
    from kuberl.trainer.sft import sft_loss_fn

    info = init_distributed()
    samples = _samples()
    total = sum(int(s.loss_mask.sum()) for s in samples)
    runs: list[tuple[int, bool | str, bool]] = [(stage, False, False) for stage in stages]
    if extras:
        runs += VARIANTS
    for stage, checkpointing, compiled in runs:
        cfg = TrainerConfig(
            zero_stage=stage,
            micro_batch_tokens=BUDGET,
            gradient_checkpointing=checkpointing,
            compile_model=compiled,
            optimizer={"lr": LR, "eps": EPS, "grad_clip": 1.0},
        )
        hf = load_causal_lm(model_dir, torch.float32)
        enable_activation_checkpointing(hf, checkpointing)
        # Layer 0's MLP runs once per micro-batch, and again in the backward when checkpointed
        # (inside the layer's checkpointed forward; hooks on the layer itself run outside it).
        # Not in compiled layers: a hook's side effect would make dynamo run the layer eager.
        layer_calls = [0]
        if not compiled:
            hf.get_decoder().layers[0].mlp.register_forward_pre_hook(
                lambda *_, calls=layer_calls: calls.__setitem__(0, calls[0] + 1)
            )
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        engine = TrainEngine(build_policy(hf, cfg), cfg, info, torch.float32)
        mine = shard(samples, info.rank, info.world_size)
        mbs = [collate(g, 0, info.device) for g in micro_batches(mine, BUDGET)]
        grad_norm, records = run_micro_batches(
            engine, mbs, sft_loss_fn(total, info.world_size), pad_id=0
        )
        compiled_frames = counters["stats"]["unique_graphs"] - graphs
        graph_breaks = sum(counters["graph_break"].values()) - breaks
        loss = torch.tensor([sum(m["loss_share"] for m, _ in records)])
        dist.all_reduce(loss)
        run_count = all_reduce_max(len(mbs), info)  # padding micro-batches included
        weights = {}
        with _watch_gathers(engine.module) as gathered:
            for bucket in iter_full_parameters(engine.module, GATHER_BUCKET, info, "hf."):
                weights.update(dict(bucket))
        if info.is_main:
            name = _run_name(stage, checkpointing, compiled)
            save_file(weights, str(out_dir / f"{name}.safetensors"))
            result = {"loss": loss.item(), "grad_norm": grad_norm, "micro_batches": len(mbs)}
            result["world_size"] = info.world_size
            result["gathered"] = gathered
            result["mlp0_forwards"] = layer_calls[0]
            result["micro_batches_run"] = run_count
            result["compiled_frames"] = compiled_frames
            result["graph_breaks"] = graph_breaks
            (out_dir / f"{name}.json").write_text(json.dumps(result))
    if extras:
        _ppo_with_critic(out_dir, model_dir)
        _reference(out_dir, model_dir, info)


def _run_name(stage: int, checkpointing: bool | str, compiled: bool) -> str:
    suffix = {False: "", True: "-checkpointed", "selective": "-selective"}[checkpointing]
    return f"stage{stage}{suffix}{'-compiled' if compiled else ''}"


def _reference(out_dir: Path, model_dir: Path, info) -> None:  # type: ignore[no-untyped-def]
    """The frozen KL reference under ZeRO-3, in device memory and offloaded to CPU memory
    (DeepSpeed's offload_param), each forward over the same micro-batch on both ranks."""
    import torch
    from safetensors.torch import save_file

    from kuberl.common.config import TrainerConfig
    from kuberl.trainer.batching import collate
    from kuberl.trainer.engine import FrozenModel, PolicyModel, load_causal_lm

    mb = collate(_samples(), 0, info.device)
    outputs, offloaded = {}, {}
    for offload in (False, True):
        ref = FrozenModel(
            PolicyModel(load_causal_lm(model_dir, torch.float32)),
            TrainerConfig(zero_stage=3),
            info,
            torch.float32,
            offload=offload,
        )
        with ref.resident():
            outputs[f"offload{int(offload)}"] = ref.forward(mb.input_ids, mb.attention_mask)
        offloaded[str(offload)] = bool(ref.engine.zero_offload_param())
        partitions = {p.ds_tensor.device.type for p in ref.module.parameters()}
        offloaded[f"{offload}-partitions"] = sorted(partitions)
    if info.is_main:
        save_file(outputs, str(out_dir / "reference.safetensors"))
        (out_dir / "reference.json").write_text(json.dumps(offloaded))


@contextlib.contextmanager
def _watch_gathers(module):  # type: ignore[no-untyped-def]
    """Record, at every ZeRO-3 gather the weight export opens, how many bytes of the module's
    parameters are gathered (whole) at that moment, whoever asked for them."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    real = deepspeed.zero.GatheredParameters
    record: dict[str, Any] = {"calls": 0, "max_bytes": 0, "model_bytes": 0, "largest": 0}
    params = list(module.parameters())
    for p in params:
        nbytes = int(getattr(p, "ds_numel", p.numel())) * p.element_size()
        record["model_bytes"] += nbytes
        record["largest"] = max(record["largest"], nbytes)

    class Watched:
        def __init__(self, *args: Any, **kw: Any) -> None:
            self.inner = real(*args, **kw)

        def __enter__(self) -> Any:
            out = self.inner.__enter__()
            whole = [
                p for p in params if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE
            ]
            record["calls"] += 1
            record["max_bytes"] = max(
                record["max_bytes"], sum(p.ds_numel * p.element_size() for p in whole)
            )
            return out

        def __exit__(self, *exc: Any) -> Any:
            return self.inner.__exit__(*exc)

    deepspeed.zero.GatheredParameters = Watched
    try:
        yield record
    finally:
        deepspeed.zero.GatheredParameters = real


def _ppo_with_critic(out_dir: Path, model_dir: Path) -> None:
    """One PPO step with GAE from a critic (its own ZeRO-3 engine) through the trainer's own
    step function, on a batch of two groups."""
    from kuberl.common.config import JobConfig
    from kuberl.common.trajectory import Group, Trajectory
    from kuberl.trainer.batch import Batch
    from kuberl.trainer.distributed import init_distributed
    from kuberl.trainer.loop import Trainer
    from kuberl.trainer.sft import samples_from_groups

    config = JobConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"group_size": 2},
            "trainer": {
                "zero_stage": 3,
                "micro_batch_tokens": 24,
                "publish_weights": False,
                "resume": False,
                "checkpoint_dir": str(out_dir / "ppo-ckpt"),
                "algorithm": {
                    "advantage": "gae",
                    "gamma": 0.99,
                    "lam": 0.95,
                    "ppo_epochs": 2,
                    "importance": {"mode": "none"},  # bypass: old logprobs are the rollout's
                },
            },
        }
    )
    trainer = Trainer(config, init_distributed(), out_dir)
    trainer.setup()
    groups = []
    for g, s in enumerate(_samples()[:4]):
        trajectories = [
            Trajectory(
                s.prompt_ids,
                s.response_ids[i:],
                np.full(len(s.response_ids) - i, -4.0, dtype=np.float32),
                prompt_id=f"p:{g}",
                sample_index=i,
                reward=float(i == g % 2),
            )
            for i in range(2)
        ]
        groups.append(Group(f"p:{g}", 0, trajectories))
    batch = Batch(samples=samples_from_groups(groups), groups=groups)
    metrics = trainer.rl_step(batch, step=0, policy_version=0)
    if trainer.dist.is_main:
        (out_dir / "ppo.json").write_text(json.dumps(metrics))


def _plain_torch_step(model_dir: Path) -> tuple[float, float, dict, float]:  # type: ignore[type-arg]
    import torch

    from kuberl.trainer.batching import collate
    from kuberl.trainer.engine import load_causal_lm
    from kuberl.trainer.logprobs import full_logprobs_and_entropy

    model = load_causal_lm(model_dir, torch.float32)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    samples = _samples()
    mb = collate(samples, 0, torch.device("cpu"))
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
    logprobs, _ = full_logprobs_and_entropy(logits, mb.input_ids[:, 1:])
    loss = -(mb.to_response(logprobs) * mb.mask).sum() / mb.mask.sum()
    loss.backward()
    loss = loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        eps=EPS,
        foreach=False,
    )
    opt.step()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moved = max((weights[k] - initial[k]).abs().max().item() for k in weights)
    return float(loss), float(grad_norm), weights, moved


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from kuberl.common.modelbuild import build_model

    root = tmp_path_factory.mktemp("zero")
    model_dir = build_model(root / "model", tokenizer="digits", seed=3)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "-m",
        "tests.integration.test_trainer_zero",
        "--worker",
        str(root),
        str(model_dir),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, _plain_torch_step(model_dir)


def test_ppo_with_gae_and_a_critic_steps_both_models_on_two_zero3_ranks(runs) -> None:  # type: ignore[no-untyped-def]
    root, _ = runs
    m = json.loads((root / "ppo.json").read_text())
    assert np.isfinite([m["loss/policy"], m["loss/value"], m["value/explained_variance"]]).all()
    assert m["grad_norm"] > 0 and m["value/grad_norm"] > 0
    # the critic starts at V = 0 and regresses towards the (non-zero) returns
    assert m["loss/value"] > 0 and m["value/returns_mean"] != 0.0


@pytest.mark.parametrize(
    ("stage", "checkpointing", "compiled"), [(s, False, False) for s in STAGES] + list(VARIANTS)
)
def test_zero_stage_step_on_two_gloo_ranks_matches_plain_torch(  # type: ignore[no-untyped-def]
    runs, stage: int, checkpointing: bool | str, compiled: bool
) -> None:
    from safetensors.torch import load_file

    root, (ref_loss, ref_norm, ref_weights, moved) = runs
    name = _run_name(stage, checkpointing, compiled)
    result = json.loads((root / f"{name}.json").read_text())
    weights = load_file(str(root / f"{name}.safetensors"))
    worst = max(
        (weights[k] - ref_weights[k]).abs().max().item() for k in weights if k in ref_weights
    )
    assert result["micro_batches"] >= 2  # accumulation ran
    # Each micro-batch's layers (padding ones included) ran forward once, and once more in the
    # backward when checkpointed.
    if compiled:  # dynamo compiled the layers (checkpoint included), nothing fell back to eager
        assert result["compiled_frames"] > 0 and result["graph_breaks"] == 0, result
    else:
        assert result["compiled_frames"] == 0
        ran = result["micro_batches_run"]
        assert result["mlp0_forwards"] == ran * (2 if checkpointing else 1)
    assert result["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert result["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    assert set(weights) <= set(ref_weights)
    assert moved > 1e-3  # the step really changed the weights (lr 1e-2)
    assert worst < 1e-5, f"max weight difference {worst}"


def test_a_zero3_reference_offloaded_to_cpu_memory_gives_the_plain_models_logprobs(runs) -> None:  # type: ignore[no-untyped-def]
    import torch
    from safetensors.torch import load_file

    from kuberl.trainer.batching import collate
    from kuberl.trainer.engine import PolicyModel, load_causal_lm

    root, _ = runs
    model = PolicyModel(load_causal_lm(root / "model", torch.float32))
    mb = collate(_samples(), 0, torch.device("cpu"))
    with torch.no_grad():
        expected = model(mb.input_ids, mb.attention_mask)
    got = load_file(str(root / "reference.safetensors"))
    # DeepSpeed took the offload config (on CPU the partitions are in host memory either way).
    assert json.loads((root / "reference.json").read_text()) == {
        "False": False,
        "True": True,
        "False-partitions": ["cpu"],
        "True-partitions": ["cpu"],
    }
    valid = mb.attention_mask[:, 1:].bool()
    for name in ("offload0", "offload1"):
        torch.testing.assert_close(got[name][valid], expected[valid], rtol=1e-5, atol=1e-5)


def test_zero3_weight_export_gathers_one_bucket_at_a_time_never_the_whole_model(runs) -> None:  # type: ignore[no-untyped-def]
    root, _ = runs
    g = json.loads((root / "stage3.json").read_text())["gathered"]
    # Each gather holds at most one bucket (or one tensor larger than a bucket), never the model.
    assert g["calls"] > 5 and g["max_bytes"] > 0
    assert g["max_bytes"] <= max(GATHER_BUCKET, g["largest"]) < g["model_bytes"], g


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        # --worker OUT MODEL [STAGE]: every stage and the extras, or one stage's step alone.
        only = tuple(int(a) for a in sys.argv[4:5])
        _worker(Path(sys.argv[2]), Path(sys.argv[3]), only or STAGES, extras=not only)
        from kuberl.trainer.distributed import leave

        leave(0)  # not the interpreter's exit: see `leave`
