"""The trainer with `model.lora` on two gloo ranks under ZeRO-2 and ZeRO-3, against PEFT itself.

One `torchrun --nproc-per-node 2` run of this module (`--worker`) builds the trainer's own parts
(`Models`, `RLStep`, `PolicyPublisher`, `Checkpointer`) for each stage in turn, with a KL
reference (`kl.coef` > 0), and:

- takes one GRPO step, gathering every parameter before and after it;
- computes the policy's and the reference's logprobs of a micro-batch;
- publishes the policy to a real weight-sync service (started here) and saves a checkpoint with
  the adapter and merged exports;
- takes a second step, then loads that checkpoint into fresh models (`resume`) and takes the same
  second step there;
- at ZeRO-3 (with activation checkpointing), takes a PPO step with GAE, whose critic has adapters
  of its own; at ZeRO-2, two steps of the SFT warm-up.

The test then checks against PEFT and plain transformers in this process: the policy's logprobs
are PeftModel's for the exported adapter, the reference's are the base model's, the step moved
adapters only, the published version is those adapters under the injected model's names, the
checkpoint holds no base weights, the merged export is PeftModel's merge, and the resumed step is
the uninterrupted one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import REPO, ServiceProcess

STAGES = (2, 3)
LORA = {"rank": 4, "alpha": 8, "export_merged": True}


def _job(root: Path, model_dir: Path, stage: int, sync: str, **trainer: Any):  # type: ignore[no-untyped-def]
    from kuberl.common.config import JobConfig

    return JobConfig.model_validate(
        {
            "model": {"path": str(model_dir), "lora": LORA},
            "rollout": {"group_size": 2},
            "endpoints": {"weight_sync": sync},
            "trainer": {
                "zero_stage": stage,
                # ZeRO-3 recomputes each layer in the backward (adapters inside checkpoints)
                "gradient_checkpointing": stage == 3,
                "micro_batch_tokens": 24,
                "resume": False,
                "checkpoint_dir": str(root / f"stage{stage}" / "ckpt"),
                "optimizer": {"lr": 1e-2, "eps": 1e-4, "warmup_steps": 3},
                "algorithm": {"kl": {"coef": 0.1}, "importance": {"mode": "none"}},
                **trainer,
            },
        }
    )


def _batch(seed: int):  # type: ignore[no-untyped-def]
    from kuberl.common.trajectory import Group, Trajectory
    from kuberl.trainer.batch import Batch
    from kuberl.trainer.sft import samples_from_groups

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(4):
        prompt = rng.integers(5, 20, size=3 + g)
        trajectories = [
            Trajectory(
                prompt,
                rng.integers(5, 20, size=2 + (g + i) % 4),
                np.full(2 + (g + i) % 4, -2.5, dtype=np.float32),
                prompt_id=f"p:{g}",
                sample_index=i,
                reward=float(i == g % 2),
            )
            for i in range(2)
        ]
        groups.append(Group(f"p:{g}", 0, trajectories))
    return Batch(samples=samples_from_groups(groups), groups=groups)


def _worker(root: Path, model_dir: Path, sync: str) -> None:
    import torch
    from safetensors.torch import save_file

    from kuberl.trainer import checkpoint as ckpt
    from kuberl.trainer.batching import collate
    from kuberl.trainer.checkpointer import Checkpointer
    from kuberl.trainer.distributed import barrier, init_distributed
    from kuberl.trainer.engine import iter_full_parameters
    from kuberl.trainer.models import Models
    from kuberl.trainer.publishing import PolicyPublisher
    from kuberl.trainer.rl import RLStep

    info = init_distributed()

    def build(config):  # type: ignore[no-untyped-def]
        models = Models()
        models.load_tokenizer(config, root)
        models.load(config, info)
        return models

    def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for bucket in iter_full_parameters(module, 1 << 20, info, "hf."):
            out.update(dict(bucket))
        return out

    for version, stage in enumerate(STAGES, start=1):
        out = root / f"stage{stage}"
        config = _job(root, model_dir, stage, sync)
        models = build(config)
        step = RLStep(config, models, info)
        before = weights(models.engine.module)
        metrics = step(_batch(1), step=0, policy_version=0)
        after = weights(models.engine.module)
        mb = collate(_batch(3).samples, models.pad_id, info.device)
        with torch.no_grad():
            policy_out = models.engine.forward(mb.input_ids, mb.attention_mask)[..., 0].contiguous()
        assert models.reference is not None
        reference_out = models.reference.forward(mb.input_ids, mb.attention_mask)[
            ..., 0
        ].contiguous()
        publisher = PolicyPublisher(config, models, info)
        if info.is_main:
            publisher.connect()
        publisher.publish(version)
        published = publisher.take_metrics()
        Checkpointer(config, info, models, root).save(ckpt.Cursor(step=1, policy_version=1), {})
        step(_batch(2), step=1, policy_version=1)
        uninterrupted = weights(models.engine.module)

        resumed_config = _job(root, model_dir, stage, sync, resume=True)
        resumed = build(resumed_config)
        Checkpointer(resumed_config, info, resumed, root).load_latest()
        RLStep(resumed_config, resumed, info)(_batch(2), step=1, policy_version=1)
        resumed_weights = weights(resumed.engine.module)
        if info.is_main:
            save_file(before, str(out / "before.safetensors"))
            save_file(after, str(out / "after.safetensors"))
            save_file(uninterrupted, str(out / "uninterrupted.safetensors"))
            save_file(resumed_weights, str(out / "resumed.safetensors"))
            save_file(
                {
                    "input_ids": mb.input_ids,
                    "attention_mask": mb.attention_mask,
                    "policy": policy_out,
                    "reference": reference_out,
                },
                str(out / "logprobs.safetensors"),
            )
            (out / "metrics.json").write_text(json.dumps({**metrics, **published}))
        barrier(info)
    _critic(root, model_dir, info, weights)
    _sft(root, model_dir, info, weights)
    barrier(info)


def _critic(root: Path, model_dir: Path, info, weights) -> None:  # type: ignore[no-untyped-def]
    """A PPO step with GAE at ZeRO-3: the critic's own adapters and its value head train."""
    from safetensors.torch import save_file

    from kuberl.trainer.models import Models
    from kuberl.trainer.rl import RLStep

    algorithm = {"advantage": "gae", "importance": {"mode": "none"}}
    config = _job(root, model_dir, 3, "", publish_weights=False, algorithm=algorithm)
    models = Models()
    models.load_tokenizer(config, root)
    models.load(config, info)
    assert models.critic is not None
    before = weights(models.critic.module)
    step = RLStep(config, models, info)
    # Two steps: the value head starts at zero, so the first sends no gradient into the body.
    step(_batch(1), step=0, policy_version=0)
    step(_batch(2), step=1, policy_version=1)
    after = weights(models.critic.module)
    if info.is_main:
        save_file(before, str(root / "critic-before.safetensors"))
        save_file(after, str(root / "critic-after.safetensors"))


def _sft(root: Path, model_dir: Path, info, weights) -> None:  # type: ignore[no-untyped-def]
    """Two steps of the SFT warm-up (`sft_steps`) at ZeRO-2 on the LoRA policy."""
    from safetensors.torch import save_file

    from kuberl.trainer.models import Models
    from kuberl.trainer.sft import SFTStep

    config = _job(root, model_dir, 2, "", publish_weights=False)
    models = Models()
    models.load_tokenizer(config, root)
    models.load(config, info)
    before = weights(models.engine.module)
    step = SFTStep(config, models, info)
    step(_batch(1))
    step(_batch(2))
    after = weights(models.engine.module)
    if info.is_main:
        save_file(before, str(root / "sft-before.safetensors"))
        save_file(after, str(root / "sft-after.safetensors"))


# ---------------------------------------------------------------- the test process


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from kuberl.common.modelbuild import build_model
    from tests.integration.test_weight_sync import _service

    root = tmp_path_factory.mktemp("lora")
    model_dir = build_model(root / "model", tokenizer="digits", seed=3)
    (root / "weight-sync").mkdir()
    services = _service(root / "weight-sync", ["snapshot"])
    sync: ServiceProcess = next(services)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
        "-m", "tests.integration.test_trainer_lora", "--worker", str(root), str(model_dir),
        sync.address,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    yield root, model_dir, sync
    next(services, None)


def _load(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _adapter_names(names) -> set[str]:  # type: ignore[no-untyped-def]
    from kuberl.common.lora import is_adapter_tensor

    return {n for n in names if is_adapter_tensor(n)}


def _logprobs(model, ids, mask):  # type: ignore[no-untyped-def]
    """log_softmax of each next token [B, T-1] from a plain forward pass."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def _close(a, b, mask) -> float:  # type: ignore[no-untyped-def]
    """The largest difference of [B, T-1] logprobs at real (unpadded) next tokens."""
    real = mask[:, 1:].bool()
    return float((a - b).abs()[real].max())


def _checkpoint(root: Path, stage: int) -> Path:
    ckpt = root / f"stage{stage}" / "ckpt"
    return ckpt / (ckpt / "latest").read_text().strip()


@pytest.mark.parametrize("stage", STAGES)
def test_a_lora_step_moves_only_adapter_tensors(run, stage: int) -> None:  # type: ignore[no-untyped-def]
    root, _, _ = run
    before = _load(root / f"stage{stage}" / "before.safetensors")
    after = _load(root / f"stage{stage}" / "after.safetensors")
    moved = {n for n in before if not (before[n] == after[n]).all()}
    adapters = _adapter_names(before)
    # Fresh adapters have B = 0, so A gets no gradient in the first step; every B moves.
    assert {n for n in adapters if "lora_B" in n} <= moved <= adapters


@pytest.mark.parametrize("stage", STAGES)
def test_the_policys_logprobs_are_peft_models_for_the_exported_adapter(run, stage: int) -> None:  # type: ignore[no-untyped-def]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, model_dir, _ = run
    lp = _load(root / f"stage{stage}" / "logprobs.safetensors")
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    peft = PeftModel.from_pretrained(base, _checkpoint(root, stage) / "adapter").eval()
    expected = _logprobs(peft, lp["input_ids"], lp["attention_mask"])
    assert _close(lp["policy"], expected, lp["attention_mask"]) < 1e-4
    # the adapters really act: the base model's logprobs are not these
    plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert (
        _close(
            lp["policy"],
            _logprobs(plain, lp["input_ids"], lp["attention_mask"]),
            lp["attention_mask"],
        )
        > 1e-3
    )


@pytest.mark.parametrize("stage", STAGES)
def test_the_kl_reference_is_the_base_model(run, stage: int) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    root, model_dir, _ = run
    lp = _load(root / f"stage{stage}" / "logprobs.safetensors")
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    expected = _logprobs(base, lp["input_ids"], lp["attention_mask"])
    assert _close(lp["reference"], expected, lp["attention_mask"]) < 1e-4


def test_a_published_version_is_the_adapters_under_the_injected_names(run) -> None:  # type: ignore[no-untyped-def]
    import torch

    from kuberl.common.weights import download_snapshot

    root, _, sync = run
    version, manifest, flat = download_snapshot(sync.address)
    published = manifest.views(flat)
    after = _load(root / "stage3" / "after.safetensors")
    metrics = json.loads((root / "stage3" / "metrics.json").read_text())
    assert version == 2 and set(published) == _adapter_names(after)
    assert "model.layers.0.self_attn.q_proj.lora_A.default.weight" in published
    assert all(torch.equal(published[n], after[n]) for n in published)
    full = sum(t.numel() * t.element_size() for t in after.values())
    assert metrics["publish/bytes"] == sum(t.numel() * t.element_size() for t in published.values())
    assert metrics["publish/bytes"] < 0.1 * full


@pytest.mark.parametrize("stage", STAGES)
def test_a_checkpoint_holds_no_base_weights(run, stage: int) -> None:  # type: ignore[no-untyped-def]
    root, model_dir, _ = run
    saved = sum(
        f.stat().st_size for f in (_checkpoint(root, stage) / "policy").rglob("*") if f.is_file()
    )
    model_bytes = (model_dir / "model.safetensors").stat().st_size
    assert saved < 0.5 * model_bytes


@pytest.mark.parametrize("stage", STAGES)
def test_a_resumed_checkpoint_takes_the_uninterrupted_next_step(run, stage: int) -> None:  # type: ignore[no-untyped-def]
    root, _, _ = run
    first = _load(root / f"stage{stage}" / "uninterrupted.safetensors")
    resumed = _load(root / f"stage{stage}" / "resumed.safetensors")
    after = _load(root / f"stage{stage}" / "after.safetensors")
    adapters = _adapter_names(first)
    worst = max((first[n] - resumed[n]).abs().max().item() for n in adapters)
    moved = max((first[n] - after[n]).abs().max().item() for n in adapters)
    assert moved > 1e-3 and worst < 1e-5


def test_the_merged_export_is_peft_models_merge(run) -> None:  # type: ignore[no-untyped-def]
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, model_dir, _ = run
    path = _checkpoint(root, 3)
    lp = _load(root / "stage3" / "logprobs.safetensors")
    merged = AutoModelForCausalLM.from_pretrained(path / "merged").eval()
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir), path / "adapter"
    )
    ours = merged.state_dict()
    theirs = peft.merge_and_unload().state_dict()
    assert set(ours) == set(theirs)
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-6
    assert (path / "merged" / "tokenizer_config.json").exists()
    assert (
        _close(
            lp["policy"],
            _logprobs(merged, lp["input_ids"], lp["attention_mask"]),
            lp["attention_mask"],
        )
        < 1e-4
    )
    assert not torch.equal(
        ours["model.layers.0.mlp.up_proj.weight"],
        AutoModelForCausalLM.from_pretrained(model_dir).state_dict()[
            "model.layers.0.mlp.up_proj.weight"
        ],
    )


def test_the_sft_warm_up_trains_the_adapters_only(run) -> None:  # type: ignore[no-untyped-def]
    root, _, _ = run
    before = _load(root / "sft-before.safetensors")
    after = _load(root / "sft-after.safetensors")
    moved = {n for n in before if not (before[n] == after[n]).all()}
    assert moved == _adapter_names(before)  # the second step moves the A matrices too


def test_a_gae_critic_trains_its_own_adapters_and_value_head(run) -> None:  # type: ignore[no-untyped-def]
    root, _, _ = run
    before = _load(root / "critic-before.safetensors")
    after = _load(root / "critic-after.safetensors")
    moved = {n for n in before if not (before[n] == after[n]).all()}
    adapters = _adapter_names(before)
    head = {"value_head.weight", "value_head.bias"}
    assert head | {n for n in adapters if "lora_B" in n} <= moved <= adapters | head


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
