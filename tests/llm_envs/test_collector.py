"""RolloutCollector: groups, failures as values, timeouts, the per-episode path."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from echo_envs import RowEnv

from agile_llmenvs.errors import SlotTimeoutError, StaleEpisodeError
from agile_llmenvs.llm_envs import RolloutCollector, RolloutHarness, StopReason
from agile_llmenvs.transport import OpenEnvServer

EOS = 2


def collector(
    tokenizer: Any, *, rows: int = 8, turns: int = 1, batch: int = 2, group: int = 4, **kwargs: Any
) -> RolloutCollector:
    env_kwargs = {k: kwargs.pop(k) for k in ("fail_rows", "hang_s") if k in kwargs}

    def factory() -> RolloutHarness:
        return RolloutHarness.local(
            RowEnv(rows=rows, turns=turns, **env_kwargs), tokenizer, max_turns=turns
        )

    return RolloutCollector(factory, batch_size=batch, group_size=group, base_seed=0, **kwargs)


def says(tokenizer: Any, choose: Callable[[int, str], str]) -> Callable[[list[list[int]]], Any]:
    """A zero-cost policy: answers each context with ``choose(position, context text)``."""

    def generate(contexts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        out = []
        for position, context in enumerate(contexts):
            text = choose(position, tokenizer.decode(context))
            ids = [*tokenizer.encode(text, add_special_tokens=False), EOS]
            out.append((ids, [-0.5] * len(ids)))
        return out

    return generate


def row_of(text: str) -> str:
    return text.rsplit("Say ", 1)[1].split(".", 1)[0]


def test_groups_are_contiguous_and_share_a_task(tokenizer: Any) -> None:
    collect = collector(tokenizer, batch=3, group=4, turns=2)
    batch = collect.collect(says(tokenizer, lambda pos, text: row_of(text) if pos % 2 else "x"))
    assert len(batch.trajectories) == 12
    assert [t.group for t in batch.trajectories] == [g for g in range(3) for _ in range(4)]
    for group in batch.groups():
        assert len({t.task for t in group}) == 1
        assert len({t.slot // 4 for t in group}) == 1
    rows = [group[0].task.row_index for group in batch.groups()]
    assert len(set(rows)) == 3
    for trajectory in batch.trajectories:
        episode = trajectory.episode
        assert episode.stop_reason is StopReason.TERMINATED  # the env ends after 2 turns
        assert sum(episode.action_mask) == len(episode.sampling_logps)
    assert {t.reward for t in batch.trajectories} == {0.0, 2.0}
    assert batch.informative_groups == 3
    assert batch.failed == 0


def test_a_raising_env_fails_only_its_episode(tokenizer: Any) -> None:
    collect = collector(tokenizer, rows=4, batch=4, group=2, fail_rows=[2])
    batch = collect.collect(says(tokenizer, lambda pos, text: row_of(text)))
    failed = [t for t in batch.trajectories if t.failed]
    assert {t.task.row_index for t in failed} == {2}
    assert len(failed) == 2
    assert "RuntimeError: row 2 cannot be loaded" in failed[0].episode.info["error"]
    assert all(t.reward == 1.0 for t in batch.trajectories if not t.failed)
    assert batch.failed == 2


def test_a_hung_env_is_replaced_after_the_timeout_while_the_others_finish(
    tokenizer: Any,
) -> None:
    collect = collector(tokenizer, batch=2, group=2, turns=2, io_timeout_s=0.5, hang_s=5.0)
    prompts = collect.reset()
    assert all(prompts)
    hung_harness = collect.slots[1].harness
    start = time.monotonic()
    results = collect.step(
        {
            i: [*tokenizer.encode("hang" if i == 1 else "x", add_special_tokens=False), EOS]
            for i in collect.live_slots
        }
    )
    assert time.monotonic() - start < 2.0
    assert sorted(results) == [0, 2, 3]  # slot 1 timed out; the others finished their turn
    assert collect.live_slots == [0, 2, 3]
    trajectories = collect.get_trajectories()
    assert trajectories[1].failed
    assert "exceeded io_timeout_s=0.5" in trajectories[1].episode.info["error"]
    assert [t.failed for t in trajectories] == [False, True, False, False]
    collect.reset()  # the slot gets a fresh env
    assert collect.slots[1].harness is not None
    assert collect.slots[1].harness is not hung_harness
    assert collect.live_slots == [0, 1, 2, 3]


def test_dynamic_sampling_drops_uninformative_groups_and_refills(tokenizer: Any) -> None:
    collect = collector(tokenizer, rows=8, batch=2, group=2, adaptive_task_sampling=False)
    seen_rows: list[str] = []

    def choose(position: int, text: str) -> str:
        row = row_of(text)
        seen_rows.append(row)
        # rows 0-3: one member right, one wrong (informative); rows 4-7: both wrong
        return row if int(row) < 4 and position % 2 == 0 else "no"

    batch = collect.collect(says(tokenizer, choose), dynamic_sampling=True, max_attempts=8)
    assert batch.informative_groups == 2
    assert all(int(g[0].task.row_index) < 4 for g in batch.groups())
    assert [t.group for t in batch.trajectories] == [0, 0, 1, 1]
    plain = collector(tokenizer, rows=8, batch=2, group=2).collect(says(tokenizer, choose))
    assert plain.attempts == 1


def test_per_episode_path_groups_episodes_and_is_thread_safe(tokenizer: Any) -> None:
    collect = collector(tokenizer, batch=2, group=4, turns=2)
    trajectories = []
    lock = threading.Lock()

    def play() -> None:
        handle = collect.reset_episode()
        answer = [*tokenizer.encode(str(handle.task.row_index), add_special_tokens=False), EOS]
        while not collect.step_episode(handle, answer).done:
            pass
        with lock:
            trajectories.append(collect.finalize_episode(handle))

    threads = [threading.Thread(target=play) for _ in range(16)]  # 16 episodes on 8 slots
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(trajectories) == 16
    assert all(t.reward == 2.0 for t in trajectories)
    by_group: dict[int, set[Any]] = {}
    for t in trajectories:
        by_group.setdefault(t.group, set()).add(t.task)
    assert sorted(by_group) == [0, 1, 2, 3]
    assert all(len(tasks) == 1 for tasks in by_group.values())


def test_a_step_finalized_in_flight_raises_and_never_touches_the_next_episode(
    tokenizer: Any,
) -> None:
    collect = collector(tokenizer, batch=1, group=1, turns=3, hang_s=0.5)
    handle = collect.reset_episode()
    hang = [*tokenizer.encode("hang", add_special_tokens=False), EOS]
    errors: list[BaseException] = []

    def slow_step() -> None:
        try:
            collect.step_episode(handle, hang)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=slow_step)
    thread.start()
    time.sleep(0.1)
    trajectory = collect.finalize_episode(handle)  # while the step is in flight
    assert trajectory.failed
    assert trajectory.episode.info["error"] == "finalized while a step was in flight"
    thread.join(5)
    assert len(errors) == 1
    assert isinstance(errors[0], StaleEpisodeError)
    with pytest.raises(StaleEpisodeError, match="is no longer on slot 0"):
        collect.step_episode(handle, [5, EOS])
    fresh = collect.reset_episode()  # the slot was released once the step returned
    assert fresh.episode_id != handle.episode_id
    assert collect.step_episode(fresh, [5, EOS]).done is False


def test_slots_are_held_until_finalized(tokenizer: Any) -> None:
    collect = collector(tokenizer, batch=1, group=1, slot_acquire_timeout_s=0.2)
    handle = collect.reset_episode()
    with pytest.raises(SlotTimeoutError, match=r"no rollout slot became free within 0\.2 s"):
        collect.reset_episode()
    collect.finalize_episode(handle)
    assert collect.reset_episode().slot == 0


def test_state_dict_and_epochs(tokenizer: Any) -> None:
    collect = collector(tokenizer, rows=4, batch=2, group=1)
    policy = says(tokenizer, lambda pos, text: row_of(text))
    collect.collect(policy)
    state = collect.state_dict()
    after = [t.task for t in collect.collect(policy).trajectories]
    assert collect.num_epochs == 1
    resumed = collector(tokenizer, rows=4, batch=2, group=1)
    resumed.load_state_dict(state)
    assert [t.task for t in resumed.collect(policy).trajectories] == after


def test_batch_must_split_across_ranks(tokenizer: Any) -> None:
    with pytest.raises(
        ValueError,
        match=r"batch_size \(3\) must be a positive multiple of "
        r"world_size \(2\)",
    ):
        collector(tokenizer, batch=3, rank=0, world_size=2)
    two_ranks = collector(tokenizer, batch=4, group=3, rank=1, world_size=2)
    assert (two_ranks.groups, two_ranks.num_slots) == (2, 6)


def test_fast_in_process_envs_run_inline_until_calls_are_slow_in_a_row(tokenizer: Any) -> None:
    from agile_llmenvs.transport.calls import DEMOTE_STRIKES, WARMUP_CALLS

    collect = collector(tokenizer, batch=1, group=1, turns=1000)
    policy = collect.slots.calls
    assert not policy.inline(RowEnv)  # unproven: on a worker thread
    collect.reset()
    for _ in range(WARMUP_CALLS + 1):
        collect.step({0: [5, EOS]})
    assert policy.inline(RowEnv)
    env = collect.slots[0].harness.client.env.inner  # type: ignore[union-attr]
    hang = [*tokenizer.encode("hang", add_special_tokens=False), EOS]
    env.hang_s = 0.02
    for _ in range(DEMOTE_STRIKES - 1):
        collect.step({0: hang})
    env.hang_s = 0.0
    collect.step({0: [5, EOS]})  # a fast call between: the slow ones were a fluke
    env.hang_s = 0.02
    for _ in range(DEMOTE_STRIKES - 1):
        collect.step({0: hang})
    assert policy.inline(RowEnv)
    collect.step({0: hang})
    assert not policy.inline(RowEnv)  # slow calls in a row: back to the threads for good


class _NonFiniteInfoEnv:
    """Row ``r`` asks for its number; row 1's step info holds a NaN deep inside, row 2's reset
    info an infinity, the other rows' info only finite numbers."""

    dataset_size = 4
    max_turns = 1

    def __init__(self) -> None:
        self.row = 0

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.row = int(task.get("row_index", 0))
        return f"Say {self.row}.", {"p": math.inf if self.row == 2 else 0.5}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        parts = [0.5, math.nan] if self.row == 1 else [0.5, 1.0]
        return "", 1.0, True, False, {"score": {"parts": parts}}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("path", ["in-process", "websocket"])
def test_a_non_finite_number_in_info_fails_its_episode_naming_the_field(
    tokenizer: Any, path: str
) -> None:
    server = OpenEnvServer(make_env=_NonFiniteInfoEnv, max_concurrent_envs=8)
    if path == "in-process":
        server.close()
        env = "in-process env '_NonFiniteInfoEnv'"
        where = {1: f"{env}, step 1", 2: f"{env}, reset"}

        def factory() -> RolloutHarness:
            return RolloutHarness.local(_NonFiniteInfoEnv(), tokenizer, max_turns=1)
    else:
        ws_url = server.url.replace("http://", "ws://") + "/ws"
        where = {1: ws_url, 2: ws_url}

        def factory() -> RolloutHarness:
            return RolloutHarness(server.url, tokenizer, max_turns=1, timeout_s=10)

    collect = RolloutCollector(factory, batch_size=4, group_size=2, base_seed=0)
    try:
        batch = collect.collect(says(tokenizer, lambda pos, text: row_of(text)))
    finally:
        collect.close()
        server.close()
    errors = {t.task.row_index: t.episode.info.get("error") for t in batch.trajectories}
    refused = (
        "EnvExecutionError: {where}: the env's observation.metadata.{field} is {name}: "
        "replies are JSON, which has no {name}; return a finite number [code EXECUTION_ERROR]"
    )
    assert errors[1] == refused.format(where=where[1], field="score.parts.1", name="NaN")
    assert errors[2] == refused.format(where=where[2], field="p", name="Infinity")
    assert (errors[0], errors[3]) == (None, None)
    assert batch.failed == 4  # both members of rows 1 and 2
    assert sorted(t.task.row_index for t in batch.trajectories if t.failed) == [1, 1, 2, 2]
    assert [t.reward for t in batch.trajectories if not t.failed] == [1.0] * 4
