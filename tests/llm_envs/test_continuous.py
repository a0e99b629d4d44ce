"""RolloutCollector's continuous path: every episode asks for its next turn on its own, and
served envs' sessions are all awaited on the one session loop."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from echo_envs import EchoEnv, RowEnv
from serving import ServedProcess

from agile_llmenvs.backends.types import Generation, SamplingParams
from agile_llmenvs.envs import make_rollout_env_factory
from agile_llmenvs.errors import GenerationServerError
from agile_llmenvs.llm_envs import OpenEnvServer, RolloutCollector, RolloutHarness, StopReason
from agile_llmenvs.llm_envs.continuous import request_seed
from agile_llmenvs.specs import LLMEnvSpec
from agile_llmenvs.transport.session_loop import SESSION_LOOP

EOS = 2
PARAMS = SamplingParams(max_tokens=16, seed=11)


class ScriptedBackend:
    """An :class:`AsyncTokenBackend` that answers each context with ``answer(text, seed)``.

    Every request is logged as ``(seed, version)``; one whose seed is in ``fail_seeds``
    raises :class:`GenerationServerError`; each request first sleeps ``delay_s(seed)``.
    """

    def __init__(
        self,
        tokenizer: Any,
        answer: Callable[[str, int | None], str],
        *,
        fail_seeds: frozenset[int | None] = frozenset(),
        delay_s: Callable[[int | None], float] = lambda seed: 0.0,
        events: list[Any] | None = None,
    ) -> None:
        self.tokenizer, self.answer = tokenizer, answer
        self.fail_seeds, self.delay_s = fail_seeds, delay_s
        self.version = 0
        self.requests: list[tuple[int | None, int]] = []
        self.events = events if events is not None else []
        self.threads: list[int] = []

    async def agenerate(self, prompt: Any, params: SamplingParams) -> Generation:
        self.requests.append((params.seed, self.version))
        self.threads.append(threading.active_count())
        await asyncio.sleep(self.delay_s(params.seed))
        if params.seed in self.fail_seeds:
            raise GenerationServerError(f"request {params.seed} refused", url="http://gen")
        ids = completion(self.tokenizer, self.answer(self.tokenizer.decode(prompt), params.seed))
        return Generation(tuple(ids), tuple([-0.5] * len(ids)), "", "stop")


def completion(tokenizer: Any, text: str) -> list[int]:
    return [*tokenizer.encode(text, add_special_tokens=False), EOS]


def row_of(text: str) -> str:
    return text.rsplit("ay ", 1)[1].split(".", 1)[0]


def by_turn(text: str, seed: int | None) -> str:
    """Right on the first turn, wrong after: the same completions whoever asks."""
    return row_of(text) if "Again" not in text else "x"


def collector(
    tokenizer: Any, *, rows: int = 8, turns: int = 2, batch: int = 3, group: int = 4, **kw: Any
) -> RolloutCollector:
    env_kwargs = {k: kw.pop(k) for k in ("fail_rows", "hang_s") if k in kw}

    def factory() -> RolloutHarness:
        env = RowEnv(rows=rows, turns=turns, **env_kwargs)
        return RolloutHarness.local(env, tokenizer, max_turns=turns)

    return RolloutCollector(factory, batch_size=batch, group_size=group, base_seed=0, **kw)


def test_continuous_groups_have_the_lock_step_tasks_and_token_exact_episodes(
    tokenizer: Any,
) -> None:
    backend = ScriptedBackend(tokenizer, by_turn)
    backend.version = 7
    continuous = collector(tokenizer).collect_continuous(backend, PARAMS)

    def generate(contexts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        ids = [completion(tokenizer, by_turn(tokenizer.decode(c), None)) for c in contexts]
        return [(i, [-0.5] * len(i)) for i in ids]

    lock_step = collector(tokenizer).collect(generate)
    assert [t.group for t in continuous.trajectories] == [g for g in range(3) for _ in range(4)]
    assert [t.task for t in continuous.trajectories] == [t.task for t in lock_step.trajectories]
    assert len({t.slot for t in continuous.trajectories}) == 12
    for ours, theirs in zip(continuous.trajectories, lock_step.trajectories, strict=True):
        assert ours.episode == theirs.episode  # ids, masks, turn ids, logps, rewards, reason
        assert ours.episode.stop_reason is StopReason.TERMINATED
        assert ours.episode.rewards == (1.0, 0.0)
        assert (ours.policy_version, theirs.policy_version) == (7, None)
    # and the sync harness alone, with the same completions
    task = continuous.trajectories[5].task
    harness = RolloutHarness.local(RowEnv(rows=8, turns=2), tokenizer, max_turns=2)
    harness.reset(**task.reset_kwargs())
    while not harness.done:
        ids = completion(tokenizer, by_turn(tokenizer.decode(harness.context_ids), None))
        harness.step(ids, [-0.5] * len(ids))
    assert continuous.trajectories[5].episode == harness.get_episode_data()
    assert (continuous.failed, continuous.attempts, continuous.informative_groups) == (0, 1, 0)


def test_each_request_has_its_own_seed_from_the_episode_and_turn(tokenizer: Any) -> None:
    backend = ScriptedBackend(tokenizer, by_turn)
    collect = collector(tokenizer, batch=2, group=2)
    collect.collect_continuous(backend, PARAMS)
    collect.collect_continuous(backend, PARAMS)  # episodes are numbered across batches
    expected = {request_seed(11, e, turn) for e in range(8) for turn in range(2)}
    assert sorted(s for s, _ in backend.requests) == sorted(expected)
    assert len(expected) == 16
    unseeded = ScriptedBackend(tokenizer, by_turn)
    collector(tokenizer, batch=1, group=2).collect_continuous(unseeded, SamplingParams(seed=None))
    assert {s for s, _ in unseeded.requests} == {None}


def test_a_failed_request_fails_only_its_episode(tokenizer: Any) -> None:
    refused = request_seed(11, 5, 1)  # episode 5 (group 1, member 1), its second turn
    backend = ScriptedBackend(tokenizer, by_turn, fail_seeds=frozenset({refused}))
    batch = collector(tokenizer).collect_continuous(backend, PARAMS)
    assert [t.failed for t in batch.trajectories] == [i == 5 for i in range(12)]
    assert batch.failed == 1
    failed = batch.trajectories[5]
    assert failed.episode.info["error"] == f"GenerationServerError: request {refused} refused"
    assert failed.policy_version == 0
    assert all(t.episode.rewards == (1.0, 0.0) for t in batch.trajectories if not t.failed)
    assert len(backend.requests) == 12 * 2  # the refused request was the failed one's last


def test_env_failures_and_timeouts_fail_only_their_episodes(tokenizer: Any) -> None:
    hang = request_seed(11, 2, 0)  # episode 2 says "hang" at its first turn

    def answer(text: str, seed: int | None) -> str:
        return "hang" if seed == hang else by_turn(text, seed)

    collect = collector(tokenizer, rows=4, batch=4, group=2, fail_rows=[3], hang_s=5.0)
    collect.io_timeout_s = 0.5
    backend = ScriptedBackend(tokenizer, answer)
    start = time.monotonic()
    batch = collect.collect_continuous(backend, PARAMS)
    assert time.monotonic() - start < 3.0
    errors = {i: t.episode.info["error"] for i, t in enumerate(batch.trajectories) if t.failed}
    rows = [t.task.row_index for t in batch.trajectories]
    assert sorted(errors) == sorted([2, *(i for i, row in enumerate(rows) if row == 3)])
    assert errors.pop(2) == "the env call exceeded io_timeout_s=0.5"
    (error,) = set(errors.values())  # named where the env raised it: echo_envs.py's reset
    assert re.fullmatch(
        r"EnvExecutionError: in-process env: RuntimeError: row 3 cannot be loaded \(raised as "
        r"RuntimeError at (\S+/)?echo_envs\.py:\d+ in reset\) \[code EXECUTION_ERROR\]",
        error,
    )
    assert batch.failed == 3
    hung_slot = batch.trajectories[2].slot
    assert collect.slots[hung_slot].harness is None  # replaced: a fresh env on its next use
    assert all(t.reward == 1.0 for t in batch.trajectories if not t.failed)


def test_episodes_do_not_wait_for_the_slowest(tokenizer: Any) -> None:
    events: list[tuple[str, int, int]] = []  # (what, episode, turn), in the order they happen
    slow = request_seed(11, 0, 1)  # episode 0's second turn takes 0.5 s
    numbers = {request_seed(11, e, t): (e, t) for e in range(4) for t in range(6)}

    def delay(seed: int | None) -> float:
        events.append(("request", *numbers[seed]))
        return 0.5 if seed == slow else 0.0

    backend = ScriptedBackend(tokenizer, by_turn, delay_s=delay)
    batch = collector(tokenizer, turns=6, batch=2, group=2).collect_continuous(backend, PARAMS)
    assert batch.failed == 0
    assert all(t.episode.num_turns == 6 for t in batch.trajectories)
    slow_at = events.index(("request", 0, 1))
    resumed_at = events.index(("request", 0, 2))
    meanwhile = events[slow_at + 1 : resumed_at]
    # every other episode played all its remaining turns while episode 0 waited
    assert sorted(e for _, e, _ in meanwhile) == [e for e in (1, 2, 3) for _ in range(5)]
    assert events[resumed_at:] == [("request", 0, t) for t in range(2, 6)]


def test_the_lock_step_path_waits_for_the_slowest(tokenizer: Any) -> None:
    """The contrast: lock-step, no episode starts turn 2 before the slowest ends turn 1."""
    order: list[int] = []

    def generate(contexts: list[list[int]]) -> list[list[int]]:
        order.append(len(contexts))
        if len(order) == 2:
            time.sleep(0.2)
        return [completion(tokenizer, by_turn(tokenizer.decode(c), None)) for c in contexts]

    collector(tokenizer, turns=6, batch=2, group=2).collect(generate)
    assert order == [4] * 6  # one call per turn, every live slot in it


def test_policy_version_is_the_version_of_the_first_request(tokenizer: Any) -> None:
    class Bumping(ScriptedBackend):
        async def agenerate(self, prompt: Any, params: SamplingParams) -> Generation:
            generation = await super().agenerate(prompt, params)
            self.version += 1  # a weight sync after every request
            return generation

    backend = Bumping(tokenizer, by_turn, delay_s=lambda seed: 0.001)
    collect = collector(tokenizer, turns=3, batch=1, group=2)

    async def three_groups() -> list[Any]:
        played = await asyncio.gather(*(collect.aplay_group(backend, PARAMS) for _ in range(3)))
        return [t for group in played for t in group]

    trajectories = SESSION_LOOP.run(three_groups())  # one group at a time on the 2 slots
    first = dict(backend.requests)  # seed -> the version when that request was made
    for episode, trajectory in enumerate(trajectories):
        versions = [first[request_seed(11, episode, turn)] for turn in range(3)]
        assert trajectory.policy_version == versions[0] < versions[2]
    assert [t.policy_version for t in trajectories] == [0, 0, 6, 6, 12, 12]


def test_aplay_group_takes_the_next_task_and_waits_for_free_slots(tokenizer: Any) -> None:
    collect = collector(tokenizer, batch=1, group=2)
    backend = ScriptedBackend(tokenizer, by_turn, delay_s=lambda seed: 0.01)
    lock_step = collector(tokenizer, batch=1, group=2)
    expected = [lock_step.assigner.next_task() for _ in range(3)]

    async def three_groups() -> list[tuple[Any, ...]]:
        return list(await asyncio.gather(*(collect.aplay_group(backend, PARAMS) for _ in range(3))))

    groups = SESSION_LOOP.run(three_groups())  # 3 groups on 2 slots: one at a time
    assert [g[0].task for g in groups] == expected
    assert [[t.group for t in g] for g in groups] == [[0, 0], [1, 1], [2, 2]]
    assert all(t.slot in (0, 1) for g in groups for t in g)
    first_requests = [s for s, _ in backend.requests[::4]]  # 2 members x 2 turns per group
    assert first_requests == [request_seed(11, e, 0) for e in (0, 2, 4)]


def test_dynamic_sampling_refills_as_the_lock_step_path_does(tokenizer: Any) -> None:
    def answer(text: str, seed: int | None) -> str:  # rows 0-3 informative, 4-7 not
        row = int(row_of(text))
        return str(row) if row < 4 and seed is not None and seed % 2 else "no"

    seeds_right = ScriptedBackend(tokenizer, answer)
    batch = collector(tokenizer, turns=1, batch=2, group=8).collect_continuous(
        seeds_right, PARAMS, dynamic_sampling=True, max_attempts=8
    )
    assert batch.informative_groups == 2
    assert all(int(g[0].task.row_index) < 4 for g in batch.groups())
    assert [t.group for t in batch.trajectories] == [0] * 8 + [1] * 8


def test_nothing_is_left_held_after_a_batch(tokenizer: Any) -> None:
    collect = collector(tokenizer, batch=2, group=2)
    collect.collect_continuous(ScriptedBackend(tokenizer, by_turn), PARAMS)
    assert all(slot.episode_id is None for slot in collect.slots)
    assert collect.reset_episode().slot == 0  # the per-episode path finds them free


# -- served envs ----------------------------------------------------------------------------

GROUPS, GROUP_SIZE = 8, 8  # 64 slots


@pytest.fixture(scope="module")
def served() -> Iterator[ServedProcess]:
    """EchoEnv served from another process, so this process's threads are the client's."""
    server = ServedProcess("echo_envs:EchoEnv", "--port", "0", "--max-concurrent-envs", "256")
    yield server
    server.kill()


def echo(text: str, seed: int | None) -> str:
    return "x"


def remote_collector(tokenizer: Any, url: str) -> RolloutCollector:
    spec = LLMEnvSpec(env_type="rollout", env_url=url, max_turns=2)
    factory, _ = make_rollout_env_factory(spec, tokenizer)
    return RolloutCollector(factory, batch_size=GROUPS, group_size=GROUP_SIZE, base_seed=0)


def test_64_remote_slots_need_no_thread_each(tokenizer: Any, served: ServedProcess) -> None:
    SESSION_LOOP.loop  # noqa: B018 - started before counting
    before = threading.active_count()
    continuous = remote_collector(tokenizer, served.url)
    backend = ScriptedBackend(tokenizer, echo)
    batch = continuous.collect_continuous(backend, PARAMS)
    assert batch.failed == 0
    assert len(batch.trajectories) == 64
    assert all(t.episode.stop_reason is StopReason.MAX_TURNS for t in batch.trajectories)
    assert len(backend.threads) == 128
    assert max(backend.threads) <= before + 1  # no thread per slot (or per call)
    continuous.close()

    lock_step = remote_collector(tokenizer, served.url)
    counts: list[int] = []

    def generate(contexts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        counts.append(threading.active_count())
        ids = completion(tokenizer, "x")
        return [(ids, [-0.5] * len(ids)) for _ in contexts]

    plain = lock_step.collect(generate)
    assert [t.episode for t in plain.trajectories] == [t.episode for t in batch.trajectories]
    assert max(counts) >= before + 64  # blocking sessions: threads grow with the slots
    lock_step.close()


def test_the_async_harness_plays_a_served_env_as_the_sync_one_does(tokenizer: Any) -> None:
    actions = ["hello", "<think>x</think> y", "stop"]

    def play_sync(harness: RolloutHarness) -> Any:
        harness.reset(seed=3)
        for action in actions:
            harness.step(completion(tokenizer, action))
        return harness.get_episode_data()

    async def play_async(harness: RolloutHarness) -> Any:
        await harness.areset(seed=3)
        for action in actions:
            await harness.astep(completion(tokenizer, action))
        size = await harness.adataset_size()
        data = harness.get_episode_data()
        await harness.aclose()
        return data, size

    with OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=2) as server:
        sync = play_sync(RolloutHarness(server.url, tokenizer, 4, system_prompt="S"))
        harness = RolloutHarness(server.url, tokenizer, 4, system_prompt="S")
        remote, size = SESSION_LOOP.run(play_async(harness))
        assert harness.client._sync_ws is None  # it never opened a blocking connection
    local, _ = SESSION_LOOP.run(
        play_async(RolloutHarness.local(EchoEnv(), tokenizer, 4, system_prompt="S"))
    )
    assert sync == remote == local
    assert sync.stop_reason is StopReason.TERMINATED
    assert size == 3


def test_the_async_harness_runs_tool_calls_as_the_sync_one_does(tokenizer: Any) -> None:
    from echo_envs import ToolEnv

    calls = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    turns = [
        completion(tokenizer, calls + calls.replace("add", "mul")),  # two calls, in order
        completion(tokenizer, '<tool_call>{"name": "add"'),  # malformed: reaches no tool
        completion(tokenizer, calls.replace("3", "4")),
    ]

    def harness() -> RolloutHarness:
        return RolloutHarness.local(
            ToolEnv(),
            tokenizer,
            3,
            mcp_tool="add",
            observation_processor=lambda o: o.get("prompt") or str(o.get("result", {}).get("data")),
        )

    sync = harness()
    sync.reset()
    sync_results = [sync.step(ids) for ids in turns]

    async def play() -> list[Any]:
        async_harness = harness()
        await async_harness.areset()
        results = [await async_harness.astep(ids) for ids in turns]
        return [results, async_harness.get_episode_data(), async_harness.client.env.calls]

    async_results, episode, tool_calls = SESSION_LOOP.run(play())
    assert async_results == sync_results
    assert episode == sync.get_episode_data()
    assert tool_calls == sync.client.env.calls == [("add", 2, 3), ("mul", 2, 3), ("add", 2, 4)]
    assert async_results[0].info["tool_calls"] == [
        {"name": "add", "reward": 0.0},
        {"name": "mul", "reward": 0.0},
    ]
