"""Per-token logprobs and entropies computed in chunks over the vocabulary.

The trainer needs, for every response token, log pi(token) and the entropy of pi at that
position. Computing them from full logits materialises a [N, V] tensor (and autograd keeps it for
the backward pass): for a 150k-vocabulary model and 32k tokens that is ~20 GB in fp32. Here the
language-model head is applied to `chunk_size` vocabulary rows at a time with an online
log-sum-exp, and the backward pass recomputes each chunk instead of keeping it, so peak extra
memory is [N, chunk_size]. The result equals the full-logits computation up to floating-point
summation order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _forward_chunk(
    zc: torch.Tensor,  # [N, C] this chunk's logits, in the weights' dtype
    local: torch.Tensor,  # [N] target index inside the chunk (clamped)
    inside: torch.Tensor,  # [N] whether the target is in this chunk
    running_max: torch.Tensor,  # [N]
    s1: torch.Tensor,  # [N]
    s2: torch.Tensor,  # [N]
    target_logit: torch.Tensor,  # [N]
    inv_temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one vocabulary chunk into the running statistics (see `_chunk_stats`). Eager, it is
    a few in-place passes over one widened copy of the chunk (`zc` itself when it is already
    fp32: the caller's temporary product)."""
    z = zc.to(running_max.dtype)  # [N, C]
    if inv_temperature != 1.0:
        z.mul_(inv_temperature)
    new_max = torch.maximum(running_max, z.amax(dim=-1))  # [N]
    picked = z.gather(1, local[:, None]).squeeze(1)  # [N]
    target_logit = torch.where(inside, picked, target_logit)
    # The first chunk's old max is -inf: exp(-inf) = 0 and (m - m') S1 = -inf * 0 -> NaN.
    shift = torch.where(torch.isfinite(running_max), running_max - new_max, 0.0)  # [N] <= 0
    scale = torch.exp(shift)  # [N]
    s2 = scale * (s2 + shift * s1)
    s1 = s1 * scale
    z.sub_(new_max[:, None])  # z - m'
    e = torch.exp(z)  # [N, C]
    s1 = s1 + e.sum(-1)
    return new_max, s1, s2 + e.mul_(z).sum(-1), target_logit


def _backward_chunk(
    zc: torch.Tensor,  # [N, C] this chunk's logits, in the weights' dtype
    lse: torch.Tensor,  # [N]
    c0: torch.Tensor,  # [N, 1]
    c1: torch.Tensor,  # [N, 1]
    local: torch.Tensor,  # [N] target index inside the chunk (clamped)
    target_grad: torch.Tensor,  # [N] g_lp / T where the target is in this chunk, else 0
    inv_temperature: float,
) -> torch.Tensor:
    """dLoss/dz of one chunk, in the weights' dtype: p (c0 + c1 z) + onehot g_lp / T."""
    z = zc.to(lse.dtype)  # [N, C]
    if inv_temperature != 1.0:
        z.mul_(inv_temperature)
    grad_z = torch.addcmul(c0, z, c1)  # [N, C]
    grad_z.mul_(z.sub_(lse[:, None]).exp_())  # * p
    grad_z.scatter_add_(1, local[:, None], target_grad[:, None])
    return grad_z.to(zc.dtype)


_COMPILED: dict[str, Any] = {}


def _chunk_functions(compiled: bool) -> tuple[Any, Any]:
    """The per-chunk functions, eager or fused by `torch.compile` (compiled once per process,
    with dynamic shapes: micro-batches differ in length). Compiled, each chunk's softmax
    statistics and its gradient are one or two kernels reading the bf16 logits, instead of a
    pass over an fp32 [N, C] tensor for every operation."""
    if not compiled:
        return _forward_chunk, _backward_chunk
    if not _COMPILED:
        _COMPILED["forward"] = torch.compile(_forward_chunk, dynamic=True)
        _COMPILED["backward"] = torch.compile(_backward_chunk, dynamic=True)
    return _COMPILED["forward"], _COMPILED["backward"]


def _chunk_stats(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N]
    chunk_size: int,
    inv_temperature: float,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online log-sum-exp, target logit and E_p[z] over vocabulary chunks (no grad).

    Per row it keeps the running max m, S1 = sum exp(z - m) and S2 = sum exp(z - m) (z - m);
    when m rises to m' both are rescaled by exp(m - m') and S2 also gains (m - m') S1. Then
    lse = m + log S1 and E_p[z] = m + S2 / S1. The chunk's product runs in the weights' dtype
    (bf16 tensor cores on GPU, fp32 accumulation inside the GEMM); its statistics in fp32."""
    n = hidden.shape[0]
    vocab = weight.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)  # bf16 accumulates in fp32
    running_max = torch.full((n,), float("-inf"), dtype=acc, device=hidden.device)  # [N]
    s1 = torch.zeros(n, dtype=acc, device=hidden.device)  # [N]
    s2 = torch.zeros(n, dtype=acc, device=hidden.device)  # [N]
    target_logit = torch.zeros(n, dtype=acc, device=hidden.device)  # [N]
    forward_chunk, _ = _chunk_functions(compiled)
    for start in range(0, vocab, chunk_size):
        end = min(start + chunk_size, vocab)
        inside = (targets >= start) & (targets < end)  # [N]
        local = (targets - start).clamp(0, end - start - 1)  # [N]
        running_max, s1, s2, target_logit = forward_chunk(
            hidden @ weight[start:end].T,
            local,
            inside,
            running_max,
            s1,
            s2,
            target_logit,
            inv_temperature,
        )
    lse = running_max + torch.log(s1)  # [N]
    mean_z = running_max + s2 / s1  # [N] E_p[z]
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
        compiled: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lse, target_logit, mean_z = _chunk_stats(
            hidden, weight, targets, chunk_size, inv_temperature, compiled
        )
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z)
        ctx.chunk_size = chunk_size
        ctx.inv_temperature = inv_temperature
        ctx.compiled = compiled
        logprobs = target_logit - lse  # [N]
        entropy = lse - mean_z  # [N]
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None]:
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        chunk, inv_t = ctx.chunk_size, ctx.inv_temperature
        _, backward_chunk = _chunk_functions(ctx.compiled)
        vocab = weight.shape[0]
        acc = lse.dtype
        g_lp = grad_logprobs.to(acc)  # [N]
        g_h = grad_entropy.to(acc)  # [N]
        # d logprob / dz = onehot - p ; d entropy / dz = -p (z - E_p[z]), so with the chain
        # rule's 1/T: grad_z = p * (c0 + c1 z) + onehot * g_lp / T, where
        # c0 = -(g_lp - g_h E_p[z]) / T and c1 = -g_h / T (both [N]).
        c0 = ((g_h * mean_z - g_lp) * inv_t)[:, None]  # [N, 1]
        c1 = (-g_h * inv_t)[:, None]  # [N, 1]
        grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)  # [N, H]
        # Each chunk's rows are written once, so the [V, H] gradient is held in the weight's
        # own dtype (no fp32 copy of the whole head).
        grad_weight = (
            torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )  # [V, H]
        hidden_w = hidden.to(weight.dtype)
        for start in range(0, vocab, chunk):
            end = min(start + chunk, vocab)
            w = weight[start:end]  # [C, H]
            # The target's one-hot term is a masked scatter, not `nonzero` rows, which would
            # wait for the GPU in every chunk.
            inside = (targets >= start) & (targets < end)  # [N]
            local = (targets - start).clamp(0, end - start - 1)  # [N]
            target_grad = torch.where(inside, g_lp * inv_t, 0.0)  # [N]
            g = backward_chunk(hidden_w @ w.T, lse, c0, c1, local, target_grad, inv_t)  # [N, C]
            # The two GEMMs in the weights' dtype (tensor cores in bf16), accumulating in fp32.
            grad_hidden += (g @ w).to(acc)  # [N, H]
            if grad_weight is not None:
                torch.mm(g.T, hidden_w, out=grad_weight[start:end])  # [C, H]
        return (
            grad_hidden.to(hidden.dtype) if ctx.needs_input_grad[0] else None,
            grad_weight,
            None,
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
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature)[targets] and the entropy, per row.

    hidden [..., H], weight [V, H], targets [...] (int64) -> (logprobs [...], entropy [...]) in
    float32. Differentiable with respect to hidden and weight. `compiled`: fuse each chunk's
    elementwise work with `torch.compile` (the same numbers up to summation order).
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
    lp, ent = _ChunkedLogprobEntropy.apply(
        flat_h, weight, flat_t, chunk_size, 1.0 / temperature, compiled
    )
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
    """A drop-in replacement for a causal LM's `lm_head` that can return logprobs directly.

    It shares the head's weight Parameter, so tied embeddings stay tied and DeepSpeed ZeRO-3
    gathers the weight for forward and backward through its usual module hooks. Called with
    `targets` it returns ONE tensor [..., 2] (logprob, entropy), without them it is the original
    linear layer. One tensor, not a pair: ZeRO-3 fetches a module's parameters again for the
    backward pass once per output tensor that receives a gradient, so a loss that used only the
    logprobs on one rank and both outputs on another would make the ranks' collectives diverge.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        chunk_size: int = 4096,
        temperature: float = 1.0,
        compiled: bool = False,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.chunk_size = chunk_size
        self.temperature = temperature
        self.compiled = compiled

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
            hidden, self.weight, targets, self.chunk_size, self.temperature, self.compiled
        )
        return torch.stack([logprobs, entropy], dim=-1)
