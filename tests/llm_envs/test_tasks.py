"""TaskAssigner and its sum tree: shards, epochs, resume, adaptive weights."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from agile_llmenvs.llm_envs import TaskAssigner, TaskRowStats
from agile_llmenvs.llm_envs.sum_tree import SumTree


def epoch_rows(size: int, world: int, epochs: int = 1, seed: int = 3) -> list[list[int]]:
    """Each rank's rows over ``epochs`` epochs."""
    out = []
    for rank in range(world):
        assigner = TaskAssigner(size, seed=seed, rank=rank, world_size=world)
        out.append([assigner.next_task().row_index for _ in range(epochs * assigner.per_epoch)])
    return out  # type: ignore[return-value]


@pytest.mark.parametrize(("size", "world"), [(12, 1), (12, 4), (10, 3), (7, 2), (100, 8), (5, 5)])
def test_shards_are_disjoint_equal_and_cover_every_row(size: int, world: int) -> None:
    shards = epoch_rows(size, world)
    assert len({len(rows) for rows in shards}) == 1  # every rank draws the same count
    assert len(shards[0]) == -(-size // world)
    sets = [set(rows) for rows in shards]
    assert set().union(*sets) == set(range(size))  # every row is served this epoch
    for a in range(world):
        for b in range(a + 1, world):
            assert not sets[a] & sets[b]  # no row on two ranks


def test_epochs_reshuffle_and_count() -> None:
    assigner = TaskAssigner(20, seed=1)
    assert assigner.num_epochs == 0
    first = [assigner.next_task().row_index for _ in range(20)]
    assert assigner.num_epochs == 1
    second = [assigner.next_task().row_index for _ in range(19)]
    assert assigner.num_epochs == 1
    second.append(assigner.next_task().row_index)
    assert assigner.num_epochs == 2
    assert sorted(first) == sorted(second) == list(range(20))
    assert first != second


def test_the_same_seed_gives_the_same_tasks_and_seeds_differ_across_ranks() -> None:
    a, b = TaskAssigner(9, seed=5), TaskAssigner(9, seed=5)
    assert [a.next_task() for _ in range(20)] == [b.next_task() for _ in range(20)]
    ranks = [TaskAssigner(9, seed=5, rank=r, world_size=3) for r in range(3)]
    seeds = [t.seed for r in ranks for t in (r.next_task() for _ in range(6))]
    assert len(set(seeds)) == len(seeds)


def test_procedural_envs_get_disjoint_seeds_and_no_rows() -> None:
    ranks = [TaskAssigner(0, seed=2, rank=r, world_size=2) for r in range(2)]
    tasks = [[rank.next_task() for _ in range(50)] for rank in ranks]
    assert all(t.row_index is None for ts in tasks for t in ts)
    assert not {t.seed for t in tasks[0]} & {t.seed for t in tasks[1]}
    assert tasks[0][0].reset_kwargs() == {"seed": tasks[0][0].seed}


@pytest.mark.parametrize("adaptive", [False, True])
def test_state_dict_resumes_the_exact_sequence(adaptive: bool) -> None:
    assigner = TaskAssigner(13, seed=4, rank=1, world_size=2, adaptive=adaptive)
    for _ in range(10):
        task = assigner.next_task()
        assigner.record_outcome(task.row_index, [0.0, float(task.row_index % 2)])
    state = assigner.state_dict()
    expected = [assigner.next_task() for _ in range(25)]
    resumed = TaskAssigner(13, seed=4, rank=1, world_size=2, adaptive=adaptive)
    resumed.load_state_dict(state)
    assert [resumed.next_task() for _ in range(25)] == expected


def test_adaptive_weights_move_toward_informative_rows() -> None:
    assigner = TaskAssigner(40, seed=0, adaptive=True)
    before = assigner.row_weight(7)
    for _ in range(10):
        assert assigner.record_outcome(7, [0.0, 1.0, 0.0]) is True
        assert assigner.record_outcome(8, [1.0, 1.0, 1.0]) is False
    assert assigner.row_weight(7) > before > assigner.row_weight(8)
    draws = Counter(assigner.next_task().row_index for _ in range(4000))
    assert draws[7] > 10 * draws[8]
    assert set(draws) <= set(range(40))


def test_adaptive_draws_stay_in_the_ranks_shard() -> None:
    assigner = TaskAssigner(30, seed=0, rank=2, world_size=3, adaptive=True)
    rows = {assigner.next_task().row_index for _ in range(500)}
    assert rows
    assert all(row % 3 == 2 for row in rows)
    with pytest.raises(ValueError, match="row 4 has no adaptive weight on rank 2"):
        assigner.row_weight(4)


def test_argument_errors() -> None:
    with pytest.raises(
        ValueError, match=r"rank must be < world_size, got rank=2 with world_size=2"
    ):
        TaskAssigner(10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="3 rows cannot give each of 4 ranks a shard"):
        TaskAssigner(3, world_size=4)


def test_sum_tree_draws_in_proportion_and_updates() -> None:
    tree = SumTree(5, initial=0.0)
    for index, weight in enumerate([1.0, 0.0, 3.0, 0.0, 6.0]):
        tree.update(index, weight)
    assert tree.total == 10.0
    assert [tree.find(m) for m in (0.0, 0.99, 1.0, 3.99, 4.0, 9.99)] == [0, 0, 2, 2, 4, 4]
    rng = np.random.default_rng(0)
    counts = Counter(tree.sample(rng) for _ in range(20000))
    assert counts[1] == counts[3] == 0
    assert abs(counts[4] / 20000 - 0.6) < 0.02
    with pytest.raises(ValueError, match="non-negative"):
        tree.update(0, -1.0)


def test_a_sum_tree_built_with_weights_holds_their_sums() -> None:
    # 5 items of weight 2: the total 10, each item's interval [2k, 2k + 2)
    tree = SumTree(5, initial=2.0)
    assert tree.total == 10.0
    assert [tree.find(m) for m in (0.0, 1.99, 2.0, 7.99, 8.0, 9.99)] == [0, 0, 1, 3, 4, 4]
    # 40,000 items of weight 1 in 65,536 leaves: item k's interval [k, k + 1), across
    # subtree boundaries at every level
    big = SumTree(40_000, initial=1.0)
    assert big.total == 40_000.0
    masses = (0.5, 31.5, 32.5, 1023.5, 1024.5, 32767.5, 32768.5, 39999.5)
    assert [big.find(m) for m in masses] == [0, 31, 32, 1023, 1024, 32767, 32768, 39999]
    big.update(39_999, 0.0)
    big.update(5, 3.0)  # item 5 now holds [5, 8); the later items move up by 2
    assert (big.total, big.weight(39_999), big.weight(5)) == (40_001.0, 0.0, 3.0)
    assert [big.find(m) for m in (4.5, 5.0, 7.99, 8.0, 40_000.5)] == [4, 5, 5, 6, 39_998]


@pytest.mark.parametrize("saved_at", [0, 1, 63, 64, 100])
def test_adaptive_draws_resume_exactly_from_a_state_saved_mid_block(saved_at: int) -> None:
    """Uniforms come in blocks of 64: a state saved anywhere in a block, through JSON,
    resumes the same rows and weights."""

    def play(assigner: TaskAssigner, draws: int, start: int = 0) -> list[int]:
        rows = []
        for i in range(start, start + draws):
            row = assigner.next_task().row_index
            assert row is not None
            rows.append(row)
            assigner.record_outcome(row, [0.0, float(i % 3 == 0)])
        return rows

    first = TaskAssigner(500, seed=3, adaptive=True, rank=1, world_size=2)
    before = play(first, saved_at)
    saved = json.loads(json.dumps(first.state_dict()))
    after = play(first, 150, saved_at)
    resumed = TaskAssigner(500, seed=3, adaptive=True, rank=1, world_size=2)
    resumed.load_state_dict(saved)
    assert play(resumed, 150, saved_at) == after
    assert all(row % 2 == 1 for row in before + after)


def test_row_stats_decay_toward_recent_outcomes() -> None:
    stats = TaskRowStats(2, decay=0.5, prior=0.5, floor=0.0)
    stats.record(0, True)
    stats.record(0, True)
    assert stats.weight(0) == pytest.approx(0.875)
    stats.record(0, False)
    assert stats.weight(0) == pytest.approx(0.4375)
