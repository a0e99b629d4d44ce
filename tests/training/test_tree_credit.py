"""``credit: tree`` on a hand-built tree: every value below is derived in the comments from
the formulas in docs/training.md (Turn-level credit, ``tree``), never read off the code.

The group holds two episodes of one task. Episode A (slot 0) plays 3 turns, rewards
(0, 0, 1); episode B (slot 1) 2 turns, rewards (0, 0). Continuations (branches) of A: x1 and
x2 from s_1, y1 and a failed one from s_2; of B: z1 from s_1. Each branch's rewards before
its turn are its episode's.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from agile_llmenvs.core import EpisodeData, RolloutBatch, StopReason, Task, TokenSample, Trajectory
from agile_llmenvs.training.credit.tree import Branch, branch_samples, tree_turn_advantages
from agile_llmenvs.training.grpo.policy_batch import build_policy_batch
from agile_llmenvs.training.objective import group_advantages, group_rewards, reward_scale


def _episode(rewards: Sequence[float], stop: StopReason = StopReason.TERMINATED) -> EpisodeData:
    """Turn ``t`` is shown the id ``10 + t`` and samples the id ``100 + t`` (log-prob
    ``-(t + 1) / 10``): ids ``10, 100, 11, 101, ...``."""
    ids = [i for t in range(len(rewards)) for i in (10 + t, 100 + t)]
    positions = range(len(ids) - 1)  # position i describes ids[i + 1]
    sample = TokenSample(
        tuple(ids),
        tuple(i % 2 == 0 for i in positions),
        tuple(i // 2 if i % 2 == 0 else -1 for i in positions),
        tuple(-(t + 1) / 10 for t in range(len(rewards))),
    )
    return EpisodeData((sample,), tuple(rewards), stop)


EPISODES = [
    Trajectory(0, 0, Task(seed=0), _episode((0, 0, 1))),
    Trajectory(0, 1, Task(seed=0), _episode((0, 0))),
]
X1 = Branch(0, 1, _episode((0, 1, 0)))
X2 = Branch(0, 1, _episode((0, 0)))  # ends early: terminated after turn 1
Y1 = Branch(0, 2, _episode((0, 0, 0)))
FAILED = Branch(0, 2, _episode((0, 0, 5), StopReason.ENV_ERROR))
Z1 = Branch(1, 1, _episode((0, 1)))
BRANCHES = [X1, X2, Y1, FAILED, Z1]


def _advantages(scale: str, branches: Sequence[Branch] = BRANCHES) -> Any:
    rewards_GN = group_rewards([t.reward for t in EPISODES], 2)
    _, kept_GN = group_advantages(rewards_GN, scale=scale)  # type: ignore[arg-type]
    return tree_turn_advantages(
        EPISODES,
        rewards_GN,
        kept_GN,
        reward_scale(rewards_GN, scale=scale),  # type: ignore[arg-type]
        branches,
        normalise=scale != "none",
    )


# Siblings and values. V(s_0) = mean(R_A, R_B) = (1 + 0) / 2 = 0.5.
# A at s_1: G_A(1) = 0 + 1 = 1, x1: 1 + 0 = 1, x2: 0           -> V = 2/3
# A at s_2: G_A(2) = 1, y1: 0 (the failed branch is no sibling)  -> V = 1/2
# B at s_1: G_B(1) = 0, z1: 1                                     -> V = 1/2
# A's terms: turn 0: r_0 + V(s_1) - V(s_0) = 0 + 2/3 - 1/2 = 1/6
#            turn 1: r_1 + V(s_2) - V(s_1) = 0 + 1/2 - 2/3 = -1/6
#            turn 2: r_2 + 0 - V(s_2) = 1 - 1/2 = 1/2
# B's terms: turn 0: 0 + 1/2 - 1/2 = 0; turn 1: 0 + 0 - 1/2 = -1/2
# branches: x1 1 - 2/3 = 1/3, x2 0 - 2/3 = -2/3, y1 0 - 1/2 = -1/2, z1 1 - 1/2 = 1/2
A_TERMS = [1 / 6, -1 / 6, 1 / 2]
B_TERMS = [0.0, -1 / 2]
BRANCH_TURNS = [[0.0, 1 / 3, 1 / 3], [0.0, -2 / 3], [0.0, 0.0, -1 / 2], [0.0, 1 / 2]]


def test_tree_advantages_unscaled() -> None:
    turns = _advantages("none")
    assert turns.per_turn == [pytest.approx(A_TERMS), pytest.approx(B_TERMS)]
    assert turns.fallback_episodes == 0
    assert [values for _, values in turns.branch_rows] == [
        pytest.approx(v) for v in BRANCH_TURNS
    ]  # x1, x2, y1, z1: the failed branch trains nothing


def test_tree_advantages_divided_by_the_group_scale() -> None:
    # the group's reward std (Bessel): sqrt(((1 - .5)^2 + (0 - .5)^2) / 1) = sqrt(0.5), plus
    # eps; the RMS of its 9 terms, sqrt((1+1+9 + 0+9 + 4+16+9 + 9) / 36 / 9) = 0.4231, is
    # smaller, so the scale is the std's
    scale = math.sqrt(0.5) + 1e-4
    turns = _advantages("group")
    assert turns.per_turn == [
        pytest.approx([v / scale for v in A_TERMS]),
        pytest.approx([v / scale for v in B_TERMS]),
    ]
    assert [values for _, values in turns.branch_rows] == [
        pytest.approx([v / scale for v in row]) for row in BRANCH_TURNS
    ]


def test_an_episode_without_branches_keeps_grpos_advantage_and_is_counted() -> None:
    turns = _advantages("none", [X1, X2, Y1])  # B has no branch
    # B: one segment, R_B - V(s_0) = 0 - 0.5 on both turns
    assert turns.per_turn[1] == pytest.approx([-0.5, -0.5])
    assert turns.fallback_episodes == 1


def test_a_branchs_row_trains_its_own_turns_only() -> None:
    [(row, values)] = branch_samples(X1, 0.25)
    # ids 10, 100, 11, 101, 12, 102; sampled targets at positions 0, 2, 4 (turns 0, 1, 2):
    # turn 0's id 100 is the episode's prefix, context here
    assert row.token_ids == (10, 100, 11, 101, 12, 102)
    assert row.action_mask == (False, False, True, False, True)
    assert row.turn_ids == (-1, -1, 1, -1, 2)
    assert row.sampling_logps == (-0.2, -0.3)
    assert values == [0.0, 0.25, 0.25]


def test_branch_rows_follow_the_episodes_in_the_policy_batch() -> None:
    turns = _advantages("none")
    rollout = RolloutBatch(tuple(EPISODES), 2, 1)
    batch = build_policy_batch(
        rollout,
        torch.zeros(2),
        0,
        turn_advantages=turns.per_turn,
        extra_rows=turns.branch_rows,
    )
    assert batch.rows == 2 + 4
    # row 2 is x1: its targets at positions 2 and 4 (turns 1 and 2) carry 1/3, the rest 0
    assert batch.advantages_B[2].tolist() == pytest.approx([0, 0, 1 / 3, 0, 1 / 3])
    assert batch.action_mask_BT[2].tolist() == [False, False, True, False, True]
    # row 0 is A: 1/6, -1/6, 1/2 on its three sampled targets
    assert batch.advantages_B[0].tolist() == pytest.approx([1 / 6, 0, -1 / 6, 0, 1 / 2])
    assert batch.sampling_logps_BT[2].tolist() == pytest.approx([0, 0, -0.2, 0, -0.3])


# -- rank invariance: the same batch on one process and split over two gloo processes --------

GROUP_1 = [  # a second group: C (1, 0) and D (0, 1, 1), with three branches
    (_episode((1, 0)), [Branch(0, 1, _episode((1, 1)))]),
    (_episode((0, 1, 1)), [Branch(1, 1, _episode((0, 0, 0))), Branch(1, 2, _episode((0, 1, 1)))]),
]


def rank_advantages(
    rank: int | None, scale: str, total: Any = None
) -> tuple[list[Any], list[list[float]]]:
    """``tree``'s advantages of the two-group batch on ``rank`` of two processes (group 0 on
    rank 0, group 1 on rank 1, each with local slots), or of the whole batch on one (None)."""
    group_0 = (list(EPISODES), list(BRANCHES))
    group_1 = (
        [Trajectory(0, i, Task(seed=1), data) for i, (data, _) in enumerate(GROUP_1)],
        [b for _, own in GROUP_1 for b in own],
    )
    if rank is not None:
        trajectories, branches = (group_0, group_1)[rank]
    else:  # one process: group 1's slots follow group 0's
        trajectories = group_0[0] + [
            Trajectory(0, 2 + t.slot, t.task, t.episode) for t in group_1[0]
        ]
        branches = group_0[1] + [Branch(2 + b.slot, b.turn, b.episode) for b in group_1[1]]
    rewards_GN = group_rewards([t.reward for t in trajectories], 2)
    _, kept_GN = group_advantages(rewards_GN, scale=scale, sum_over_processes=total)  # type: ignore[arg-type]
    turns = tree_turn_advantages(
        trajectories,
        rewards_GN,
        kept_GN,
        reward_scale(rewards_GN, scale=scale, sum_over_processes=total),  # type: ignore[arg-type]
        branches,
        batch_scale=scale == "batch",
        sum_over_processes=total,
    )
    return turns.per_turn, [list(values) for _, values in turns.branch_rows]


RANK = """
import json, os, sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import test_tree_credit as cases
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)

def total(tensor):
    tensor = tensor.clone()
    dist.all_reduce(tensor)
    return tensor

rank = dist.get_rank()
print(json.dumps({s: cases.rank_advantages(rank, s, total) for s in ("group", "batch")}))
dist.destroy_process_group()
"""


def test_tree_advantages_are_the_same_on_two_gloo_processes(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    here = str(Path(__file__).parent)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, here],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [process.communicate(timeout=120) for process in ranks]
    for process, (_, stderr) in zip(ranks, outputs, strict=True):
        assert process.returncode == 0, stderr[-2000:]
    results = [json.loads(stdout.splitlines()[-1]) for stdout, _ in outputs]
    for scale in ("group", "batch"):
        per_turn, rows = rank_advantages(None, scale)
        split_turns = results[0][scale][0] + results[1][scale][0]
        split_rows = results[0][scale][1] + results[1][scale][1]
        assert split_turns == [pytest.approx(t, abs=1e-12) for t in per_turn]
        assert split_rows == [pytest.approx(r, abs=1e-12) for r in rows]
    # the batch's scale couples the ranks: it differs from the group scale on both
    assert results[0]["batch"] != results[0]["group"]
    assert results[1]["batch"] != results[1]["group"]
