"""The RL algorithms (`kuberl.trainer.algorithms`) on small hand-computed examples: every
advantage estimator, the policy losses and their gradients, loss aggregation, KL estimators
against closed forms, TIS/MIS and the mismatch metrics, the critic's loss, and the two entry
points the training loop calls. Expected numbers are written out with their arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kuberl.common.config import AlgorithmConfig
from kuberl.trainer.algorithms import (
    aggregate_loss,
    compute_advantages,
    drgrpo_advantages,
    grpo_advantages,
    gspo_policy_loss,
    importance_weights,
    kl_estimate,
    mismatch_metrics,
    policy_loss_and_metrics,
    ppo_policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    token_level_rewards,
    value_loss_and_metrics,
)

LN = math.log


def config(**fields) -> AlgorithmConfig:
    return AlgorithmConfig.model_validate(fields)


# ----------------------------------------------------------------------------- advantages


def test_grpo_normalises_by_the_group_mean_and_unbiased_std() -> None:
    # group [1, 0, 0, 0]: mean 0.25; var = (0.75^2 + 3 * 0.25^2) / 3 = 0.75 / 3 = 0.25, std 0.5
    # A = (r - 0.25) / 0.5 = [1.5, -0.5, -0.5, -0.5]; group [2, 4]: mean 3, std sqrt(2) -> -+0.7071
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 3.0, 3.0])
    adv = grpo_advantages(rewards[:4], group_size=4, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]))
    adv = grpo_advantages(torch.tensor([2.0, 4.0]), group_size=2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2)]))


def test_grpo_gives_zero_advantage_to_a_group_whose_rewards_agree() -> None:
    # std 0: (r - mean) / (0 + eps) = 0 / eps = 0, never NaN
    assert torch.equal(grpo_advantages(torch.ones(4), 4), torch.zeros(4))


def test_drgrpo_only_subtracts_the_group_mean() -> None:
    # [1, 0, 0, 0] - 0.25
    adv = drgrpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_rloo_subtracts_the_mean_of_the_other_samples() -> None:
    # [1, 0, 0, 0]: A0 = 1 - (0+0+0)/3 = 1; A1 = 0 - (1+0+0)/3 = -1/3
    # [2, 4]: A0 = 2 - 4 = -2; A1 = 4 - 2 = 2
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    torch.testing.assert_close(
        rloo_advantages(torch.tensor([2.0, 4.0]), 2), torch.tensor([-2.0, 2.0])
    )


def test_a_batch_that_does_not_hold_whole_groups_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"group_size=4 for 6 sequences"):
        grpo_advantages(torch.zeros(6), group_size=4)


def test_token_level_rewards_put_the_reward_on_the_last_response_token_minus_kl() -> None:
    # row 0: last response token is 2 -> [-0.5*0.2, -0.5*0.4, 1 - 0.5*0.6, 0]
    # row 1: mask [1, 0, 1, 0] (a hole) -> last is 2; row 2: no response -> nothing
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    kl = torch.tensor([[0.2, 0.4, 0.6, 9.0]] * 3)
    out = token_level_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, kl, kl_coef=0.5)
    expected = torch.tensor(
        [[-0.1, -0.2, 0.7, 0.0], [-0.1, 0.0, 2.0 - 0.3, 0.0], [0.0, 0.0, 0.0, 0.0]]
    )
    torch.testing.assert_close(out, expected)


def test_reinforce_pp_normalises_token_returns_over_the_batch() -> None:
    # gamma 1, rewards 1 and -1 on the last tokens: returns [[1, 1, 1], [-1, -1, 0(pad)]]
    # 5 tokens: mean (3 - 2)/5 = 0.2; var = (3*0.8^2 + 2*1.2^2)/4 = (1.92 + 2.88)/4 = 1.2
    # A = (G - 0.2)/sqrt(1.2): 0.8/1.0954451 = 0.7302967; -1.2/1.0954451 = -1.0954451
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, 0.0]])
    adv, returns = reinforce_pp_advantages(token_rewards, mask, gamma=1.0)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]))
    a, b = 0.7302967, -1.0954451
    torch.testing.assert_close(adv, torch.tensor([[a, a, a], [b, b, 0.0]]), rtol=1e-5, atol=1e-5)


def test_compute_advantages_broadcasts_group_advantages_over_the_response() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv, returns = compute_advantages(config(advantage="drgrpo"), rewards, mask, group_size=4)
    expected = torch.tensor([[0.75, 0.75, 0], [-0.25] * 3, [-0.25, 0, 0], [-0.25] * 3])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, rewards[:, None] * mask)


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_compute_advantages_selects_the_group_estimator(kind: str) -> None:
    rewards = torch.tensor([1.0, 0.0, 3.0, 0.5, 2.0, 2.0])
    mask = torch.ones(6, 2)
    adv, _ = compute_advantages(config(advantage=kind), rewards, mask, group_size=3)
    expected = {
        "grpo": grpo_advantages(rewards, 3),
        "drgrpo": drgrpo_advantages(rewards, 3),
        "rloo": rloo_advantages(rewards, 3),
    }[kind]
    torch.testing.assert_close(adv[:, 0], expected)


def test_kl_in_reward_lowers_a_group_sample_by_its_summed_kl() -> None:
    # k1 per token = old - ref: row 0 [0, 0], row 1 [1, 1] -> sums 0 and 2; coef 0.5
    # rewards [1, 1] -> [1, 0]; GRPO: mean 0.5, std sqrt(0.5) -> [+0.7071, -0.7071]
    cfg = config(
        advantage="grpo", std_eps=1e-9, kl={"coef": 0.5, "estimator": "k1", "in_reward": True}
    )
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    adv, returns = compute_advantages(
        cfg, torch.ones(2), torch.ones(2, 2), 2, old_logprobs=old, ref_logprobs=ref
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2)]))
    torch.testing.assert_close(returns[:, 0], torch.tensor([1.0, 0.0]))


def test_kl_in_reward_is_per_token_for_reinforce_pp() -> None:
    # gamma 0.5, k1 kl [0.2, 0.4, 0.6], coef 0.5: token rewards [-0.1, -0.2, 1 - 0.3 = 0.7]
    # G2 = 0.7; G1 = -0.2 + 0.5*0.7 = 0.15; G0 = -0.1 + 0.5*0.15 = -0.025
    cfg = config(
        advantage="reinforce_pp", gamma=0.5, kl={"coef": 0.5, "estimator": "k1", "in_reward": True}
    )
    old = torch.zeros(1, 3)
    ref = -torch.tensor([[0.2, 0.4, 0.6]])
    _, returns = compute_advantages(
        cfg, torch.ones(1), torch.ones(1, 3), 1, old_logprobs=old, ref_logprobs=ref
    )
    torch.testing.assert_close(returns, torch.tensor([[-0.025, 0.15, 0.7]]))


def test_compute_advantages_gae_whitens_the_critic_advantages() -> None:
    # Raw GAE as in test_gae's hand example: [0.21712, 0.246, 0.3], returns [0.71712, 0.846, 1.0].
    # mean = 0.76312/3 = 0.2543733; deviations [-0.0372533, -0.0083733, 0.0456267];
    # var = (0.00138781 + 0.00007011 + 0.00208180)/2 = 0.00176986; std = 0.0420697
    cfg = config(advantage="gae", gamma=0.9, lam=0.8, std_eps=1e-9)
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, returns = compute_advantages(cfg, torch.ones(1), torch.ones(1, 3), 1, values=values)
    torch.testing.assert_close(returns, torch.tensor([[0.71712, 0.846, 1.0]]))
    expected = torch.tensor([[-0.0372533, -0.0083733, 0.0456267]]) / 0.0420697
    torch.testing.assert_close(adv, expected, rtol=1e-4, atol=1e-4)


def test_compute_advantages_gae_without_values_is_rejected() -> None:
    with pytest.raises(ValueError, match="needs the critic's values"):
        compute_advantages(config(advantage="gae"), torch.ones(2), torch.ones(2, 3), 1)


def test_kl_in_reward_without_reference_logprobs_is_rejected() -> None:
    cfg = config(kl={"coef": 0.1, "in_reward": True})
    with pytest.raises(ValueError, match="needs old_logprobs and ref_logprobs"):
        compute_advantages(cfg, torch.ones(2), torch.ones(2, 3), 2)


# ----------------------------------------------------------------------------- aggregation


def test_loss_aggregations_match_their_definitions() -> None:
    # tokens: row 0 [1, 2, 3], row 1 [4] (mask), 10 in all over 4 tokens and 2 rows, T = 3
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate_loss(loss, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(loss, mask, "seq_mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate_loss(loss, mask, "token_sum").item() == pytest.approx(10 / (2 * 3))
    assert aggregate_loss(loss, mask, "token_sum", norm_tokens=5).item() == pytest.approx(1.0)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "token_sum"])
def test_micro_batch_losses_add_up_to_the_batch_loss_with_a_global_count(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=gen)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 2, 4, 5])[:, None]
    count = float(mask.sum()) if mode == "token_mean" else 6.0
    parts = [
        aggregate_loss(loss[s], mask[s], mode, global_count=count)
        for s in (slice(0, 2), slice(2, 6))
    ]
    torch.testing.assert_close(sum(parts), aggregate_loss(loss, mask, mode))


# ----------------------------------------------------------------------------- policy losses


def ppo_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # ratios [1.5, 0.5, 1.1, 3.5] with advantages [1, -1, 1, -1]
    old = torch.full((1, 4), -1.0)
    logprobs = (old + torch.tensor([[LN(1.5), LN(0.5), LN(1.1), LN(3.5)]])).requires_grad_()
    return logprobs, old, torch.tensor([[1.0, -1.0, 1.0, -1.0]])


def test_ppo_clips_asymmetrically_like_dapo_clip_higher() -> None:
    # clip range [0.8, 1.28]; loss = max(-A r, -A clip(r)):
    # t0: max(-1.5, -1.28) = -1.28 (clipped high)   t1: max(0.5, 0.8) = 0.8 (clipped low)
    # t2: max(-1.1, -1.1) = -1.1                    t3: max(3.5, 1.28) = 3.5
    logprobs, old, adv = ppo_example()
    loss, stats = ppo_policy_loss(logprobs, old, adv, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 0.8, -1.1, 3.5]]))
    assert stats["clipped"].tolist() == [[True, True, False, False]]


def test_ppo_dual_clip_bounds_the_loss_of_negative_advantages() -> None:
    # c = 3: t3 (A = -1, r = 3.5): min(3.5, -A*c = 3) = 3; the others are unchanged
    logprobs, old, adv = ppo_example()
    loss, stats = ppo_policy_loss(logprobs, old, adv, 0.2, 0.28, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 0.8, -1.1, 3.0]]))
    assert stats["dual_clipped"].tolist() == [[False, False, False, True]]


def test_ppo_gradient_is_zero_on_clipped_tokens_and_minus_a_ratio_elsewhere() -> None:
    # d(-A r)/d log pi = -A r: t2 -> -1.1, t3 -> +3.5; clipped t0, t1 and dual-clipped -> 0
    logprobs, old, adv = ppo_example()
    loss, _ = ppo_policy_loss(logprobs, old, adv, 0.2, 0.28)
    loss.sum().backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -1.1, 3.5]]))


def test_policy_entry_point_reports_the_hand_computed_loss_and_clip_fractions() -> None:
    # token_mean of [-1.28, 0.8, -1.1, 3.0] = 1.42/4 = 0.355; clipped 2 of 4 (1 low, 1 high);
    # dual-clipped 1 of 4; rollout == old so no correction: weights 1, mismatch ratio 1
    logprobs, old, adv = ppo_example()
    cfg = config(clip_low=0.2, clip_high=0.28, dual_clip=3.0, importance={"mode": "none"})
    loss, m = policy_loss_and_metrics(cfg, logprobs, old, old, adv, torch.ones(1, 4))
    assert loss.item() == pytest.approx(0.355, abs=1e-6)
    assert (m["policy/clip_frac"], m["policy/clip_frac_low"], m["policy/clip_frac_high"]) == (
        0.5,
        0.25,
        0.25,
    )
    assert m["policy/dual_clip_frac"] == 0.25
    assert m["policy/ratio_max"] == pytest.approx(3.5, rel=1e-6)
    assert (m["mismatch/ratio_max"], m["mismatch/kl"], m["mismatch/masked_frac"]) == (1.0, 0.0, 0.0)


def test_approx_kl_estimates_kl_of_old_against_new_from_the_old_policys_samples() -> None:
    # pi_old = (0.5, 0.5), pi = (0.9, 0.1); the two tokens, one each, are pi_old's samples in
    # their exact proportions. KL(pi_old || pi) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5108;
    # the old formula gave 1.267 (KL(pi || pi_old) is 0.368).
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    logprobs = torch.log(torch.tensor([[0.9, 0.1]]))
    cfg = config(importance={"mode": "none"})
    _, m = policy_loss_and_metrics(cfg, logprobs, old, old, torch.ones(1, 2), torch.ones(1, 2))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert float(m["policy/approx_kl"]) == pytest.approx(expected, abs=1e-6)


def gspo_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # seq 0: token log-ratios [ln 2, 0] (and a pad), A = 1; seq 1: [0.1, -0.1, 0], A = -2
    old = torch.full((2, 3), -1.0)
    log_ratio = torch.tensor([[LN(2.0), 0.0, 0.0], [0.1, -0.1, 0.0]])
    logprobs = (old + log_ratio).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    return logprobs, old, adv, mask


def test_gspo_clips_the_sequence_ratio_exp_of_the_mean_log_ratio() -> None:
    # seq 0: s = exp((ln 2 + 0)/2) = sqrt(2) = 1.41421 > 1.2 -> loss max(-1.41421, -1.2) = -1.2
    # seq 1: s = exp(0) = 1 -> loss -A*1 = 2 per token
    logprobs, old, adv, mask = gspo_example()
    loss, stats = gspo_policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(loss * mask, torch.tensor([[-1.2, -1.2, 0.0], [2.0, 2.0, 2.0]]))
    torch.testing.assert_close(stats["ratio"][0, :2], torch.full((2,), math.sqrt(2)))


def test_gspo_with_seq_mean_has_gspo_sequence_gradient() -> None:
    # seq_mean over 2 sequences: seq 1 token t gets (1/2) * (1/3) * (-A) * s = (1/6) * 2 * 1 = 1/3;
    # seq 0 is clipped: 0. Loss = (-1.2 + 2)/2 = 0.4
    logprobs, old, adv, mask = gspo_example()
    cfg = config(policy_loss="gspo", loss_agg="seq_mean", importance={"mode": "none"})
    loss, _ = policy_loss_and_metrics(cfg, logprobs, old, old, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(0.4, abs=1e-6)
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 3] * 3]))


def test_entropy_bonus_and_kl_loss_enter_the_total_with_their_coefficients() -> None:
    # on-policy (old None): ratio 1, A = 1 -> pg = -1 per token, token_mean -1
    # entropy [0.5, 1.5] -> mean 1.0, coef 0.1 -> -0.1
    # k1 = log pi - log pi_ref = -1 - (-1.5) = 0.5 per token, coef 0.2 -> +0.1; total -1.0
    logprobs = torch.full((1, 2), -1.0, requires_grad=True)
    cfg = config(entropy_coef=0.1, kl={"coef": 0.2, "estimator": "k1"}, importance={"mode": "none"})
    loss, m = policy_loss_and_metrics(
        cfg,
        logprobs,
        None,
        logprobs.detach(),
        torch.ones(1, 2),
        torch.ones(1, 2),
        ref_logprobs=torch.full((1, 2), -1.5),
        entropy=torch.tensor([[0.5, 1.5]]),
    )
    assert loss.item() == pytest.approx(-1.0)
    assert (m["loss/policy"], m["entropy"], m["kl/ref"]) == pytest.approx((-1.0, 1.0, 0.5))


def test_kl_coef_in_the_loss_without_reference_logprobs_is_rejected() -> None:
    cfg = config(kl={"coef": 0.1})
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss_and_metrics(cfg, x, None, x, x, torch.ones(1, 2))


def test_padding_with_nan_and_inf_leaves_loss_and_gradient_finite() -> None:
    logprobs = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    junk = torch.tensor([[-1.2, float("nan")]])
    cfg = config(kl={"coef": 0.1}, entropy_coef=0.01)
    loss, m = policy_loss_and_metrics(
        cfg, logprobs, junk, junk, torch.tensor([[1.0, float("nan")]]), torch.tensor([[1, 0]]),
        ref_logprobs=junk, entropy=torch.tensor([[0.3, float("nan")]]),
    )  # fmt: skip
    loss.backward()
    assert logprobs.grad is not None
    assert math.isfinite(loss.item()) and torch.isfinite(logprobs.grad).all()
    assert all(math.isfinite(v) for v in m.values())


# ----------------------------------------------------------------------------- KL estimators


def test_kl_estimators_on_one_token() -> None:
    # pi = 0.5, pi_ref = 0.25: log_r = ln(0.25/0.5) = -0.693147
    # k1 = 0.693147; k2 = 0.693147^2 / 2 = 0.240227; k3 = 0.5 - 1 + 0.693147 = 0.193147
    lp, ref = torch.tensor([[LN(0.5)]]), torch.tensor([[LN(0.25)]])
    got = [kl_estimate(lp, ref, k).item() for k in ("k1", "k2", "k3")]
    assert got == pytest.approx([0.693147, 0.240227, 0.193147], abs=1e-6)


def test_kl_estimators_match_the_closed_form_for_gaussians() -> None:
    # pi = N(0, 1), pi_ref = N(mu, 1): log_r(x) = mu x - mu^2/2; KL(pi || pi_ref) = mu^2/2.
    # E[k1] = E[k3] = mu^2/2 (unbiased); E[k2] = E[(mu x - mu^2/2)^2]/2 = mu^2/2 + mu^4/8.
    # Expectations by 80-point Gauss-Hermite quadrature (exact for k1, k2; converged for k3).
    mu = 0.7
    x, w = np.polynomial.hermite_e.hermegauss(80)
    w = torch.tensor(w / math.sqrt(2 * math.pi))
    x = torch.tensor(x)[None, :]
    logprobs = -(x**2) / 2 - 0.5 * math.log(2 * math.pi)
    ref = -((x - mu) ** 2) / 2 - 0.5 * math.log(2 * math.pi)
    expect = {"k1": mu**2 / 2, "k2": mu**2 / 2 + mu**4 / 8, "k3": mu**2 / 2}
    for name, value in expect.items():
        assert (kl_estimate(logprobs, ref, name)[0] * w).sum().item() == pytest.approx(
            value, rel=1e-9
        )


def test_k1_and_k3_are_unbiased_for_categorical_kl() -> None:
    # Summing p(x) * k(x) over the whole support is the exact expectation.
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    closed = torch.distributions.kl_divergence(
        torch.distributions.Categorical(p), torch.distributions.Categorical(q)
    ).item()
    for name in ("k1", "k3"):
        estimate = (p * kl_estimate(p.log()[None], q.log()[None], name)[0]).sum().item()
        assert estimate == pytest.approx(closed, rel=1e-12)


def test_k3_is_never_negative() -> None:
    gen = torch.Generator().manual_seed(0)
    lp, ref = torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen)
    assert (kl_estimate(lp, ref, "k3") >= 0).all()


# ----------------------------------------------------------------------------- TIS / MIS


def test_tis_weights_are_the_ratio_capped_and_detached() -> None:
    # ratio pi_train/pi_rollout = [0.5, 1, 3], cap 2 -> [0.5, 1, 2]
    rollout = torch.full((1, 3), -1.0)
    train = (rollout + torch.tensor([[LN(0.5), 0.0, LN(3.0)]])).requires_grad_()
    w = importance_weights(train, rollout, torch.ones(1, 3), "tis", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 2.0]]))
    assert not w.requires_grad


def test_mis_drops_tokens_whose_ratio_is_outside_the_threshold() -> None:
    # threshold 2: keep 1/2 <= ratio <= 2 -> [0.4 drop, 1 keep, 3 drop, 2 keep]
    rollout = torch.zeros(1, 4)
    train = torch.tensor([[LN(0.4), 0.0, LN(3.0), LN(2.0)]])
    w = importance_weights(train, rollout, torch.ones(1, 4), "mis", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0, 1.0]]))


def test_sequence_level_weights_use_the_geometric_mean_ratio() -> None:
    # seq 0: ratios [2, 8] -> exp((ln 2 + ln 8)/2) = 4; seq 1: [0.5, 2] -> 1
    # TIS cap 2 -> [2, 2], [1, 1]; MIS threshold 2 -> seq 0 dropped whole, seq 1 kept
    rollout = torch.zeros(2, 2)
    train = torch.tensor([[LN(2.0), LN(8.0)], [LN(0.5), LN(2.0)]])
    mask = torch.ones(2, 2)
    tis = importance_weights(train, rollout, mask, "tis", cap=2.0, level="sequence")
    mis = importance_weights(train, rollout, mask, "mis", threshold=2.0, level="sequence")
    torch.testing.assert_close(tis, torch.tensor([[2.0, 2.0], [1.0, 1.0]]))
    torch.testing.assert_close(mis, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))


def test_tis_weights_scale_each_token_of_the_on_policy_loss() -> None:
    # old None (one update per batch): ratio 1, A = 1 -> pg = -w; w = [0.5, 1, 2] (cap 2 on 3)
    # token_mean = -(0.5 + 1 + 2)/3 = -1.1666667; d/d log pi_t = -w_t / 3
    rollout = torch.full((1, 3), -1.0)
    logprobs = (rollout + torch.tensor([[LN(0.5), 0.0, LN(3.0)]])).requires_grad_()
    cfg = config(importance={"mode": "tis", "cap": 2.0})
    loss, m = policy_loss_and_metrics(
        cfg, logprobs, None, rollout, torch.ones(1, 3), torch.ones(1, 3)
    )
    loss.backward()
    assert loss.item() == pytest.approx(-3.5 / 3)
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -1.0, -2.0]]) / 3)
    assert m["mismatch/truncated_frac"] == pytest.approx(1 / 3)


def test_mis_removes_dropped_tokens_from_the_loss_and_reports_the_fraction() -> None:
    # ratios [0.4, 1, 3, 2]: tokens 0 and 2 dropped; A = [1, 2, 4, 8], on-policy pg = -A * keep
    # token_mean keeps the normaliser 4: -(2 + 8)/4 = -2.5; masked 2 of 4
    rollout = torch.zeros(1, 4)
    logprobs = torch.tensor([[LN(0.4), 0.0, LN(3.0), LN(2.0)]], requires_grad=True)
    cfg = config(importance={"mode": "mis", "threshold": 2.0})
    adv = torch.tensor([[1.0, 2.0, 4.0, 8.0]])
    loss, m = policy_loss_and_metrics(cfg, logprobs, None, rollout, adv, torch.ones(1, 4))
    assert loss.item() == pytest.approx(-2.5)
    assert m["mismatch/masked_frac"] == 0.5


def test_bypass_ratio_is_against_the_engine_and_mismatch_compares_current_logprobs() -> None:
    # old = the engine's logprobs (several updates, no recompute): the PPO ratio is pi / pi_rollout
    # = [1.5, 0.5, 1.1, 3.5] as in ppo_example, so the loss is its 0.355 (clip 0.2/0.28, dual 3);
    # mismatch/* compare the current logprobs with the engine's: ratio_max 3.5, not 1.
    logprobs, rollout, adv = ppo_example()
    cfg = config(clip_low=0.2, clip_high=0.28, dual_clip=3.0, importance={"mode": "none"})
    loss, m = policy_loss_and_metrics(
        cfg, logprobs, rollout, rollout, adv, torch.ones(1, 4), old_is_rollout=True
    )
    assert (loss.item(), m["mismatch/ratio_max"]) == pytest.approx((0.355, 3.5), abs=1e-6)


def test_bypass_refuses_a_tis_weight_it_cannot_compute() -> None:
    logprobs, rollout, adv = ppo_example()
    with pytest.raises(ValueError, match="needs pi_old"):
        policy_loss_and_metrics(
            config(), logprobs, rollout, rollout, adv, torch.ones(1, 4), old_is_rollout=True
        )


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_a_job_with_several_updates_and_tis_or_mis_must_recompute_old_logprobs(mode) -> None:
    with pytest.raises(ValueError, match="recompute_old_logprobs: true"):
        config(ppo_epochs=2, importance={"mode": mode})
    assert config(ppo_epochs=2, mini_batches=2, recompute_old_logprobs=True).ppo_epochs == 2


def test_mismatch_metrics_give_kl_and_ratio_percentiles_over_the_mask() -> None:
    # ratios [1, 2, 4, 8, 16] (+ a padded 1000 that must not count)
    # p50 = 4; p90 at rank 0.9*4 = 3.6 -> 8 + 0.6*8 = 12.8; p99 at 3.96 -> 8 + 0.96*8 = 15.68
    # kl = mean(r - 1 - ln r) = (0 + 1 + 3 + 7 + 15 - ln(2*4*8*16))/5 = (26 - 6.9314718)/5
    rollout = torch.zeros(1, 6)
    train = torch.tensor([[LN(r) for r in (1, 2, 4, 8, 16, 1000)]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    m = {k: v.item() for k, v in mismatch_metrics(train, rollout, mask).items()}
    assert m["mismatch/ratio_p50"] == pytest.approx(4.0)
    assert m["mismatch/ratio_p90"] == pytest.approx(12.8)
    assert m["mismatch/ratio_p99"] == pytest.approx(15.68)
    assert (m["mismatch/ratio_min"], m["mismatch/ratio_max"]) == pytest.approx((1.0, 16.0))
    assert m["mismatch/kl"] == pytest.approx((26 - LN(1024)) / 5)


def test_mismatch_is_reported_even_when_no_correction_is_applied() -> None:
    rollout = torch.zeros(1, 2)
    logprobs = torch.tensor([[LN(2.0), 0.0]])
    cfg = config(importance={"mode": "none"})
    _, m = policy_loss_and_metrics(cfg, logprobs, None, rollout, torch.ones(1, 2), torch.ones(1, 2))
    # ratios [2, 1]: max 2, p50 1.5; weights all 1; 1 of 2 above cap 2? no (2 is not > 2)
    assert (m["mismatch/ratio_max"], m["mismatch/ratio_p50"]) == pytest.approx((2.0, 1.5))
    assert (m["mismatch/weight_mean"], m["mismatch/truncated_frac"]) == (1.0, 0.0)


# ----------------------------------------------------------------------------- critic


def test_value_loss_is_clipped_around_the_old_values() -> None:
    # clip 0.2, returns 1:
    # t0 V 1.5 (old 1.0): clipped V = 1.2 -> max(0.5*0.5^2 = 0.125, 0.5*0.2^2 = 0.02) = 0.125
    # t1 V 0.6 (old 0.2): clipped V = 0.4 -> max(0.5*0.4^2 = 0.08, 0.5*0.6^2 = 0.18) = 0.18
    # token_mean (0.125 + 0.18)/2 = 0.1525; the clipped term won on 1 of 2 tokens
    values = torch.tensor([[1.5, 0.6]], requires_grad=True)
    loss, m = value_loss_and_metrics(
        config(value_clip=0.2),
        values,
        torch.tensor([[1.0, 0.2]]),
        torch.ones(1, 2),
        torch.ones(1, 2),
    )
    assert loss.item() == pytest.approx(0.1525)
    assert m["value/clip_frac"] == 0.5


def test_a_value_inside_the_clip_range_is_not_counted_as_clipped_in_float32() -> None:
    # |V - old| = 0.134 < 0.2, but old + (V - old) is one float32 step away from V.
    old, v, ret = -0.1674894541501999, -0.03337755426764488, 0.49365633726119995
    values = torch.tensor([[v]], dtype=torch.float32, requires_grad=True)
    returns = torch.tensor([[ret]], dtype=torch.float32)
    loss, m = value_loss_and_metrics(
        config(value_clip=0.2),
        values,
        torch.tensor([[old]], dtype=torch.float32),
        returns,
        torch.ones(1, 1),
    )
    assert m["value/clip_frac"] == 0.0
    assert loss.item() == (0.5 * (values.detach() - returns) ** 2).item()
