"""The state-passing face of an environment, which runners and branching drive.

``reset`` returns a :class:`State`; ``step(state, action)`` returns the next one inside a
:class:`StepResult`. A state holds the conversation so far, so a runner can build the
model's messages from it alone. ``spec.pure_step`` says whether ``step`` is a function of the
state value (then a state may be stepped any number of times, which branching exploits) or
drives a live env behind the state (then each state is stepped at most once).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agile_llmenvs.core.chat import Completion, Message, ToolCall

__all__ = ["Action", "Environment", "EnvironmentSpec", "State", "StepResult"]


@dataclass(frozen=True)
class EnvironmentSpec:
    """What a runner needs to know about an environment before driving it.

    Attributes:
        name: A label for results and logs.
        pure_step: ``step`` is a function of the ``State`` value alone.
        dataset_size: How many tasks (``task_index`` 0 .. n-1) the env has, if it says.
        max_turns: The env's own turn budget, if it declares one.
        tools: Tools (OpenAI function shape) the env offers the policy.
        forkable: Everything the env's episodes hold lives in this process's memory (no
            child process, socket or temporary directory of its own), so a forked copy of
            the process is an independent copy of the env. Branching reads it to choose a
            strategy; an env that starts a shell or talks to a server sets it False.
    """

    name: str
    pure_step: bool = False
    dataset_size: int | None = None
    max_turns: int | None = None
    tools: tuple[Mapping[str, Any], ...] = ()
    forkable: bool = True


@dataclass(frozen=True)
class State:
    """One point of an episode.

    Attributes:
        observation: The latest observation (the prompt the policy answers next).
        messages: The conversation so far: observations as user turns, actions as assistant
            turns, ending with ``observation``.
        step_count: Actions taken so far.
        done: Whether the episode has ended.
        task: The task the episode was reset with (``{"row_index": 3}``, say).
        episode_id: Identifies the episode among those the environment is running.
        payload: Whatever else the environment keeps in its states.
        seed: The seed the episode was reset with, so it can be rebuilt by replay.
    """

    observation: str
    messages: tuple[Message, ...]
    step_count: int = 0
    done: bool = False
    task: Mapping[str, Any] = field(default_factory=dict)
    episode_id: int = 0
    payload: Any = None
    seed: int | None = None


@dataclass(frozen=True)
class Action:
    """What the policy did: its text, and any tool calls it made.

    Attributes:
        text: The assistant's text, as the env will read it.
        tool_calls: Structured tool calls (API backends report them apart from the text).
        token_ids: The sampled ids, from local backends (for token-exact training data).
    """

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    token_ids: tuple[int, ...] | None = None

    @classmethod
    def from_text(cls, text: str) -> Action:
        """An action that is plain text."""
        return cls(text=text)

    @classmethod
    def from_completion(cls, completion: Completion) -> Action:
        """The action a backend's completion stands for."""
        ids = completion.generation.token_ids if completion.generation is not None else None
        return cls(completion.text, completion.tool_calls, ids)


@dataclass(frozen=True)
class StepResult:
    """The outcome of one ``step``.

    Attributes:
        next_state: The state after the action.
        reward: The reward for the action.
        terminated: The episode reached a terminal state.
        truncated: The episode was cut short by the environment (a time limit, say).
        info: The environment's extra information.
    """

    next_state: State
    reward: float
    terminated: bool = False
    truncated: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        """Whether the episode ended, either way."""
        return self.terminated or self.truncated


@runtime_checkable
class Environment(Protocol):
    """The state-passing environment that runners and branching drive."""

    @property
    def spec(self) -> EnvironmentSpec:
        """What the environment is and can do."""
        ...

    def reset(
        self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[State, dict[str, Any]]:
        """Start an episode of the task ``options`` describes; returns ``(state, info)``."""
        ...

    def step(self, state: State, action: Action) -> StepResult:
        """Apply ``action`` in ``state``."""
        ...

    def release(self, state: State) -> None:
        """End the episode of ``state`` early and free what it holds (a no-op when done)."""
        ...

    def close(self) -> None:
        """Release every resource the environment holds."""
        ...
