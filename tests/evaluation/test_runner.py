"""TrajectoryRunner: lock-step batches, dropout, chunking with global progress offsets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fakes import (
    GREEDY,
    ChatAPIServer,
    CountingBackend,
    DigitEnvFactory,
    Injection,
)

from agile_llmenvs.backends import APIConfig, HFBackend, OpenAIBackend, RetryPolicy
from agile_llmenvs.core import from_text_env
from agile_llmenvs.errors import EvaluationError
from agile_llmenvs.evaluation import (
    BatchResult,
    RunnerConfig,
    StopReason,
    TrajectoryRunner,
    run_evaluation,
)


@pytest.fixture
def counting(hf_backend: HFBackend) -> CountingBackend:
    return CountingBackend(hf_backend)


@pytest.fixture
def answering(server: ChatAPIServer) -> Iterator[OpenAIBackend]:
    """An API model that always says the digit it is asked for."""
    config = APIConfig(retry=RetryPolicy(max_retries=1, initial_backoff_s=0.01))
    backend = OpenAIBackend("m", base_url=server.openai_url, api_key="k", config=config)
    yield backend
    backend.close()


def asked(batch: list) -> list[str]:
    """The digit each conversation of a batch is about (from its first user turn)."""
    return [next(m["content"] for m in c if m["role"] == "user")[-2] for c in batch]


def test_one_backend_call_per_step_and_finished_trajectories_drop_out(
    counting: CountingBackend,
) -> None:
    # Task i lasts i + 1 turns.
    env = from_text_env(DigitEnvFactory(turns=lambda row: row + 1), name="digits")
    result = TrajectoryRunner(env, counting, GREEDY).run_batch([2, 0, 1])
    assert counting.calls == [("generate_chat_batch", n) for n in (3, 2, 1)]
    assert [asked(batch) for batch in counting.batches] == [["2", "0", "1"], ["2", "1"], ["2"]]
    assert [t.task_index for t in result.trajectories] == [2, 0, 1]
    assert [t.num_steps for t in result.trajectories] == [3, 1, 2]
    assert {t.stop_reason for t in result.trajectories} == {StopReason.TERMINATED}
    assert result.env_name == "digits"


def test_batch_size_chunks_with_global_progress_offsets(counting: CountingBackend) -> None:
    env = from_text_env(DigitEnvFactory(turns=lambda row: 1 + row % 2))
    progress: list[tuple[int, int]] = []
    result = TrajectoryRunner(env, counting, GREEDY).run_batch(
        range(7), batch_size=3, progress_callback=lambda done, total: progress.append((done, total))
    )
    # Chunks [0 1 2] [3 4 5] [6]; odd rows take two turns.
    sizes = [n for _, n in counting.calls]
    assert sizes == [3, 1, 3, 2, 1]
    assert progress == [(n, 7) for n in range(1, 8)]
    assert [t.task_index for t in result.trajectories] == list(range(7))


def test_the_step_budget_ends_long_episodes_and_frees_them(counting: CountingBackend) -> None:
    factory = DigitEnvFactory(turns=lambda row: 5)
    env = from_text_env(factory)
    runner = TrajectoryRunner(env, counting, GREEDY, config=RunnerConfig(max_steps=2))
    result = runner.run_batch([0, 1])
    assert [n for _, n in counting.calls] == [2, 2]
    assert [t.stop_reason for t in result.trajectories] == [StopReason.MAX_STEPS] * 2
    assert [t.num_steps for t in result.trajectories] == [2, 2]
    assert [e.closed for e in factory.made[1:]] == [True, True]


def test_system_prompt_and_seeds(counting: CountingBackend) -> None:
    factory = DigitEnvFactory()
    env = from_text_env(factory)
    config = RunnerConfig(system_prompt="Answer with a digit.", seed=100)
    result = TrajectoryRunner(env, counting, GREEDY, config=config).run_batch([3])
    (conversation,) = counting.batches[0]
    assert conversation[0] == {"role": "system", "content": "Answer with a digit."}
    assert conversation[1] == {"role": "user", "content": "Say the digit 3."}
    assert result.trajectories[0].messages[:2] == tuple(conversation)
    assert factory.made[1].reset_seeds == [103]


def test_success_rate_and_mean_reward(answering: OpenAIBackend, server: ChatAPIServer) -> None:
    server.reply = lambda messages: "7"  # right for rows 7 and 17 only
    env = from_text_env(DigitEnvFactory())
    result = run_evaluation(env, answering, GREEDY)  # all 10 rows of the env
    assert result.num_tasks == 10
    assert result.success_rate == 0.1
    assert result.mean_reward == 0.1
    assert [t.success for t in result.trajectories] == [n == 7 for n in range(10)]


def test_failures_are_values_not_exceptions(
    answering: OpenAIBackend, server: ChatAPIServer
) -> None:
    server.injections.append(Injection(503, times=5, match="digit 1"))
    env = from_text_env(DigitEnvFactory(bad_rows=frozenset({2}), bad_steps=frozenset({3})))
    result = TrajectoryRunner(env, answering, GREEDY).run_batch([0, 1, 2, 3])
    reasons = [t.stop_reason for t in result.trajectories]
    assert reasons == [
        StopReason.TERMINATED,
        StopReason.BACKEND_ERROR,
        StopReason.ENV_ERROR,
        StopReason.ENV_ERROR,
    ]
    errors = [t.error for t in result.trajectories]
    assert errors == [
        None,
        "gave up after 2 attempts; last: HTTP 503: injected 503",
        "KeyError: 'row 2 is broken'",
        "RuntimeError: step of row 3 failed",
    ]
    assert [t.success for t in result.trajectories] == [True, False, False, False]
    assert result.num_errors == 3
    assert result.success_rate == 0.25


def test_bad_arguments(counting: CountingBackend) -> None:
    env = from_text_env(DigitEnvFactory())
    runner = TrajectoryRunner(env, counting, GREEDY)
    with pytest.raises(EvaluationError, match=r"^batch_size must be >= 1 or None, got 0$"):
        runner.run_batch([0], batch_size=0)
    with pytest.raises(ValueError, match=r"^max_steps must be >= 1, got 0$"):
        RunnerConfig(max_steps=0)

    class Sizeless:
        def reset(self, *, seed: int | None = None, **task: object) -> tuple[str, dict]:
            return "", {}

        def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
            return "", 0.0, True, False, {}

        def close(self) -> None:
            pass

    with pytest.raises(EvaluationError, match=r"does not say how many tasks it has"):
        run_evaluation(from_text_env(Sizeless), counting)
    assert run_evaluation(from_text_env(Sizeless), counting, GREEDY, num_tasks=2).num_tasks == 2
    assert counting.calls == [("generate_chat_batch", 2)]


def test_result_summary_and_concat() -> None:
    assert BatchResult(()).summary() == {
        "env_name": "",
        "num_tasks": 0,
        "success_rate": 0.0,
        "mean_reward": 0.0,
        "mean_steps": 0.0,
        "num_errors": 0,
    }
    assert BatchResult.concat([], "x") == BatchResult((), "x")


def test_branching_hooks_are_kept(counting: CountingBackend) -> None:
    env = from_text_env(DigitEnvFactory())
    factory = DigitEnvFactory()

    def restore(environment: object, state: object) -> None:
        pass

    runner = TrajectoryRunner(env, counting, env_factory=factory, restore_fn=restore)
    assert runner.env_factory is factory
    assert runner.restore_fn is restore
    assert counting.calls == []
