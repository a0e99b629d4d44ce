"""Env failures that speak: a broken env is named at once and never trains for hours on nothing.

An episode whose env raised, lost its connection or timed out scores nothing and is left out of
the update (:mod:`~agile_llmenvs.training.objective.losses`). :class:`EnvFailures` watches each
step's failed episodes: the first failure of each kind (the exception's type and where the env
raised it, or the whole message when no place is known) is printed once, with the env's file and
line; and a step whose failed share is above ``training.max_failed_fraction`` is a failing step, of
which ``training.max_failed_steps`` in a row stop the run with :class:`EnvFailuresError`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from agile_llmenvs.core import Trajectory
from agile_llmenvs.errors import EnvFailuresError
from agile_llmenvs.weights import find_checkpoint

__all__ = ["EnvFailures", "failure_kind"]

# "... (raised as NameError at guess_env.py:12 in step) ...": the exception and its place
_RAISED_AT = re.compile(r"\(raised as (\S+) at ([^)]+)\)")


def failure_kind(error: str) -> str:
    """What makes two failures the same: the exception's type and place when the message
    names them, else the message itself."""
    found = _RAISED_AT.search(error)
    return f"{found.group(1)} at {found.group(2)}" if found else error


class EnvFailures:
    """Counts each step's failed episodes, reports new kinds, and stops a failing run.

    Args:
        max_fraction: A step with a larger share of failed episodes is failing.
        max_steps: Failing steps in a row that stop the run.
        report: Print new kinds of failure (the main process does; every process counts).
        stream: Where reports go (stderr by default).
    """

    def __init__(
        self,
        max_fraction: float,
        max_steps: int,
        *,
        report: bool = True,
        stream: TextIO | None = None,
        output_dir: Path | None = None,
    ) -> None:
        self.max_fraction, self.max_steps, self.report = max_fraction, max_steps, report
        self.output_dir = output_dir  # the run's: the stop offers --resume once it holds one
        self.stream = stream if stream is not None else sys.stderr
        self.seen: dict[str, str] = {}  # kind -> its first message
        self.failing_steps = 0  # in a row, up to the last step recorded
        self.first_error: str | None = None  # since the last step that was not failing

    def see(self, step: int, trajectories: Sequence[Trajectory]) -> None:
        """Report the kinds of failure among this process's ``trajectories`` of step
        ``step`` not seen before, each once, with how many of them it has."""
        errors = [str(t.episode.info.get("error", "unknown")) for t in trajectories if t.failed]
        kinds = [failure_kind(error) for error in errors]
        for error, kind in zip(errors, kinds, strict=True):
            if kind not in self.seen:
                self.seen[kind] = error
                self._report(step, error, kinds.count(kind), len(trajectories))
        if errors and self.first_error is None:
            self.first_error = errors[0]

    def check(self, step: int, failed: int, episodes: int) -> None:
        """Count step ``step`` as failing or not from the run's ``failed`` of ``episodes``
        (summed over processes, so every process takes the same decision).

        Raises:
            EnvFailuresError: this was the ``max_steps``-th failing step in a row.
        """
        if episodes == 0 or failed / episodes <= self.max_fraction:
            self.failing_steps, self.first_error = 0, None
            return
        self.failing_steps += 1
        if self.failing_steps >= self.max_steps:
            raise EnvFailuresError(self._stop_message(step, failed, episodes))

    def _report(self, step: int, error: str, count: int, total: int) -> None:
        if not self.report:
            return
        print(
            f"env error at step {step} ({count} of {total} episodes; first of its kind, later "
            f"ones are counted in failed_episodes): {error}",
            file=self.stream,
            flush=True,
        )

    def _stop_message(self, step: int, failed: int, episodes: int) -> str:
        steps = f"{self.max_steps} steps in a row" if self.max_steps > 1 else "a step"
        first = f"; the first error: {self.first_error}" if self.first_error else ""
        return (
            f"the env failed in more than {self.max_fraction:.0%} of the episodes for "
            f"{steps} (step {step}: {failed} of {episodes}): stopping, as "
            f"training.max_failed_fraction and training.max_failed_steps say{first}. The failed "
            f"episodes are in rollouts.jsonl; fix the env and train again ({self._again()})"
        )

    def _again(self) -> str:
        """How to train again: from the last checkpoint when there is one."""
        if self.output_dir is not None and find_checkpoint(self.output_dir, report=False):
            return "--resume continues from the last checkpoint, --overwrite starts over"
        return "no checkpoint was saved: --overwrite starts over"
