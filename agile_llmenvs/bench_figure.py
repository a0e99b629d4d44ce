"""One row of the performance table: a figure a benchmark script prints, and its target.

:mod:`agile_llmenvs.bench_figures` lists the figures of every script in ``bench/``;
:mod:`agile_llmenvs.bench_table` renders them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Figure", "Target", "at_least", "at_most"]


@dataclass(frozen=True)
class Target:
    """A bound a figure should meet, such as ``<= 2``."""

    op: Literal["<=", ">="]
    bound: float

    def met(self, value: float) -> bool:
        """Whether ``value`` is within the bound."""
        return value <= self.bound if self.op == "<=" else value >= self.bound


@dataclass(frozen=True)
class Figure:
    """One row of the table, read from a script's JSON result.

    Attributes:
        key: Dotted path of the value in the JSON object (``"ours.p50_us"``).
        label: What the figure measures, in words.
        unit: Appended to the value and the target (``"x"`` for ratios).
        target: The bound to meet; ``None`` for a figure shown for reference.
        detail: Shown after the value in brackets; ``{dotted.key}`` fields are filled
            from the same JSON object.
    """

    key: str
    label: str
    unit: str = "x"
    target: Target | None = None
    detail: str = ""


def at_most(bound: float) -> Target:
    """The target ``<= bound``."""
    return Target("<=", bound)


def at_least(bound: float) -> Target:
    """The target ``>= bound``."""
    return Target(">=", bound)
