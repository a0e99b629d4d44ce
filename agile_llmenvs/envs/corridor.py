"""A multi-turn task that ships with the package: take the key, walk the corridor, open the door.

Only the first turn decides the outcome; every later turn is noise. A policy that says a digit
at the first turn takes the key, and the door at the end of the corridor opens for it (reward
1.0, at the last turn only); what it says in the corridor changes nothing. Episode-level credit
gives every turn the episode's advantage, the corridor turns' included, so this is the task
where turn-level credit (``training.credit``) has something to show
(``manifests/grpo_corridor.yaml``, ``bench/turn_credit.py``).
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass
from typing import Any

from agile_llmenvs.errors import EnvStateError

__all__ = ["KEY_COLOURS", "CorridorEnv", "CorridorState"]

#: The colours a key may have; the seed picks one (only the wording changes).
KEY_COLOURS = ("red", "blue", "green")
_DIGIT = re.compile(r"\d")


@dataclass(frozen=True)
class CorridorState:
    """One episode's whole state: what :meth:`CorridorEnv.get_state` returns.

    Attributes:
        colour: The key's colour, from the seed.
        turn: Turns taken so far (0 after ``reset``).
        has_key: Whether the policy took the key at its first turn.
    """

    colour: str
    turn: int = 0
    has_key: bool = False


class CorridorEnv:
    """Key-and-door corridor: ``max_turns`` turns, the first of which decides the reward.

    - Turn 1: a key lies at the policy's feet; an action containing a digit takes it.
    - Turns 2 .. ``max_turns`` - 1: the corridor; the action changes nothing.
    - Turn ``max_turns``: the door; it opens (reward 1.0) if the key was taken, else 0.0.
      The episode terminates here; every earlier turn's reward is 0.0.

    Observations are fixed texts of (key colour, turn, key taken), so the same situation
    reads the same in every episode. The env is deterministic given the seed: ``pure_step``.
    The last ``info`` says whether the episode was a ``success``.

    Args:
        max_turns: Turns per episode, the key's and the door's included (at least 2).
    """

    pure_step = True  # deterministic given seed and task: branching may copy the state

    def __init__(self, max_turns: int = 4) -> None:
        if max_turns < 2:
            raise ValueError(
                f"max_turns must be at least 2 (the key and the door), got {max_turns}"
            )
        self.max_turns = max_turns
        self.state: CorridorState | None = None

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.state = CorridorState(colour=random.Random(seed).choice(KEY_COLOURS))
        return self._observation(self.state), {"colour": self.state.colour}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        state = self._live_state()
        has_key = state.has_key or (state.turn == 0 and _DIGIT.search(action) is not None)
        self.state = state = dataclasses.replace(state, turn=state.turn + 1, has_key=has_key)
        if state.turn < self.max_turns:
            return self._observation(state), 0.0, False, False, {"has_key": has_key}
        reply = "The door opens." if has_key else "The door is locked."
        return reply, float(has_key), True, False, {"has_key": has_key, "success": has_key}

    def get_state(self) -> CorridorState:
        """The episode's state (immutable, so it is its own snapshot)."""
        return self._live_state(finished_ok=True)

    def set_state(self, state: CorridorState) -> None:
        """Restore a state taken by :meth:`get_state`."""
        if not isinstance(state, CorridorState) or not 0 <= state.turn <= self.max_turns:
            raise EnvStateError(
                f"expected a CorridorState with turn in 0..{self.max_turns}, got {state!r}"
            )
        self.state = state

    def close(self) -> None:
        self.state = None

    def _live_state(self, *, finished_ok: bool = False) -> CorridorState:
        if self.state is None:
            raise EnvStateError("CorridorEnv has no episode: call reset() first")
        if self.state.turn >= self.max_turns and not finished_ok:
            raise EnvStateError("the episode is over (the door was reached): call reset()")
        return self.state

    def _observation(self, state: CorridorState) -> str:
        if state.turn == 0:
            return (
                f"You are in a corridor. A {state.colour} key lies at your feet. "
                "Say a digit to take the key. The door at the end opens only with the key."
            )
        carrying = f"You carry the {state.colour} key." if state.has_key else "You have no key."
        if state.turn == self.max_turns - 1:
            return f"You reach the door. {carrying}"
        return f"You walk down the corridor, step {state.turn}. {carrying}"
