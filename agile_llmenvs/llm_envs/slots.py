"""SlotPool: one rank's rollout slots, shared by every way of collecting rollouts.

A slot holds a :class:`RolloutHarness`, built from the factory at its first use and built
afresh after its env hung, and, while an episode (or a group of the continuous path) holds
it, the holder's episode number. The pool runs its slots' env calls concurrently, each within
``io_timeout_s``, and numbers episodes across batches. The lock-step path plays every slot at
once; the per-episode path holds one free slot per episode; the continuous path holds a
group's worth.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from agile_llmenvs.core import EpisodeData, failed_episode
from agile_llmenvs.errors import SlotTimeoutError
from agile_llmenvs.llm_envs.actions import in_process_env_class
from agile_llmenvs.llm_envs.harness import RolloutHarness
from agile_llmenvs.transport.calls import CallPolicy

__all__ = ["GROUP_HOLDER", "Slot", "SlotPool"]

GROUP_HOLDER = -1
"""The episode number a slot a continuous group holds is marked with."""


@dataclass
class Slot:
    """One rollout slot.

    Attributes:
        harness: Its harness (None until first used, and after its env hung).
        episode_id: The episode holding it (:data:`GROUP_HOLDER` for a group); None when free.
        in_flight: A step of the holding episode is running (per-episode path).
        release_pending: The episode was finalized while its step ran: free the slot when
            the step returns.
        failure: Why the slot's current episode failed, if it did.
        calls_class: The class whose call times the pool's :class:`CallPolicy` judges for
            this slot (see :meth:`SlotPool.run`), with the client it was read from
            (``calls_client``): read again when the harness's client changes.
    """

    harness: RolloutHarness | None = None
    episode_id: int | None = None
    in_flight: bool = False
    release_pending: bool = False
    failure: str | None = None
    calls_client: Any = None
    calls_class: type | None = None


class SlotPool:
    """``size`` rollout slots, their env calls, and who holds them.

    ``lock`` guards the slots' holders and the episode numbers; it is re-entrant, so a caller
    may hold it across several of the pool's calls.

    Args:
        size: Slots in the pool.
        build: Builds one slot's harness.
        io_timeout_s: Longest an env call may take (None: unbounded); a slot whose call
            outlives it is replaced and only its episode fails.
    """

    def __init__(
        self, size: int, build: Callable[[], RolloutHarness], *, io_timeout_s: float | None
    ) -> None:
        self.build = build
        self.io_timeout_s = io_timeout_s
        self.lock = threading.Condition()
        self.calls = CallPolicy("auto")
        self.calls.always_threaded.add(_RemoteCalls)
        self.executor = ThreadPoolExecutor(2 * size, thread_name_prefix="rollout-slot")
        self._slots = [Slot() for _ in range(size)]
        self._episodes = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, index: int) -> Slot:
        return self._slots[index]

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots)

    # -- harnesses ---------------------------------------------------------------------------

    def harness(self, index: int) -> RolloutHarness:
        """Slot ``index``'s harness, built now if it has none."""
        slot = self._slots[index]
        if slot.harness is None:
            slot.harness = self.build()
        return slot.harness

    def live(self) -> list[int]:
        """Slots whose episode is still running."""
        return [
            i
            for i, slot in enumerate(self._slots)
            if slot.failure is None and slot.harness is not None and not slot.harness.done
        ]

    def episode(self, index: int, abort_reason: str) -> EpisodeData:
        """The slot's episode data; a running episode is aborted, a failed slot's is a value."""
        slot = self._slots[index]
        if slot.failure is not None or slot.harness is None:
            return failed_episode(slot.failure or "the slot has no env")
        if not slot.harness.done:
            slot.harness.abort(abort_reason)
        return slot.harness.get_episode_data()

    def replace(self, index: int, reason: str) -> None:
        """Fail the slot's episode with ``reason`` and drop its harness (closed in the
        background); a fresh one is built at the slot's next use."""
        slot = self._slots[index]
        slot.failure = reason
        hung, slot.harness = slot.harness, None
        if hung is not None:
            self.executor.submit(_close_quietly, hung)

    # -- holders -----------------------------------------------------------------------------

    def number_episodes(self, count: int = 1) -> int:
        """Number ``count`` new episodes; returns the first number."""
        with self.lock:
            first = self._episodes
            self._episodes += count
            return first

    def wait_free(self, timeout_s: float | None) -> int:
        """The first free slot, once there is one (call it with :attr:`lock` held, to
        :meth:`hold` the slot before another caller sees it free).

        Raises:
            SlotTimeoutError: none became free within ``timeout_s``.
        """
        with self.lock:
            free = self.lock.wait_for(
                lambda: any(s.episode_id is None for s in self._slots), timeout=timeout_s
            )
            if not free:
                raise SlotTimeoutError(f"no rollout slot became free within {timeout_s} s")
            return next(i for i, s in enumerate(self._slots) if s.episode_id is None)

    def hold(self, index: int, episode_id: int) -> None:
        """Mark slot ``index`` as held by episode ``episode_id``, its last failure cleared."""
        with self.lock:
            slot = self._slots[index]
            slot.episode_id, slot.failure, slot.release_pending = episode_id, None, False

    def take(self, count: int) -> list[int] | None:
        """Hold ``count`` free slots for a group at once, or none (None) when fewer are free."""
        with self.lock:
            free = [i for i, s in enumerate(self._slots) if s.episode_id is None]
            if len(free) < count:
                return None
            for index in free[:count]:
                self._slots[index].episode_id = GROUP_HOLDER
            return free[:count]

    def release(self, index: int) -> None:
        """Free slot ``index`` and wake those waiting for one."""
        with self.lock:
            slot = self._slots[index]
            slot.episode_id, slot.release_pending = None, False
            self.lock.notify_all()

    # -- env calls ---------------------------------------------------------------------------

    def run(self, calls: dict[int, Callable[[], Any]]) -> dict[int, Any]:
        """Run each slot's env call; a call that raises or outlives ``io_timeout_s`` fails its
        slot (recorded, not raised).

        Calls run concurrently on worker threads, which enforce the timeout. A hop to a worker
        costs more than a fast in-process env's whole turn, so an in-process env class that
        has shown its calls are fast runs inline instead (see
        :class:`~agile_llmenvs.transport.calls.CallPolicy`); a few slow inline calls in a row
        send it back to the threads.
        """
        judged: dict[type, bool] = {}  # one verdict per class a call: all judged before any runs
        inline: list[tuple[int, type, Callable[[], Any]]] = []
        futures: dict[int, Future[Any]] = {}
        for index, call in calls.items():
            env_class = self._env_class(index)
            verdict = judged.get(env_class)
            if verdict is None:
                verdict = judged[env_class] = self.calls.inline(env_class)
            if verdict:
                inline.append((index, env_class, call))
            else:
                futures[index] = self.executor.submit(self._timed, env_class, call)
        results = {}
        for index, env_class, call in inline:
            try:
                results[index] = self._timed(env_class, call)
            except Exception as exc:
                self._slots[index].failure = f"{type(exc).__name__}: {exc}"
        done, _ = wait(futures.values(), timeout=self.io_timeout_s)
        for index, future in futures.items():
            if future not in done:
                self.replace(index, f"the env call exceeded io_timeout_s={self.io_timeout_s}")
            elif (error := future.exception()) is not None:
                self._slots[index].failure = f"{type(error).__name__}: {error}"
            else:
                results[index] = future.result()
        return results

    def _timed(self, env_class: type, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return call()
        finally:
            self.calls.record(env_class, time.perf_counter() - start)

    def _env_class(self, index: int) -> type:
        """The class whose calls the policy judges: an in-process env's, else the client's
        (remote calls always go to threads: their waiting is what runs concurrently); read
        once per client of the slot."""
        slot = self._slots[index]
        client = (slot.harness or self.harness(index)).client
        if slot.calls_client is not client or slot.calls_class is None:
            slot.calls_client = client
            slot.calls_class = in_process_env_class(client) or _RemoteCalls
        return slot.calls_class

    def close(self) -> None:
        """Close every slot's env and stop the worker threads."""
        for slot in self._slots:
            if slot.harness is not None:
                _close_quietly(slot.harness)
                slot.harness = None
        self.executor.shutdown(wait=False, cancel_futures=True)


class _RemoteCalls:
    """Stands for every env reached over the wire: its calls always run on threads."""


def _close_quietly(harness: RolloutHarness) -> None:
    with contextlib.suppress(Exception):
        harness.close()
