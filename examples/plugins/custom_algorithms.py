"""Example algorithm plugins: an advantage estimator and a policy loss a job names by path.

examples/custom-algorithms.yaml trains with both:

    trainer:
      algorithm:
        advantage: examples.plugins.custom_algorithms:fixed_baseline_advantages
        policy_loss: examples.plugins.custom_algorithms:cispo_loss

The trainer imports this module (it must be importable where the trainer runs: here from the
repository root) and checks each function's signature at start. The contracts, with the shapes,
are `AdvantageEstimator` and `PolicyLoss` in `kuberl.trainer.algorithms`; docs/algorithms.md
walks through them.
"""

from __future__ import annotations

from torch import Tensor

from kuberl.common.config import AlgorithmConfig
from kuberl.trainer.algorithms import AdvantageInputs, PolicyLossInputs

#: REINFORCE's baseline for rewards in [0, 1]: the middle of the range.
BASELINE = 0.5


def fixed_baseline_advantages(
    inputs: AdvantageInputs, config: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """REINFORCE with a constant baseline: A = r - BASELINE on every response token.

    Unlike GRPO it needs no group (any group_size) and keeps a signal when every sample of a
    group scored the same. Returns (advantages, returns), both [B, T]."""
    advantages = (inputs.rewards - BASELINE)[:, None].expand_as(inputs.mask)  # [B, T]
    returns = inputs.rewards[:, None].expand_as(inputs.mask)  # [B, T]
    return advantages, returns


def cispo_loss(
    inputs: PolicyLossInputs, config: AlgorithmConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): clip the importance weight, not the update.

    loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * log pi(a_t), r_t = pi / pi_old:
    every token keeps its gradient (PPO's clip zeroes it for clipped tokens), only its weight is
    bounded. Returns the per-token loss [B, T] and per-token stats [B, T]; `cispo_weight` is
    reported by the trainer as the metric policy/cispo_weight."""
    log_ratio = (inputs.logprobs - inputs.old_logprobs).detach().clamp(-20.0, 20.0)  # [B, T]
    ratio = log_ratio.exp()  # [B, T]
    weight = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)  # [B, T], no gradient
    loss = -weight * inputs.advantages * inputs.logprobs  # [B, T]
    return loss, {
        "ratio": ratio,
        "clipped": weight != ratio,
        "cispo_weight": weight,
    }
