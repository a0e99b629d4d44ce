"""Guess the digit: a multi-turn text env, the one docs/own_env.md builds."""

from __future__ import annotations

import random
import re
from typing import Any


class GuessTheDigit:
    """Guess a secret digit (0-9) in at most ``max_turns`` tries; after a wrong guess the env
    says whether the secret is higher or lower.

    Each turn's reward: 1.0 for the right digit, 0.0 for a wrong one, -0.1 for an answer
    with no digit. The episode's reward is the sum of its turns'.
    """

    def __init__(self, max_turns: int = 3) -> None:
        self.max_turns = max_turns  # the turn budget training and eval read
        self.secret = 0
        self.turn = 0

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.secret = random.Random(seed).randint(0, 9)
        self.turn = 0
        return "I am thinking of a digit from 0 to 9. Answer with one digit.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        found = re.search(r"\d", action)
        if found is None:
            reply, reward = "Answer with one digit.", -0.1
        elif int(found.group()) == self.secret:
            return "Right!", 1.0, True, False, {"success": True}
        else:
            reply = "Higher." if self.secret > int(found.group()) else "Lower."
            reward = 0.0
        return reply, reward, False, self.turn >= self.max_turns, {"success": False}

    def close(self) -> None:
        pass
