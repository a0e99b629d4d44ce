"""The objectives against values worked out by hand."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import pytest
import torch

from agile_llmenvs.training.objective import (
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
    advantages, kept = group_advantages(rewards, scale="none")
    assert advantages.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    assert kept.all()


def test_group_scale_divides_by_the_groups_bessel_std_plus_1e_4() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0]], dtype=torch.float64)
    advantages, _ = group_advantages(rewards, scale="group")
    # mean 0.25; std over n - 1 = 3: sqrt((0.75^2 + 3 * 0.25^2) / 3) = sqrt(0.75 / 3) = 0.5
    # (the population std, over 4, is sqrt(3)/4 = 0.433)
    std = 0.5 + 1e-4
    assert advantages[0].tolist() == pytest.approx(
        [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std]
    )
    # equal rewards: 0 / (0 + 1e-4) stays 0 instead of NaN
    assert advantages[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_rewards_closer_than_float32_resolves_keep_their_difference() -> None:
    # 100.0 and 100.00001: the mean is 100.000005, each member 5e-6 from it, and the
    # Bessel std is sqrt(2 * (5e-6)^2 / 1) = 5e-6 * sqrt(2); float32 holds 100.00001 as
    # 100.0000076 (its spacing at 100 is 7.6e-6) and rounds the mean down to 100.0, which
    # gave the first member 0 and the second a positive advantage
    rewards = group_rewards([100.0, 100.00001, 7.0, 7.0], group_size=2)
    assert rewards.dtype == torch.float64
    assert rewards.shape == (2, 2)
    assert group_advantages(rewards, scale="none")[0][0].tolist() == pytest.approx(
        [-5e-6, 5e-6], rel=1e-6
    )
    advantages, _ = group_advantages(rewards, scale="group")
    scaled = 5e-6 / (5e-6 * math.sqrt(2) + 1e-4)  # 0.0466
    assert advantages[0].tolist() == pytest.approx([-scaled, scaled], rel=1e-6)
    assert advantages[1].tolist() == [0.0, 0.0]


def test_a_failed_member_is_no_reward_of_zero() -> None:
    # three members score 1.0 and one env crashed (its "reward" 0 is no score)
    rewards = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    finished = torch.tensor([[True, True, True, False]])
    advantages, kept = group_advantages(rewards, scale="group", finished_GN=finished)
    # the finished members all scored 1.0: no comparison, nothing to push up or down
    # (counting the crash as 0 gave 0.5, 0.5, 0.5, -1.5)
    assert advantages.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    assert kept.tolist() == [[True, True, True, False]]


def test_a_group_left_with_one_finished_member_is_dropped() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    finished = torch.tensor([[True, False, False], [True, True, True]])
    advantages, kept = group_advantages(rewards, scale="none", finished_GN=finished)
    assert kept.tolist() == [[False, False, False], [True, True, True]]
    assert advantages[0].tolist() == [0.0, 0.0, 0.0]
    assert advantages[1].tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3])


# Three groups of four: group 1's last member failed (its 5.0 is no score); group 2 has one
# finished member, so it is dropped, and its 7.0 counts in no statistic.
REWARDS = torch.tensor(
    [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 5.0], [7.0, 0.0, 0.0, 0.0]], dtype=torch.float64
)
FINISHED = torch.tensor(
    [[True, True, True, True], [True, True, True, False], [True, False, False, False]]
)
# group means: 0.25 and (1 + 1 + 0) / 3 = 2/3
CENTRED = [[0.75, -0.25, -0.25, -0.25], [1 / 3, 1 / 3, -2 / 3, 0.0], [0.0, 0.0, 0.0, 0.0]]
# group stds over n - 1: sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5, and
# sqrt(((1/3)^2 + (1/3)^2 + (2/3)^2) / 2) = sqrt((6/9) / 2) = sqrt(1/3)
GROUP_STDS = [0.5, math.sqrt(1 / 3), 1.0]  # group 2's is never used: it is dropped
# the batch's kept rewards: 1, 0, 0, 0, 1, 1, 0; mean 3/7; three are 4/7 above it, four 3/7
# below; std over n - 1 = 6: sqrt((3 * 16/49 + 4 * 9/49) / 6) = sqrt((84/49) / 6) = sqrt(2/7)
BATCH_STD = math.sqrt(2 / 7)


@pytest.mark.parametrize(
    ("scale", "divisors"),
    [
        ("group", [s + 1e-4 for s in GROUP_STDS]),
        ("batch", [BATCH_STD + 1e-4] * 3),
        ("none", [1.0] * 3),
    ],
)
def test_scale_rewards_by_hand(scale: str, divisors: list[float]) -> None:
    advantages, kept = group_advantages(REWARDS, scale=scale, finished_GN=FINISHED)  # type: ignore[arg-type]
    assert kept.tolist() == [[True] * 4, [True, True, True, False], [False] * 4]
    for group, divisor in enumerate(divisors):
        expected = [a / divisor for a in CENTRED[group]]
        assert advantages[group].tolist() == pytest.approx(expected, rel=1e-12, abs=0.0)


class _TwoProcessSum:
    """An all-reduce sum over two threads, as two processes would run it."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=10)
        self.parts: list[torch.Tensor] = [torch.zeros(0), torch.zeros(0)]

    def of_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def total(tensor: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = tensor
            self.barrier.wait()
            summed = self.parts[0] + self.parts[1]
            self.barrier.wait()  # both have read the parts before either writes again
            return summed

        return total


def test_batch_scale_is_over_the_batch_of_every_process() -> None:
    # process 0 holds groups 0 and 2, process 1 group 1: each divides by the whole batch's std
    shares = ([0, 2], [1])
    summed = _TwoProcessSum()
    results: list[torch.Tensor] = [torch.zeros(0), torch.zeros(0)]

    def run(rank: int) -> None:
        rows = shares[rank]
        results[rank] = group_advantages(
            REWARDS[rows],
            scale="batch",
            finished_GN=FINISHED[rows],
            sum_over_processes=summed.of_rank(rank),
        )[0]

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    divisor = BATCH_STD + 1e-4
    for rank, group, row in ((0, 0, 0), (1, 1, 0), (0, 2, 1)):
        expected = [a / divisor for a in CENTRED[group]]
        assert results[rank][row].tolist() == pytest.approx(expected, rel=1e-12, abs=0.0)


# Two rows on this process: row 0 samples 2 tokens, row 1 samples 1. The global batch (two
# processes) has 4 rows and 6 sampled tokens; the optimizer step accumulates 2 micro-batches;
# dr_grpo's constant completion length is 5.
MASK = torch.tensor([[True, True, False], [False, True, False]])
COUNTS = TokenCounts(rows=4, tokens=6, processes=2, micro_batches=2, max_completion_tokens=5)


@pytest.mark.parametrize(
    ("loss_type", "row0", "row1"),
    [
        ("grpo", 1 / (4 * 2), 1 / (4 * 1)),  # 1 / (rows * the row's own tokens)
        ("dapo", 1 / 6, 1 / 6),  # 1 / sampled tokens of the global batch
        ("dr_grpo", 1 / (4 * 5), 1 / (4 * 5)),  # 1 / (rows * max completion tokens)
        ("bnpo", 1 / (2 * 2 * 3), 1 / (2 * 2 * 3)),  # 1 / (processes * micro-batches * these 3)
    ],
)
def test_token_weights_by_hand(loss_type: str, row0: float, row1: float) -> None:
    weights = token_weights(loss_type, MASK, COUNTS)  # type: ignore[arg-type]
    expected = torch.tensor([[row0, row0, 0.0], [0.0, row1, 0.0]])
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=0.0)


def test_bnpo_is_trls_mean_over_each_micro_batch() -> None:
    # This process's optimizer step: micro-batch 1 (MASK) samples 3 tokens, micro-batch 2 one.
    # TRL's bnpo loss of a micro-batch is sum(loss * mask) / mask.sum() / A (A = 2 gradient
    # accumulation steps), and DDP averages the gradients over P = 2 processes, so a token
    # weighs 1 / (P * A * 3) = 1/12 in micro-batch 1 and 1 / (P * A * 1) = 1/4 in micro-batch 2
    second_mask = torch.tensor([[True, False, False]])
    first = token_weights("bnpo", MASK, COUNTS)
    second = token_weights("bnpo", second_mask, COUNTS)
    expected = torch.tensor([[1 / 12, 1 / 12, 0.0], [0.0, 1 / 12, 0.0]])
    torch.testing.assert_close(first, expected, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(second, torch.tensor([[1 / 4, 0.0, 0.0]]), rtol=1e-6, atol=0.0)
    # per-token losses (9.0 off the mask): TRL's (1/P) * sum over micro-batches of
    # (sum(loss * mask) / mask.sum()) / A = ((0.5 - 1.0 + 2.0) / 3 / 2 + 3.0 / 1 / 2) / 2
    # = (0.25 + 1.5) / 2 = 0.875
    first_loss = torch.tensor([[0.5, -1.0, 9.0], [9.0, 2.0, 9.0]])
    second_loss = torch.tensor([[3.0, 9.0, 9.0]])
    ours = (first * first_loss).sum() + (second * second_loss).sum()
    assert ours.item() == pytest.approx(0.875)


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
