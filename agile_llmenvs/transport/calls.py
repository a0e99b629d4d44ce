"""How the server's event loop waits for a sync env call, which runs in its thread pool.

Awaiting a worker thread through asyncio costs 70-120 µs per call on these machines — more
than the rest of the server's work for a step. In ``auto`` mode each env class starts with
plain awaits; once it has shown :data:`WARMUP_CALLS` calls under ``inline_budget_s``, the loop
waits for each of its calls on the worker's future itself, up to ``inline_wait_s`` (about the
cost of running it inline), and only awaits it when it takes longer. So one session's env call
delays the others by at most ``inline_wait_s``, whatever the env does. :data:`DEMOTE_STRIKES`
calls in a row over ``demote_after_s`` return that class to plain awaits for good, while one
call that the OS merely descheduled on a loaded machine does not cost a fast env its waits.
``inline`` runs calls on the loop itself (no bound: opt-in); ``thread`` always awaits.
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
    """Per env class, how the loop waits for its sync calls; fed with each call's duration.

    Args:
        mode: ``auto`` (adaptive, above), ``thread`` (always await) or ``inline`` (run on the
            event loop).
        inline_budget_s: A call this fast counts towards being waited for.
        demote_after_s: :data:`DEMOTE_STRIKES` waited-for calls in a row this slow return
            their class to plain awaits.
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
        """Whether ``env_class`` has proven its calls fast (``inline`` mode: always).

        The rollout collector then runs them in its own thread; the server waits for them.
        """
        if self.mode != "auto":
            return self.mode == "inline"
        if env_class in self.always_threaded or env_class in self._demoted:
            return False
        return self._fast_calls.get(env_class, 0) >= WARMUP_CALLS

    def wait_s(self, env_class: type, inline_wait_s: float) -> float | None:
        """How long the server's loop waits for the next call of ``env_class`` before it
        awaits it (0: await at once; None: run it on the loop itself, ``inline`` mode)."""
        if self.mode == "inline":
            return None
        return inline_wait_s if self.inline(env_class) else 0.0

    def record(self, env_class: type, seconds: float) -> None:
        """Account one call of ``env_class`` that took ``seconds``."""
        if self.mode != "auto" or env_class in self._demoted:
            return
        if self._fast_calls.get(env_class, 0) >= WARMUP_CALLS:
            if seconds <= self.demote_after_s:
                self._strikes[env_class] = 0
                return
            strikes = self._strikes.get(env_class, 0) + 1
            self._strikes[env_class] = strikes
            if strikes >= DEMOTE_STRIKES:
                self._demoted.add(env_class)
                logger.info(
                    "%s: %d calls in a row over %.1f ms; the server no longer waits for its calls",
                    env_class.__name__,
                    strikes,
                    self.demote_after_s * 1e3,
                )
        elif seconds <= self.inline_budget_s:
            self._fast_calls[env_class] = self._fast_calls.get(env_class, 0) + 1
        else:
            self._fast_calls[env_class] = 0
