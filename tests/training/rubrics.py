"""A dense reward for short training tests: the share of digits in a completion."""

from __future__ import annotations


def digit_share(completion: str, answer: str, **_: object) -> float:
    """Fraction of the completion's characters that are digits (0 for an empty one)."""
    return sum(ch.isdigit() for ch in completion) / len(completion) if completion else 0.0
