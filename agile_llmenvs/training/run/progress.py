"""What a training run shows while it runs: its own progress, and no other library's.

In a terminal the progress is a ``tqdm`` bar on stderr. Anywhere else (a log file, a CI job,
a captured pipe) a bar's carriage returns pile up into one huge line, so it is a plain line
every :data:`PROGRESS_INTERVAL_S` seconds instead, plus the first and the last step. Other
libraries' bars are off while the policy loads and saves (:func:`quiet_libraries`; the
command line turns them off for the whole run).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from agile_llmenvs._quiet import quiet_libraries

__all__ = ["PROGRESS_INTERVAL_S", "Progress", "quiet_libraries"]

#: Seconds between two progress lines outside a terminal.
PROGRESS_INTERVAL_S = 5.0


class Progress:
    """A loop's step count and latest values, shown on ``stream`` (stderr by default).

    Args:
        name: The label (the algorithm).
        start: Steps done before this run (a resume's checkpoint step).
        total: The run's last step.
        enabled: ``False`` shows nothing (a process other than the main one).
        interval_s: Seconds between lines outside a terminal.
        stream: Where to write; a terminal gets a bar, anything else lines.
    """

    def __init__(
        self,
        name: str,
        *,
        start: int,
        total: int,
        enabled: bool = True,
        interval_s: float = PROGRESS_INTERVAL_S,
        stream: TextIO | None = None,
    ) -> None:
        self.name, self.step, self.total, self.enabled = name, start, total, enabled
        self.interval_s = interval_s
        self.stream = stream if stream is not None else sys.stderr
        self.values: dict[str, float | str] = {}
        self._started = time.monotonic()
        self._last_line: float | None = None
        self._bar: Any = None
        if enabled and _is_terminal(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(initial=start, total=total, desc=name, file=self.stream)

    def show(self, **values: float | str) -> None:
        """Show these values from now on (the bar's postfix, or the next line's): numbers to
        4 significant digits, text as it is."""
        self.values = values
        if self._bar is not None:
            self._bar.set_postfix({key: _shown(value) for key, value in values.items()})

    def advance(self) -> None:
        """Count one more step done."""
        self.step += 1
        if self._bar is not None:
            self._bar.update(1)
            return
        if not self.enabled:
            return
        now = time.monotonic()
        due = self._last_line is None or now - self._last_line >= self.interval_s
        if due or self.step >= self.total:
            self._last_line = now
            print(self.line(now - self._started), file=self.stream, flush=True)

    def line(self, elapsed_s: float) -> str:
        """``grpo step 12/800: reward 0.5, loss 0.0123 (6 s)``."""
        values = ", ".join(f"{key} {_shown(value)}" for key, value in self.values.items())
        shown = f": {values}" if values else ""
        return f"{self.name} step {self.step}/{self.total}{shown} ({elapsed_s:.0f} s)"

    def close(self) -> None:
        """End the bar (lines need no ending)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _shown(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:.4g}"
