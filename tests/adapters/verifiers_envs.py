"""Tiny classic verifiers envs (single-turn, multi-turn, tool) for the adapter's tests: each
built from the real package and a few rows, each a ``load_environment``-style function."""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = "Reply with the number only."
SUMS = [
    {"question": "What is 2 + 3?", "answer": "5"},
    {"question": "What is 4 + 4?", "answer": "8"},
    {"question": "What is 7 + 6?", "answer": "13"},
    {"question": "What is 9 + 1?", "answer": "10"},
]


def exact_answer(completion: Any, answer: str, **kwargs: Any) -> float:
    """1.0 when the last assistant message is the answer, else 0.0."""
    replies = [m for m in completion if m.role == "assistant"]
    return 1.0 if replies and str(replies[-1].content).strip() == answer else 0.0


def reply_length(completion: Any, **kwargs: Any) -> float:
    """A metric only (weight 0): the characters of the last reply."""
    replies = [m for m in completion if m.role == "assistant"]
    return float(len(str(replies[-1].content))) if replies else 0.0


def rubric() -> Any:
    return vf.Rubric(funcs=[exact_answer, reply_length], weights=[1.0, 0.0])


def load_single_turn() -> Any:
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(SUMS), system_prompt=SYSTEM_PROMPT, rubric=rubric()
    )


class HintEnv(vf.MultiTurnEnv):
    """The first reply is answered with a hint ("Check again."), the second one is scored."""

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
        return [vf.UserMessage(content="Check again: what is the sum?")]


def load_multi_turn() -> Any:
    return HintEnv(
        dataset=Dataset.from_list(SUMS), system_prompt=SYSTEM_PROMPT, rubric=rubric(), max_turns=2
    )


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def load_tool() -> Any:
    tool_rubric = vf.Rubric(funcs=[exact_answer, used_the_tool], weights=[1.0, 0.0])
    return vf.ToolEnv(
        dataset=Dataset.from_list(SUMS),
        system_prompt=SYSTEM_PROMPT,
        rubric=tool_rubric,
        tools=[add],
        max_turns=3,
    )


def used_the_tool(completion: Any, **kwargs: Any) -> float:
    return float(any(m.role == "tool" for m in completion))


class SlowEnv(vf.MultiTurnEnv):
    """Replies after ``delay_s``: to trip the adapter's per-call timeout."""

    delay_s = 30.0

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
        import asyncio

        state["slow_started"] = True
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            CANCELLED.append(state["example_id"])
        return [vf.UserMessage(content="late")]


CANCELLED: list[int] = []


def load_slow() -> Any:
    return SlowEnv(dataset=Dataset.from_list(SUMS), rubric=rubric(), max_turns=3)
