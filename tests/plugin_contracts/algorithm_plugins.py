"""Plugins for the contract tests: right and wrong signatures, loaded by path."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from kuberl.common.config import AlgorithmConfig
from kuberl.trainer.algorithms import AdvantageInputs, PolicyLossInputs


def constant_advantages(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """A = 0.25 everywhere; returns = the sequence reward."""
    ones = inputs.mask.to(inputs.rewards.dtype)  # [B, T]
    return 0.25 * ones, inputs.rewards[:, None] * ones


def vanilla_pg_loss(
    inputs: PolicyLossInputs, config: AlgorithmConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """-A * log pi, and one extra per-token stat."""
    return -inputs.advantages * inputs.logprobs, {"marker": inputs.mask.float() * 3.0}


def one_argument(inputs: Any) -> Any:
    return inputs


NOT_CALLABLE = 3
