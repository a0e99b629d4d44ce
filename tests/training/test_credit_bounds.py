"""Turn advantages on hand-built groups: bounded whatever the reward spread, ``anchor`` as GiGPO
(arXiv 2505.10978) defines it, and the groups ``dynamic_sampling`` keeps for their turns.

Every episode here acts from one-token observations: turn ``t`` is shown the id ``obs[t]`` and
samples one token, so the turns that share an observation id share an anchor group. Each
expected value is derived in the test's comments, from the paper's formulas: the episode term
``(R - mean R) / (std R + 1e-4)`` over the group, the step term ``(G - mean G) / (std G +
1e-4)`` over the anchor group (Bessel's std, as ``torch.std``), ``G_t = r_t + gamma G_{t+1}``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import pytest
import torch

from agile_llmenvs.core import EpisodeData, StopReason, Task, TokenSample, Trajectory
from agile_llmenvs.core.trajectory import finished_rewards
from agile_llmenvs.llm_envs.batch_builder import BatchBuilder
from agile_llmenvs.training.credit import (
    AnchorSettings,
    anchor_signal,
    batch_turn_advantages,
    turn_scale,
)
from agile_llmenvs.training.objective import group_advantages, group_rewards, reward_scale

EPS = 1e-4
GIGPO = AnchorSettings()  # gamma 0.95, omega 1


def episode(obs: Sequence[int], rewards: Sequence[float], slot: int) -> Trajectory:
    """Turn ``t`` shown the id ``obs[t]``, sampling the id ``100 + t``, rewarded
    ``rewards[t]``."""
    ids = [i for t, o in enumerate(obs) for i in (o, 100 + t)]
    positions = range(len(ids) - 1)  # position i describes ids[i + 1]
    sample = TokenSample(
        tuple(ids),
        tuple(i % 2 == 0 for i in positions),
        tuple(i // 2 if i % 2 == 0 else -1 for i in positions),
    )
    data = EpisodeData((sample,), tuple(rewards), StopReason.TERMINATED)
    return Trajectory(0, slot, Task(seed=0), data)


def group(*members: tuple[Sequence[int], Sequence[float]]) -> list[Trajectory]:
    return [episode(obs, rewards, slot) for slot, (obs, rewards) in enumerate(members)]


def turn_advantages(
    trajectories: list[Trajectory],
    credit: str,
    scale: str = "group",
    values: dict[int, dict[int, float]] | None = None,
    anchor: AnchorSettings = GIGPO,
) -> list[list[float] | None]:
    rewards_GN = group_rewards([t.reward for t in trajectories], len(trajectories))
    advantages_GN, kept_GN = group_advantages(rewards_GN, scale=scale)  # type: ignore[arg-type]
    turns = batch_turn_advantages(
        credit,
        trajectories,
        rewards_GN,
        advantages_GN,
        kept_GN,
        reward_scale(rewards_GN, scale=scale),  # type: ignore[arg-type]
        values,
        anchor=anchor,
        normalise=scale != "none",
        batch_scale=scale == "batch",
    )
    return turns.per_turn


def test_turn_mc_on_a_group_of_equal_returns_is_bounded() -> None:
    # four episodes of two turns, rewards (0, 1): every return 1, the group's std 0.
    # V(s_0) = 1; V(s_1) by member 0.5, 1.0, 1.0, 0.75, so the turn terms r + V' - V are
    # (-0.5, 0.5), (0, 0), (0, 0), (-0.25, 0.25). Divided by 0 + 1e-4 they were +-5000.
    trajectories = group(*[((1, 2), (0.0, 1.0))] * 4)
    values = {0: {1: 0.5}, 1: {1: 1.0}, 2: {1: 1.0}, 3: {1: 0.75}}
    # their RMS: sqrt((0.25 + 0.25 + 0.0625 + 0.0625) / 8) = sqrt(0.078125)
    rms = math.sqrt(0.078125)
    expected = [[-0.5 / rms, 0.5 / rms], [0.0, 0.0], [0.0, 0.0], [-0.25 / rms, 0.25 / rms]]
    for scale in ("group", "batch"):
        got = turn_advantages(trajectories, "turn_mc", scale, values)
        for member, want in zip(got, expected, strict=True):
            assert member == pytest.approx(want, abs=1e-12)
        # |x| <= sqrt(sum x^2) = sqrt(8) x RMS: no advantage passes sqrt(8)
        assert max(abs(a) for member in got for a in member or ()) <= math.sqrt(8)
    # scale_rewards: none divides by nothing: the terms themselves
    got = turn_advantages(trajectories, "turn_mc", "none", values)
    assert got == [[-0.5, 0.5], [0.0, 0.0], [0.0, 0.0], [-0.25, 0.25]]


def test_turn_scale_is_the_reward_scale_unless_the_terms_are_wider() -> None:
    assert turn_scale(0.5, squares=4 * 0.01, count=4) == 0.5  # RMS 0.1 < 0.5
    assert turn_scale(1e-4, squares=4 * 0.01, count=4) == pytest.approx(0.1)
    assert turn_scale(0.3, squares=0.0, count=0) == 0.3


def test_anchor_on_a_group_of_equal_returns_is_bounded() -> None:
    # every return is 1 (episode terms 0), but member 0 earns it as 0.5 + 0.5.
    # Anchor group of observation 1, G_0 = r_0 + 0.95 r_1: 0.975, 0.95, 0.95, 0.95;
    #   mean 0.95625, deviations 0.01875 and -0.00625 (x3), std sqrt(0.00046875 / 3) = 0.0125.
    # Observation 2, G_1 = r_1: 0.5, 1, 1, 1; mean 0.875, deviations -0.375 and 0.125 (x3),
    #   std sqrt(0.1875 / 3) = 0.25. Undiscounted and over the episode group's 0 + 1e-4 (the
    #   old anchor), member 0's second turn got -0.375 / 1e-4 = -3750.
    trajectories = group(((1, 2), (0.5, 0.5)), *[((1, 2), (0.0, 1.0))] * 3)
    got = turn_advantages(trajectories, "anchor")
    first = [0.01875 / (0.0125 + EPS), -0.375 / (0.25 + EPS)]
    others = [-0.00625 / (0.0125 + EPS), 0.125 / (0.25 + EPS)]
    assert got[0] == pytest.approx(first, abs=1e-9)
    for member in got[1:]:
        assert member == pytest.approx(others, abs=1e-9)
    # a step term over its anchor group's std is within (n - 1) / sqrt(n) = 1.5 for n = 4
    assert max(abs(a) for member in got for a in member or ()) <= 1.5


def test_a_one_turn_member_is_in_its_anchor_group() -> None:
    # returns 1, 1 (one turn each, at observation 1), 0 (observations 1, 2; rewards 0, 0) and
    # 0.5 (observations 1, 3; rewards 0, 0.5). Episode terms: mean 0.625, std
    # sqrt((0.140625 x 2 + 0.390625 + 0.015625) / 3) = sqrt(0.6875 / 3).
    # Observation 1's anchor group is all four first turns: G = 1, 1, 0, 0.95 x 0.5 = 0.475;
    # mean 0.61875, deviations 0.38125 (x2), -0.61875, -0.14375, std sqrt(0.69421875 / 3).
    # Leaving the one-turn members out (the old anchor) compared member 3 with member 2 alone
    # and gave its first turn +0.261, the sign of neither term.
    trajectories = group(((1,), (1.0,)), ((1,), (1.0,)), ((1, 2), (0.0, 0.0)), ((1, 3), (0.0, 0.5)))
    got = turn_advantages(trajectories, "anchor")
    episode_std = math.sqrt(0.6875 / 3) + EPS
    anchor_std = math.sqrt(0.69421875 / 3) + EPS
    episode_terms = [0.375 / episode_std, 0.375 / episode_std, -0.625 / episode_std]
    episode_terms.append(-0.125 / episode_std)
    step_terms = [0.38125 / anchor_std, 0.38125 / anchor_std, -0.61875 / anchor_std]
    step_terms.append(-0.14375 / anchor_std)
    # the second turns are alone in their anchor groups (observations 2 and 3): step term 0
    expected = [
        [episode_terms[0] + step_terms[0]],
        [episode_terms[1] + step_terms[1]],
        [episode_terms[2] + step_terms[2], episode_terms[2]],
        [episode_terms[3] + step_terms[3], episode_terms[3]],
    ]
    for member, want in zip(got, expected, strict=True):
        assert member == pytest.approx(want, abs=1e-12)
    assert got[3] is not None
    assert got[3][0] == pytest.approx(-0.56, abs=5e-3)  # GiGPO's figure


def test_the_discount_tells_a_looping_turn_from_the_useful_one() -> None:
    # member 0 is shown observation 1, loops back to it, then earns 1; member 1 earns 1 at
    # once; members 2 and 3 earn 0. Observation 1's anchor group holds all five turns.
    # gamma 0.95: G = 0.95 (the loop), 1 (the useful turn), 1, 0, 0; mean 0.59, deviations
    #   0.36, 0.41, 0.41, -0.59, -0.59; std sqrt(1.162 / 4).
    # gamma 1: G = 1, 1, 1, 0, 0: the loop and the useful turn get the same.
    trajectories = group(((1, 1), (0.0, 1.0)), ((1,), (1.0,)), ((1,), (0.0,)), ((1,), (0.0,)))
    episode_term = 0.5 / (math.sqrt(1 / 3) + EPS)
    std = math.sqrt(1.162 / 4) + EPS
    got = turn_advantages(trajectories, "anchor")
    assert got[0] == pytest.approx(
        [episode_term + 0.36 / std, episode_term + 0.41 / std], abs=1e-12
    )
    undiscounted = turn_advantages(trajectories, "anchor", anchor=AnchorSettings(gamma=1.0))
    assert undiscounted[0] is not None
    assert undiscounted[0][0] == undiscounted[0][1]


def test_omega_weighs_the_step_term_and_none_leaves_it_unscaled() -> None:
    # the one-turn-member group again: member 3's first turn under scale_rewards: none is
    # (0.5 - 0.625) + omega (0.475 - 0.61875)
    trajectories = group(((1,), (1.0,)), ((1,), (1.0,)), ((1, 2), (0.0, 0.0)), ((1, 3), (0.0, 0.5)))
    for omega in (0.0, 0.5, 2.0):
        got = turn_advantages(trajectories, "anchor", "none", anchor=AnchorSettings(omega=omega))
        assert got[3] == pytest.approx([-0.125 + omega * -0.14375, -0.125], abs=1e-12)


def test_anchor_signal_says_which_equal_reward_groups_still_train() -> None:
    signal = partial(anchor_signal, gamma=0.95)
    # equal returns, different returns to go from a shared observation: signal
    assert signal(group(((1, 2), (0.5, 0.5)), ((1, 2), (0.0, 1.0))))
    # identical episodes: none
    assert not signal(group(((1, 2), (0.0, 1.0)), ((1, 2), (0.0, 1.0))))
    # the returns to go differ only where no observation is shared: none
    assert not signal(group(((1, 2), (0.5, 0.5)), ((1, 3), (0.5, 0.5))))
    # under gamma 1 the reward's timing alone is no signal; under 0.95 it is
    late = group(((1, 2, 3), (0.0, 0.0, 1.0)), ((1, 4), (0.0, 1.0)))
    assert signal(late)
    assert not anchor_signal(late, gamma=1.0)


def test_dynamic_sampling_keeps_a_group_whose_turns_carry_signal() -> None:
    informative = group(((1, 2), (0.0, 1.0)), ((1, 3), (0.0, 0.0)))
    flat = group(((1, 2), (0.0, 1.0)), ((1, 2), (0.0, 1.0)))
    turns = group(((1, 2), (0.5, 0.5)), ((1, 2), (0.0, 1.0)))
    played = [tuple(informative), tuple(flat), tuple(turns)]

    def record(g: tuple[Trajectory, ...]) -> bool:
        return len(set(finished_rewards(g))) > 1

    for turn_signal, kept in [(None, [0]), (partial(anchor_signal, gamma=0.95), [0, 2])]:
        builder = BatchBuilder(
            3, 2, record, dynamic_sampling=True, max_attempts=1, turn_signal=turn_signal
        )
        builder.add_round(played)
        assert builder.kept == [played[i] for i in kept]
        assert builder.spare == [played[i] for i in range(3) if i not in kept]


def test_every_kept_member_gets_turn_advantages_on_several_groups() -> None:
    # two groups: one spread (returns 1, 0), one equal (returns 1, 1): the batch scale is the
    # std of 1, 0, 1, 1 about 0.75, sqrt(0.75 / 3) = 0.5, plus 1e-4; turn_mc without values
    # gives each member one segment, R - mean: 0.5, -0.5, 0, 0, well within the scale
    trajectories = [
        *group(((1, 2), (0.0, 1.0)), ((1, 2), (0.0, 0.0))),
        *group(((1, 2), (0.0, 1.0)), ((1, 2), (0.0, 1.0))),
    ]
    trajectories = [Trajectory(i // 2, i, t.task, t.episode) for i, t in enumerate(trajectories)]
    rewards_GN = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    advantages_GN, kept_GN = group_advantages(rewards_GN, scale="batch")
    turns = batch_turn_advantages(
        "turn_mc",
        trajectories,
        rewards_GN,
        advantages_GN,
        kept_GN,
        reward_scale(rewards_GN, scale="batch"),
        {},
        batch_scale=True,
    )
    scale = 0.5 + EPS
    expected = [[0.5 / scale] * 2, [-0.5 / scale] * 2, [0.0] * 2, [0.0] * 2]
    for member, want in zip(turns.per_turn, expected, strict=True):
        assert member == pytest.approx(want, abs=1e-12)
    assert turns.fallback_episodes == 4
