"""The objectives against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from agile_llmenvs.training.losses import (
    TokenCounts,
    approx_kl,
    dpo_loss,
    group_advantages,
    group_rewards,
    policy_token_loss,
    token_weights,
)


def test_group_advantages_centre_each_group() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    advantages, kept = group_advantages(rewards, scale=False)
    assert advantages.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    assert kept.all()


def test_group_advantages_scaled_by_population_std() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0]])
    advantages, _ = group_advantages(rewards, scale=True, eps=0.0)
    std = math.sqrt(0.25**2 * 3 + 0.75**2) / 2  # population std of (1, 0, 0, 0) = sqrt(3)/4
    assert std == pytest.approx(math.sqrt(3) / 4)
    expected = [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std]
    assert advantages[0].tolist() == pytest.approx(expected)
    # equal rewards: 0 / (0 + eps) stays 0 instead of NaN
    assert group_advantages(rewards, scale=True)[0][1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_rewards_closer_than_float32_resolves_keep_their_difference() -> None:
    # 100.0 and 100.00001: the mean is 100.000005, each member 5e-6 from it, and the
    # population std is 5e-6, so the scaled advantages are -+5e-6 / (5e-6 + 1e-6) = -+5/6;
    # float32 holds 100.00001 as 100.0000076 (its spacing at 100 is 7.6e-6) and rounds the
    # mean down to 100.0, which gave (0, +1.19)
    rewards = group_rewards([100.0, 100.00001, 7.0, 7.0], group_size=2)
    assert rewards.dtype == torch.float64
    assert rewards.shape == (2, 2)
    advantages, _ = group_advantages(rewards, scale=True)
    assert advantages[0].tolist() == pytest.approx([-5 / 6, 5 / 6], rel=1e-9)
    assert advantages[1].tolist() == [0.0, 0.0]


def test_a_failed_member_is_no_reward_of_zero() -> None:
    # three members score 1.0 and one env crashed (its "reward" 0 is no score)
    rewards = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    finished = torch.tensor([[True, True, True, False]])
    advantages, kept = group_advantages(rewards, scale=True, finished_GN=finished)
    # the finished members all scored 1.0: no comparison, nothing to push up or down
    # (counting the crash as 0 gave 0.577, 0.577, 0.577, -1.732)
    assert advantages.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    assert kept.tolist() == [[True, True, True, False]]


def test_group_statistics_use_only_the_finished_members() -> None:
    rewards = torch.tensor([[1.0, 0.0, 1.0, 5.0]])
    finished = torch.tensor([[True, True, True, False]])
    advantages, _ = group_advantages(rewards, scale=True, finished_GN=finished, eps=0.0)
    # mean of (1, 0, 1) = 2/3; centred (1/3, -2/3, 1/3); population std = sqrt(2)/3
    std = math.sqrt(2) / 3
    expected = [1 / 3 / std, -2 / 3 / std, 1 / 3 / std, 0.0]
    assert advantages[0].tolist() == pytest.approx(expected)


def test_a_group_left_with_one_finished_member_is_dropped() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    finished = torch.tensor([[True, False, False], [True, True, True]])
    advantages, kept = group_advantages(rewards, scale=False, finished_GN=finished)
    assert kept.tolist() == [[False, False, False], [True, True, True]]
    assert advantages[0].tolist() == [0.0, 0.0, 0.0]
    assert advantages[1].tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3])


# Two rows on this process: row 0 samples 2 tokens, row 1 samples 1. The global batch (two
# processes) has 4 rows and 6 sampled tokens; dr_grpo's constant completion length is 5.
MASK = torch.tensor([[True, True, False], [False, True, False]])
COUNTS = TokenCounts(rows=4, tokens=6, local_tokens=3, processes=2, max_completion_tokens=5)


@pytest.mark.parametrize(
    ("loss_type", "row0", "row1"),
    [
        ("grpo", 1 / (4 * 2), 1 / (4 * 1)),  # 1 / (rows * the row's own tokens)
        ("dapo", 1 / 6, 1 / 6),  # 1 / sampled tokens of the global batch
        ("dr_grpo", 1 / (4 * 5), 1 / (4 * 5)),  # 1 / (rows * max completion tokens)
        ("bnpo", 1 / (2 * 3), 1 / (2 * 3)),  # 1 / (processes * this process's tokens)
    ],
)
def test_token_weights_by_hand(loss_type: str, row0: float, row1: float) -> None:
    weights = token_weights(loss_type, MASK, COUNTS)  # type: ignore[arg-type]
    expected = torch.tensor([[row0, row0, 0.0], [0.0, row1, 0.0]])
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=0.0)


def test_clipped_surrogate_by_hand() -> None:
    # ratios exp(log 1.5) = 1.5 and exp(log 0.5) = 0.5, eps 0.2
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.5, 1.0, 1.0]]))
    sampling = torch.zeros(2, 3)
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = policy_token_loss(logps, sampling, advantages, clip_eps=0.2)
    # row 0, A=1: ratio 1.5 -> min(1.5, 1.2) = 1.2; ratio 0.5 -> min(0.5, 0.8) = 0.5
    # row 1, A=-2: ratio 1.5 -> min(-3.0, -2.4) = -3.0 (the pessimistic, unclipped term)
    assert out.loss_BT[mask].tolist() == pytest.approx([-1.2, -0.5, 3.0])
    # the clip removes the gradient only of ratio 1.5 with A > 0: 1 token of 3 (ratio 0.5 with
    # A > 0 and ratio 1.5 with A < 0 keep the unclipped, differentiable term)
    assert out.clipped_BT[mask].tolist() == [True, False, False]
    assert out.clipped_BT[mask].float().mean().item() == pytest.approx(1 / 3)
    assert out.ratio_BT[mask].tolist() == pytest.approx([1.5, 0.5, 1.5])


def test_clip_counts_low_ratios_with_negative_advantage() -> None:
    # ratios (1.5, 0.5, 1.5): A = +1, +1, -1 -> clipped: 1.5 > 1.2 with A > 0 only; and
    # ratios (0.5, 0.9) with A = -1 -> 0.5 < 0.8 clipped, 0.9 not
    logps = torch.log(torch.tensor([[1.5, 0.5], [1.5, 1.0], [0.5, 0.9]]))
    out = policy_token_loss(logps, torch.zeros(3, 2), torch.tensor([1.0, -1.0, -1.0]), clip_eps=0.2)
    assert out.clipped_BT.tolist() == [[True, False], [False, False], [True, False]]


def test_clipped_gradient_is_zero_and_on_policy_gradient_is_advantage_weighted() -> None:
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = policy_token_loss(logps, logps.detach(), torch.tensor([3.0]), clip_eps=0.2)
    out.loss_BT.sum().backward()
    assert logps.grad is not None
    assert logps.grad[0].tolist() == pytest.approx([-3.0, -3.0])  # -A * ratio, ratio 1
    assert not out.clipped_BT.any()
    clipped = torch.log(torch.tensor([[1.5]])).requires_grad_()
    policy_token_loss(
        clipped, torch.zeros(1, 1), torch.tensor([1.0]), clip_eps=0.2
    ).loss_BT.sum().backward()
    assert clipped.grad is not None
    assert clipped.grad.item() == 0.0


def test_kl_term_is_added_per_token_with_beta() -> None:
    logps = torch.tensor([[0.0, -1.0]])
    ref = torch.tensor([[0.0, 0.0]])
    out = policy_token_loss(
        logps, logps, torch.tensor([0.0]), clip_eps=0.2, ref_logps_BT=ref, beta=0.5
    )
    # d = ref - logp = (0, 1): exp(d) - d - 1 = (0, e - 2); advantage 0 leaves only 0.5 * kl
    assert out.kl_BT[0].tolist() == pytest.approx([0.0, math.e - 2])
    assert out.loss_BT[0].tolist() == pytest.approx([0.0, 0.5 * (math.e - 2)])
    assert approx_kl(logps, ref)[0].tolist() == pytest.approx([0.0, math.e - 2])


def test_dpo_loss_by_hand() -> None:
    loss, margin = dpo_loss(
        torch.tensor([-1.0, -2.0]),
        torch.tensor([-3.0, -2.0]),
        torch.tensor([-2.0, -2.0]),
        torch.tensor([-2.0, -2.0]),
        beta=0.5,
    )
    # row 0: margin = (-1 + 2) - (-3 + 2) = 2; loss = -log sigmoid(0.5 * 2) = log(1 + e^-1)
    # row 1: margin 0; loss = log 2
    assert margin.tolist() == pytest.approx([2.0, 0.0])
    assert loss.tolist() == pytest.approx([math.log(1 + math.exp(-1)), math.log(2)])
