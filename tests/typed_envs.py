"""An OpenEnv env with its own typed action (an ``int`` field), written as an OpenEnv user
writes one, and an ``action_parser`` for it: the invalid-turn tests' env (#34)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

from agile_llmenvs.transport._openenv import Action, Environment, Observation, State


class IntGuessAction(Action):
    guess: int


class IntGuessObservation(Observation):
    text: str


class _Positive(BaseModel):  # the env's own model: its refusal is the env's bug, not the policy's
    value: int


class IntGuessEnvironment(Environment):
    """Guess 7 in three attempts; reward 1 for the right guess. ``13`` raises (an env bug);
    a negative guess fails the env's own pydantic validation (also an env bug)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    max_turns = 3

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> IntGuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return IntGuessObservation(text="Guess a number from 1 to 10.")

    def step(
        self, action: IntGuessAction, timeout_s: float | None = None, **kwargs: Any
    ) -> IntGuessObservation:
        self._state.step_count += 1
        if action.guess == 13:
            raise RuntimeError("unlucky number")
        if action.guess < 0:
            _Positive(value="negative")  # type: ignore[arg-type]
        right = action.guess == 7
        return IntGuessObservation(
            text="Right!" if right else f"{action.guess} is wrong.",
            reward=1.0 if right else 0.0,
            done=right or self._state.step_count >= self.max_turns,
        )

    @property
    def state(self) -> State:
        return self._state


def parse_guess(text: str) -> dict[str, Any]:
    """The action of ``<guess>N</guess>``; anything else is refused with the format to use."""
    found = re.search(r"<guess>\s*(-?\d+)\s*</guess>", text)
    if found is None:
        raise ValueError("write your guess as <guess>N</guess>")
    return {"guess": int(found.group(1))}


def parse_as_text(text: str) -> dict[str, Any]:
    """The text itself as the guess: the action class decides whether it is an int."""
    return {"guess": text.strip()}
