"""The RL algorithms of the trainer as pure tensor functions: advantages (GRPO, Dr.GRPO, RLOO,
REINFORCE++, PPO with GAE), policy and value losses (PPO clip with clip-higher and dual-clip, GSPO,
AReaL's decoupled PPO for stale data), KL to the reference policy (k1/k2/k3) and the
train-inference mismatch correction (TIS/MIS).

Advantage estimators and policy losses are extension points: each is a function registered under
a name (`@register_advantage("grpo")`, `@register_policy_loss("ppo")`), and a job names one in
`trainer.algorithm.advantage` / `policy_loss`, or a plugin `package.module:function` with the same
contract (`AdvantageEstimator`, `PolicyLoss`; docs/algorithms.md shows one). The training loop
calls three functions per batch; everything else here is their building blocks, each usable and
tested on its own (no I/O, shapes beside each line that changes them):

    advantages, returns = compute_advantages(
        config, rewards, mask, group_size, values=None, old_logprobs=None, ref_logprobs=None)
    loss, metrics = policy_loss_and_metrics(
        config, logprobs, old_logprobs, rollout_logprobs, advantages, mask,
        ref_logprobs=None, entropy=None, global_count=None)
    value_loss, value_metrics = value_loss_and_metrics(     # the critic, when the estimator has one
        config, values, old_values, returns, mask, global_count=None)

`config` is `kuberl.common.config.AlgorithmConfig`. Shapes: B sequences, T the padded response
length. `rewards` is `[B]` (one scalar per sequence) and the batch holds whole groups: rows
`g * group_size ... (g + 1) * group_size - 1` are the samples of prompt g. Every `[B, T]` tensor
is right-padded and `mask` is 1 (or True) on the policy's own response tokens and 0 on padding and
on tokens the policy did not choose (tool output in multi-turn); values at mask 0 are never read,
so padding may hold anything, even NaN. Log-probabilities are of the sampled tokens.

- `old_logprobs` is the trainer's log-probability under the policy that generated the batch. Pass
  the recomputed ones (`recompute_old_logprobs`), or None when the batch gets exactly one optimizer
  step: then the current `logprobs` are the old ones (detached), which is on-policy and free. With
  several updates per batch and no recomputation, pass `rollout_logprobs` as `old_logprobs`
  ("bypass": the PPO ratio is then against the engine itself and TIS/MIS see no mismatch).
- `global_count` makes gradient accumulation exact: the number of tokens (`token_mean`) or
  sequences (`seq_mean`, `token_sum`) in the whole optimizer step, so that the losses of its
  micro-batches add up to the loss of the whole batch. None uses this batch's own count.
- `metrics` is a flat `dict[str, float]` (one device sync): loss terms, clip fractions, ratio
  stats, approximate KL to the old policy, entropy, KL to the reference, advantage stats and the
  mismatch figures `mismatch/*` (always reported, whatever the correction mode).

GAE is parallel over time and exact: see `compute_gae` and `discounted_suffix_sum`.
docs/algorithms.md has the formulas, the conventions and measured speed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kuberl.common.config import AlgorithmConfig
from kuberl.common.plugins import Registry

# exp() of a log-ratio beyond this would overflow fp32 (and bf16) or give inf*0 = NaN gradients.
LOG_RATIO_LIMIT = 20.0

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageEstimator",
    "AdvantageInputs",
    "Algorithm",
    "PolicyLoss",
    "PolicyLossInputs",
    "aggregate_loss",
    "compute_advantages",
    "compute_gae",
    "decoupled_ppo_policy_loss",
    "discounted_returns",
    "discounted_suffix_sum",
    "drgrpo_advantages",
    "grpo_advantages",
    "gspo_policy_loss",
    "importance_weights",
    "kl_estimate",
    "masked_mean",
    "masked_whiten",
    "mismatch_metrics",
    "policy_loss_and_metrics",
    "ppo_policy_loss",
    "register_advantage",
    "register_policy_loss",
    "reinforce_pp_advantages",
    "resolve_algorithm",
    "rloo_advantages",
    "second_moment_mask",
    "token_level_rewards",
    "value_loss_and_metrics",
]


# ----------------------------------------------------------------- masked reductions


def _valid(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _check_same_shape(mask: Tensor, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but mask has {tuple(mask.shape)}; every "
                "per-token tensor must be [B, T] like mask"
            )


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of x where mask is set (x elsewhere may be anything, even NaN)."""
    zeroed = torch.where(_valid(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return zeroed.sum() if dim is None else zeroed.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x where mask is set; 0 where nothing is set."""
    count = _valid(mask).sum() if dim is None else _valid(mask).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """(x - mean) / (std + eps) over the masked elements (unbiased std); 0 elsewhere."""
    valid = _valid(mask)
    mean = masked_mean(x, valid)  # []
    centered = torch.where(valid, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))
    var = (centered**2).sum() / (valid.sum() - 1).clamp_min(1)  # []
    return centered / (var.sqrt() + eps)  # [B, T]


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    mode: str,
    global_count: float | None = None,
    norm_tokens: int | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    token_mean: sum / tokens (DAPO). seq_mean: mean over sequences of each sequence's token mean
    (original GRPO, GSPO). token_sum: sum / (sequences * norm_tokens), Dr.GRPO's constant
    normaliser (norm_tokens defaults to T). `global_count` replaces the token (token_mean) or
    sequence (seq_mean, token_sum) count, for gradient accumulation over micro-batches.
    """
    valid = _valid(mask)
    if mode == "token_mean":
        count = valid.sum().clamp_min(1) if global_count is None else global_count
        return masked_sum(loss, valid) / count
    if mode == "seq_mean":
        seq_loss = masked_sum(loss, valid, dim=-1) / valid.sum(-1).clamp_min(1)  # [B]
        return seq_loss.sum() / (loss.shape[0] if global_count is None else global_count)
    if mode == "token_sum":
        n_seqs = loss.shape[0] if global_count is None else global_count
        return masked_sum(loss, valid) / (n_seqs * (norm_tokens or loss.shape[-1]))
    raise ValueError(
        f"unknown loss aggregation {mode!r}; expected token_mean, seq_mean or token_sum"
    )


# ----------------------------------------------------------------- extension points


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator sees of one batch (B sequences, T the padded response length).

    The batch holds whole groups: rows g * group_size ... (g + 1) * group_size - 1 are the
    samples of prompt g. With `kl.in_reward` both reward forms already include the KL penalty.
    """

    rewards: Tensor  # [B] each sequence's reward (less kl.coef * its summed KL)
    token_rewards: (
        Tensor  # [B, T] the reward on each row's last token (less kl.coef * KL per token)
    )
    mask: Tensor  # [B, T] bool: the policy's own response tokens
    group_size: int
    values: Tensor | None  # [B, T] the critic's V(s_t); only for estimators with needs_critic


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a policy loss sees of one (micro-)batch; every tensor [B, T], 0 off the mask."""

    logprobs: Tensor  # [B, T] log pi(a_t) under the policy being trained, with gradient
    old_logprobs: Tensor  # [B, T] log pi_old(a_t), detached (see the module docstring)
    advantages: Tensor  # [B, T]
    mask: Tensor  # [B, T] bool: the tokens that count
    # [B, T] log pi_behav(a_t), the rollout engine's own (the policy that sampled), detached
    rollout_logprobs: Tensor | None = None


AdvantageEstimator = Callable[[AdvantageInputs, AlgorithmConfig], tuple[Tensor, Tensor]]
"""estimator(inputs, config) -> (advantages [B, T], returns [B, T]); values off the mask are
ignored (they become 0). `returns` are the critic's targets for estimators with a critic."""

PolicyLoss = Callable[[PolicyLossInputs, AlgorithmConfig], tuple[Tensor, dict[str, Tensor]]]
"""loss(inputs, config) -> (per-token loss [B, T], stats). The caller weights the loss by TIS/MIS
and aggregates it (`loss_agg`). stats are [B, T] tensors, all optional: "ratio" (pi / pi_old as
the loss used it; default exp(logprobs - old_logprobs)), "clipped" and "dual_clipped" (bool, the
clipped term won; reported as policy/clip_frac*); any other key is reported as its masked mean,
`policy/<key>`."""

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", ["inputs", "config"]
)
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", ["inputs", "config"])
_NEEDS_CRITIC: set[AdvantageEstimator] = set()


def register_advantage(
    name: str, *, needs_critic: bool = False
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Register an `AdvantageEstimator` under `name`; with needs_critic the trainer trains a
    critic and passes its values in `AdvantageInputs.values`."""
    add = ADVANTAGE_ESTIMATORS.register(name)

    def register(fn: AdvantageEstimator) -> AdvantageEstimator:
        add(fn)
        if needs_critic:
            _NEEDS_CRITIC.add(fn)
        return fn

    return register


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a `PolicyLoss` under `name`."""
    return POLICY_LOSSES.register(name)


@dataclass(frozen=True)
class Algorithm:
    """The estimator and loss a job's `trainer.algorithm` names, loaded and checked."""

    advantage: AdvantageEstimator
    policy_loss: PolicyLoss
    needs_critic: bool


def resolve_algorithm(config: AlgorithmConfig) -> Algorithm:
    """Load what `config` names; a plugin that cannot be used raises PluginError naming the field.
    The trainer calls this at start so that a bad plugin fails before any work."""
    advantage = ADVANTAGE_ESTIMATORS.resolve(config.advantage, "trainer.algorithm.advantage")
    policy_loss = POLICY_LOSSES.resolve(config.policy_loss, "trainer.algorithm.policy_loss")
    return Algorithm(advantage, policy_loss, needs_critic=advantage in _NEEDS_CRITIC)


# ----------------------------------------------------------------- advantages


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be [B] (one per sequence), got shape {tuple(rewards.shape)}"
        )
    if group_size < 2 or rewards.shape[0] % group_size:
        raise ValueError(
            f"group_size must be >= 2 and divide the batch; got group_size={group_size} for "
            f"{rewards.shape[0]} sequences (a batch holds whole groups)"
        )
    return rewards.view(-1, group_size)  # [G, n]


def grpo_advantages(
    rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO: (r - group mean) / (group std + eps), std unbiased as in verl and TRL. [B] -> [B]."""
    grouped = _groups(rewards, group_size)  # [G, n]
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # [G, n]
    if normalize_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)  # [G, n]
    return centered.reshape(-1)  # [B]


def drgrpo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Dr.GRPO: r - group mean (no std). Its loss is not length-normalised either: use
    loss_agg token_sum with loss_norm_tokens = the generation budget. [B] -> [B]."""
    return grpo_advantages(rewards, group_size, normalize_std=False)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: r_i - mean of the other n - 1 rewards of the group. [B] -> [B]."""
    grouped = _groups(rewards, group_size)  # [G, n]
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # [G, n]
    return (grouped - others).reshape(-1)  # [B]


def token_level_rewards(
    rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """The sequence reward on each row's last response token, minus kl_coef * kl on every response
    token. A row without response tokens gets nothing. [B], [B, T] -> [B, T]."""
    valid = _valid(mask)
    B, T = valid.shape
    positions = torch.arange(T, device=valid.device).expand(B, T)  # [B, T]
    last = torch.where(valid, positions, -1).amax(dim=-1)  # [B]
    out = torch.zeros(B, T, dtype=rewards.dtype, device=rewards.device)  # [B, T]
    # A row without response tokens puts 0 at position 0, which its mask ignores anyway.
    out.scatter_(1, last.clamp_min(0)[:, None], torch.where(last >= 0, rewards, 0)[:, None])
    if kl is not None and kl_coef:
        out = out - kl_coef * torch.where(
            valid, kl, torch.zeros((), dtype=kl.dtype, device=kl.device)
        )
    return out  # [B, T]


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = sum_k gamma^k r over this and later response tokens (GAE, V = 0, lam = 1). [B, T]."""
    return compute_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[1]


def reinforce_pp_advantages(
    token_rewards: Tensor, mask: Tensor, gamma: float = 1.0, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted token returns, normalised over all response tokens of the batch.
    Returns (advantages, returns), both [B, T]."""
    returns = discounted_returns(token_rewards, mask, gamma)  # [B, T]
    return masked_whiten(returns, mask, eps), returns


def _per_sequence(advantages: Tensor, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """A group estimator's [B] advantages, and the reward as return, on every response token."""
    return advantages[:, None].expand_as(inputs.mask), inputs.rewards[:, None].expand_as(
        inputs.mask
    )


@register_advantage("grpo")
def _grpo(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """`grpo_advantages` of rewards [B] on every response token; returns: the reward. [B, T]."""
    adv = grpo_advantages(inputs.rewards, inputs.group_size, config.normalize_std, config.std_eps)
    return _per_sequence(adv, inputs)


@register_advantage("drgrpo")
def _drgrpo(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """`drgrpo_advantages` of rewards [B] on every response token; returns: the reward. [B, T]."""
    return _per_sequence(drgrpo_advantages(inputs.rewards, inputs.group_size), inputs)


@register_advantage("rloo")
def _rloo(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """`rloo_advantages` of rewards [B] on every response token; returns: the reward. [B, T]."""
    return _per_sequence(rloo_advantages(inputs.rewards, inputs.group_size), inputs)


@register_advantage("reinforce_pp")
def _reinforce_pp(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """`reinforce_pp_advantages` of token_rewards [B, T]: (whitened returns, returns), [B, T]."""
    return reinforce_pp_advantages(inputs.token_rewards, inputs.mask, config.gamma, config.std_eps)


@register_advantage("gae", needs_critic=True)
def _gae(inputs: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """`compute_gae` of token_rewards and the critic's values [B, T], advantages whitened
    (`whiten_advantages`); returns are the critic's targets. [B, T], [B, T]."""
    if inputs.values is None:
        raise ValueError("advantage 'gae' needs the critic's values ([B, T])")
    advantages, returns = compute_gae(
        inputs.token_rewards, inputs.values, inputs.mask, config.gamma, config.lam
    )
    if config.whiten_advantages:
        advantages = masked_whiten(advantages, inputs.mask, config.std_eps)  # [B, T]
    return advantages, returns


def compute_advantages(
    config: AlgorithmConfig,
    rewards: Tensor,
    mask: Tensor,
    group_size: int,
    values: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns, both [B, T] and 0 off the mask, by the estimator
    `config.advantage` names (a registered one or a plugin, see `AdvantageInputs`).

    rewards [B] per sequence; values [B, T] the critic's V(s_t) (estimators that need a critic).
    With `config.kl.in_reward` the KL of the sampling policy (`old_logprobs`, [B, T]: the
    trainer's recomputed ones or the rollout engine's) to the reference (`ref_logprobs`) is
    subtracted from the reward: per token in `token_rewards`, summed over the response in
    `rewards`.
    """
    valid = _valid(mask)
    _check_same_shape(valid, values=values, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
    if rewards.shape != valid.shape[:1]:
        raise ValueError(
            f"rewards must be [B] = [{valid.shape[0]}] (one per sequence), "
            f"got {tuple(rewards.shape)}"
        )
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    kl = None
    if config.kl.in_reward and config.kl.coef > 0:
        if old_logprobs is None or ref_logprobs is None:
            raise ValueError("kl.in_reward needs old_logprobs and ref_logprobs ([B, T] each)")
        kl = kl_estimate(old_logprobs, ref_logprobs, config.kl.estimator, valid)  # [B, T]
    inputs = AdvantageInputs(
        rewards=rewards if kl is None else rewards - config.kl.coef * masked_sum(kl, valid, -1),
        token_rewards=token_level_rewards(rewards, valid, kl, config.kl.coef),  # [B, T]
        mask=valid,
        group_size=group_size,
        values=values,
    )
    estimator = ADVANTAGE_ESTIMATORS.resolve(config.advantage, "trainer.algorithm.advantage")
    advantages, returns = estimator(inputs, config)
    _check_same_shape(valid, advantages=advantages, returns=returns)
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    return torch.where(valid, advantages, zero), torch.where(valid, returns, zero)


# ----------------------------------------------------------------- GAE, parallel and exact


def _block_suffix_sums(blocks: Tensor, powers: Tensor, use_matmul: bool) -> Tensor:
    """Per block of the last dim: y[t] = sum_{s >= t} c^(s - t) x[s]. [..., C] -> [..., C]."""
    C = blocks.shape[-1]
    if use_matmul:
        offset = torch.arange(C, device=blocks.device)
        diff = offset[:, None] - offset[None, :]  # [C, C]: s - t
        decay = torch.where(diff >= 0, powers[diff.clamp_min(0)], 0)  # [C, C]: c^(s-t), s >= t
        return blocks @ decay  # [..., C]
    # Hillis-Steele doubling, for when a matmul would not be exact (TF32 on CUDA).
    out, k = blocks, 1
    while k < C:
        out = out + powers[k] * F.pad(out[..., k:], (0, k))  # [..., C]
        k *= 2
    return out


def discounted_suffix_sum(x: Tensor, discount: float, block: int = 32) -> Tensor:
    """y[..., t] = sum_{s >= t} discount^(s - t) x[..., s] along the last dim, 0 <= discount <= 1.

    Parallel and exact: the sequence is cut into blocks of `block`; each block's own suffix sums
    are one matmul with the [block, block] matrix of powers discount^k, k < block; the blocks are
    then joined by the same problem one level up (the block sums with discount^block), so the
    depth is log_block(T) and every power ever used is a plain power in [0, 1] computed in float64:
    nothing is divided, so nothing overflows, and an underflow to 0 is the true value's own. The
    error is that of a pairwise-like sum of at most `block` terms per level. [..., T] -> [..., T].
    """
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    *lead, T = x.shape
    if T == 0:
        return x.clone()
    rows = x.reshape(-1, T)  # [R, T]
    C = min(block, T)
    n_blocks = -(-T // C)
    if n_blocks * C != T:
        rows = F.pad(rows, (0, n_blocks * C - T))  # [R, N * C]
    blocks = rows.view(rows.shape[0], n_blocks, C)  # [R, N, C]
    powers = discount ** torch.arange(C + 1, dtype=torch.float64, device=x.device)  # [C + 1]
    # Subnormal powers would only add < 1e-38 relative, at 100x the cost on x86: flush them.
    powers = torch.where(powers < torch.finfo(x.dtype).tiny, 0.0, powers).to(x.dtype)
    # TF32 would round the matmul's inputs to 10 mantissa bits; doubling is exact there.
    tf32 = x.is_cuda and x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    local = _block_suffix_sums(blocks, powers[:C], use_matmul=not tf32)  # [R, N, C]
    if n_blocks > 1:
        starts = discounted_suffix_sum(local[:, :, 0], discount**C, block)  # [R, N]
        after = F.pad(starts[:, 1:], (0, 1))  # [R, N]: the sum from the next block's start
        local.addcmul_(after[:, :, None], powers.flip(0)[:C])  # [R, N, C]: += c^(C - t) * after
    return local.reshape(rows.shape[0], n_blocks * C)[:, :T].reshape(*lead, T)  # [..., T]


def compute_gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation, parallel over time. All [B, T]; returns (adv, returns).

    Definition (the sequential one it is tested against): the MDP steps of a row are its positions
    with mask 1, in order, t_1 < ... < t_n (holes, e.g. tool output, are skipped, not steps);
    rewards and values at mask 0 are ignored; the value after the last step is 0 (terminal).
        delta_k = r[t_k] + gamma * V[t_{k+1}] - V[t_k],      V[t_{n+1}] = 0
        A_k     = delta_k + gamma * lam * A_{k+1},           A_{n+1} = 0
        returns = A + V;   advantages and returns are 0 where mask is 0.
    Computed, with c = gamma * lam and S_c(x)[k] = sum_{j >= k} c^(j - k) x[j], as
        returns_k = S_c(r)[k] + gamma * (1 - lam) * S_c(V)[k + 1],   A_k = returns_k - V_k
    (the same sums, regrouped): it never forms the deltas, so for lam = 1 the values telescope
    exactly instead of accumulating 2n rounding errors. Fp32 in, fp32 out (at least), any device.
    """
    _check_same_shape(mask, rewards=rewards, values=values)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    valid = _valid(mask)
    B, T = valid.shape
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    steps = torch.empty(2, B, T, dtype=dtype, device=rewards.device)  # [2, B, T]: r, V; 0 off mask
    torch.where(valid, rewards.to(dtype), zero, out=steps[0])
    torch.where(valid, values.to(dtype), zero, out=steps[1])
    # With a hole (a 0 before a 1) the steps are first moved to the front of their row, in order,
    # so the recursion has constant coefficients and a zero tail. A right-padded mask has none.
    as_bytes = valid.view(torch.uint8)
    packed = T > 1 and bool((as_bytes[:, 1:] > as_bytes[:, :-1]).any())
    if packed:
        slot = torch.where(valid, valid.long().cumsum(-1) - 1, T)  # [B, T]: step index, T = none
        steps = torch.zeros(2, B, T + 1, dtype=dtype, device=steps.device).scatter_(
            2, slot.expand(2, B, T), steps
        )[..., :T]  # [2, B, T]: each row's steps first, then zeros
    c, weight = gamma * lam, gamma * (1.0 - lam)
    if weight:
        sums = discounted_suffix_sum(steps, c)  # [2, B, T]: S_c(r), S_c(V)
        returns = sums[0]  # [B, T]
        returns[:, :-1].add_(sums[1][:, 1:], alpha=weight)  # + gamma (1 - lam) S_c(V)[k + 1]
    else:
        returns = discounted_suffix_sum(steps[0], c)  # [B, T]
    advantages = returns - steps[1]  # [B, T]
    if not packed:
        return advantages, returns  # exactly 0 after each row's last step: its inputs were 0
    back = slot.clamp_max(T - 1)  # [B, T]
    advantages, returns = advantages.gather(1, back), returns.gather(1, back)  # [B, T]
    return torch.where(valid, advantages, zero), torch.where(valid, returns, zero)


# ----------------------------------------------------------------- KL and mismatch


def kl_estimate(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: str, mask: Tensor | None = None
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1/k2/k3).

    With log_r = log pi_ref - log pi:  k1 = -log_r (unbiased, can be < 0);
    k2 = log_r^2 / 2 (biased, low variance; its gradient is the KL's);
    k3 = exp(log_r) - 1 - log_r (unbiased, >= 0). 0 where mask is 0. [B, T] -> [B, T].
    """
    log_r = ref_logprobs - logprobs  # [B, T]
    if mask is not None:
        log_r = torch.where(
            _valid(mask), log_r, torch.zeros((), dtype=log_r.dtype, device=log_r.device)
        )
    log_r = log_r.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def _importance_ratio(
    train_logprobs: Tensor, rollout_logprobs: Tensor, valid: Tensor, level: str
) -> Tensor:
    """pi_train / pi_rollout per token, or its per-sequence geometric mean. [B, T] -> [B, T]."""
    zero = torch.zeros((), dtype=train_logprobs.dtype, device=train_logprobs.device)
    log_ratio = torch.where(valid, train_logprobs.detach() - rollout_logprobs, zero)  # [B, T]
    if level == "sequence":
        log_ratio = masked_mean(log_ratio, valid, dim=-1)[:, None].expand_as(log_ratio)  # [B, T]
    elif level != "token":
        raise ValueError(f"unknown importance level {level!r}; expected token or sequence")
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()  # [B, T]


def importance_weights(
    train_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    mode: str,
    cap: float = 2.0,
    threshold: float = 2.0,
    level: str = "token",
) -> Tensor:
    """Detached per-token weights correcting the train-inference mismatch. [B, T] -> [B, T].

    ratio = pi_train / pi_rollout per token, or per sequence the geometric mean of its tokens'
    ratios exp(mean log ratio) (level "sequence", the same for all its tokens).
    tis: min(ratio, cap). mis: 1 if 1/threshold <= ratio <= threshold else 0 (the token, or the
    whole sequence, is dropped; it still counts in the loss normaliser). none: 1. 0 off the mask.
    """
    valid = _valid(mask)
    zero = torch.zeros((), dtype=train_logprobs.dtype, device=train_logprobs.device)
    ratio = _importance_ratio(train_logprobs, rollout_logprobs, valid, level)  # [B, T]
    if mode == "tis":
        weights = ratio.clamp_max(cap)
    elif mode == "mis":
        weights = ((ratio <= threshold) & (ratio >= 1.0 / threshold)).to(ratio.dtype)
    elif mode == "none":
        weights = torch.ones_like(ratio)
    else:
        raise ValueError(f"unknown importance mode {mode!r}; expected none, tis or mis")
    return torch.where(valid, weights, zero)  # [B, T]


def _percentiles(sorted_values: Tensor, qs: tuple[float, ...]) -> list[Tensor]:
    """Linear-interpolated percentiles (numpy's default) of an ascending 1-D tensor."""
    n = sorted_values.numel()
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out.append(sorted_values[lo] + (pos - lo) * (sorted_values[hi] - sorted_values[lo]))
    return out


def mismatch_metrics(
    train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """How far the rollout engine's token probabilities are from the trainer's, over the mask.

    kl: KL(pi_rollout || pi_train) per token, k3-estimated from the engine's samples; kl_k1 the
    plain log-ratio mean; ratio_* = percentiles of pi_train / pi_rollout. 0-dim tensors.
    """
    valid = _valid(mask)
    log_ratio = (train_logprobs.detach() - rollout_logprobs)[valid].float()  # [N]
    if log_ratio.numel() == 0:
        zero = torch.zeros((), device=log_ratio.device)
        names = ("kl", "kl_k1", "ratio_min", "ratio_p50", "ratio_p90", "ratio_p99", "ratio_max")
        return {f"mismatch/{k}": zero for k in names}
    log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = log_ratio.sort().values.exp()  # [N] ascending
    p50, p90, p99 = _percentiles(ratio, (0.5, 0.9, 0.99))
    return {
        "mismatch/kl": (torch.expm1(log_ratio) - log_ratio).mean(),
        "mismatch/kl_k1": (-log_ratio).mean(),
        "mismatch/ratio_min": ratio[0],
        "mismatch/ratio_p50": p50,
        "mismatch/ratio_p90": p90,
        "mismatch/ratio_p99": p99,
        "mismatch/ratio_max": ratio[-1],
    }


# ----------------------------------------------------------------- policy and value losses


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate per token, with DAPO's asymmetric clip [1 - low, 1 + high] and
    optionally dual-clip (for A < 0 the loss is at most -A * c). [B, T] -> [B, T] loss and
    [B, T] indicators: ratio, clipped (the clipped term won, no gradient), dual_clipped."""
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [B, T]
    ratio = log_ratio.exp()  # [B, T]
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    loss = torch.maximum(unclipped, clipped)  # [B, T]
    stats = {"ratio": ratio.detach(), "clipped": (clipped > unclipped).detach()}
    if dual_clip is not None:
        bound = -advantages * dual_clip  # [B, T]
        dual = (advantages < 0) & (loss > bound)  # [B, T]
        loss = torch.where(dual, bound, loss)  # [B, T]
        stats["dual_clipped"] = dual.detach()
    return loss, stats


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: one ratio per sequence, s = exp(mean over its tokens of log(pi / pi_old)), clipped to
    [1 - low, 1 + high]. Written per token as s_t = sg(s) * pi_t / sg(pi_t) (GSPO-token): the value
    is s on every token and, with loss_agg seq_mean, the gradient is exactly GSPO's
    s * mean_t grad log pi_t. [B, T] -> [B, T] loss and indicators like `ppo_policy_loss`."""
    valid = _valid(mask)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    token_log_ratio = torch.where(valid, logprobs - old_logprobs, zero)  # [B, T]
    seq_log_ratio = masked_mean(token_log_ratio, valid, dim=-1).detach()  # [B]
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    log_ratio = seq_log_ratio[:, None] + logprobs - logprobs.detach()  # [B, T]
    ratio = log_ratio.exp()  # [B, T]: the sequence ratio, with each token's own gradient
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    loss = torch.maximum(unclipped, clipped)  # [B, T]
    return loss, {"ratio": ratio.detach(), "clipped": (clipped > unclipped).detach()}


def second_moment_mask(log_ratio: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """M2PO's trust region (Zheng et al. 2025): the tokens to keep, [B, T] bool, so that the mean
    of log_ratio^2 over the kept ones is at most `threshold`, leaving out the fewest tokens, those
    with the largest log_ratio^2 (ties: the later in row-major order). False off the mask."""
    valid = _valid(mask)
    m2 = torch.where(valid, log_ratio.detach().float() ** 2, torch.inf).flatten()  # [N]
    order = m2.argsort(stable=True)  # ascending, padding (inf) last
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)  # [N] position in the order
    counts = torch.arange(1, order.numel() + 1, device=m2.device)  # [N]
    # The mean of the k smallest grows with k, so the kept tokens are a prefix of the order;
    # padding's inf never passes, and no host sync is needed.
    keep_n = (m2[order].cumsum(0) / counts <= threshold).sum()  # []
    return (rank < keep_n).view(valid.shape) & valid  # [B, T]


def decoupled_ppo_policy_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    behaviour_cap: float | None = 5.0,
    cap_action: str = "mask",
    m2_threshold: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """AReaL's decoupled PPO (Fu et al. 2025): w * ppo(r), r = pi / pi_prox clipped as in
    `ppo_policy_loss`, w = pi_prox / pi_behav detached: the trust region is around the trainer's
    policy at the step's start, and w corrects for the older policy that sampled. Tokens with
    w > behaviour_cap are dropped (cap_action "mask") or get w = cap ("clamp"); with
    m2_threshold, M2PO's `second_moment_mask` of log w drops more. Dropped tokens have w = 0.
    [B, T] -> [B, T] loss and indicators like `ppo_policy_loss`, plus behaviour_weight and
    behaviour_dropped."""
    valid = _valid(mask)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    loss, stats = ppo_policy_loss(
        logprobs, prox_logprobs, advantages, clip_low, clip_high, dual_clip
    )
    log_w = torch.where(valid, prox_logprobs - rollout_logprobs, zero).detach()  # [B, T]
    weight = log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()  # [B, T]
    keep = valid  # [B, T]
    if behaviour_cap is not None and cap_action == "mask":
        keep = keep & (weight <= behaviour_cap)
    elif behaviour_cap is not None and cap_action == "clamp":
        weight = weight.clamp_max(behaviour_cap)
    elif behaviour_cap is not None:
        raise ValueError(f"unknown cap_action {cap_action!r}; expected mask or clamp")
    if m2_threshold is not None:
        keep = keep & second_moment_mask(log_w, valid, m2_threshold)
    weight = torch.where(keep, weight, zero)  # [B, T]
    stats["behaviour_weight"] = weight
    stats["behaviour_dropped"] = valid & ~keep
    return loss * weight, stats


@register_policy_loss("ppo")
def _ppo(inputs: PolicyLossInputs, config: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """`ppo_policy_loss` with the configured clips: loss [B, T], stats ratio / clipped /
    dual_clipped [B, T]."""
    return ppo_policy_loss(
        inputs.logprobs,
        inputs.old_logprobs,
        inputs.advantages,
        config.clip_low,
        config.clip_high,
        config.dual_clip,
    )


@register_policy_loss("gspo")
def _gspo(inputs: PolicyLossInputs, config: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """`gspo_policy_loss` with the configured clips: loss [B, T], stats ratio / clipped [B, T]."""
    return gspo_policy_loss(
        inputs.logprobs,
        inputs.old_logprobs,
        inputs.advantages,
        inputs.mask,
        config.clip_low,
        config.clip_high,
    )


@register_policy_loss("decoupled_ppo")
def _decoupled_ppo(
    inputs: PolicyLossInputs, config: AlgorithmConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """`decoupled_ppo_policy_loss`, pi_prox = old_logprobs, with the configured clips and
    `decoupled` bounds: loss [B, T], stats as ppo's plus behaviour_weight / behaviour_dropped."""
    if inputs.rollout_logprobs is None:
        raise ValueError("decoupled_ppo needs the rollout engine's logprobs (rollout_logprobs)")
    d = config.decoupled
    return decoupled_ppo_policy_loss(
        inputs.logprobs,
        inputs.old_logprobs,
        inputs.rollout_logprobs,
        inputs.advantages,
        inputs.mask,
        config.clip_low,
        config.clip_high,
        config.dual_clip,
        d.behaviour_cap,
        d.cap_action,
        d.m2_threshold,
    )


def _floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    """All metrics to Python floats with a single device sync."""
    if not metrics:
        return {}
    values = torch.stack([m.detach().float().reshape(()) for m in metrics.values()]).tolist()
    return dict(zip(metrics, values, strict=True))


def policy_loss_and_metrics(
    config: AlgorithmConfig,
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    global_count: float | None = None,
    old_is_rollout: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """The policy's loss for one (micro-)batch and its metrics. All inputs [B, T].

    loss = agg(w * pg) - entropy_coef * agg(entropy) + kl.coef * agg(kl(pi || pi_ref))
    where pg is the PPO (or GSPO) surrogate against `old_logprobs` (None: the detached current
    logprobs, see the module docstring), w the TIS/MIS weight from pi_old / pi_rollout, agg the
    configured aggregation. The KL term is absent when kl.coef is 0 or kl.in_reward is set.

    old_is_rollout ("bypass": `old_logprobs` are the engine's own, several updates without a
    recompute): there is no pi_old to compare with the engine, so a TIS/MIS weight is refused
    (the PPO clip bounds pi / pi_rollout itself), and the `mismatch/*` metrics compare the
    current logprobs, detached, with the engine's.
    """
    valid = _valid(mask)
    _check_same_shape(
        valid,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs,
        advantages=advantages,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
    )
    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # bf16 ratios would be coarse
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)

    def clean(x: Tensor) -> Tensor:  # padding may hold -inf or NaN: make it a harmless 0
        return torch.where(valid, x.to(dtype), zero)

    logprobs, advantages = clean(logprobs), clean(advantages)
    old = clean(old_logprobs).detach() if old_logprobs is not None else logprobs.detach()
    rollout = clean(rollout_logprobs).detach()

    def agg(x: Tensor) -> Tensor:
        return aggregate_loss(x, valid, config.loss_agg, global_count, config.loss_norm_tokens)

    imp = config.importance
    if old_is_rollout and imp.mode != "none":
        raise ValueError(
            f"importance.mode {imp.mode!r} needs pi_old, and the old logprobs given are the "
            "rollout engine's own: recompute them, or set importance.mode to none"
        )
    trained = logprobs.detach() if old_is_rollout else old  # the trainer's side of the mismatch
    weights = importance_weights(
        trained, rollout, valid, imp.mode, imp.cap, imp.threshold, imp.level
    )
    policy_loss = POLICY_LOSSES.resolve(config.policy_loss, "trainer.algorithm.policy_loss")
    pg, stats = policy_loss(PolicyLossInputs(logprobs, old, advantages, valid, rollout), config)
    _check_same_shape(valid, loss=pg, **stats)
    pg_loss = agg(pg * weights)  # []
    loss = pg_loss
    log_ratio = torch.where(valid, logprobs.detach() - old, zero)  # [B, T]
    ratio = stats.pop("ratio", None)
    ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp() if ratio is None else ratio
    clipped = stats.pop("clipped", torch.zeros_like(valid))  # [B, T] bool
    m: dict[str, Tensor] = {
        "loss/policy": pg_loss,
        "policy/clip_frac": masked_mean(clipped.to(ratio.dtype), valid),
        "policy/clip_frac_low": masked_mean((clipped & (ratio < 1)).to(ratio.dtype), valid),
        "policy/clip_frac_high": masked_mean((clipped & (ratio > 1)).to(ratio.dtype), valid),
        # k3 of KL(pi_old || pi) from tokens pi_old sampled: (r - 1) - log r, r = pi / pi_old.
        "policy/approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, valid),
        "policy/ratio_mean": masked_mean(ratio, valid),
        "policy/ratio_min": torch.where(valid, ratio, torch.inf).amin().nan_to_num(0, 0, 0),
        "policy/ratio_max": torch.where(valid, ratio, -torch.inf).amax().nan_to_num(0, 0, 0),
        "advantages/mean": masked_mean(advantages.detach(), valid),
        "advantages/abs_max": F.pad(advantages.detach().abs().flatten(), (0, 1)).amax(),
    }
    if "dual_clipped" in stats:
        m["policy/dual_clip_frac"] = masked_mean(stats.pop("dual_clipped").to(ratio.dtype), valid)
    for name, per_token in stats.items():  # a loss's own per-token figures
        m[f"policy/{name}"] = masked_mean(per_token.detach().to(ratio.dtype), valid)
    if entropy is not None:
        entropy_mean = agg(clean(entropy) if config.entropy_coef else clean(entropy).detach())
        if config.entropy_coef:
            loss = loss - config.entropy_coef * entropy_mean
        m["entropy"] = entropy_mean
    kl_in_loss = config.kl.coef > 0 and not config.kl.in_reward
    if kl_in_loss and ref_logprobs is None:
        raise ValueError("kl.coef > 0 (in the loss) needs ref_logprobs ([B, T])")
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, clean(ref_logprobs).detach(), config.kl.estimator, valid)
        kl_loss = agg(kl if kl_in_loss else kl.detach())
        if kl_in_loss:
            loss = loss + config.kl.coef * kl_loss
        m["kl/ref"] = kl_loss
    m.update(mismatch_metrics(trained, rollout, valid))
    # What TIS and MIS would do at this batch, reported whichever correction is on.
    is_ratio = _importance_ratio(trained, rollout, valid, imp.level)  # [B, T]
    outside = (is_ratio > imp.threshold) | (is_ratio < 1.0 / imp.threshold)  # [B, T]
    m["mismatch/weight_mean"] = masked_mean(weights, valid)
    m["mismatch/truncated_frac"] = masked_mean((is_ratio > imp.cap).to(ratio.dtype), valid)
    m["mismatch/outside_threshold_frac"] = masked_mean(outside.to(ratio.dtype), valid)
    m["mismatch/masked_frac"] = masked_mean((valid & (weights == 0)).to(ratio.dtype), valid)
    m["loss/total"] = loss
    return loss, _floats(m)


def value_loss_and_metrics(
    config: AlgorithmConfig,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    global_count: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The critic's loss, 0.5 * (V - R)^2, clipped PPO-style when `config.value_clip` is set:
    0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2). All inputs [B, T]."""
    valid = _valid(mask)
    _check_same_shape(valid, values=values, old_values=old_values, returns=returns)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values = torch.where(valid, values, zero)
    old_values = torch.where(valid, old_values, zero).detach()
    returns = torch.where(valid, returns, zero).detach()
    loss = 0.5 * (values - returns) ** 2  # [B, T]
    clip_frac = zero
    if config.value_clip is not None:
        # Clamping V itself keeps a value inside the range bit-identical to V; old + clamp(V - old)
        # can round one step away from it and count the token as clipped.
        clipped_values = torch.clamp(
            values, old_values - config.value_clip, old_values + config.value_clip
        )  # [B, T]
        clipped_loss = 0.5 * (clipped_values - returns) ** 2  # [B, T]
        clip_frac = masked_mean((clipped_loss > loss).to(values.dtype), valid)
        loss = torch.maximum(loss, clipped_loss)  # [B, T]
    value_loss = aggregate_loss(loss, valid, config.loss_agg, global_count, config.loss_norm_tokens)
    residual_var = (
        masked_mean((returns - values.detach()) ** 2, valid)
        - masked_mean(returns - values.detach(), valid) ** 2
    )
    returns_var = masked_mean(returns**2, valid) - masked_mean(returns, valid) ** 2
    m = {
        "loss/value": value_loss,
        "value/clip_frac": clip_frac,
        "value/mean": masked_mean(values.detach(), valid),
        "value/returns_mean": masked_mean(returns, valid),
        "value/explained_variance": 1 - residual_var / returns_var.clamp_min(1e-12),
    }
    return value_loss, _floats(m)
