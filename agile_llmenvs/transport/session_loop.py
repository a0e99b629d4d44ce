"""One event loop thread shared by every remote env session of the process.

Calls block the caller's thread while their I/O runs here, so keep-alive pings are answered
even while the caller spends minutes generating (a loop that only runs during calls misses
them, and the server drops the session).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from agile_llmenvs._loops import new_event_loop
from agile_llmenvs.errors import EnvStateError

__all__ = ["SESSION_LOOP", "SessionLoop"]

T = TypeVar("T")


class SessionLoop:
    """A daemon thread running an asyncio loop, started on first use (and after a fork)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, started if needed."""
        with self._lock:
            if self._loop is None or self._pid != os.getpid() or not self._thread_alive():
                self._start()
            assert self._loop is not None
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and block until it finishes.

        Lighter than ``asyncio.run_coroutine_threadsafe`` (one task, one ``threading.Event``,
        no chained futures): this hop is on every blocking env call.

        Raises:
            EnvStateError: called from the loop's own thread (it would deadlock).
        """
        loop = self.loop
        if threading.current_thread() is self._thread:
            coro.close()
            raise EnvStateError(
                "a blocking env call was made from the session loop itself; use the async "
                "methods (areset/astep/...) there"
            )
        done = threading.Event()
        tasks: list[asyncio.Task[T]] = []

        def start() -> None:
            task = loop.create_task(coro)
            task.add_done_callback(lambda _: done.set())
            tasks.append(task)

        loop.call_soon_threadsafe(start)
        try:
            done.wait()
        except BaseException:  # e.g. KeyboardInterrupt: do not leave the call running
            loop.call_soon_threadsafe(lambda: tasks and tasks[0].cancel())
            raise
        return tasks[0].result()

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _start(self) -> None:
        loop = new_event_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self._thread = threading.Thread(target=main, name="env-session-loop", daemon=True)
        self._thread.start()
        ready.wait()
        self._loop = loop
        self._pid = os.getpid()


SESSION_LOOP = SessionLoop()
