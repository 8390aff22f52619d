"""AReaL's decoupled PPO objective (`decoupled_ppo`) and M2PO's second-moment mask on small
hand-computed examples: the behaviour weight and its cap (mask and clamp), the gradient, the
cases where it is exactly standard PPO or PPO + TIS, and the job settings it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from kuberl.common.config import AlgorithmConfig
from kuberl.trainer.algorithms import (
    decoupled_ppo_policy_loss,
    policy_loss_and_metrics,
    ppo_policy_loss,
    second_moment_mask,
)

LN = math.log


def config(**fields) -> AlgorithmConfig:
    return AlgorithmConfig.model_validate(fields)


def example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # r = pi / pi_prox = [1.5, 0.5, 1.1, 3.5], A = [1, -1, 1, -1]; PPO (clip 0.2 / 0.28) gives
    # [-1.28, 0.8, -1.1, 3.5]. w = pi_prox / pi_behav = [2, 0.5, 1, 8].
    prox = torch.full((1, 4), -1.0)
    logprobs = (prox + torch.tensor([[LN(1.5), LN(0.5), LN(1.1), LN(3.5)]])).requires_grad_()
    behaviour = prox - torch.tensor([[LN(2.0), LN(0.5), 0.0, LN(8.0)]])
    return logprobs, prox, behaviour, torch.tensor([[1.0, -1.0, 1.0, -1.0]])


def test_the_surrogate_is_weighted_by_pi_prox_over_pi_behav_and_tokens_above_the_cap_dropped():
    # cap 5, mask: w = [2, 0.5, 1, 0 (8 > 5)] -> [2 * -1.28, 0.5 * 0.8, -1.1, 0]
    logprobs, prox, behaviour, adv = example()
    loss, stats = decoupled_ppo_policy_loss(
        logprobs, prox, behaviour, adv, torch.ones(1, 4), 0.2, 0.28, behaviour_cap=5.0
    )
    torch.testing.assert_close(loss, torch.tensor([[-2.56, 0.4, -1.1, 0.0]]))
    torch.testing.assert_close(stats["behaviour_weight"], torch.tensor([[2.0, 0.5, 1.0, 0.0]]))
    assert stats["behaviour_dropped"].tolist() == [[False, False, False, True]]


def test_clamp_keeps_a_token_above_the_cap_at_the_cap():
    # cap 5, clamp: w = [2, 0.5, 1, 5] -> t3: 5 * 3.5 = 17.5
    logprobs, prox, behaviour, adv = example()
    loss, stats = decoupled_ppo_policy_loss(
        logprobs, prox, behaviour, adv, torch.ones(1, 4), 0.2, 0.28, 5.0, cap_action="clamp"
    )
    torch.testing.assert_close(loss, torch.tensor([[-2.56, 0.4, -1.1, 17.5]]))
    assert not stats["behaviour_dropped"].any()


def test_the_gradient_is_minus_w_a_r_on_unclipped_tokens_and_the_weight_is_detached():
    # clipped t0, t1 -> 0; t2: -1 * 1 * 1.1; t3 (clamp, w = 5): -5 * (-1) * 3.5 = 17.5
    logprobs, prox, behaviour, adv = example()
    prox.requires_grad_()
    loss, stats = decoupled_ppo_policy_loss(
        logprobs, prox, behaviour, adv, torch.ones(1, 4), 0.2, 0.28, 5.0, cap_action="clamp"
    )
    loss.sum().backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -1.1, 17.5]]))
    assert not stats["behaviour_weight"].requires_grad


def test_with_the_behaviour_policy_equal_to_pi_prox_it_is_standard_ppo():
    torch.manual_seed(0)
    prox = torch.randn(3, 5)
    logprobs = (prox + 0.3 * torch.randn(3, 5)).requires_grad_()
    adv = torch.randn(3, 5)
    expected, _ = ppo_policy_loss(logprobs, prox, adv, 0.2, 0.28, dual_clip=3.0)
    loss, stats = decoupled_ppo_policy_loss(
        logprobs,
        prox,
        prox,
        adv,
        torch.ones(3, 5),
        0.2,
        0.28,
        3.0,
        behaviour_cap=1.01,
        m2_threshold=1e-9,
    )
    torch.testing.assert_close(loss, expected)
    assert not stats["behaviour_dropped"].any()


def test_one_update_with_a_clamped_cap_is_exactly_ppo_with_tis():
    # One update per batch (old None): pi_prox = pi detached. decoupled_ppo (clamp, cap 2) and
    # ppo + TIS (cap 2) are the same objective: equal loss and gradient.
    torch.manual_seed(1)
    rollout = torch.randn(4, 6)
    mask = torch.rand(4, 6) > 0.2
    adv = torch.randn(4, 6)
    results = []
    for cfg in (
        config(importance={"mode": "tis", "cap": 2.0}),
        config(
            policy_loss="decoupled_ppo", decoupled={"behaviour_cap": 2.0, "cap_action": "clamp"}
        ),
    ):
        logprobs = rollout + torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
        logprobs.requires_grad_()
        loss, _ = policy_loss_and_metrics(cfg, logprobs, None, rollout, adv, mask)
        loss.backward()
        results.append((loss.detach(), logprobs.grad))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


def test_pi_prox_from_the_current_pass_equals_a_recomputed_one_at_the_first_update():
    # The free pi_prox (old None) and a recomputed one (same weights) give the same step.
    logprobs, _, behaviour, adv = example()
    cfg = config(policy_loss="decoupled_ppo")
    free, _ = policy_loss_and_metrics(cfg, logprobs, None, behaviour, adv, torch.ones(1, 4))
    recomputed, _ = policy_loss_and_metrics(
        cfg, logprobs, logprobs.detach().clone(), behaviour, adv, torch.ones(1, 4)
    )
    (g_free,) = torch.autograd.grad(free, logprobs)
    (g_recomputed,) = torch.autograd.grad(recomputed, logprobs)
    assert free.item() == pytest.approx(recomputed.item())
    torch.testing.assert_close(g_free, g_recomputed)


def test_dropped_tokens_still_count_in_the_normaliser_and_are_reported():
    # pi = pi_prox (old None): r = 1, A = 1 -> pg = -w; w = pi / pi_behav = [2, 0.5, 1, 0 (8)]
    # token_mean over 4 tokens: -(2 + 0.5 + 1)/4 = -0.875; dropped 1 of 4; mean w 3.5/4
    _, prox, behaviour, _ = example()
    cfg = config(policy_loss="decoupled_ppo")
    loss, m = policy_loss_and_metrics(
        cfg, prox, None, behaviour, torch.ones(1, 4), torch.ones(1, 4)
    )
    assert loss.item() == pytest.approx(-0.875)
    assert m["policy/behaviour_dropped"] == 0.25
    assert m["policy/behaviour_weight"] == pytest.approx(0.875)
    assert m["mismatch/ratio_max"] == pytest.approx(8.0)


def test_m2_mask_leaves_out_the_largest_squared_log_ratios_until_their_mean_is_small():
    # (log w)^2 = [0.01, 0.04, 0.25, 0.09] (+ padding); ascending running means
    # 0.01, 0.025, 0.0467, 0.0975: threshold 0.04 keeps t0, t1; 0.05 also keeps t3
    log_w = torch.tensor([[0.1, -0.2, 0.5, 0.3, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert second_moment_mask(log_w, mask, 0.04).tolist() == [[True, True, False, False, False]]
    assert second_moment_mask(log_w, mask, 0.05).tolist() == [[True, True, False, True, False]]
    assert second_moment_mask(log_w, mask, 1.0).tolist() == [[True, True, True, True, False]]


def test_m2_mask_is_over_every_row_of_the_batch():
    # squares [[0.64, 0], [0.01, 0.04]]: means 0, 0.005, 0.0167, 0.1725 -> 0.02 keeps three
    log_w = torch.tensor([[0.8, 0.0], [0.1, 0.2]])
    keep = second_moment_mask(log_w, torch.ones(2, 2), 0.02)
    assert keep.tolist() == [[False, True], [True, True]]


def test_m2_threshold_drops_tokens_in_the_loss():
    # w = [2, 0.5, 1, 8], (log w)^2 = [0.48, 0.48, 0, 4.32]; no cap, tau 0.2: the running means
    # 0, 0.24, ... keep only t2 -> loss [0, 0, -1.1, 0]
    logprobs, prox, behaviour, adv = example()
    loss, stats = decoupled_ppo_policy_loss(
        logprobs,
        prox,
        behaviour,
        adv,
        torch.ones(1, 4),
        0.2,
        0.28,
        behaviour_cap=None,
        m2_threshold=0.2,
    )
    torch.testing.assert_close(loss, torch.tensor([[0.0, 0.0, -1.1, 0.0]]))
    assert stats["behaviour_dropped"].tolist() == [[True, True, False, True]]


def test_decoupled_ppo_turns_off_importance_unless_the_job_sets_it():
    assert config(policy_loss="decoupled_ppo").importance.mode == "none"
    with pytest.raises(ValueError, match="importance.mode: none"):
        config(policy_loss="decoupled_ppo", importance={"mode": "tis"})


def test_decoupled_ppo_with_several_updates_must_recompute_pi_prox():
    with pytest.raises(ValueError, match="recompute_old_logprobs: true"):
        config(policy_loss="decoupled_ppo", mini_batches=2)
    cfg = config(policy_loss="decoupled_ppo", mini_batches=2, recompute_old_logprobs=True)
    assert cfg.mini_batches == 2


@pytest.mark.parametrize("fields", [{"behaviour_cap": 1.0}, {"m2_threshold": 0}])
def test_decoupled_bounds_out_of_range_are_refused(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        config(policy_loss="decoupled_ppo", decoupled=fields)
