"""run_multi_evaluation: several environments interleaved in one lock-step loop."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from fakes import GREEDY, CountingBackend, DigitEnv, DigitEnvFactory

from agile_llmenvs.backends import HFBackend, SamplingParams
from agile_llmenvs.core import from_text_env
from agile_llmenvs.errors import EvaluationError
from agile_llmenvs.evaluation import (
    MultiEvalEntry,
    SegmentBudget,
    SegmentedTrajectoryRunner,
    TrajectoryRunner,
)
from agile_llmenvs.evaluation import run_multi_evaluation as run_multi


@pytest.fixture
def counting(hf_backend: HFBackend) -> CountingBackend:
    return CountingBackend(hf_backend)


def runner(backend: object, turns: int, name: str) -> TrajectoryRunner:
    env = from_text_env(DigitEnvFactory(turns=lambda row: turns), name=name)
    return TrajectoryRunner(env, backend, GREEDY)  # type: ignore[arg-type]


def sizes(backend: CountingBackend) -> list[int]:
    assert {method for method, _ in backend.calls} <= {"generate_chat_batch"}
    return [n for _, n in backend.calls]


def test_one_call_per_step_across_environments(counting: CountingBackend) -> None:
    long, short = runner(counting, 3, "long"), runner(counting, 1, "short")
    results = run_multi([MultiEvalEntry(long, [0, 1]), MultiEvalEntry(short, [5, 6, 7])])
    assert sizes(counting) == [5, 2, 2]
    assert [r.env_name for r in results] == ["long", "short"]
    assert [[t.task_index for t in r.trajectories] for r in results] == [[0, 1], [5, 6, 7]]
    assert [[t.num_steps for t in r.trajectories] for r in results] == [[3, 3], [1, 1, 1]]


def test_batch_size_chunks_across_entries(counting: CountingBackend) -> None:
    a, b = runner(counting, 2, "a"), runner(counting, 1, "b")
    progress: list[tuple[int, int]] = []
    results = run_multi(
        [MultiEvalEntry(a, [0, 1, 2]), MultiEvalEntry(b, [3, 4])],
        batch_size=2,
        progress_callback=lambda done, total: progress.append((done, total)),
    )
    # Chunks: (a0 a1) (a2 b3) (b4); a-tasks take two steps, b-tasks one.
    assert sizes(counting) == [2, 2, 2, 1, 1]
    assert progress == [(n, 5) for n in range(1, 6)]
    assert [r.num_tasks for r in results] == [3, 2]


def test_each_trajectory_is_built_by_its_own_runner(counting: CountingBackend) -> None:
    a, b = runner(counting, 1, "a"), runner(counting, 1, "b")
    b.config = type(b.config)(system_prompt="B only")
    run_multi([MultiEvalEntry(a, [1]), MultiEvalEntry(b, [2])])
    first, second = counting.batches[0]
    assert first[0] == {"role": "user", "content": "Say the digit 1."}
    assert second[0] == {"role": "system", "content": "B only"}


def entries_with(*runners: TrajectoryRunner) -> Sequence[MultiEvalEntry]:
    return [MultiEvalEntry(r, [0]) for r in runners]


def test_entries_must_share_backend_params_and_tools(
    hf_backend: HFBackend, counting: CountingBackend
) -> None:
    base = runner(counting, 1, "a")
    with pytest.raises(EvaluationError, match=r"^run_multi_evaluation needs at least one entry$"):
        run_multi([])
    other_backend = runner(CountingBackend(hf_backend), 1, "b")
    with pytest.raises(
        ValueError, match=r"^entries\[1\] uses a different backend object from entries\[0\]"
    ):
        run_multi(entries_with(base, other_backend))
    other_params = runner(counting, 1, "c")
    other_params.sampling_params = SamplingParams(max_tokens=5, temperature=0.0)
    with pytest.raises(
        ValueError, match=r"^entries\[1\] samples with SamplingParams\(max_tokens=5"
    ):
        run_multi(entries_with(base, other_params))
    segmented = SegmentedTrajectoryRunner(
        base.environment, counting, GREEDY, strategy=SegmentBudget()
    )
    with pytest.raises(ValueError, match=r"^entries\[0\] has a SegmentedTrajectoryRunner; only"):
        run_multi(entries_with(segmented, base))

    class ToolDigits(DigitEnv):
        tools = ({"type": "function", "function": {"name": "f"}},)

    tooled = TrajectoryRunner(from_text_env(ToolDigits), counting, GREEDY)
    with pytest.raises(ValueError, match=r"^entries\[1\] offers different tools from entries\[0\]"):
        run_multi(entries_with(base, tooled))
    with pytest.raises(ValueError, match=r"^batch_size must be >= 1 or None, got 0$"):
        run_multi(entries_with(base), batch_size=0)
    assert counting.calls == []


def test_tools_go_through_generate_with_tools_batch(counting: CountingBackend) -> None:
    class ToolDigits(DigitEnv):
        tools = ({"type": "function", "function": {"name": "f", "parameters": {}}},)

    a = TrajectoryRunner(from_text_env(ToolDigits, name="a"), counting, GREEDY)
    b = TrajectoryRunner(from_text_env(ToolDigits, name="b"), counting, GREEDY)
    run_multi([MultiEvalEntry(a, [0]), MultiEvalEntry(b, [1, 2])])
    assert counting.calls == [("generate_with_tools_batch", 3)]
