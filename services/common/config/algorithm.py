"""The `trainer.algorithm` section: advantage estimator, policy loss, KL and TIS/MIS."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kuberl.common.config.base import Section

#: The advantage estimators and policy losses `kuberl.trainer.algorithms` registers under these
#: names; a job names one of them or a plugin, `package.module:function`.
BUILTIN_ADVANTAGES = ("grpo", "drgrpo", "rloo", "reinforce_pp", "gae")
BUILTIN_POLICY_LOSSES = ("ppo", "gspo", "decoupled_ppo")
PLUGIN_PATH = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$"


def _builtin_or_plugin_schema(builtins: tuple[str, ...]) -> dict[str, Any]:
    return {"anyOf": [{"enum": list(builtins)}, {"pattern": PLUGIN_PATH}]}


def _builtin_or_plugin(value: str, builtins: tuple[str, ...], kind: str) -> str:
    """`value` unchanged if it names a built-in or has a plugin path's shape (the trainer loads
    and checks plugins at start, where their modules are importable)."""
    if value in builtins or re.match(PLUGIN_PATH, value):
        return value
    raise ValueError(
        f"unknown {kind} {value!r}; expected one of {', '.join(builtins)}, or a plugin "
        "'package.module:function'"
    )


class KLConfig(Section):
    """KL to the frozen reference policy (Schulman's estimators, `kuberl.trainer.algorithms`)."""

    coef: float = Field(0.0, ge=0, description="0 disables the reference model.")
    estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="k1 = log(pi/pi_ref); k2 = (log(pi/pi_ref))^2 / 2; "
        "k3 = pi_ref/pi - 1 - log(pi_ref/pi) (unbiased and >= 0).",
    )
    offload_reference: bool = Field(
        False,
        description="Keep the frozen reference policy's weights in CPU memory between uses. "
        "With zero_stage 3 it is DeepSpeed's offload_param (each rank's partition lives in CPU "
        "memory; layers are fetched to the device for their forward); with stages 0-2 the whole "
        "reference moves to the device for each reference pass and back to CPU after it. Frees "
        "the reference's device memory for training at the price of a host-to-device copy per "
        "step; nothing changes on a CPU trainer.",
    )
    in_reward: bool = Field(
        False,
        description="Subtract coef * KL from the reward (per token for reinforce_pp and gae, "
        "summed over the response for grpo, drgrpo and rloo) instead of adding it to the loss.",
    )


class ImportanceConfig(Section):
    """Correction of the train-inference mismatch using the rollout engine's logprobs."""

    mode: Literal["none", "tis", "mis"] = Field(
        "tis",
        description="ratio = pi_train / pi_rollout per token. tis: weight each token's loss by "
        "min(ratio, cap), detached; mis: drop tokens (or sequences) whose ratio is outside "
        "[1/threshold, threshold]; none: no correction (the mismatch is still reported).",
    )
    cap: float = Field(2.0, gt=0, description="TIS: per-token weight min(ratio, cap).")
    threshold: float = Field(
        2.0,
        gt=1,
        description="MIS: drop tokens (or sequences) whose ratio exceeds this or is below its "
        "inverse.",
    )
    level: Literal["token", "sequence"] = Field(
        "token",
        description="sequence: one ratio per sequence, the geometric mean of its token ratios "
        "exp(mean log ratio), applied to all its tokens.",
    )


class DecoupledConfig(Section):
    """`decoupled_ppo`: AReaL's decoupled PPO objective (Fu et al. 2025, arXiv 2505.24298).

    loss = -w * min(r * A, clip(r) * A), r = pi / pi_prox, w = pi_prox / pi_behav (detached),
    where pi_prox is the trainer's policy at the start of the step and pi_behav the rollout
    engine's (possibly several versions older). The bounds below keep w's variance in check."""

    behaviour_cap: float | None = Field(
        5.0,
        gt=1,
        description="Bound on w = pi_prox / pi_behav (AReaL's behav_imp_weight_cap); null: none.",
    )
    cap_action: Literal["mask", "clamp"] = Field(
        "mask",
        description="mask: a token whose w exceeds behaviour_cap is left out of the gradient "
        "(it still counts in the loss normaliser), as AReaL does; clamp: w = min(w, cap), TIS.",
    )
    m2_threshold: float | None = Field(
        None,
        gt=0,
        description="M2PO (Zheng et al. 2025, arXiv 2510.01161), a staleness-aware bound: the "
        "tokens with the largest (log w)^2 are left out until the mean (log w)^2 of the rest is "
        "at most this (the paper uses 0.04); computed over each micro-batch. null: off.",
    )


class AlgorithmConfig(Section):
    """The RL algorithm: advantage estimator, policy loss, KL and mismatch correction.

    Read by `kuberl.trainer.algorithms` (see docs/algorithms.md for the formulas)."""

    advantage: str = Field(
        "grpo",
        description="A built-in estimator or a plugin `package.module:function` "
        "(docs/algorithms.md). grpo: (r - group mean) / (group std + eps); drgrpo: r - group "
        "mean (use loss_agg token_sum with loss_norm_tokens for its length-unbiased loss); "
        "rloo: r - mean of the other samples of the group; reinforce_pp: discounted token "
        "returns normalised over the batch; gae: PPO with a critic.",
        json_schema_extra=_builtin_or_plugin_schema(BUILTIN_ADVANTAGES),
    )
    normalize_std: bool = Field(True, description="GRPO: divide by the group's std.")
    std_eps: float = Field(
        1e-6, gt=0, description="Added to a std before dividing by it (grpo, reinforce_pp, gae)."
    )
    whiten_advantages: bool = Field(
        True, description="gae: normalise advantages to mean 0, std 1 over the batch's tokens."
    )
    policy_loss: str = Field(
        "ppo",
        description="A built-in loss or a plugin `package.module:function` "
        "(docs/algorithms.md). ppo: token-level clipped ratio; gspo: sequence-level ratio "
        "exp(mean token log-ratio), clipped per sequence (use small clips, e.g. 3e-4 / 4e-4); "
        "decoupled_ppo: AReaL's decoupled objective, ppo's ratio against the trainer's policy "
        "at the step's start times a bounded behaviour weight pi_prox / pi_rollout (see "
        "`decoupled`); it replaces importance, which it turns off unless set (then it must be "
        "none).",
        json_schema_extra=_builtin_or_plugin_schema(BUILTIN_POLICY_LOSSES),
    )
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0, description="> clip_low is DAPO clip-higher.")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip constant c (e.g. 3).")
    loss_agg: Literal["token_mean", "seq_mean", "token_sum"] = Field(
        "token_mean",
        description="token_mean: sum over tokens / number of tokens (DAPO); seq_mean: mean over "
        "sequences of each sequence's token mean (original GRPO); token_sum: sum over tokens / "
        "(number of sequences * loss_norm_tokens) (Dr.GRPO's constant normaliser).",
    )
    loss_norm_tokens: int | None = Field(
        None,
        ge=1,
        description="token_sum: the constant length normaliser (Dr.GRPO uses the generation "
        "budget, max_new_tokens); null uses the batch's padded length T.",
    )
    entropy_coef: float = 0.0
    value_clip: float | None = Field(
        0.2, gt=0, description="gae: clip the critic's new values to old +- this (null: off)."
    )
    kl: KLConfig = Field(default_factory=KLConfig)
    importance: ImportanceConfig = Field(default_factory=ImportanceConfig)
    decoupled: DecoupledConfig = Field(default_factory=DecoupledConfig)
    ppo_epochs: int = Field(1, ge=1)
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per batch and epoch.")
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    recompute_old_logprobs: bool = Field(
        False,
        description="Recompute old logprobs with the trainer (one forward pass without "
        "gradient per step). Off: with one update per batch the current logprobs are the old "
        "ones; with several (ppo_epochs * mini_batches > 1) the rollout engine's logprobs are "
        '("bypass": the PPO ratio is taken against the engine, and importance.mode must be '
        "none).",
    )

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, value: str) -> str:
        return _builtin_or_plugin(value, BUILTIN_ADVANTAGES, "advantage estimator")

    @field_validator("policy_loss")
    @classmethod
    def _known_policy_loss(cls, value: str) -> str:
        return _builtin_or_plugin(value, BUILTIN_POLICY_LOSSES, "policy loss")

    @model_validator(mode="after")
    def _decoupled_loss_owns_the_behaviour_weight(self) -> AlgorithmConfig:
        if self.policy_loss != "decoupled_ppo":
            return self
        if "importance" not in self.model_fields_set:
            self.importance = ImportanceConfig(mode="none")
        elif self.importance.mode != "none":
            raise ValueError(
                f"policy_loss decoupled_ppo weighs tokens by pi_prox / pi_rollout itself, and "
                f"importance.mode {self.importance.mode!r} would apply that correction a second "
                "time: set importance.mode: none (bound the weight with decoupled.behaviour_cap)"
            )
        updates = self.ppo_epochs * self.mini_batches
        if updates > 1 and not self.recompute_old_logprobs:
            raise ValueError(
                f"policy_loss decoupled_ppo needs pi_prox, the policy at the start of the step, "
                f"and with {updates} updates per batch (ppo_epochs * mini_batches) it is known "
                "only if recompute_old_logprobs is true. Set recompute_old_logprobs: true (one "
                "extra forward pass per step), or use one update per batch"
            )
        return self

    @model_validator(mode="after")
    def _importance_needs_old_logprobs(self) -> AlgorithmConfig:
        updates = self.ppo_epochs * self.mini_batches
        if self.importance.mode != "none" and updates > 1 and not self.recompute_old_logprobs:
            raise ValueError(
                f"importance.mode {self.importance.mode!r} weighs tokens by pi_old / pi_rollout, "
                f"and with {updates} updates per batch (ppo_epochs * mini_batches) pi_old is known "
                "only if recompute_old_logprobs is true. Set recompute_old_logprobs: true (one "
                "extra forward pass per step), or importance.mode: none (the PPO ratio is then "
                "taken against the rollout engine's logprobs, and its clip bounds the mismatch)"
            )
        return self
