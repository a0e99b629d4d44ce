"""SegmentedTrajectoryRunner: segment rounds in lock-step, forced segments, COMPLETE."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from fakes import GREEDY, CountingBackend, DigitEnvFactory

from agile_llmenvs.backends import Backend, HFBackend, Message, SamplingParams
from agile_llmenvs.core import from_text_env
from agile_llmenvs.evaluation import (
    COMPLETE,
    ForceAction,
    SegmentBudget,
    SegmentContext,
    SegmentedTrajectoryRunner,
    StopReason,
)
from agile_llmenvs.evaluation.segmented import Segment


def asked_digit(conversation: list[Message]) -> str:
    return str(conversation[0]["content"])[-2]


@pytest.fixture
def counting(hf_backend: HFBackend) -> CountingBackend:
    return CountingBackend(hf_backend)


def test_forced_segments_skip_the_backend_and_complete_calls_once_each(
    counting: CountingBackend,
) -> None:
    env = from_text_env(DigitEnvFactory())
    strategy = SegmentBudget(
        segment_tokens=2,
        max_segments=2,
        force=lambda ctx: "<forced>" if ctx.task_index == 1 else None,
    )
    runner = SegmentedTrajectoryRunner(env, counting, GREEDY, strategy=strategy)
    result = runner.run_batch([0, 1, 2])
    assert counting.calls == [
        ("generate_chat_batch", 2),  # round 1: task 1 is forced
        ("generate_chat_batch", 2),  # round 2
        ("generate_chat", 1),  # round 3: every turn completes, one call each
        ("generate_chat", 1),
        ("generate_chat", 1),
    ]
    assert [asked_digit(c) for c in counting.batches[0]] == ["0", "2"]
    forced = result.trajectories[1]
    final_messages = counting.batches[3][0]
    assert final_messages[-2:] == [
        {"role": "assistant", "content": "<forced><forced>"},
        {"role": "user", "content": "Now give your final answer."},
    ]
    assert forced.turns[0].action.text.startswith("<forced><forced>")
    assert [t.stop_reason for t in result.trajectories] == [StopReason.TERMINATED] * 3


def test_segments_continue_the_partial_response(counting: CountingBackend) -> None:
    env = from_text_env(DigitEnvFactory())
    strategy = SegmentBudget(segment_tokens=3, max_segments=2, continue_prompt="Go on.")
    result = SegmentedTrajectoryRunner(env, counting, GREEDY, strategy=strategy).run_batch([4])
    first_segment_call, second_segment_call, final_call = counting.batches
    assert first_segment_call == [[{"role": "user", "content": "Say the digit 4."}]]
    (second,) = second_segment_call
    assert second[1]["role"] == "assistant"
    assert second[2] == {"role": "user", "content": "Go on."}
    segment_text = second[1]["content"]
    action = result.trajectories[0].turns[0].action
    assert action.text.startswith(segment_text)
    assert len(action.text) > len(segment_text)
    assert action.token_ids is None  # a stitched response is not one sampled sequence
    assert final_call[0][-1] == {"role": "user", "content": "Now give your final answer."}


class CompleteAtOnce:
    """Completes every turn without a segment: only the final calls reach the backend."""

    def __init__(self) -> None:
        self.rounds: list[int] = []

    def generate_segment_batch(
        self, backend: Backend, contexts: Sequence[SegmentContext], params: SamplingParams
    ) -> list[Segment]:
        self.rounds.append(len(contexts))
        return [COMPLETE for _ in contexts]

    def final_messages(self, context: SegmentContext) -> list[Message]:
        return list(context.messages)


def test_a_custom_strategy_drives_multi_turn_episodes(counting: CountingBackend) -> None:
    env = from_text_env(DigitEnvFactory(turns=lambda row: row + 1))
    strategy = CompleteAtOnce()
    progress: list[tuple[int, int]] = []
    result = SegmentedTrajectoryRunner(env, counting, GREEDY, strategy=strategy).run_batch(
        [0, 1, 2, 3], batch_size=2, progress_callback=lambda d, t: progress.append((d, t))
    )
    # Task i takes i + 1 turns: chunk (0 1) has rounds of 2, 1; chunk (2 3) of 2, 2, 2, 1.
    assert strategy.rounds == [2, 1, 2, 2, 2, 1]
    assert counting.calls == [("generate_chat", 1)] * (1 + 2 + 3 + 4)
    assert progress == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert [t.num_steps for t in result.trajectories] == [1, 2, 3, 4]


def test_force_action_is_a_segment() -> None:
    assert ForceAction("x").text == "x"
    assert SegmentContext(0, (), ("a", "b")).partial == "ab"
