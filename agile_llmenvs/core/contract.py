"""The plain-text env contract: what an environment author writes.

Gymnasium-shaped and stateful. The rollout harness, the collector, the OpenEnv server and the
state-passing :mod:`agile_llmenvs.core` face all drive envs through this contract. Optional
capabilities are narrow protocols an env may also satisfy, never mixins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "StepTuple",
    "SupportsDatasetSize",
    "SupportsMaxTurns",
    "SupportsSnapshot",
    "SupportsTools",
    "TextEnv",
]

StepTuple = tuple[str, float, bool, bool, dict[str, Any]]
"""``(observation, reward, terminated, truncated, info)``, as gymnasium's ``step``."""


@runtime_checkable
class TextEnv(Protocol):
    """A text environment: string observations in, string actions out.

    ``reset`` takes the task as keyword arguments (a dataset row's ``row_index``, say, or
    whatever keys the env understands) and returns the first prompt; ``step`` takes the
    policy's text and returns the next observation, the reward and the two end flags. A
    reset ``info["system_prompt"]`` (a string) is the episode's system message: the rollout
    harness shows it in the chat template's system role unless the run sets its own. A step
    ``info["messages"]`` (``{"role": "tool" | "user", "content": str}`` dicts, the tool
    results first) is the observation as messages: the harness shows the tool results in
    the template's tool role, and the observation text as one user message where the
    template has none.
    """

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        """Start an episode; returns ``(observation, info)``."""
        ...

    def step(self, action: str) -> StepTuple:
        """Apply the policy's text; returns the 5-tuple :data:`StepTuple`."""
        ...

    def close(self) -> None:
        """Release the env's resources."""
        ...


@runtime_checkable
class SupportsDatasetSize(Protocol):
    """An env over a fixed set of rows; ``reset(row_index=i)`` picks row ``i``."""

    dataset_size: int


@runtime_checkable
class SupportsTools(Protocol):
    """An env that offers tools (JSON-schema function descriptions) to the policy."""

    tools: Sequence[Mapping[str, Any]]


@runtime_checkable
class SupportsMaxTurns(Protocol):
    """An env that declares its own turn budget."""

    max_turns: int


@runtime_checkable
class SupportsSnapshot(Protocol):
    """An env whose whole state can be captured and restored (for branching)."""

    def get_state(self) -> Any:
        """A picklable snapshot of the env's state."""
        ...

    def set_state(self, state: Any) -> None:
        """Restore a snapshot taken by :meth:`get_state`."""
        ...
