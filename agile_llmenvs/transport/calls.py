"""Where a sync env call runs: inline on the server's event loop, or in its thread pool.

A hop to a worker thread costs 70-120 µs per call on these machines — more than the rest of
the server's work for a step. In ``auto`` mode each env class starts in the pool; once it has
shown :data:`WARMUP_CALLS` calls under ``inline_budget_s`` it runs inline, and
:data:`DEMOTE_STRIKES` inline calls in a row over ``demote_after_s`` send that class back to the
pool for good: a slow env stalls the loop (and every other session's replies and pings) a few
times at most, briefly, while one call that the OS merely descheduled on a loaded machine does
not cost a fast env its inline calls.
"""

from __future__ import annotations

import logging
from typing import Literal

__all__ = ["DEMOTE_STRIKES", "WARMUP_CALLS", "CallMode", "CallPolicy"]

logger = logging.getLogger(__name__)

CallMode = Literal["auto", "thread", "inline"]
#: Fast calls an env class must show in the pool before it runs inline.
WARMUP_CALLS = 32
#: Slow inline calls in a row that send an env class back to the pool for good.
DEMOTE_STRIKES = 3


class CallPolicy:
    """Per env class, whether its sync calls run inline; fed with each call's duration.

    Args:
        mode: ``auto`` (adaptive, above), ``thread`` (always the pool) or ``inline`` (never).
        inline_budget_s: A call this fast counts towards running inline.
        demote_after_s: :data:`DEMOTE_STRIKES` inline calls in a row this slow return their
            class to the pool.
    """

    def __init__(
        self, mode: CallMode, *, inline_budget_s: float = 0.001, demote_after_s: float = 0.005
    ) -> None:
        self.mode = mode
        self.inline_budget_s = inline_budget_s
        self.demote_after_s = demote_after_s
        self._fast_calls: dict[type, int] = {}
        self._strikes: dict[type, int] = {}
        self._demoted: set[type] = set()
        self.always_threaded: set[type] = set()

    def inline(self, env_class: type) -> bool:
        """Whether the next call of ``env_class`` runs inline."""
        if self.mode != "auto":
            return self.mode == "inline"
        if env_class in self.always_threaded:
            return False
        return env_class not in self._demoted and self._fast_calls.get(env_class, 0) >= (
            WARMUP_CALLS
        )

    def record(self, env_class: type, seconds: float, *, inline: bool) -> None:
        """Account one call of ``env_class`` that took ``seconds``."""
        if self.mode != "auto" or env_class in self._demoted:
            return
        if inline:
            if seconds <= self.demote_after_s:
                self._strikes[env_class] = 0
                return
            strikes = self._strikes.get(env_class, 0) + 1
            self._strikes[env_class] = strikes
            if strikes >= DEMOTE_STRIKES:
                self._demoted.add(env_class)
                logger.info(
                    "%s: %d calls in a row over %.1f ms; its calls now run in the thread pool",
                    env_class.__name__,
                    strikes,
                    self.demote_after_s * 1e3,
                )
        elif seconds <= self.inline_budget_s:
            self._fast_calls[env_class] = self._fast_calls.get(env_class, 0) + 1
        else:
            self._fast_calls[env_class] = 0
