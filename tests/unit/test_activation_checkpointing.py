"""`trainer.gradient_checkpointing` (`engine.enable_activation_checkpointing`): whole layers or
selective checkpointing give the same outputs and gradients as none, and keep less activation
memory for the backward, selective between the two (tensor bytes counted by torch's
MemTracker, so the figures do not depend on the allocator)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kuberl.common.config import ConfigError, parse_job_config


def _policy(path: Path, mode: bool | str) -> Any:
    from kuberl.trainer.engine import PolicyModel, enable_activation_checkpointing, load_causal_lm

    hf = load_causal_lm(path, torch.float32)
    enable_activation_checkpointing(hf, mode)
    policy = PolicyModel(hf, chunk_size=64)
    policy.train()
    return policy


def test_selective_and_whole_layer_checkpointing_keep_the_numbers_and_less_memory(
    tmp_path: Path,
) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    from kuberl.common.modelbuild import build_model

    path = build_model(tmp_path / "m", tokenizer="digits", seed=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 90, (2, 256), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 200:] = 0  # one right-padded row
    weights = torch.randn(2, 255, 2, generator=g)
    results, activations = {}, {}
    for mode in (False, True, "selective"):
        policy = _policy(path, mode)
        tracker = MemTracker()
        tracker.track_external(policy)
        with tracker:
            out = policy(ids, mask)
            (out * weights).sum().backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        activations[mode] = next(v for k, v in peak.items() if str(k).endswith("ACT"))
        results[mode] = [out.detach()] + [p.grad.clone() for p in policy.parameters()]
    for mode in (True, "selective"):
        for none, checkpointed in zip(results[False], results[mode], strict=True):
            assert torch.allclose(none, checkpointed, rtol=1e-5, atol=1e-6)
    # Whole layers keep only each layer's input; selective also the products' outputs.
    assert activations[True] < activations["selective"] < 0.8 * activations[False], activations


def test_the_option_takes_true_false_or_selective_and_names_them_otherwise() -> None:
    for value in (True, False, "selective"):
        config = parse_job_config({"trainer": {"gradient_checkpointing": value}}, env={})
        assert config.trainer.gradient_checkpointing == value
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        parse_job_config({"trainer": {"gradient_checkpointing": "partial"}}, env={})
