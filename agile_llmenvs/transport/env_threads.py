"""The worker threads of a server's sync env calls, which a hung call cannot use up.

A thread cannot be stopped from outside, so an env call that outlives ``env_step_timeout_s``
keeps its thread until it returns, perhaps never. With a fixed pool, a few such calls would
leave no thread for any other session (every factory call then times out while ``/health``
answers 200). Here a call marked hung no longer counts against the pool's size: a new thread
takes its place, up to ``max_hung`` hung calls. Past that bound the server can no longer
promise to serve, and :attr:`EnvThreads.exhausted` says why (``/health`` answers 503 with it).
The threads are daemons, so a hung call never blocks the process from exiting.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["EnvThreads"]

_Work = tuple[Future[Any], Callable[[], Any]]


class EnvThreads:
    """A thread pool of ``threads`` workers, plus one for each hung call (at most ``max_hung``).

    Args:
        threads: Workers for calls that return.
        max_hung: Hung calls whose threads are replaced; more leave the pool short.
        name: Prefix of the threads' names.
    """

    def __init__(self, threads: int, max_hung: int, name: str = "env-session") -> None:
        if threads < 1 or max_hung < 0:
            raise ValueError(f"need threads >= 1 and max_hung >= 0, got {threads}, {max_hung}")
        self.threads = threads
        self.max_hung = max_hung
        self.name = name
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._started = 0
        self._hung: dict[Future[Any], str] = {}
        self._closed = False

    @property
    def hung(self) -> list[str]:
        """What each call still running past its bound is (``step``, ``reset``, ...)."""
        with self._lock:
            return list(self._hung.values())

    @property
    def exhausted(self) -> str | None:
        """Why the pool can replace no more hung threads, or None while it can."""
        hung = self.hung
        if len(hung) < self.max_hung:
            return None
        return (
            f"{len(hung)} env calls ({', '.join(sorted(hung))}) outlived env_step_timeout_s and "
            f"still hold their threads; past {self.max_hung} hung calls the server replaces "
            "no more threads and can no longer build envs reliably: restart it"
        )

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        """Run ``call`` in a worker thread; its outcome (any ``BaseException`` too) is the
        future's."""
        if self._closed:
            raise RuntimeError("the env server is closing: no new env calls")
        future: Future[Any] = Future()
        self._work.put((future, call))
        if not self._idle.acquire(blocking=False):
            self._grow()
        return future

    def mark_hung(self, future: Future[Any], what: str) -> None:
        """``future``'s call outlived its bound: a new thread takes its place (up to
        ``max_hung`` such calls), and it stops counting once it returns."""
        with self._lock:
            if future.done():
                return
            self._hung[future] = what
        future.add_done_callback(self._returned)
        if not self._work.empty():
            self._grow()

    def close(self) -> None:
        """Refuse new calls and stop idle workers; running calls finish in their threads."""
        self._closed = True
        with self._lock:
            started = self._started
        for _ in range(started):
            self._work.put(None)

    def _returned(self, future: Future[Any]) -> None:
        with self._lock:
            self._hung.pop(future, None)

    def _limit(self) -> int:
        return self.threads + min(len(self._hung), self.max_hung)

    def _grow(self) -> None:
        with self._lock:
            if self._started >= self._limit():
                return
            self._started += 1
            number = self._started
        threading.Thread(target=self._serve, name=f"{self.name}-{number}", daemon=True).start()

    def _serve(self) -> None:
        while (work := self._work.get()) is not None:
            future, call = work
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as exc:  # handed to the event loop, which decides
                    future.set_exception(exc)
            del work, future, call
            with self._lock:  # a thread that stood in for a hung call that has returned
                if self._started > self._limit():
                    self._started -= 1
                    return
            self._idle.release()
