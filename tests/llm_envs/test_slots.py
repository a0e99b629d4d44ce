"""SlotPool: the rollout slots every collection path shares, and who holds them."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from echo_envs import RowEnv

from agile_llmenvs.errors import SlotTimeoutError
from agile_llmenvs.llm_envs import RolloutHarness, SlotPool
from agile_llmenvs.llm_envs.slots import GROUP_HOLDER

EOS = 2


def pool_of(tokenizer: Any, size: int = 3, **env: Any) -> SlotPool:
    def build() -> RolloutHarness:
        return RolloutHarness.local(RowEnv(rows=4, **env), tokenizer)

    return SlotPool(size, build, io_timeout_s=0.5)


def test_slots_are_held_one_at_a_time_or_a_group_at_once_and_released(tokenizer: Any) -> None:
    pool = pool_of(tokenizer)
    assert pool.number_episodes(2) == 0
    assert pool.number_episodes() == 2
    with pool.lock:
        index = pool.wait_free(timeout_s=0.1)
        pool.hold(index, 7)
    assert (index, pool[0].episode_id) == (0, 7)
    assert pool.take(3) is None  # only two are free: a group takes all its slots or none
    assert pool.take(2) == [1, 2]
    assert [slot.episode_id for slot in pool] == [7, GROUP_HOLDER, GROUP_HOLDER]
    with pytest.raises(SlotTimeoutError, match=r"no rollout slot became free within 0.05 s"):
        pool.wait_free(timeout_s=0.05)
    threading.Timer(0.1, pool.release, args=(2,)).start()
    assert pool.wait_free(timeout_s=5) == 2  # a release wakes the waiting
    pool.close()


def test_a_hung_call_fails_and_replaces_only_its_slot(tokenizer: Any) -> None:
    pool = pool_of(tokenizer, size=2, hang_s=3.0)
    prompts = pool.run({i: lambda i=i: pool.harness(i).reset(row_index=i) for i in range(2)})
    assert sorted(prompts) == [0, 1]
    hung = pool.harness(1)
    hang, fine = (
        [*tokenizer.encode(text, add_special_tokens=False), EOS] for text in ("hang", "0")
    )
    start = time.monotonic()
    results = pool.run({0: lambda: pool.harness(0).step(fine), 1: lambda: hung.step(hang)})
    assert time.monotonic() - start < 2.0
    assert sorted(results) == [0]
    assert pool[1].failure == "the env call exceeded io_timeout_s=0.5"
    assert pool[1].harness is None  # a fresh one is built at its next use
    assert pool.episode(1, "unused").info == {"error": "the env call exceeded io_timeout_s=0.5"}
    assert pool.harness(1) is not hung
    pool.close()


class _OtherRowEnv(RowEnv):
    """The same env under another class: its calls have proven nothing yet."""


def test_a_slot_whose_client_changes_is_judged_by_the_new_env_class(tokenizer: Any) -> None:
    from agile_llmenvs.transport.calls import WARMUP_CALLS
    from agile_llmenvs.transport.client import InProcessEnvClient

    pool = pool_of(tokenizer, size=1)

    def reset_on_thread() -> str:
        pool.harness(0).reset(row_index=1)
        return threading.current_thread().name

    for _ in range(WARMUP_CALLS):  # RowEnv proves its calls fast on the worker threads
        assert pool.run({0: reset_on_thread})[0].startswith("rollout-slot")
    assert pool.run({0: reset_on_thread}) == {0: threading.current_thread().name}  # inline
    pool.harness(0).client = InProcessEnvClient(_OtherRowEnv(rows=4))
    assert pool.run({0: reset_on_thread})[0].startswith("rollout-slot")  # unproven: a thread
    assert not pool.calls.inline(_OtherRowEnv)
    assert pool.calls.inline(RowEnv)
    pool.close()
