"""GRPO advantages and loss: exact values on hand-computed cases, gradients, clipping, aggregation modes."""

from __future__ import annotations

import math

import pytest
import torch

from daedalus_trainer.grpo import discounted_returns, group_advantages, grpo_loss, step_advantages


def test_group_std_advantages_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    adv, zero = group_advantages(rewards, "group-std", eps=0.0)
    assert zero.tolist() == [False, True, False]
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))
    assert torch.equal(adv[1], torch.zeros(4))
    std = math.sqrt(0.75 * 0.25)  # population std of {0,0,0,1}
    assert torch.allclose(adv[2], torch.tensor([-0.25, -0.25, -0.25, 0.75]) / std)
    assert torch.allclose(adv.sum(dim=1), torch.zeros(3), atol=1e-6)


def test_no_norm_advantages_are_centred_rewards():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    adv, zero = group_advantages(rewards, "none")
    assert torch.allclose(adv, torch.tensor([[0.75, -0.25, -0.25, -0.25]]))
    assert not zero.item()


def test_discounted_returns_of_a_sparse_success():
    assert discounted_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert discounted_returns([0.0, 0.0], 0.9) == [0.0, 0.0]
    assert discounted_returns([], 0.9) == []


def test_step_advantages_hand_computed():
    # one group of 3 episodes on one maze (anchor states are cells); gamma 0.5
    states = [["a", "b", "g"],          # a -> b -> g: reaches the goal in 3 turns
              ["a", "c", "b", "g"],     # a -> c -> b -> g: in 4
              ["a", "c", "c"]]          # a -> c -> c: fails
    rewards = [[0, 0, 1], [0, 0, 0, 1], [0, 0, 0]]
    adv = step_advantages(states, rewards, group_size=3, gamma=0.5, eps=0.0)
    # returns: ep0 [.25, .5, 1]; ep1 [.125, .25, .5, 1]; ep2 [0, 0, 0]
    a = torch.tensor([0.25, 0.125, 0.0], dtype=torch.float64)  # the three turns taken in state a
    za = ((a - a.mean()) / a.std(unbiased=False)).tolist()
    c = torch.tensor([0.25, 0.0, 0.0], dtype=torch.float64)  # ep1's turn in c, ep2's two turns in c
    zc = ((c - c.mean()) / c.std(unbiased=False)).tolist()
    expect = [[za[0], 0.0, 0.0], [za[1], zc[0], 0.0, 0.0], [za[2], zc[1], zc[2]]]
    for got_row, want_row in zip(adv, expect):
        assert got_row == pytest.approx(want_row, abs=1e-9)
    # b (returns 0.5 and 0.5) and g (1 and 1) are step groups of equal returns: 0. From a, the shorter way scores
    # highest and the failure lowest
    assert adv[0][0] > adv[1][0] > adv[2][0]
    # "none": returns centred, not scaled
    adv_none = step_advantages(states, rewards, group_size=3, gamma=0.5, norm="none")
    assert adv_none[0][0] == pytest.approx(0.25 - 0.125)


def test_step_groups_do_not_cross_episode_groups_and_skip_unknown_states():
    # the same cell in two different groups (two mazes) is two anchor states; None is never grouped
    states = [["a"], ["a"], ["a"], [None]]
    rewards = [[1.0], [0.0], [1.0], [0.0]]
    adv = step_advantages(states, rewards, group_size=2, gamma=0.95, eps=0.0)
    assert adv[0] == [1.0] and adv[1] == [-1.0]
    assert adv[2] == [0.0] and adv[3] == [0.0]


def test_every_success_group_still_has_step_signal():
    # all episodes of the group succeed (GRPO: zero variance, no signal); from the shared start cell, the episode
    # that took the direct way gets a positive step advantage, the detour a negative one
    states = [["s", "x", "g"], ["s", "y", "z", "g"]]
    rewards = [[0, 0, 1], [0, 0, 0, 1]]
    episode_adv, zero = group_advantages(torch.tensor([[1.0, 1.0]]))
    assert zero.tolist() == [True] and torch.equal(episode_adv, torch.zeros(1, 2))
    adv = step_advantages(states, rewards, group_size=2, gamma=0.95, eps=0.0)
    assert adv[0][0] == pytest.approx(1.0) and adv[1][0] == pytest.approx(-1.0)
    assert adv[0][1:] == [0.0, 0.0] and adv[1][1:] == [0.0, 0.0, 0.0]


def test_step_advantages_reject_bad_arguments():
    with pytest.raises(ValueError, match="same"):
        step_advantages([["a"]], [[0.0, 1.0]], 1, 0.9)
    with pytest.raises(ValueError, match="groups of 2"):
        step_advantages([["a"]], [[1.0]], 2, 0.9)
    with pytest.raises(ValueError, match="gamma"):
        step_advantages([["a"]], [[1.0]], 1, 0.0)
    with pytest.raises(ValueError, match="unknown advantage"):
        step_advantages([["a"]], [[1.0]], 1, 0.9, norm="rank")


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="groups, group_size"):
        group_advantages(torch.zeros(4), "none")
    with pytest.raises(ValueError, match="unknown advantage"):
        group_advantages(torch.zeros(2, 2), "rank")
    lp = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        grpo_loss(lp, lp, torch.ones(1), torch.ones(1, 3), torch.zeros(1, dtype=torch.long), aggregation="mean")
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, lp, torch.ones(1), torch.ones(1, 3), torch.zeros(1, dtype=torch.long), kl_coef=0.1)


def _batch():
    # Two episodes: episode 0 has two turn rows (3 + 1 tokens), episode 1 one row (2 tokens).
    mask = torch.tensor([[1, 1, 1], [0, 0, 1], [0, 1, 1]], dtype=torch.float32)
    ep = torch.tensor([0, 0, 1])
    adv = torch.tensor([1.0, 1.0, -3.0])  # per row (episode 0 twice); not a zero sum, so each denominator shows
    return mask, ep, adv


def test_on_policy_loss_values_for_each_aggregation():
    mask, ep, adv = _batch()
    lp = torch.zeros(3, 3, requires_grad=True)
    # ratio == 1 on-policy: per-token loss = -A.
    loss, stats = grpo_loss(lp, lp.detach(), adv, mask, ep, aggregation="token-mean")
    # tokens: ep0 4 tokens * -1, ep1 2 tokens * +3 -> (-4 + 6) / 6 assistant tokens (not / 9 positions)
    assert loss.item() == pytest.approx(2.0 / 6)
    assert stats.tokens == 6 and stats.ratio_mean == pytest.approx(1.0) and stats.clip_fraction == 0.0
    loss, _ = grpo_loss(lp, lp.detach(), adv, mask, ep, aggregation="seq-mean-token-sum")
    assert loss.item() == pytest.approx((-4.0 + 6.0) / 2)
    loss, _ = grpo_loss(lp, lp.detach(), adv, mask, ep, aggregation="seq-mean-token-mean")
    assert loss.item() == pytest.approx((-1.0 + 3.0) / 2)


def test_gradient_raises_logprob_of_positive_advantage_tokens():
    mask, ep, adv = _batch()
    lp = torch.full((3, 3), -1.0, requires_grad=True)
    loss, _ = grpo_loss(lp, lp.detach(), adv, mask, ep)
    loss.backward()
    g = lp.grad
    assert (g[0] < 0).all()  # descending the loss raises logp where A > 0
    assert g[1, 2] < 0 and g[1, :2].abs().sum() == 0  # prompt tokens get no gradient
    assert (g[2, 1:] > 0).all() and g[2, 0] == 0


def test_clipping_stops_gradient_outside_the_trust_region():
    mask = torch.ones(2, 1)
    ep = torch.tensor([0, 1])
    adv = torch.tensor([1.0, -1.0])
    old = torch.zeros(2, 1)
    # Row 0: ratio e^0.5 = 1.65 > 1.28 with A > 0 -> clipped; row 1: ratio e^-0.5 = 0.61 < 0.8 with A < 0 -> clipped.
    lp = torch.tensor([[0.5], [-0.5]], requires_grad=True)
    loss, stats = grpo_loss(lp, old, adv, mask, ep, clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(2, 1))
    assert stats.clip_fraction == 1.0
    assert loss.item() == pytest.approx(-(1.28 * 1.0 + 0.8 * -1.0) / 2)
    # Inside the region the gradient flows.
    lp2 = torch.tensor([[0.1], [-0.1]], requires_grad=True)
    loss2, stats2 = grpo_loss(lp2, old, adv, mask, ep)
    loss2.backward()
    assert (lp2.grad.abs() > 0).all() and stats2.clip_fraction == 0.0


def test_kl_k3_is_zero_at_reference_and_positive_elsewhere():
    mask = torch.ones(1, 2)
    ep = torch.zeros(1, dtype=torch.long)
    lp = torch.tensor([[-1.0, -2.0]])
    _, same = grpo_loss(lp, lp, torch.zeros(1), mask, ep, ref_logprobs=lp.clone(), kl_coef=0.1)
    assert same.kl == pytest.approx(0.0)
    ref = torch.tensor([[-1.5, -1.0]])
    loss, diff = grpo_loss(lp, lp, torch.zeros(1), mask, ep, ref_logprobs=ref, kl_coef=0.5)
    d = ref - lp
    k3 = (torch.exp(d) - d - 1).mean().item()
    assert diff.kl == pytest.approx(k3) and k3 > 0
    assert loss.item() == pytest.approx(0.5 * k3)


def test_far_off_policy_tokens_keep_the_loss_and_gradient_finite():
    """A token 100 nats off the behaviour policy (possible with several updates per batch) or the reference: without
    the clamps exp() overflows to inf and the learner would skip the mini-batch; with them the loss is finite, the
    clipped token has no gradient, and k3 stops at KL_CLAMP (verl's bounds)."""
    from daedalus_trainer.grpo import KL_CLAMP, LOG_RATIO_CLAMP

    mask = torch.ones(1, 2)
    ep = torch.zeros(1, dtype=torch.long)
    old = torch.tensor([[-101.0, -1.0]])
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)  # token 0: log-ratio +100
    loss, stats = grpo_loss(lp, old, torch.tensor([-1.0]), mask, ep)
    loss.backward()
    ratio = math.exp(LOG_RATIO_CLAMP)
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx((ratio * 1.0 + 1.0) / 2, rel=1e-5)
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 0] == 0.0 and lp.grad[0, 1] != 0.0
    lp2 = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[99.0, -1.0]])  # ref - logp = 100 on token 0, 0 on token 1
    loss2, stats2 = grpo_loss(lp2, lp2.detach(), torch.zeros(1), mask, ep, ref_logprobs=ref, kl_coef=1.0)
    loss2.backward()
    assert stats2.kl == pytest.approx(KL_CLAMP / 2) and loss2.item() == pytest.approx(KL_CLAMP / 2)
    assert torch.isfinite(lp2.grad).all()


def test_cosine_learning_rate_schedule_values():
    from types import SimpleNamespace

    from daedalus_trainer.grpo import learning_rate_at

    algo = SimpleNamespace(learning_rate=1e-3, steps=4, lr_schedule="cosine")
    # lr * (1 + cos(pi * (step - 1) / 4)) / 2 for steps 1..4: 1, (1 + 1/sqrt2) / 2, 1/2, (1 - 1/sqrt2) / 2
    expected = [1e-3, 1e-3 * (1 + 2 ** -0.5) / 2, 0.5e-3, 1e-3 * (1 - 2 ** -0.5) / 2]
    assert [learning_rate_at(algo, s) for s in (1, 2, 3, 4)] == pytest.approx(expected, rel=1e-12)
    assert learning_rate_at(algo, 9) == pytest.approx(0.0, abs=1e-18)  # past the last step (steps lowered)
    algo.lr_schedule = "constant"
    assert {learning_rate_at(algo, s) for s in (1, 3, 9)} == {1e-3}
    with pytest.raises(ValueError, match="numbered from 1"):
        learning_rate_at(algo, 0)
    algo.lr_schedule = "linear"
    with pytest.raises(ValueError, match="unknown lrSchedule"):
        learning_rate_at(algo, 1)
