"""Where a sync env call runs: inline on the server's event loop, or in its thread pool.

A hop to a worker thread costs 70-120 µs per call on these machines — more than the rest of
the server's work for a step. In ``auto`` mode each env class starts in the pool; once it has
shown :data:`WARMUP_CALLS` calls under ``inline_budget_s`` it runs inline, and the first
inline call over ``demote_after_s`` sends that class back to the pool for good, so a slow env
stalls the loop (and every other session's replies and pings) at most once, briefly.
"""

from __future__ import annotations

import logging
from typing import Literal

__all__ = ["WARMUP_CALLS", "CallMode", "CallPolicy"]

logger = logging.getLogger(__name__)

CallMode = Literal["auto", "thread", "inline"]
#: Fast calls an env class must show in the pool before it runs inline.
WARMUP_CALLS = 32


class CallPolicy:
    """Per env class, whether its sync calls run inline; fed with each call's duration.

    Args:
        mode: ``auto`` (adaptive, above), ``thread`` (always the pool) or ``inline`` (never).
        inline_budget_s: A call this fast counts towards running inline.
        demote_after_s: An inline call this slow returns its class to the pool.
    """

    def __init__(
        self, mode: CallMode, *, inline_budget_s: float = 0.001, demote_after_s: float = 0.005
    ) -> None:
        self.mode = mode
        self.inline_budget_s = inline_budget_s
        self.demote_after_s = demote_after_s
        self._fast_calls: dict[type, int] = {}
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
            if seconds > self.demote_after_s:
                self._demoted.add(env_class)
                logger.info(
                    "%s: a %.1f ms call; its calls now run in the thread pool",
                    env_class.__name__,
                    seconds * 1e3,
                )
        elif seconds <= self.inline_budget_s:
            self._fast_calls[env_class] = self._fast_calls.get(env_class, 0) + 1
        else:
            self._fast_calls[env_class] = 0
