"""A worker thread the server's event loop hands a proven-fast env call to, and waits on.

Awaiting a thread-pool future through asyncio costs 70-120 µs per call here; handing a call to
one waiting thread through a ``SimpleQueue`` and waiting on a lock costs ~15 µs. The loop waits
at most ``wait_s``: a call that takes longer goes on in the lane while the loop serves other
sessions, and its result arrives as an asyncio future. One call at a time: while a slow call
holds the lane, calls go to the thread pool.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["FastLane", "LaneJob"]


class LaneJob:
    """One call handed to the lane: done at once, or awaited through :meth:`future`."""

    __slots__ = ("_done", "_guard", "_waiter", "call", "error", "finished", "value")

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.value: Any = None
        self.error: BaseException | None = None
        self.finished = threading.Lock()
        self.finished.acquire()
        self._guard = threading.Lock()
        self._done = False
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]] | None = None

    @property
    def done(self) -> bool:
        """Whether the call has returned (or raised)."""
        return self._done

    def result(self) -> Any:
        """The call's value; re-raises what it raised."""
        if self.error is not None:
            raise self.error
        return self.value

    def future(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
        """An asyncio future of the call's outcome, on ``loop``."""
        future = loop.create_future()
        with self._guard:
            if not self._done:
                self._waiter = (loop, future)
                return future
        _deliver(future, self)
        return future

    def _finish(self) -> None:
        with self._guard:
            self._done = True
            waiter = self._waiter
        self.finished.release()
        if waiter is not None:
            loop, future = waiter
            loop.call_soon_threadsafe(_deliver, future, self)


class FastLane:
    """One daemon thread running the calls handed to it, one at a time."""

    def __init__(self, name: str = "env-fast-lane") -> None:
        self._jobs: queue.SimpleQueue[LaneJob | None] = queue.SimpleQueue()
        self._free = True
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def free(self) -> bool:
        """Whether no call is running in the lane."""
        return self._free

    def run(self, call: Callable[[], Any], wait_s: float) -> LaneJob:
        """Hand ``call`` to the lane and wait for it at most ``wait_s`` seconds."""
        job = LaneJob(call)
        self._free = False
        self._jobs.put(job)
        job.finished.acquire(timeout=wait_s)
        return job

    def close(self) -> None:
        """Stop the thread once the running call (if any) returns."""
        self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job.value = job.call()
            except BaseException as exc:  # handed back to the loop, which decides
                job.error = exc
            self._free = True
            job._finish()


def _deliver(future: asyncio.Future[Any], job: LaneJob) -> None:
    if future.cancelled():
        return
    if job.error is not None:
        future.set_exception(job.error)
    else:
        future.set_result(job.value)
