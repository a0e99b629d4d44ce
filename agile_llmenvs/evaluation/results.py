"""What an evaluation returns: trajectories that end with a named reason, and their summary."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from agile_llmenvs.backends.types import Message
from agile_llmenvs.core.types import Action

__all__ = ["BatchResult", "StopReason", "Trajectory", "Turn", "truncate"]


class StopReason(StrEnum):
    """Why a trajectory ended."""

    TERMINATED = "terminated"
    """The env reached a terminal state."""
    TRUNCATED = "truncated"
    """The env cut the episode short."""
    MAX_STEPS = "max_steps"
    """The runner's step budget ran out."""
    BACKEND_ERROR = "backend_error"
    """The backend could not produce a completion (an API request failed past its retries)."""
    ENV_ERROR = "env_error"
    """The env raised in ``reset`` or ``step``."""


@dataclass(frozen=True)
class Turn:
    """One step: what the policy did and what the env answered."""

    action: Action
    observation: str
    reward: float
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Trajectory:
    """One finished episode.

    Attributes:
        task_index: The task (dataset row) it ran.
        env_name: The environment's name.
        turns: Every step, in order.
        messages: The whole conversation, system prompt included (a message that showed
            images holds them as image parts; a results file records each as
            ``{"type": "image"}``).
        total_reward: The sum of the turns' rewards.
        success: Whether the episode counts as solved (the env's ``info["success"]`` when
            it reports one, else ``total_reward`` reaching the runner's threshold).
        stop_reason: Why it ended.
        error: What went wrong, for the two error reasons.
    """

    task_index: int
    env_name: str
    turns: tuple[Turn, ...]
    messages: tuple[Message, ...]
    total_reward: float
    success: bool
    stop_reason: StopReason
    error: str | None = None

    @property
    def num_steps(self) -> int:
        """How many steps the episode took."""
        return len(self.turns)

    def to_dict(
        self, *, max_text_chars: int | None = None, token_ids: bool = False
    ) -> dict[str, Any]:
        """A JSON-ready record of the trajectory.

        Args:
            max_text_chars: Cut every action and message text to this many characters,
                marked with how many were left out (see :func:`truncate`); ``None`` keeps all.
            token_ids: Also record each action's sampled token ids (``token_ids``: one list
                per turn, ``None`` where the backend reports no ids).
        """
        record: dict[str, Any] = {
            "task_index": self.task_index,
            "env_name": self.env_name,
            "total_reward": self.total_reward,
            "success": self.success,
            "stop_reason": str(self.stop_reason),
            "error": self.error,
            "num_steps": self.num_steps,
            "actions": [truncate(turn.action.text, max_text_chars) for turn in self.turns],
            "rewards": [turn.reward for turn in self.turns],
            "messages": [_cut_message(m, max_text_chars) for m in self.messages],
        }
        if token_ids:
            record["token_ids"] = [
                None if turn.action.token_ids is None else list(turn.action.token_ids)
                for turn in self.turns
            ]
        return record


def truncate(text: str, max_chars: int | None) -> str:
    """``text`` cut to ``max_chars`` characters, then ``…[+N chars]`` saying how many were cut
    (``text`` itself when it fits, or when ``max_chars`` is ``None``)."""
    if max_chars is None or len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}…[+{len(text) - max_chars} chars]"


def _cut_message(message: Message, max_chars: int | None) -> dict[str, Any]:
    """A message as a results file holds it: texts cut, an image part without its pixels."""
    record = dict(message)
    content = record.get("content")
    if isinstance(content, str):
        record["content"] = truncate(content, max_chars)
    elif isinstance(content, list | tuple):
        record["content"] = [_cut_part(part, max_chars) for part in content]
    return record


def _cut_part(part: Any, max_chars: int | None) -> Any:
    if not isinstance(part, Mapping):
        return part
    if part.get("type") == "image":
        return {"type": "image"}
    if isinstance(part.get("text"), str):
        return {**part, "text": truncate(part["text"], max_chars)}
    return dict(part)


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


@dataclass(frozen=True)
class BatchResult:
    """The trajectories of one batch, in the order their tasks were given.

    Attributes:
        trajectories: One per task.
        env_name: The environment they ran in.
    """

    trajectories: tuple[Trajectory, ...]
    env_name: str = ""

    @property
    def num_tasks(self) -> int:
        """How many trajectories there are."""
        return len(self.trajectories)

    @property
    def success_rate(self) -> float:
        """The share of trajectories that succeeded (0.0 for an empty batch)."""
        return _mean([1.0 if t.success else 0.0 for t in self.trajectories])

    @property
    def mean_reward(self) -> float:
        """The mean total reward per trajectory."""
        return _mean([t.total_reward for t in self.trajectories])

    @property
    def mean_steps(self) -> float:
        """The mean number of steps per trajectory."""
        return _mean([float(t.num_steps) for t in self.trajectories])

    @property
    def num_errors(self) -> int:
        """How many trajectories ended in a backend or env error."""
        errors = (StopReason.BACKEND_ERROR, StopReason.ENV_ERROR)
        return sum(1 for t in self.trajectories if t.stop_reason in errors)

    def summary(self) -> dict[str, Any]:
        """The headline figures, JSON-ready."""
        return {
            "env_name": self.env_name,
            "num_tasks": self.num_tasks,
            "success_rate": self.success_rate,
            "mean_reward": self.mean_reward,
            "mean_steps": self.mean_steps,
            "num_errors": self.num_errors,
        }

    def to_dict(
        self, *, max_text_chars: int | None = None, token_ids: bool = False
    ) -> dict[str, Any]:
        """The summary and every trajectory, JSON-ready (arguments as for
        :meth:`Trajectory.to_dict`)."""
        trajectories = [
            t.to_dict(max_text_chars=max_text_chars, token_ids=token_ids) for t in self.trajectories
        ]
        return {**self.summary(), "trajectories": trajectories}

    @classmethod
    def concat(cls, results: Iterable[BatchResult], env_name: str = "") -> BatchResult:
        """One result holding the trajectories of ``results``, in order."""
        results = list(results)
        name = env_name or (results[0].env_name if results else "")
        return cls(tuple(t for r in results for t in r.trajectories), name)
