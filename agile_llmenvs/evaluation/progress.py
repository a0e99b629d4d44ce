"""A progress display for evaluations: steps, trajectories, tokens and an ETA from steps.

Whole trajectories finish late (in lock-step, a chunk's trajectories end together), so the
estimate comes from env steps: the time per step so far, times the steps the run can still
take. On a terminal the line is redrawn in place; anywhere else (a log file, CI) a plain line
is written every ``interval_s`` seconds, with no carriage returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from agile_llmenvs.evaluation.lockstep import Progress

__all__ = ["ProgressDisplay", "format_progress"]


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_progress(progress: Progress, elapsed_s: float, label: str = "eval") -> str:
    """One line: share of the step budget done, steps, trajectories, tokens, elapsed, ETA.

    The ETA is ``elapsed / steps * (max_steps - steps)``; before the first step it is ``?``.
    """
    steps, budget = progress.steps, max(progress.max_steps, progress.steps)
    share = steps / budget if budget else 1.0
    parts = [
        f"{label}: {share:4.0%}",
        f"{steps}/{budget} steps",
        f"{progress.completed}/{progress.total} trajectories",
    ]
    if progress.tokens:
        rate = progress.tokens / elapsed_s if elapsed_s > 0 else 0.0
        parts.append(f"{progress.tokens:,} tokens ({rate:,.0f}/s)")
    eta = _clock(elapsed_s / steps * (budget - steps)) if steps else "?"
    parts.append(f"{_clock(elapsed_s)} elapsed, ETA {eta}")
    return " | ".join(parts)


class ProgressDisplay:
    """Shows an evaluation's :class:`~agile_llmenvs.evaluation.Progress` on a stream.

    Pass it as ``on_step`` to :func:`~agile_llmenvs.evaluation.run_multi_evaluation`, and
    call :meth:`close` when the run ends.

    Args:
        stream: Where to write (``sys.stderr``, say).
        interval_s: Outside a terminal, the least time between two lines (the first report
            and the last are always written).
        label: The line's first word.
        clock: Seconds, monotonic (for tests).
    """

    def __init__(
        self,
        stream: TextIO,
        *,
        interval_s: float = 5.0,
        label: str = "eval",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream, self.interval_s, self.label, self.clock = stream, interval_s, label, clock
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._start = clock()
        self._last_line: float | None = None
        self._pending: Progress | None = None
        self._width = 0

    def __call__(self, progress: Progress) -> None:
        """Show ``progress``: redrawn on a terminal, else written when due."""
        now = self.clock()
        if self.tty:
            self._redraw(format_progress(progress, now - self._start, self.label))
        elif self._last_line is None or now - self._last_line >= self.interval_s:
            self._write(progress, now)
        else:
            self._pending = progress

    def close(self) -> None:
        """End the display: the last report, if not yet shown, then a newline on a terminal."""
        if self._pending is not None:
            self._write(self._pending, self.clock())
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()

    def _write(self, progress: Progress, now: float) -> None:
        self.stream.write(format_progress(progress, now - self._start, self.label) + "\n")
        self.stream.flush()
        self._last_line, self._pending = now, None

    def _redraw(self, line: str) -> None:
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)
