"""Continuous rollouts: each episode asks for its next turn as soon as its env replies.

The lock-step path (:meth:`RolloutCollector.collect`) waits at every turn for the slowest live
slot. Here every episode is its own task on the session loop
(:data:`~agile_llmenvs.transport.session_loop.SESSION_LOOP`): ``areset``, then
``agenerate`` -> ``astep`` until it is done, against an
:class:`~agile_llmenvs.backends.types.AsyncTokenBackend` that takes one prompt per request
(a ``vllm serve`` batches the requests in flight itself). A remote env's calls are awaited on
that same loop, so a thousand slots need no thread each; an in-process env's blocking calls
run on the slot pool's threads, or inline once its class has shown them fast
(:class:`~agile_llmenvs.llm_envs.actions.AsyncEnvCalls`).

Failures stay with their episode, as on the lock-step path: an env call that raises, or
outlives ``io_timeout_s`` (its slot then gets a fresh env), and a generation request that
fails (:class:`~agile_llmenvs.errors.GenerationServerError`) each give that episode a failed
value; the rest of its group and batch play on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from agile_llmenvs.core import EpisodeData, RolloutBatch, Task, Trajectory, failed_episode
from agile_llmenvs.errors import GenerationServerError
from agile_llmenvs.llm_envs.actions import AsyncEnvCalls
from agile_llmenvs.llm_envs.batch_builder import BatchBuilder
from agile_llmenvs.llm_envs.harness import RolloutHarness
from agile_llmenvs.llm_envs.slots import SlotPool

if TYPE_CHECKING:  # llm_envs does not import the backends layer
    from agile_llmenvs.backends.types import AsyncTokenBackend, SamplingParams

__all__ = ["ContinuousRollouts", "Observer", "request_seed"]

T = TypeVar("T")

#: Called with live slots' harnesses (by slot) before each of their generations: the point
#: to checkpoint their episodes (``credit: turn_mc`` / ``tree``).
Observer = Callable[[dict[int, RolloutHarness]], None]


def request_seed(seed: int | None, episode: int, turn: int) -> int | None:
    """The sampler seed of one generation request: a 31-bit hash of the batch's ``seed``, the
    episode's number and the turn (None when ``seed`` is None: unseeded sampling)."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}/{episode}/{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") >> 1


class _EpisodeFailed(Exception):
    """Ends one episode as a failed value (never leaves this module)."""


class ContinuousRollouts:
    """The collector's continuous path (see the module docstring) over its slot pool; every
    method runs on the session loop.

    Slots are taken a group at a time, first come first served: a group waits (awaiting, not
    polling) until ``group_size`` slots are free, and holds them until its last member ends.

    Args:
        slots: The slots episodes play on (their env calls, their episode numbers).
        groups: Groups per round of a batch.
        group_size: Episodes per group, sharing one task.
    """

    def __init__(self, slots: SlotPool, groups: int, group_size: int) -> None:
        self.slots = slots
        self.groups, self.group_size = groups, group_size
        self.env_calls = AsyncEnvCalls(slots.calls, slots.executor)
        self._waiting: deque[tuple[int, asyncio.Future[list[int]]]] = deque()
        self._groups_started = 0

    async def collect(
        self,
        builder: BatchBuilder,
        next_task: Callable[[], Task],
        backend: AsyncTokenBackend,
        params: SamplingParams,
        observe: Observer | None = None,
    ) -> RolloutBatch:
        """The batch ``builder`` assembles, every group of a round played at once, on the
        tasks ``next_task`` draws (see :meth:`RolloutCollector.collect_continuous`)."""
        while builder.wants_round():
            tasks = [next_task() for _ in range(self.groups)]
            played = [
                self.play_group(backend, params, task, g, observe) for g, task in enumerate(tasks)
            ]
            builder.add_round(await _all(played))
        return builder.batch()

    async def next_group(
        self, backend: AsyncTokenBackend, params: SamplingParams, next_task: Callable[[], Task]
    ) -> tuple[Trajectory, ...]:
        """The group of the task ``next_task`` draws now (see
        :meth:`RolloutCollector.aplay_group`)."""
        group = self._groups_started
        self._groups_started += 1
        return await self.play_group(backend, params, next_task(), group)

    async def play_group(
        self,
        backend: AsyncTokenBackend,
        params: SamplingParams,
        task: Task,
        group: int,
        observe: Observer | None = None,
    ) -> tuple[Trajectory, ...]:
        """Play ``task``'s group on ``group_size`` free slots; trajectories in member order.
        ``observe`` sees each episode's harness (``{slot: harness}``) before every request.

        Episode numbers (which seed the requests) are taken before the slots are awaited, so
        they follow the order groups were started in.
        """
        first = self.slots.number_episodes(self.group_size)
        slots = await self._acquire(self.group_size)
        try:
            played = await _all(
                [
                    self._episode(backend, params, s, task, first + m, observe)
                    for m, s in enumerate(slots)
                ]
            )
        finally:
            self._release(slots)
        return tuple(
            Trajectory(group, slot, task, episode, version)
            for slot, (episode, version) in zip(slots, played, strict=True)
        )

    # -- one episode -------------------------------------------------------------------------

    async def _episode(
        self,
        backend: AsyncTokenBackend,
        params: SamplingParams,
        slot: int,
        task: Task,
        episode: int,
        observe: Observer | None = None,
    ) -> tuple[EpisodeData, int | None]:
        """Play one episode to its end: ``(its data, the policy version of its first request)``."""
        version: int | None = None
        try:
            harness = self._slot_harness(slot)
            await self._env_call(slot, harness.areset(**task.reset_kwargs()))
            turn = 0
            while not harness.done:
                if observe is not None:  # on the loop, between this episode's env calls
                    observe({slot: harness})
                if version is None:  # versions only rise: the oldest policy of the episode
                    version = backend.version
                request = replace(params, seed=request_seed(params.seed, episode, turn))
                if harness.context_images is not None:
                    raise _EpisodeFailed(
                        f"{type(backend).__name__} generates from ids alone but the prompt "
                        "shows images: play image envs on the lock-step path with the HF "
                        "backend"
                    )
                try:
                    generation = await backend.agenerate(harness.context_ids, request)
                except GenerationServerError as exc:
                    raise _EpisodeFailed(f"{type(exc).__name__}: {exc}") from exc
                await self._env_call(slot, harness.astep(generation.token_ids, generation.logprobs))
                turn += 1
            return harness.get_episode_data(), version
        except _EpisodeFailed as failure:
            return failed_episode(str(failure)), version

    async def _env_call(self, slot: int, call: Awaitable[T]) -> T:
        """Await an env call of ``slot``; one that raises or outlives ``io_timeout_s`` fails
        the episode (a timed-out slot gets a fresh env, as on the lock-step path)."""
        timeout_s = self.slots.io_timeout_s
        try:
            async with asyncio.timeout(timeout_s) as deadline:
                return await call
        except Exception as exc:
            if isinstance(exc, TimeoutError) and deadline.expired():
                reason = f"the env call exceeded io_timeout_s={timeout_s}"
                self.slots.replace(slot, reason)
                raise _EpisodeFailed(reason) from None
            raise _EpisodeFailed(f"{type(exc).__name__}: {exc}") from exc

    def _slot_harness(self, slot: int) -> RolloutHarness:
        """The slot's harness (built here, on the loop, at its first use: a pool thread per
        build would leave a thread per slot behind); its blocking env calls then run through
        this path's pool and call policy."""
        try:
            harness = self.slots.harness(slot)
        except Exception as exc:
            raise _EpisodeFailed(f"{type(exc).__name__}: {exc}") from exc
        harness.async_calls = self.env_calls
        return harness

    # -- slots -------------------------------------------------------------------------------

    async def _acquire(self, count: int) -> list[int]:
        """Hold ``count`` free slots, waiting behind the groups that asked first."""
        if not self._waiting and (slots := self.slots.take(count)) is not None:
            return slots
        waiter: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiting.append((count, waiter))
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release(waiter.result())
            with contextlib.suppress(ValueError):
                self._waiting.remove((count, waiter))
            raise

    def _release(self, slots: list[int]) -> None:
        with self.slots.lock:
            for index in slots:
                self.slots.release(index)
        while self._waiting:
            count, waiter = self._waiting[0]
            if waiter.done():
                self._waiting.popleft()
                continue
            taken = self.slots.take(count)
            if taken is None:
                return
            self._waiting.popleft()
            waiter.set_result(taken)


async def _all(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Await ``calls`` concurrently; the first to raise cancels the rest and is raised as
    itself (a bug, since failures are values here), not inside an exception group."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_awaited(call)) for call in calls]
    except BaseExceptionGroup as raised:
        raise raised.exceptions[0]  # noqa: B904 - the group is its __context__
    return [task.result() for task in tasks]


async def _awaited(call: Awaitable[T]) -> T:
    return await call
