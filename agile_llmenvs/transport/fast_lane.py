"""A worker thread the server's event loop hands proven-fast env calls to, and waits on.

Awaiting a thread-pool future through asyncio costs 70-120 µs per call here; handing calls to
one waiting thread through a ``SimpleQueue`` and waiting on a lock costs ~15 µs per hand-off.
The calls of one event-loop iteration go over together (:class:`LaneBatcher`), so at many
sessions the hand-off is paid once for many calls. The loop waits at most ``wait_s`` for a
batch: at the deadline the call running goes on in the lane while the loop serves other
sessions (its result arrives as an asyncio future), and the calls not started yet are handed
back, to run in the thread pool. One batch at a time: while a slow call holds the lane, calls
go to the thread pool.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["FastLane", "LaneBatcher", "LaneJob"]


class LaneJob:
    """One call handed to the lane: done at once, or awaited through :meth:`future`."""

    __slots__ = ("_done", "_guard", "_waiter", "call", "error", "started", "value")

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.started = False
        self.value: Any = None
        self.error: BaseException | None = None
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
        if waiter is not None:
            loop, future = waiter
            loop.call_soon_threadsafe(_deliver, future, self)


class _Batch:
    """Calls handed over together; the lane starts none of them once ``expired``."""

    __slots__ = ("expired", "finished", "guard", "jobs")

    def __init__(self, jobs: list[LaneJob]) -> None:
        self.jobs = jobs
        self.guard = threading.Lock()
        self.expired = False
        self.finished = threading.Lock()
        self.finished.acquire()


class FastLane:
    """One daemon thread running the calls handed to it, one at a time."""

    def __init__(self, name: str = "env-fast-lane") -> None:
        self._jobs: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._free = True
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def free(self) -> bool:
        """Whether no call is running in the lane."""
        return self._free

    def run(self, call: Callable[[], Any], wait_s: float) -> LaneJob | None:
        """Hand ``call`` alone to the lane and wait for it at most ``wait_s`` seconds.

        Returns its job (done, or running), or None when the wait ran out before the lane
        started it: the caller runs it elsewhere.
        """
        job = LaneJob(call)
        self.run_batch([job], wait_s)
        return job if job.started else None

    def run_batch(self, jobs: list[LaneJob], wait_s: float) -> None:
        """Hand ``jobs`` to the lane and wait at most ``wait_s`` seconds for all of them.

        On return every job is ``done``, running (``started``: its result comes through
        :meth:`LaneJob.future`), or never to be started by the lane (not ``started``).
        """
        batch = _Batch(jobs)
        self._free = False
        self._jobs.put(batch)
        if not batch.finished.acquire(timeout=wait_s):
            with batch.guard:
                batch.expired = True

    def close(self) -> None:
        """Stop the thread once the running call (if any) returns."""
        self._jobs.put(None)

    def _work(self) -> None:
        while (batch := self._jobs.get()) is not None:
            for job in batch.jobs:
                with batch.guard:
                    if batch.expired:
                        break
                    job.started = True
                try:
                    job.value = job.call()
                except BaseException as exc:  # handed back to the loop, which decides
                    job.error = exc
                job._finish()
            self._free = True
            batch.finished.release()


class LaneBatcher:
    """Collects the lane calls of one event-loop iteration and hands them over together.

    :meth:`add` returns a future that resolves, once the batch has been run (or its wait has
    run out), to the call's :class:`LaneJob`, or to None when the lane never started it (the
    lane was busy, or the batch's wait ran out first): the caller runs it elsewhere.
    """

    def __init__(self, lane: FastLane, wait_s: float) -> None:
        self.lane = lane
        self.wait_s = wait_s
        self._pending: list[tuple[LaneJob, asyncio.Future[LaneJob | None]]] = []

    def add(self, call: Callable[[], Any]) -> asyncio.Future[LaneJob | None]:
        """Queue ``call`` for this iteration's batch."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[LaneJob | None] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)  # after the handlers that are ready now have queued
        self._pending.append((LaneJob(call), future))
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if self.lane.free:
            self.lane.run_batch([job for job, _ in batch], self.wait_s)
        for job, future in batch:
            if not future.cancelled():
                future.set_result(job if job.started else None)


def _deliver(future: asyncio.Future[Any], job: LaneJob) -> None:
    if future.cancelled():
        return
    if job.error is not None:
        future.set_exception(job.error)
    else:
        future.set_result(job.value)
