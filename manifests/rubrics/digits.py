"""Reward functions for ``data/digits.jsonl``: each scores one completion against its row."""

from __future__ import annotations


def exact_digit(completion: str, answer: str, **_: object) -> float:
    """1.0 when the completion, stripped, is exactly the expected digit."""
    return 1.0 if completion.strip() == answer else 0.0


def contains_digit(completion: str, answer: str, **_: object) -> float:
    """1.0 when the expected digit appears anywhere in the completion."""
    return 1.0 if answer in completion else 0.0
