"""The objectives against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from agile_llmenvs.training.losses import (
    approx_kl,
    clipped_policy_loss,
    dpo_loss,
    group_advantages,
    masked_mean,
)


def test_group_advantages_centre_each_group() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    advantages = group_advantages(rewards, scale=False)
    assert advantages.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]


def test_group_advantages_scaled_by_population_std() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0]])
    advantages = group_advantages(rewards, scale=True, eps=0.0)
    std = math.sqrt(0.25**2 * 3 + 0.75**2) / 2  # population std of (1, 0, 0, 0) = sqrt(3)/4
    assert std == pytest.approx(math.sqrt(3) / 4)
    expected = [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std]
    assert advantages[0].tolist() == pytest.approx(expected)
    # equal rewards: 0 / (0 + eps) stays 0 instead of NaN
    assert group_advantages(rewards, scale=True)[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_masked_mean_ignores_masked_out_positions() -> None:
    values = torch.tensor([[1.0, 100.0], [3.0, 5.0]])
    mask = torch.tensor([[True, False], [True, True]])
    assert masked_mean(values, mask).item() == pytest.approx(3.0)
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_clipped_policy_loss_by_hand() -> None:
    # ratios exp(log 1.5) = 1.5 and exp(log 0.5) = 0.5, eps 0.2
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.5, 1.0, 1.0]]))
    sampling = torch.zeros(2, 3)
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, clip_fraction = clipped_policy_loss(logps, sampling, advantages, mask, clip_eps=0.2)
    # row 0, A=1: ratio 1.5 -> min(1.5, 1.2) = 1.2; ratio 0.5 -> min(0.5, 0.8) = 0.5
    # row 1, A=-2: ratio 1.5 -> min(-3.0, -2.4) = -3.0 (the pessimistic, unclipped term)
    assert loss.item() == pytest.approx(-(1.2 + 0.5 - 3.0) / 3)
    # clipped where the two terms differ: 1.5*1 vs 1.2; 0.5 vs 0.8; -3.0 vs -2.4 -> all three
    assert clip_fraction.item() == pytest.approx(1.0)


def test_clipped_policy_loss_on_policy_gradient_is_advantage_weighted() -> None:
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, clip_fraction = clipped_policy_loss(
        logps, logps.detach(), torch.tensor([3.0]), torch.tensor([[True, True]]), clip_eps=0.2
    )
    loss.backward()
    assert loss.item() == pytest.approx(-3.0)
    assert clip_fraction.item() == 0.0
    assert logps.grad is not None
    assert logps.grad[0].tolist() == pytest.approx([-1.5, -1.5])


def test_approx_kl_k3_by_hand() -> None:
    logps = torch.tensor([[0.0, -1.0]])
    ref = torch.tensor([[0.0, 0.0]])
    kl = approx_kl(logps, ref, torch.tensor([[True, True]]))
    # d = ref - logp = (0, 1): exp(d) - d - 1 = (0, e - 2)
    assert kl.item() == pytest.approx((math.e - 2) / 2)


def test_dpo_loss_by_hand() -> None:
    loss, margin = dpo_loss(
        torch.tensor([-1.0]),
        torch.tensor([-3.0]),
        torch.tensor([-2.0]),
        torch.tensor([-2.0]),
        beta=0.5,
    )
    # margin = (-1 + 2) - (-3 + 2) = 2; loss = -log sigmoid(0.5 * 2) = log(1 + e^-1)
    assert margin.item() == pytest.approx(2.0)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)))
