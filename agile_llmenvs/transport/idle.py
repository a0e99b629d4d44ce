"""The idle watchdog of a server connection: close it once it has been idle too long."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["IdleClock", "close_when_idle"]


class IdleClock:
    """What the idle watchdog reads: when the last reply went, and whether a call runs."""

    __slots__ = ("busy", "last")

    def __init__(self, now: float) -> None:
        self.busy = False
        self.last = now


async def close_when_idle(ws: Any, clock: IdleClock, idle_s: float) -> None:
    """Close ``ws`` (code 1001) once ``idle_s`` passes with no message and no call running.

    A timer per connection that sleeps until the deadline, instead of a timeout armed on
    every receive (which cost ~7% of the server's time per step under load).
    """
    loop = asyncio.get_running_loop()
    while True:
        left = idle_s if clock.busy else clock.last + idle_s - loop.time()
        if left <= 0:
            await ws.close(1001, "session idle timeout")
            return
        await asyncio.sleep(left)
