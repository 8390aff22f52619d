"""GAE (`kuberl.trainer.algorithms.compute_gae`): a hand-computed example, then the parallel
implementation against the sequential definition evaluated in float64 Python, for random shapes,
masks with holes and empty rows, gamma and lam in {0, 0.95, 0.99, 1}, and T up to 32k.

"Within 1e-5 relative" is measured per row against the row's scale:
max_t |ours - ref| <= 1e-5 * max_t |ref|. (An entry that is itself a near-cancellation of large
sums cannot be 1e-5 relative in fp32 arithmetic by any method; docs/algorithms.md shows that
verl's fp32 loop is further from the definition than this implementation.)
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kuberl.trainer.algorithms import (
    _block_suffix_sums,
    compute_gae,
    discounted_returns,
    discounted_suffix_sum,
)

DISCOUNTS = (0.0, 0.95, 0.99, 1.0)


def sequential_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, one step at a time backwards, in float64 Python: steps are the positions
    with mask 1 (holes skipped), the value after the last step is 0, masked positions output 0."""
    B, T = rewards.shape
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        r, v, m = rewards[b].tolist(), values[b].tolist(), mask[b].tolist()
        next_value, next_adv = 0.0, 0.0
        for t in reversed(range(T)):
            if not m[t]:
                continue
            delta = r[t] + gamma * next_value - v[t]
            next_adv = delta + gamma * lam * next_adv
            adv[b][t], ret[b][t] = next_adv, next_adv + v[t]
            next_value = v[t]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def row_relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().amax(dim=-1).clamp_min(1e-30)  # [B]
    return ((ours.double() - ref).abs().amax(dim=-1) / scale).max().item()


def random_batch(
    B: int, T: int, seed: int, holes: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=gen)
    values = torch.randn(B, T, generator=gen) + 0.5
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    lengths[0] = T  # one full row
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] right-padded
    if holes:
        mask &= torch.rand(B, T, generator=gen) > 0.2  # masked tool-output tokens inside
    return rewards, values, mask


def test_gae_matches_a_hand_computed_example() -> None:
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72), V after the last token is 0:
    # delta2 = 1 + 0.9*0 - 0.7 = 0.3;  delta1 = 0 + 0.9*0.7 - 0.6 = 0.03
    # delta0 = 0 + 0.9*0.6 - 0.5 = 0.04
    # A2 = 0.3;  A1 = 0.03 + 0.72*0.3 = 0.246;  A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]; the padded 4th position is 0.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0, 0.0]]))


def test_gae_skips_masked_tokens_inside_a_response() -> None:
    # Position 1 is tool output (mask 0): not a step, its reward 5 and value 9 are ignored.
    # delta2 = 1 - 0.7 = 0.3, A2 = 0.3
    # delta0 = 0 + 0.9*0.7 - 0.5 = 0.13, A0 = 0.13 + 0.72*0.3 = 0.346
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.7]])
    mask = torch.tensor([[True, False, True]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.346, 0.0, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.846, 0.0, 1.0]]))


@pytest.mark.parametrize(("gamma", "lam"), list(itertools.product(DISCOUNTS, DISCOUNTS)))
def test_gae_equals_the_sequential_definition_for_random_masks(gamma: float, lam: float) -> None:
    rewards, values, mask = random_batch(B=5, T=300, seed=7, holes=True)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = sequential_gae(rewards.double(), values.double(), mask, gamma, lam)
    assert (adv.dtype, adv.shape) == (torch.float32, (5, 300))
    assert max(row_relative_error(adv, ref_adv), row_relative_error(ret, ref_ret)) < 1e-5


@pytest.mark.parametrize(("gamma", "lam"), list(itertools.product(DISCOUNTS, DISCOUNTS)))
def test_gae_equals_the_sequential_definition_at_32k_tokens(gamma: float, lam: float) -> None:
    rewards, values, mask = random_batch(B=2, T=32768, seed=11, holes=(gamma + lam) % 2 == 0)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = sequential_gae(rewards.double(), values.double(), mask, gamma, lam)
    assert max(row_relative_error(adv, ref_adv), row_relative_error(ret, ref_ret)) < 1e-5


@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (4, 31), (2, 32), (2, 33), (3, 1025)])
def test_gae_is_exact_for_lengths_around_block_boundaries(shape: tuple[int, int]) -> None:
    rewards, values, mask = random_batch(*shape, seed=sum(shape), holes=False)
    adv, ret = compute_gae(rewards, values, mask, 0.99, 0.95)
    ref_adv, ref_ret = sequential_gae(rewards.double(), values.double(), mask, 0.99, 0.95)
    assert max(row_relative_error(adv, ref_adv), row_relative_error(ret, ref_ret)) < 1e-5


def test_gae_equals_verls_masked_loop_on_every_response_token() -> None:
    # verl's compute_gae_advantage_return carries the next value and advantage across mask 0.
    rewards, values, mask = random_batch(B=4, T=200, seed=21, holes=True)
    m = mask.double()
    next_value, last, out = torch.zeros(4), torch.zeros(4), []
    for t in reversed(range(200)):
        delta = rewards[:, t] + 0.99 * next_value - values[:, t]
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last = (delta + 0.99 * 0.95 * last) * m[:, t] + (1 - m[:, t]) * last
        out.append(last)
    verl = torch.stack(out[::-1], dim=1)
    adv, _ = compute_gae(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(adv[mask], verl[mask].float(), rtol=1e-5, atol=1e-5)


def test_gae_ignores_whatever_padding_holds_even_nan() -> None:
    rewards, values, mask = random_batch(B=4, T=64, seed=3, holes=True)
    clean = compute_gae(rewards, values, mask, 0.99, 0.95)
    dirty = compute_gae(
        rewards.masked_fill(~mask, float("nan")), values.masked_fill(~mask, float("inf")), mask,
        0.99, 0.95,
    )  # fmt: skip
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


def test_gae_stays_finite_and_exact_when_decay_powers_underflow() -> None:
    # gamma * lam = 1e-3: (1e-3)^32 underflows fp32 and (1e-3)^-k would overflow; nothing may.
    rewards, values, mask = random_batch(B=2, T=4096, seed=5, holes=True)
    adv, _ = compute_gae(rewards, values, mask, 0.1, 0.01)
    ref_adv, _ = sequential_gae(rewards.double(), values.double(), mask, 0.1, 0.01)
    assert torch.isfinite(adv).all() and row_relative_error(adv, ref_adv) < 1e-5


def test_gae_computes_in_float64_when_given_float64() -> None:
    rewards, values, mask = random_batch(B=2, T=2048, seed=9, holes=True)
    adv, _ = compute_gae(rewards.double(), values.double(), mask, 1.0, 1.0)
    ref_adv, _ = sequential_gae(rewards.double(), values.double(), mask, 1.0, 1.0)
    assert adv.dtype == torch.float64 and row_relative_error(adv, ref_adv) < 1e-12


def test_gae_rejects_a_discount_outside_zero_one() -> None:
    rewards, values, mask = random_batch(B=1, T=4, seed=1, holes=False)
    with pytest.raises(ValueError, match=r"gamma and lam must be in \[0, 1\]"):
        compute_gae(rewards, values, mask, gamma=1.5, lam=0.9)


def test_gae_rejects_tensors_whose_shape_differs_from_the_mask() -> None:
    with pytest.raises(ValueError, match=r"values has shape \(2, 3\) but mask has \(2, 4\)"):
        compute_gae(torch.zeros(2, 4), torch.zeros(2, 3), torch.ones(2, 4), 1.0, 1.0)


def test_discounted_suffix_sum_joins_blocks_correctly() -> None:
    # block 2, c = 0.5: y4 = 5; y3 = 4 + 0.5*5 = 6.5; y2 = 3 + 0.5*6.5 = 6.25;
    # y1 = 2 + 0.5*6.25 = 5.125; y0 = 1 + 0.5*5.125 = 3.5625
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    expected = torch.tensor([[3.5625, 5.125, 6.25, 6.5, 5.0]])
    torch.testing.assert_close(discounted_suffix_sum(x, 0.5, block=2), expected)


def test_the_doubling_path_used_under_tf32_equals_the_matmul_path() -> None:
    blocks = torch.randn(3, 7, 32, dtype=torch.float64)
    powers = 0.97 ** torch.arange(32, dtype=torch.float64)
    torch.testing.assert_close(
        _block_suffix_sums(blocks, powers, use_matmul=False),
        _block_suffix_sums(blocks, powers, use_matmul=True),
    )


def test_discounted_returns_sum_later_rewards_with_gamma() -> None:
    # gamma 0.5 over [1, 2, 4]: G2 = 4; G1 = 2 + 0.5*4 = 4; G0 = 1 + 0.5*4 = 3
    returns = discounted_returns(
        torch.tensor([[1.0, 2.0, 4.0, 8.0]]), torch.tensor([[1, 1, 1, 0]]), 0.5
    )
    torch.testing.assert_close(returns, torch.tensor([[3.0, 4.0, 4.0, 0.0]]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gae_on_cuda_equals_the_sequential_definition() -> None:
    rewards, values, mask = random_batch(B=2, T=32768, seed=13, holes=True)
    adv, ret = compute_gae(rewards.cuda(), values.cuda(), mask.cuda(), 0.99, 0.95)
    ref_adv, ref_ret = sequential_gae(rewards.double(), values.double(), mask, 0.99, 0.95)
    assert (
        max(row_relative_error(adv.cpu(), ref_adv), row_relative_error(ret.cpu(), ref_ret)) < 1e-5
    )
