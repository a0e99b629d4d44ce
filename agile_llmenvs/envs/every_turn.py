"""A multi-turn task that ships with the package: every turn counts.

At each of ``max_turns`` turns the policy is asked for a digit; the episode scores 1.0, at its
last turn, only if every one of its turns said one. A single wrong turn anywhere ruins the
episode, so episode-level credit pushes the episode's good turns down with its bad one; a
credit that tells the turns apart (``training.credit``: ``turn_mc``, ``tree``) need not. The
observations do not say whether the episode is already ruined. Beside the corridor
(:mod:`~agile_llmenvs.envs.corridor`, where only the first turn decides) this is the task of
``manifests/grpo_every_turn.yaml`` and ``bench/turn_credit.py --task every_turn``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from agile_llmenvs.errors import EnvStateError

__all__ = ["EveryTurnEnv", "EveryTurnState"]

_DIGIT = re.compile(r"\d")


@dataclass(frozen=True)
class EveryTurnState:
    """One episode's whole state: what :meth:`EveryTurnEnv.get_state` returns.

    Attributes:
        turn: Turns taken so far (0 after ``reset``).
        intact: Whether every turn so far said a digit.
    """

    turn: int = 0
    intact: bool = True


class EveryTurnEnv:
    """``max_turns`` turns, each asking for a digit; reward 1.0 at the last turn if every
    turn said one, else 0.0 (every earlier turn's reward is 0.0). Deterministic given its
    actions (``pure_step``); the last ``info`` says whether the episode was a ``success``.

    Args:
        max_turns: Turns per episode (at least 1).
    """

    pure_step = True  # deterministic: branching may copy the state

    def __init__(self, max_turns: int = 4) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.max_turns = max_turns
        self.state: EveryTurnState | None = None

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.state = EveryTurnState()
        return self._observation(self.state), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        state = self._live_state()
        intact = state.intact and _DIGIT.search(action) is not None
        self.state = state = dataclasses.replace(state, turn=state.turn + 1, intact=intact)
        if state.turn < self.max_turns:
            return self._observation(state), 0.0, False, False, {}
        reply = "Done: every turn said a digit." if intact else "Done."
        return reply, float(intact), True, False, {"success": intact}

    def get_state(self) -> EveryTurnState:
        """The episode's state (immutable, so it is its own snapshot)."""
        return self._live_state(finished_ok=True)

    def set_state(self, state: EveryTurnState) -> None:
        """Restore a state taken by :meth:`get_state`."""
        if not isinstance(state, EveryTurnState) or not 0 <= state.turn <= self.max_turns:
            raise EnvStateError(
                f"expected an EveryTurnState with turn in 0..{self.max_turns}, got {state!r}"
            )
        self.state = state

    def close(self) -> None:
        self.state = None

    def _live_state(self, *, finished_ok: bool = False) -> EveryTurnState:
        if self.state is None:
            raise EnvStateError("EveryTurnEnv has no episode: call reset() first")
        if self.state.turn >= self.max_turns and not finished_ok:
            raise EnvStateError("the episode is over: call reset()")
        return self.state

    def _observation(self, state: EveryTurnState) -> str:
        return f"Turn {state.turn + 1} of {self.max_turns}: say a digit."
