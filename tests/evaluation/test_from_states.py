"""run_batch_from_states / run_batch_from_state_actions: the pure path, the multi-instance
path (fresh instances restored in threads, capped by batch_size, always closed), and a
Monte-Carlo Q-value that matches the exact value."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import pytest
from branch_envs import DiceEnv, LedgerEnv, dice_value, ledger_env
from fakes import GREEDY, CountingBackend

from agile_llmenvs.backends import HFBackend, SamplingParams
from agile_llmenvs.branching import BranchManager
from agile_llmenvs.core import Action, Environment, State, from_text_env
from agile_llmenvs.core.replay import replay_restore
from agile_llmenvs.core.text_env import TextEnvironment
from agile_llmenvs.errors import BackendError, EvaluationError
from agile_llmenvs.evaluation import RunnerConfig, StopReason, TrajectoryRunner

A = Action.from_text


@pytest.fixture
def counting(hf_backend: HFBackend) -> CountingBackend:
    return CountingBackend(hf_backend)


class Instances:
    """An env_factory that records the instances it made, how many were alive at most, and
    where restores ran."""

    def __init__(self) -> None:
        self.made: list[TextEnvironment] = []
        self.closed: list[TextEnvironment] = []
        self.most_alive = 0
        self.restore_threads: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self) -> Environment:
        env = ledger_env()
        original_close = env.close

        def close() -> None:
            with self._lock:
                self.closed.append(env)
            original_close()

        env.close = close  # type: ignore[method-assign]
        with self._lock:
            self.made.append(env)
            self.most_alive = max(self.most_alive, len(self.made) - len(self.closed))
        return env

    def restore(self, env: Environment, state: State) -> State:
        self.restore_threads.add(threading.current_thread().name)
        return replay_restore(env, state)


def ledger_state(env: Environment, *steps: str) -> State:
    state, _ = env.reset(seed=1, options={"start": "s"})
    for step in steps:
        state = env.step(state, A(step)).next_state
    return state


def test_pure_step_env_bypasses_the_instances(counting: CountingBackend) -> None:
    env = from_text_env(LedgerEnv, name="ledger", pure_step=True)
    made: list[Environment] = []
    state = ledger_state(env, "a")
    runner = TrajectoryRunner(
        env,
        counting,
        GREEDY,
        config=RunnerConfig(max_steps=3),
        env_factory=lambda: made.append(ledger_env()) or ledger_env(),  # type: ignore[func-returns-value]
        restore_fn=replay_restore,
    )
    result = runner.run_batch_from_states([state] * 4)
    assert made == []
    assert counting.calls == [("generate_chat_batch", 4)] * 2  # steps 2 and 3 of 3
    for trajectory in result.trajectories:
        assert trajectory.stop_reason is StopReason.MAX_STEPS
        assert len(trajectory.turns) == 2
        assert [m["content"] for m in trajectory.messages[:3]] == ["s", "a", "s|a"]
        assert trajectory.total_reward == 3.0 + 4.0  # the continuation's rewards only


def test_multi_instance_path_restores_in_threads_caps_and_closes(
    counting: CountingBackend,
) -> None:
    instances = Instances()
    env = ledger_env()
    state = ledger_state(env, "a", "b")
    runner = TrajectoryRunner(
        env,
        counting,
        GREEDY,
        config=RunnerConfig(max_steps=4),
        env_factory=instances,
        restore_fn=instances.restore,
    )
    progress: list[tuple[int, int]] = []
    forced = [A(f"f{i}") for i in range(6)]
    result = runner.run_batch_from_state_actions(
        [state] * 6, forced, batch_size=4, progress_callback=lambda *p: progress.append(p)
    )
    assert len(instances.made) == 6
    assert sorted(map(id, instances.closed)) == sorted(map(id, instances.made))
    assert instances.most_alive == 4
    assert "MainThread" not in instances.restore_threads
    # chunks of 4 and 2; per chunk one forced step, then one generated step (4 - 2 - 1)
    assert counting.calls == [("generate_chat_batch", 4), ("generate_chat_batch", 2)]
    assert progress == [(i, 6) for i in range(1, 7)]
    for i, trajectory in enumerate(result.trajectories):
        assert trajectory.turns[0].action.text == f"f{i}"
        assert trajectory.turns[0].observation == f"s|a|b|f{i}"
        assert trajectory.stop_reason is StopReason.MAX_STEPS
        assert len(trajectory.turns) == 2
    assert env.step(state, A("still")).next_state.observation == "s|a|b|still"


def test_a_failed_restore_is_a_value_and_every_instance_is_closed(
    counting: CountingBackend,
) -> None:
    instances = Instances()
    env = ledger_env()
    good, bad = ledger_state(env, "a"), ledger_state(env, "x")

    def restore(fresh: Environment, state: State) -> State:
        if state.observation == "s|x":
            raise OSError("container gone")
        return instances.restore(fresh, state)

    runner = TrajectoryRunner(env, counting, GREEDY, env_factory=instances, restore_fn=restore)
    result = runner.run_batch_from_state_actions([good, bad], [A("stop"), A("stop")])
    first, second = result.trajectories
    assert first.stop_reason is StopReason.TERMINATED
    assert second.stop_reason is StopReason.ENV_ERROR
    assert second.error == "restore_fn failed: OSError: container gone"
    assert len(instances.closed) == len(instances.made) == 2


def test_instances_are_closed_when_the_backend_raises(hf_backend: HFBackend) -> None:
    class Refusing(CountingBackend):
        def generate_chat_batch(self, batch: object, params: SamplingParams) -> list:  # type: ignore[override]
            raise BackendError("bad key")

    instances = Instances()
    env = ledger_env()
    runner = TrajectoryRunner(
        env, Refusing(hf_backend), env_factory=instances, restore_fn=instances.restore
    )
    with pytest.raises(BackendError, match="bad key"):
        runner.run_batch_from_states([ledger_state(env, "a")] * 3)
    assert len(instances.closed) == len(instances.made) == 3


def test_bad_arguments(counting: CountingBackend) -> None:
    env = ledger_env()
    state = ledger_state(env, "a")
    no_restore = TrajectoryRunner(env, counting, env_factory=ledger_env)
    with pytest.raises(EvaluationError, match=r"^env_factory is set but restore_fn is not"):
        no_restore.run_batch_from_states([state])
    plain = TrajectoryRunner(env, counting, GREEDY, config=RunnerConfig(max_steps=2))
    with pytest.raises(
        EvaluationError,
        match=r"^'ledger' is not pure-step, so each of its states can be continued once; "
        r"episode \d+ appears more than once",
    ):
        plain.run_batch_from_states([state, state])
    with pytest.raises(EvaluationError, match=r"one action per state; got 1 states and 2"):
        plain.run_batch_from_state_actions([state], [A("a"), A("b")])
    with pytest.raises(EvaluationError, match=r"batch_size must be >= 1 or None, got 0"):
        plain.run_batch_from_states([state], batch_size=0)
    other = ledger_state(env, "b")
    result = plain.run_batch_from_states([state, other])  # distinct live episodes: fine
    assert [t.stop_reason for t in result.trajectories] == [StopReason.MAX_STEPS] * 2


@pytest.fixture
def dice_manager() -> Iterator[tuple[BranchManager, State]]:
    env = from_text_env(DiceEnv, name="dice")
    state, _ = env.reset(seed=0)
    with BranchManager.create(env) as manager:
        manager.checkpoint("s", state)
        yield manager, state


def test_monte_carlo_q_values_match_the_exact_values(
    hf_backend: HFBackend, dice_manager: tuple[BranchManager, State]
) -> None:
    manager, state = dice_manager
    runner = TrajectoryRunner(
        manager.branch("s")[0],
        hf_backend,
        SamplingParams(max_tokens=2, temperature=1.0),
        env_factory=lambda: manager.branch("s")[0],
        restore_fn=lambda env, restored: restored,
    )
    rollouts = 240
    intervals = []
    for kind in ("risky", "safe"):
        result = runner.run_batch_from_state_actions(
            [state] * rollouts, [A(kind)] * rollouts, batch_size=60
        )
        returns = [t.total_reward for t in result.trajectories]
        assert all(t.error is None for t in result.trajectories)
        mean = sum(returns) / rollouts
        spread = math.sqrt(sum((r - mean) ** 2 for r in returns) / (rollouts - 1))
        half_width = 4 * spread / math.sqrt(rollouts)  # 4 sigma: a flake once in ~16,000 runs
        exact = dice_value(kind, turns_left=3)
        assert abs(mean - exact) <= half_width, (kind, mean, exact, half_width)
        intervals.append((mean - half_width, mean + half_width))
    (risky_low, _), (_, safe_high) = intervals
    assert (dice_value("risky", 3), dice_value("safe", 3)) == (1.1875, 0.25)
    assert risky_low > safe_high  # the estimates tell the better action apart
