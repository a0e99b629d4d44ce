"""AgileRL's names on TaskAssigner and RolloutCollector, checked against what AgileRL's own tests
assert (tests/test_llm_envs/test_task_assigner.py and test_collector.py there), rewritten for
this library's classes. Where the behaviour differs on purpose, the test pins ours and says
what AgileRL does; docs/migrating.md lists every difference.

Hand-derived values: a row's rate starts at the prior 0.5 and each outcome ``x`` (1 for an
informative group) sets ``rate = 0.8 * rate + 0.2 * x``, so after ``n`` tied groups it is
``0.5 * 0.8**n`` and after ``n`` informative ones ``1 - 0.5 * 0.8**n``; its weight is
``0.05 + rate``.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from typing import Any

import pytest
from echo_envs import RowEnv

from agile_llmenvs.llm_envs import RolloutCollector, RolloutHarness, TaskAssigner
from agile_llmenvs.llm_envs.tasks import TaskRowWeight

FLOOR = 0.05
EOS = 2


def exactly(message: str) -> str:
    """A ``match`` pattern for exactly ``message``."""
    return f"^{re.escape(message)}$"


def tied(n: int) -> float:
    """The rate of a row after ``n`` tied groups."""
    return 0.5 * 0.8**n


def feed(assigner: TaskAssigner, row: int, *, informative: bool, times: int) -> None:
    """Record ``times`` identical outcomes for ``row``, the way AgileRL's tests do."""
    for _ in range(times):
        assigner.record_outcome(row, informative=informative)


# -- TaskAssigner: adaptive sampling -------------------------------------------------------


def test_the_informative_row_is_drawn_far_more_often_than_the_tied_row() -> None:
    assigner = TaskAssigner(2, seed=0, adaptive=True)
    feed(assigner, 0, informative=False, times=20)
    feed(assigner, 1, informative=True, times=20)
    tied_weight, informative_weight = FLOOR + tied(20), FLOOR + 1 - tied(20)

    counts = Counter(assigner.next_row() for _ in range(4000))

    stats = {row.row: row for row in assigner.row_stats()}
    assert stats[0].rate == pytest.approx(tied(20))
    assert stats[0].weight == pytest.approx(tied_weight)
    assert stats[1].weight == pytest.approx(informative_weight)
    assert counts[1] > 8 * counts[0]
    # the weights sum to 2 * FLOOR + 1 = 1.1
    assert counts[0] / 4000 == pytest.approx(tied_weight / 1.1, abs=0.02)


def test_an_always_tied_row_keeps_the_floor_weight() -> None:
    # AgileRL's weight floor is ~0.07 ((0 + 1) / (12 + 2)); ours is FLOOR
    assigner = TaskAssigner(1, seed=0, adaptive=True)

    feed(assigner, 0, informative=False, times=500)

    [stats] = assigner.row_stats()
    assert stats.rate == pytest.approx(tied(500))
    assert stats.weight == FLOOR  # 0.5 * 0.8**500 ~ 1e-49 vanishes beside the floor


def test_unseen_rows_start_at_the_prior() -> None:
    # AgileRL: 0.5 each; ours: FLOOR + prior
    assigner = TaskAssigner(3, seed=0, adaptive=True)

    assert assigner.row_stats() == [TaskRowWeight(row, 0.5, 0.55) for row in range(3)]


def test_a_tied_row_recovers_once_it_turns_informative() -> None:
    assigner = TaskAssigner(1, seed=0, adaptive=True)
    feed(assigner, 0, informative=False, times=20)
    [before] = assigner.row_stats()

    feed(assigner, 0, informative=True, times=16)

    [after] = assigner.row_stats()
    assert before.weight == pytest.approx(FLOOR + tied(20))  # 0.0558
    # 16 informative groups from rate r: 1 - (1 - r) * 0.8**16
    assert after.weight == pytest.approx(FLOOR + 1 - (1 - tied(20)) * 0.8**16)  # 1.0220
    assert before.weight < 0.09
    assert after.weight > 0.7


def test_the_same_seed_and_outcomes_draw_the_same_rows() -> None:
    def draws(seed: int) -> list[int]:
        assigner = TaskAssigner(6, seed=seed, adaptive=True)
        feed(assigner, 2, informative=True, times=5)
        feed(assigner, 4, informative=False, times=5)
        return [assigner.next_row() for _ in range(50)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


def test_adaptive_draws_stay_in_this_ranks_strided_shard() -> None:
    # AgileRL's tested release gives rank 1 of 2 the contiguous rows 5..9; ours owns the
    # rows r % 2 == 1, so a dataset sorted by kind gives every rank the same mix
    assigner = TaskAssigner(10, seed=0, rank=1, world_size=2, adaptive=True)
    feed(assigner, 7, informative=True, times=10)

    rows = {assigner.next_row() for _ in range(200)}

    assert rows == {1, 3, 5, 7, 9}
    assert [row.row for row in assigner.row_stats()] == [1, 3, 5, 7, 9]


def test_shard_sized_adaptive_draws_count_as_epochs() -> None:
    assigner = TaskAssigner(4, seed=0, adaptive=True)

    for _ in range(9):
        assigner.next_row()

    assert assigner.num_epochs == 2


def test_an_outcome_for_a_row_outside_the_shard_is_refused() -> None:
    assigner = TaskAssigner(10, seed=0, rank=0, world_size=2, adaptive=True)

    with pytest.raises(
        ValueError,
        match=exactly(
            "row 5 is outside rank 0's shard: with adaptive sampling, rank 0 of 2 owns rows "
            "0, 2, 4, ..., 8 (r % 2 == 0); record each group's outcome on the rank that drew it"
        ),
    ):
        assigner.record_outcome(5, informative=True)

    assert [row.weight for row in assigner.row_stats()] == [0.55] * 5  # nothing recorded


# -- TaskAssigner: the epoch cycle -----------------------------------------------------------


def test_outcomes_leave_the_epoch_cycle_unchanged_when_not_adaptive() -> None:
    reference = TaskAssigner(5, seed=0)
    assigner = TaskAssigner(5, seed=0)
    feed(assigner, 0, informative=False, times=10)
    feed(assigner, 3, informative=True, times=10)

    rows = [assigner.next_row() for _ in range(15)]

    assert rows == [reference.next_row() for _ in range(15)]
    assert sorted(rows[:5]) == sorted(rows[5:10]) == sorted(rows[10:]) == list(range(5))
    # AgileRL counts a pass when the next one starts (2 here); ours when its last row is drawn
    assert assigner.num_epochs == 3
    assert assigner.row_stats() == []  # no weights outside adaptive sampling


def test_next_row_is_the_row_of_next_task() -> None:
    by_row, by_task = TaskAssigner(7, seed=2), TaskAssigner(7, seed=2)

    assert [by_row.next_row() for _ in range(10)] == [
        by_task.next_task().row_index for _ in range(10)
    ]
    assert by_row.next_task() == by_task.next_task()  # the same sequence afterwards


def test_next_row_of_a_procedural_env_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=exactly(
            "a procedural env (dataset_size=0) has no rows; call next_task() for its seeds"
        ),
    ):
        TaskAssigner(0).next_row()


# -- TaskAssigner: record_outcome's forms and its shard check --------------------------------


def test_record_outcome_takes_rewards_or_informative() -> None:
    assigner = TaskAssigner(4, seed=0, adaptive=True)

    assert assigner.record_outcome(1, [0.0, 1.0]) is True
    assert assigner.record_outcome(1, informative=True) is True
    assert assigner.record_outcome(1, True) is True  # AgileRL's positional form
    assert assigner.record_outcome(2, [1.0, 1.0]) is False
    assert assigner.record_outcome(2, informative=False) is False

    rates = [row.rate for row in assigner.row_stats()]
    assert rates == pytest.approx([0.5, 1 - tied(3), tied(2), 0.5])


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1,), {}), ((1, [1.0, 0.0]), {"informative": True}), ((1, True), {"informative": True})],
    ids=["neither", "rewards-and-informative", "bool-and-informative"],
)
def test_record_outcome_needs_exactly_one_outcome(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    with pytest.raises(
        TypeError,
        match=exactly("record_outcome needs the group's rewards or informative=..., exactly one"),
    ):
        TaskAssigner(4, adaptive=True).record_outcome(*args, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "row", "message"),
    [
        (
            {"dataset_size": 9, "rank": 2, "world_size": 3, "adaptive": True},
            1,
            "row 1 is outside rank 2's shard: with adaptive sampling, rank 2 of 3 owns rows "
            "2, 5, 8 (r % 3 == 2); record each group's outcome on the rank that drew it",
        ),
        (
            {"dataset_size": 4, "adaptive": True},
            4,
            "row 4 is outside rank 0's shard: with adaptive sampling, rank 0 of 1 owns rows "
            "0, 1, 2, 3 (r % 1 == 0); record each group's outcome on the rank that drew it",
        ),
        (
            {"dataset_size": 10, "rank": 1, "world_size": 2},
            10,
            "row 10 is outside rank 1's shard: the epoch cycle deals rows 0..9 across the 2 "
            "rank(s); record only rows this assigner drew",
        ),
        (
            {"dataset_size": 10},
            -1,
            "row -1 is outside rank 0's shard: the epoch cycle deals rows 0..9 across the 1 "
            "rank(s); record only rows this assigner drew",
        ),
        (
            {"dataset_size": 0, "rank": 1, "world_size": 2},
            0,
            "row 0 is outside rank 1's shard: a procedural env (dataset_size=0) has no rows; "
            "record outcomes only for tasks with a row_index",
        ),
    ],
    ids=[
        "adaptive-other-rank",
        "adaptive-past-the-end",
        "cycle-past-the-end",
        "negative",
        "procedural",
    ],
)
def test_outcomes_outside_the_shard_are_refused(
    kwargs: dict[str, Any], row: int, message: str
) -> None:
    with pytest.raises(ValueError, match=exactly(message)):
        TaskAssigner(**kwargs).record_outcome(row, [0.0, 1.0])


def test_a_non_adaptive_rank_accepts_any_row_of_the_dataset() -> None:
    # rows are dealt anew every epoch, so a row of another rank's shard now was this rank's
    # (or will be) in another epoch
    assigner = TaskAssigner(10, seed=0, rank=1, world_size=2)

    assert [assigner.record_outcome(row, informative=row == 3) for row in (0, 3, 9)] == [
        False,
        True,
        False,
    ]


# -- TaskAssigner: checkpoints -----------------------------------------------------------------


def test_a_json_round_trip_of_the_state_restores_every_row_weight() -> None:
    saved = TaskAssigner(6, seed=0, adaptive=True)
    feed(saved, 0, informative=False, times=20)
    feed(saved, 2, informative=True, times=5)
    feed(saved, 4, informative=True, times=3)
    feed(saved, 4, informative=False, times=4)
    restored = TaskAssigner(6, seed=0, adaptive=True)

    restored.load_state_dict(json.loads(json.dumps(saved.state_dict())))

    assert restored.row_stats() == saved.row_stats()
    rates = {row.row: row.rate for row in restored.row_stats()}
    assert rates[4] == pytest.approx((1 - 0.5 * 0.8**3) * 0.8**4)  # 0.744 * 0.4096


def test_restored_state_steers_the_draws_like_the_original() -> None:
    saved = TaskAssigner(6, seed=5, adaptive=True)
    feed(saved, 1, informative=True, times=10)
    feed(saved, 3, informative=False, times=10)
    restored = TaskAssigner(6, seed=5, adaptive=True)
    restored.load_state_dict(saved.state_dict())

    restored_rows = [restored.next_row() for _ in range(50)]

    assert restored_rows == [saved.next_row() for _ in range(50)]


# -- rank and world_size, refused at construction ----------------------------------------------


BAD_RANKS = [
    (
        {"rank": 2, "world_size": 2},
        "rank must be < world_size, got rank=2 with world_size=2; ranks are numbered 0 to 1: "
        "pass a smaller rank, or world_size=3 or more",
    ),
    (
        {"rank": -1, "world_size": 2},
        "rank must be >= 0, got -1; ranks are numbered 0 to world_size - 1 (0 to 1 here)",
    ),
    (
        {"rank": 0, "world_size": 0},
        "world_size must be >= 1, got 0; pass the number of data-parallel processes "
        "(1 when not distributed)",
    ),
    (
        {"rank": 1.0, "world_size": 2},
        "rank must be an int, got 1.0 (float); pass this process's index among the "
        "data-parallel processes (0 when not distributed)",
    ),
    (
        {"rank": True, "world_size": 2},
        "rank must be an int, got True (bool); pass this process's index among the "
        "data-parallel processes (0 when not distributed)",
    ),
    (
        {"rank": 0, "world_size": "2"},
        "world_size must be an int, got '2' (str); pass the number of data-parallel "
        "processes (1 when not distributed)",
    ),
]
BAD_RANK_IDS = ["rank-too-big", "negative-rank", "no-world", "float-rank", "bool-rank", "str-world"]


@pytest.mark.parametrize(("kwargs", "message"), BAD_RANKS, ids=BAD_RANK_IDS)
def test_the_assigner_refuses_a_bad_rank(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=exactly(message)):
        TaskAssigner(10, **kwargs)


def _never_built() -> RolloutHarness:
    raise AssertionError("the collector built an env while refusing its arguments")


@pytest.mark.parametrize(("kwargs", "message"), BAD_RANKS, ids=BAD_RANK_IDS)
def test_the_collector_refuses_a_bad_rank_at_construction(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=exactly(message)):
        RolloutCollector(_never_built, batch_size=4, group_size=1, **kwargs)


def test_without_torch_distributed_world_size_defaults_to_one() -> None:
    with pytest.raises(
        ValueError,
        match=exactly(
            "rank must be < world_size, got rank=1 with world_size=1; ranks are numbered 0 to 0: "
            "pass a smaller rank, or world_size=2 or more"
        ),
    ):
        RolloutCollector(_never_built, batch_size=4, group_size=1, rank=1)


def test_the_collector_refuses_a_batch_that_does_not_split_across_ranks() -> None:
    with pytest.raises(
        ValueError,
        match=exactly(
            "batch_size (8) must be a positive multiple of world_size (3), and group_size (1) >= 1"
        ),
    ):
        RolloutCollector(_never_built, batch_size=8, group_size=1, rank=0, world_size=3)


# -- RolloutCollector: batch_size, num_envs, envs ----------------------------------------------


def row_collector(tokenizer: Any, *, rows: int = 8, **kwargs: Any) -> RolloutCollector:
    hang_s = kwargs.pop("hang_s", 30.0)

    def factory() -> RolloutHarness:
        return RolloutHarness.local(RowEnv(rows=rows, hang_s=hang_s), tokenizer, max_turns=1)

    return RolloutCollector(factory, **kwargs)


def test_the_world_wide_batch_splits_evenly_across_ranks(tokenizer: Any) -> None:
    collector = row_collector(tokenizer, batch_size=8, group_size=4, rank=1, world_size=2)
    try:
        collector.reset()

        assert collector.batch_size == 4
        assert collector.num_envs == 16
        assert len(collector.envs) == 16
        assert (collector.assigner.rank, collector.assigner.world_size) == (1, 2)
    finally:
        collector.close()


def test_a_single_rank_keeps_the_full_batch(tokenizer: Any) -> None:
    collector = row_collector(tokenizer, batch_size=8, group_size=4, rank=0, world_size=1)

    assert (collector.batch_size, collector.num_envs) == (8, 32)


def test_envs_are_the_slots_harnesses_in_slot_order(tokenizer: Any) -> None:
    collector = row_collector(tokenizer, batch_size=2, group_size=2)
    try:
        envs = collector.envs  # built on first read; AgileRL builds them at the first reset

        assert len(envs) == 4
        assert len({id(env) for env in envs}) == 4
        assert all(a is b for a, b in zip(collector.envs, envs, strict=True))
        prompts = collector.reset()
        assert [env.context_ids for env in envs] == prompts
    finally:
        collector.close()


def test_a_timeout_replaces_only_the_hung_slot(tokenizer: Any) -> None:
    # AgileRL raises TimeoutError from step(); ours fails the hung slot's episode only
    collector = row_collector(tokenizer, batch_size=2, group_size=1, io_timeout_s=0.3, hang_s=3.0)
    try:
        collector.reset()
        hung, fast = collector.envs
        hang = [*tokenizer.encode("hang", add_special_tokens=False), EOS]
        start = time.monotonic()

        results = collector.step({0: hang, 1: [5, EOS]})

        assert time.monotonic() - start < 2.0
        assert sorted(results) == [1]
        replacement, same = collector.envs
        assert replacement is not hung
        assert same is fast
    finally:
        collector.close()


# -- RolloutCollector: tasks of the per-episode path ---------------------------------------------


def test_overlapping_groups_cover_every_row_once_per_epoch(tokenizer: Any) -> None:
    # AgileRL pins each group's task with assign_group_task(); ours gives group_size
    # consecutive reset_episode() calls one task
    collector = row_collector(tokenizer, batch_size=8, group_size=2, base_seed=3)
    try:
        first = [collector.reset_episode() for _ in range(16)]  # every slot held at once
        for handle in first:
            collector.finalize_episode(handle)
        second = [collector.reset_episode() for _ in range(16)]

        handles = first + second
        pairs = [handles[i : i + 2] for i in range(0, 32, 2)]
        assert all(a.group == b.group and a.task == b.task for a, b in pairs)
        group_rows = [a.task.row_index for a, _ in pairs]
        assert Counter(group_rows[:8]) == Counter(group_rows[8:]) == Counter(range(8))
    finally:
        collector.close()


def test_adaptive_sampling_favours_rows_whose_groups_were_informative(tokenizer: Any) -> None:
    # AgileRL's collector.record_group_outcome / task_row_stats are the assigner's
    # record_outcome / row_stats here
    collector = row_collector(
        tokenizer, batch_size=8, group_size=2, base_seed=3, adaptive_task_sampling=True
    )
    try:
        for row in range(8):
            feed(collector.assigner, row, informative=row == 5, times=20)

        rows = Counter(collector.assigner.next_row() for _ in range(800))

        weights = {stats.row: stats.weight for stats in collector.assigner.row_stats()}
        assert weights[5] == pytest.approx(FLOOR + 1 - tied(20))  # 1.0442
        assert all(weights[row] == pytest.approx(FLOOR + tied(20)) for row in weights if row != 5)
        assert rows[5] > 400  # its share: 1.0442 / (1.0442 + 7 * 0.0558) = 0.73
        assert all(0 < rows[row] < 80 for row in range(8) if row != 5)
    finally:
        collector.close()
