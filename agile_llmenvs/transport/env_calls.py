"""Where the server's env calls run, and how long it waits for them.

Sync env calls run where :class:`~agile_llmenvs.transport.calls.CallPolicy` says: in a shared
thread pool, or, once an env class has shown its calls are fast, in the fast lane with the other
calls of the same event-loop iteration (:mod:`~agile_llmenvs.transport.fast_lane`), the loop
waiting at most ``inline_wait_s``. Envs implementing OpenEnv's ``reset_async`` /
``step_async`` are awaited directly. Every call is bounded by ``env_step_timeout_s``; a call
that outlives it, or raises a ``BaseException`` that is no ``Exception``, is a
:class:`Discard`: its session ends, the server goes on, and a thread stands in for the one
the hung call holds (:class:`~agile_llmenvs.transport.env_threads.EnvThreads`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from agile_llmenvs.transport._openenv import Environment
from agile_llmenvs.transport.calls import CallPolicy
from agile_llmenvs.transport.env_threads import EnvThreads
from agile_llmenvs.transport.fast_lane import FastLane, LaneBatcher

if TYPE_CHECKING:
    from agile_llmenvs.transport.settings import ServerSettings

__all__ = ["Discard", "EnvCallTimeout", "EnvCalls", "result"]

logger = logging.getLogger(__name__)


class EnvCalls:
    """Runs a server's env calls: its thread pool, call policy and fast lane.

    Args:
        settings: The server's settings (``env_calls``, ``inline_wait_s``,
            ``env_step_timeout_s``).
        threads: Threads of the pool (and, twice that, hung calls whose threads are
            replaced).
        sessions: How many sessions are live (a lone session's call goes to the lane at once).
    """

    def __init__(self, settings: ServerSettings, threads: int, sessions: Callable[[], int]) -> None:
        self.settings = settings
        self.sessions = sessions
        self.threads = EnvThreads(threads, max_hung=2 * threads)
        self.policy = CallPolicy(settings.env_calls)
        self.lane = FastLane()
        self.batcher = LaneBatcher(self.lane, settings.inline_wait_s)

    def close(self) -> None:
        """Stop the pool and the lane; running calls finish in their (daemon) threads."""
        self.threads.close()
        self.lane.close()

    async def call(self, env: Environment, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run one env call where the call policy says, bounded by ``env_step_timeout_s``.

        Raises:
            Discard: the call outlived its bound or raised a ``BaseException`` that is not
                an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``): the session ends
                and its env is discarded; the server goes on.
        """
        env_class = type(env)
        overridden = getattr(env_class, f"{method}_async", None)
        if overridden is not None and overridden is not getattr(Environment, f"{method}_async"):
            task = asyncio.ensure_future(getattr(env, f"{method}_async")(*args, **kwargs))
            return await self.settle(task, method)
        call = partial(self._timed, env_class, partial(getattr(env, method), *args, **kwargs))
        wait = self.policy.wait_s(env_class, self.settings.inline_wait_s)
        if wait is None:  # env_calls="inline": on the loop itself, unbounded
            return result(call)
        what = method.removesuffix("_frame")
        if wait > 0 and self.lane.free:  # proven fast: to the lane, with this iteration's others
            if self.sessions() > 1:
                job = await self.batcher.add(call)
            else:  # no other session to batch with: hand it over now, saving a loop turn
                job = self.lane.run(call, wait)
            if job is not None:
                if job.done:
                    return result(job.result)
                return await self.settle(job.future(asyncio.get_running_loop()), what)
            wait = 0.0  # the lane never started it: the thread pool runs it
        future = self.threads.submit(call)
        if wait > 0:
            concurrent.futures.wait((future,), timeout=wait)
        if future.done():
            return result(future.result)
        return await self.settle(asyncio.wrap_future(future), what, future)

    async def call_bounded(self, call: Callable[[], Any], what: str | None = None) -> Any:
        """``call()`` in the thread pool, bounded like an env call (the factory, ``state``,
        ``get_metadata``, close)."""
        future = self.threads.submit(call)
        what = what or str(getattr(call, "__name__", "env call"))
        return await self.settle(asyncio.wrap_future(future), what, future)

    async def settle(
        self,
        future: asyncio.Future[Any],
        what: str,
        thread_call: concurrent.futures.Future[Any] | None = None,
    ) -> Any:
        """The result of an env call's future, waited for at most ``env_step_timeout_s``
        (``thread_call``: the pool's future of that call, whose thread a new one replaces
        when it does not return in time)."""
        timeout = self.settings.env_step_timeout_s
        done, _ = await asyncio.wait((future,), timeout=timeout)
        if not done:
            future.cancel()  # an async env stops; a thread cannot be stopped from outside
            if thread_call is not None:
                self.threads.mark_hung(thread_call, what)
            raise Discard(
                EnvCallTimeout(
                    f"the env's {what} took longer than env_step_timeout_s={timeout:g} s; "
                    "the session is closed and its env discarded"
                )
            )
        return result(future.result)

    def _timed(self, env_class: type, call: Callable[[], Any]) -> Any:
        """Run ``call`` and report its own duration (never the wait for a worker thread,
        which grows with the number of sessions, not with the env's cost)."""
        start = time.perf_counter()
        try:
            return call()
        finally:
            self.policy.record(env_class, time.perf_counter() - start)


class Discard(Exception):
    """An env call that ends its session: it outlived ``env_step_timeout_s``, or raised a
    ``BaseException`` such as ``SystemExit`` (which must not stop the server)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exc = exc


class EnvCallTimeout(Exception):
    """An env call outlived ``env_step_timeout_s`` (reported to the client, never raised
    to the caller of the server)."""


def result(get: Callable[[], Any]) -> Any:
    """``get()``; a ``BaseException`` that is no ``Exception`` (an env's ``SystemExit``,
    ``KeyboardInterrupt``) becomes :class:`Discard` instead of stopping the server."""
    try:
        return get()
    except Exception:
        raise
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        logger.error("an env call raised %s; its session is closed", type(exc).__name__)
        raise Discard(exc) from None
