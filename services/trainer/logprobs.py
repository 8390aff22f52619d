"""Per-token logprobs and entropies computed in chunks over the vocabulary.

The trainer needs, for every response token, log pi(token) and the entropy of pi at that
position. Computing them from full logits materialises a [N, V] tensor (and autograd keeps it for
the backward pass): for a 150k-vocabulary model and 32k tokens that is ~20 GB in fp32. Here the
language-model head is applied to `chunk_size` vocabulary rows at a time with an online
log-sum-exp, and the backward pass recomputes each chunk instead of keeping it, so peak extra
memory is [N, chunk_size]. The result equals the full-logits computation up to floating-point
summation order (tested in tests/unit/test_trainer_logprobs.py).

`LogprobHead` replaces a causal LM's `lm_head` (same weight Parameter, so tied embeddings stay
tied and DeepSpeed ZeRO-3 gathers the weight for forward and backward through its usual module
hooks). Called with `targets`, it returns (logprobs, entropy); without, it behaves like the
original linear layer. With targets it returns ONE tensor [..., 2] (logprob, entropy) rather than
a pair: DeepSpeed ZeRO-3 fetches a module's parameters again for the backward pass once per
output tensor that receives a gradient, so a loss that uses only the logprobs on one rank and
both outputs on another would make the ranks' collectives diverge.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _chunk_stats(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N]
    chunk_size: int,
    inv_temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online log-sum-exp, target logit and E_p[z] over vocabulary chunks (no grad)."""
    n = hidden.shape[0]
    vocab = weight.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)  # bf16 accumulates in fp32
    running_max = torch.full((n,), float("-inf"), dtype=acc, device=hidden.device)  # [N]
    sum_exp = torch.zeros(n, dtype=acc, device=hidden.device)  # [N]
    sum_exp_z = torch.zeros(n, dtype=acc, device=hidden.device)  # [N]
    target_logit = torch.zeros(n, dtype=acc, device=hidden.device)  # [N]
    for start in range(0, vocab, chunk_size):
        end = min(start + chunk_size, vocab)
        z = (hidden @ weight[start:end].T).to(acc) * inv_temperature  # [N, C]
        new_max = torch.maximum(running_max, z.max(dim=-1).values)  # [N]
        scale = torch.exp(running_max - new_max)  # [N]
        e = torch.exp(z - new_max[:, None])  # [N, C]
        sum_exp = sum_exp * scale + e.sum(-1)
        sum_exp_z = sum_exp_z * scale + (e * z).sum(-1)
        running_max = new_max
        inside = (targets >= start) & (targets < end)  # [N]
        local = (targets - start).clamp(0, end - start - 1)  # [N]
        picked = z.gather(1, local[:, None]).squeeze(1)  # [N]
        target_logit = torch.where(inside, picked, target_logit)
    lse = running_max + torch.log(sum_exp)  # [N]
    mean_z = sum_exp_z / sum_exp  # [N] E_p[z]
    return lse, target_logit, mean_z


class _ChunkedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_size: int,
        inv_temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lse, target_logit, mean_z = _chunk_stats(
            hidden, weight, targets, chunk_size, inv_temperature
        )
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z)
        ctx.chunk_size = chunk_size
        ctx.inv_temperature = inv_temperature
        logprobs = target_logit - lse  # [N]
        entropy = lse - mean_z  # [N]
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        chunk, inv_t = ctx.chunk_size, ctx.inv_temperature
        vocab = weight.shape[0]
        acc = lse.dtype
        g_lp = grad_logprobs.to(acc)  # [N]
        g_h = grad_entropy.to(acc)  # [N]
        grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)  # [N, H]
        # Each chunk's rows are computed in fp32 and written once, so the [V, H] gradient can be
        # held in the weight's own dtype (no fp32 copy of the whole head).
        grad_weight = (
            torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )  # [V, H]
        for start in range(0, vocab, chunk):
            end = min(start + chunk, vocab)
            w = weight[start:end]  # [C, H]
            z = (hidden @ w.T).to(acc) * inv_t  # [N, C]
            p = torch.exp(z - lse[:, None])  # [N, C]
            # d logprob / dz = onehot - p ; d entropy / dz = -p * (z - E_p[z])
            grad_z = -p * (g_lp[:, None] + g_h[:, None] * (z - mean_z[:, None]))  # [N, C]
            inside = (targets >= start) & (targets < end)  # [N]
            rows = inside.nonzero(as_tuple=True)[0]
            grad_z[rows, targets[rows] - start] += g_lp[rows]
            grad_z = grad_z * inv_t
            grad_hidden += grad_z @ w.to(acc)  # [N, H]
            if grad_weight is not None:
                grad_weight[start:end] = (grad_z.T @ hidden.to(acc)).to(weight.dtype)  # [C, H]
        return (
            grad_hidden.to(hidden.dtype) if ctx.needs_input_grad[0] else None,
            grad_weight,
            None,
            None,
            None,
        )


def chunked_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 4096,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature)[targets] and the entropy, per row.

    hidden [..., H], weight [V, H], targets [...] (int64) -> (logprobs [...], entropy [...]) in
    float32. Differentiable with respect to hidden and weight.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lead = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    flat_t = targets.reshape(-1).long()  # [N]
    if flat_h.shape[0] != flat_t.shape[0]:
        raise ValueError(
            f"hidden has {flat_h.shape[0]} positions but targets has {flat_t.shape[0]}"
        )
    lp, ent = _ChunkedLogprobEntropy.apply(flat_h, weight, flat_t, chunk_size, 1.0 / temperature)
    return lp.reshape(lead), ent.reshape(lead)


def full_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference computation from full logits [..., V]: (logprobs [...], entropy [...])."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(acc) / temperature, dim=-1)  # [..., V]
    picked = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [...]
    entropy = -(logp.exp() * logp).sum(-1)  # [...]
    return picked, entropy


class LogprobHead(nn.Module):
    """A drop-in replacement for a causal LM's `lm_head` that can return logprobs directly."""

    def __init__(
        self, weight: nn.Parameter, chunk_size: int = 4096, temperature: float = 1.0
    ) -> None:
        super().__init__()
        self.weight = weight
        self.chunk_size = chunk_size
        self.temperature = temperature

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V]; with targets [...] -> [..., 2] (logprob, entropy)."""
        if targets is None:
            return nn.functional.linear(hidden, self.weight)
        logprobs, entropy = chunked_logprobs_and_entropy(
            hidden, self.weight, targets, self.chunk_size, self.temperature
        )
        return torch.stack([logprobs, entropy], dim=-1)
