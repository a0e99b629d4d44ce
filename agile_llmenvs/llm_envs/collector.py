"""RolloutCollector: GRPO groups of token-exact rollouts over one rank's rollout slots."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from agile_llmenvs.core.images import ImagePrompt
from agile_llmenvs.errors import SlotTimeoutError, StaleEpisodeError
from agile_llmenvs.llm_envs.continuous import ContinuousRollouts
from agile_llmenvs.llm_envs.episode import EpisodeData, TurnResult
from agile_llmenvs.llm_envs.harness import RolloutHarness
from agile_llmenvs.llm_envs.tasks import Task, TaskAssigner, check_rank
from agile_llmenvs.llm_envs.trajectory import (
    BatchBuilder,
    RolloutBatch,
    Trajectory,
    failed_episode,
    finished_rewards,
)
from agile_llmenvs.transport.calls import CallPolicy
from agile_llmenvs.transport.client import InProcessEnvClient
from agile_llmenvs.transport.session_loop import SESSION_LOOP

if TYPE_CHECKING:  # llm_envs does not import the backends layer
    from agile_llmenvs.backends.types import AsyncTokenBackend, SamplingParams

__all__ = ["EpisodeHandle", "Generate", "Observer", "RolloutCollector"]

Generate = Callable[[list[list[int]]], Sequence[Any]]
"""A policy: context ids of every live slot -> sampled ids (or ``(ids, logps)``) for each."""

Observer = Callable[[dict[int, RolloutHarness]], None]
"""Sees the harness of every live slot, by slot, before each generation of a batch."""


@dataclass(frozen=True)
class EpisodeHandle:
    """A slot held by one episode of the per-episode path, from reset to finalize."""

    slot: int
    episode_id: int
    group: int
    task: Task
    prompt_ids: list[int]
    done: bool = False


@dataclass
class _Slot:
    harness: RolloutHarness | None = None
    episode_id: int | None = None  # held by this episode (per-episode path)
    in_flight: bool = False
    release_pending: bool = False
    failure: str | None = None


class RolloutCollector:
    """Batched collector over one rank's share of a global batch.

    ``batch_size`` is the world-wide group count; this rank holds ``(batch_size /
    world_size) * group_size`` harness slots, built lazily from ``env_factory``. Drive it
    lock-step (:meth:`reset` / :meth:`step` / :meth:`get_trajectories`, or :meth:`collect`
    with a policy) or per episode (:meth:`reset_episode` / :meth:`step_episode` /
    :meth:`finalize_episode`, thread-safe). Env calls of all slots run concurrently; a slot
    whose env call exceeds ``io_timeout_s`` is closed and replaced, and only its episode fails.

    Args:
        env_factory: Builds one :class:`RolloutHarness` (called with ``**env_config``).
        batch_size: GRPO groups per step, across all ranks.
        group_size: Episodes per group, sharing one task.
        env_config: Keyword arguments for ``env_factory``.
        io_timeout_s: Longest an env call may take (None: unbounded).
        base_seed: Seed of the task order and task seeds.
        slot_acquire_timeout_s: Longest :meth:`reset_episode` waits for a free slot.
        rank: This rank (default: the torch.distributed rank, else 0).
        world_size: Ranks (default: the torch.distributed world size, else 1).
        adaptive_task_sampling: Draw rows by recent informative-group rate.

    Raises:
        ValueError: ``rank`` / ``world_size`` are not ints with ``0 <= rank < world_size``,
            or ``batch_size`` is not a positive multiple of ``world_size``, or
            ``group_size < 1``.
    """

    def __init__(
        self,
        env_factory: Callable[..., RolloutHarness],
        batch_size: int,
        group_size: int,
        env_config: dict[str, Any] | None = None,
        io_timeout_s: float | None = 600.0,
        base_seed: int | None = None,
        slot_acquire_timeout_s: float | None = 300.0,
        rank: int | None = None,
        world_size: int | None = None,
        adaptive_task_sampling: bool = False,
    ) -> None:
        rank, world_size = check_rank(*_distributed(rank, world_size))
        if group_size < 1 or batch_size < 1 or batch_size % world_size:
            raise ValueError(
                f"batch_size ({batch_size}) must be a positive multiple of "
                f"world_size ({world_size}), and group_size ({group_size}) >= 1"
            )
        self.env_factory, self.env_config = env_factory, dict(env_config or {})
        self.group_size, self.groups = group_size, batch_size // world_size
        self.io_timeout_s, self.slot_acquire_timeout_s = io_timeout_s, slot_acquire_timeout_s
        self.rank, self.world_size, self.base_seed = rank, world_size, base_seed
        self.adaptive = adaptive_task_sampling
        self.num_slots = self.groups * group_size
        self._slots = [_Slot() for _ in range(self.num_slots)]
        self._pool = ThreadPoolExecutor(2 * self.num_slots, thread_name_prefix="rollout-slot")
        self._calls = CallPolicy("auto")
        self._calls.always_threaded.add(_RemoteCalls)
        self._assigner: TaskAssigner | None = None
        self._tasks: list[Task] = []
        self._lock = threading.Condition()
        self._next_episode = 0
        self._open_group: tuple[int, Task, int] | None = None  # (group, task, members left)
        self._group_counter = 0
        self._continuous = ContinuousRollouts(self)

    # -- AgileRL's names -----------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """This rank's GRPO groups per step: the world-wide ``batch_size`` / ``world_size``
        (AgileRL's attribute; the same as :attr:`groups`)."""
        return self.groups

    @property
    def num_envs(self) -> int:
        """This rank's slots, ``batch_size * group_size`` (AgileRL's name of :attr:`num_slots`)."""
        return self.num_slots

    def check_env(self) -> None:
        """Build the first slot's env now (it plays that slot's first episode), so a mistake
        in the env's construction fails while a run sets up rather than at its first step."""
        self._harness(0)

    @property
    def envs(self) -> list[RolloutHarness]:
        """Every slot's harness, in slot order, building any slot's not built yet.

        A new list each time: a slot whose env timed out gets a fresh harness on its next
        use, so hold slot indices rather than this list.
        """
        return [self._harness(i) for i in range(self.num_slots)]

    # -- tasks -------------------------------------------------------------------------------

    @property
    def assigner(self) -> TaskAssigner:
        """The task assigner (built on first use, from the env's ``dataset_size``)."""
        if self._assigner is None:
            self._set_assigner(self._harness(0).dataset_size())
        assert self._assigner is not None
        return self._assigner

    def _set_assigner(self, rows: int) -> None:
        self._assigner = TaskAssigner(
            rows,
            seed=self.base_seed,
            rank=self.rank,
            world_size=self.world_size,
            adaptive=self.adaptive,
        )

    @property
    def num_epochs(self) -> int:
        """Full passes over this rank's shard of the dataset."""
        return self.assigner.num_epochs

    def state_dict(self) -> dict[str, Any]:
        """The task assigner's state, to resume the exact task sequence."""
        return {"assigner": self.assigner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`."""
        self.assigner.load_state_dict(state["assigner"])

    # -- lock-step path ----------------------------------------------------------------------

    def reset(self) -> list[list[int]]:
        """Start one episode per slot, a fresh task per group; returns each slot's prompt
        (empty for a slot whose env failed)."""
        assigner = self.assigner
        self._tasks = [assigner.next_task() for _ in range(self.groups)]
        for slot in self._slots:
            slot.failure = None
        calls = {i: self._reset_call(i) for i in range(self.num_slots)}
        prompts = self._run(calls)
        return [prompts.get(i) or [] for i in range(self.num_slots)]

    @property
    def live_slots(self) -> list[int]:
        """Slots whose episode is still running."""
        return [
            i
            for i, slot in enumerate(self._slots)
            if slot.failure is None and slot.harness is not None and not slot.harness.done
        ]

    def contexts(self) -> dict[int, list[int]]:
        """Each live slot's context: the prompt of its next generation (an
        :class:`~agile_llmenvs.core.images.ImagePrompt` when it shows images)."""
        return {i: _context(self._harness(i)) for i in self.live_slots}

    def step(
        self,
        completions: dict[int, Sequence[int]],
        sampling_logps: dict[int, Sequence[float]] | None = None,
    ) -> dict[int, TurnResult]:
        """Play one turn on every slot in ``completions`` (live slots only), concurrently."""
        logps = sampling_logps or {}
        calls: dict[int, Callable[[], Any]] = {
            i: partial(self._harness(i).step, ids, logps.get(i)) for i, ids in completions.items()
        }
        return self._run(calls)

    def get_trajectories(self) -> list[Trajectory]:
        """Every slot's trajectory, in contiguous groups (a failed env gives a failed value)."""
        trajectories = []
        for i in range(self.num_slots):
            group = i // self.group_size
            episode = self._slot_episode(i, "collected before it ended")
            trajectories.append(Trajectory(group, i, self._tasks[group], episode))
        return trajectories

    def collect(
        self,
        generate: Generate,
        *,
        dynamic_sampling: bool = False,
        max_attempts: int = 4,
        observe: Observer | None = None,
    ) -> RolloutBatch:
        """Play a whole batch with ``generate`` as the policy.

        With ``dynamic_sampling``, groups whose rewards are all equal are dropped and the
        batch is refilled from new tasks, for at most ``max_attempts`` rounds; the batch is
        then topped up with uninformative groups so every rank returns the same count.
        ``observe`` is called with the harness of every live slot (by slot) after the resets
        and after each turn, before the next generation: the point to checkpoint their
        episodes (``credit: turn_mc``).
        """
        builder = self._batch_builder(dynamic_sampling, max_attempts)
        while builder.wants_round():
            builder.add_round(self._play(generate, observe))
        return builder.batch()

    def _batch_builder(self, dynamic_sampling: bool, max_attempts: int) -> BatchBuilder:
        """Assembles one batch of this rank's groups from rounds (both paths use it)."""
        return BatchBuilder(
            self.groups,
            self.group_size,
            self._record,
            dynamic_sampling=dynamic_sampling,
            max_attempts=max_attempts,
        )

    def _play(
        self, generate: Generate, observe: Observer | None = None
    ) -> list[tuple[Trajectory, ...]]:
        self.reset()
        while live := self.contexts():
            if observe is not None:
                observe({i: self._harness(i) for i in live})
            slots = list(live)
            outputs = generate([live[i] for i in slots])
            completions, logps = {}, {}
            for i, output in zip(slots, outputs, strict=True):
                ids, lp = output if isinstance(output, tuple) else (output, None)
                completions[i] = ids
                if lp is not None:
                    logps[i] = lp
            self.step(completions, logps or None)
        trajectories = self.get_trajectories()
        return [
            tuple(trajectories[g * self.group_size : (g + 1) * self.group_size])
            for g in range(self.groups)
        ]

    def _record(self, group: tuple[Trajectory, ...]) -> bool:
        task = group[0].task
        rewards = finished_rewards(group)
        if task.row_index is None:
            return len(set(rewards)) > 1
        return self.assigner.record_outcome(task.row_index, rewards)

    # -- continuous path ---------------------------------------------------------------------

    def collect_continuous(
        self,
        backend: AsyncTokenBackend,
        params: SamplingParams,
        *,
        dynamic_sampling: bool = False,
        max_attempts: int = 4,
    ) -> RolloutBatch:
        """Play a whole batch as :meth:`collect` does (the same tasks in the same order,
        contiguous groups, dynamic sampling, failures as values), with every episode asking
        ``backend`` for its next turn as soon as its env replies, instead of every slot
        waiting for the slowest at each turn. All groups of a round play at once, on the
        session loop (this call blocks until the batch is done).

        Request ``r`` (the turn) of episode ``e`` (numbered across batches) is sampled with
        seed ``request_seed(params.seed, e, r)``; each trajectory records the backend's
        ``version`` read before its first request (``policy_version``). An env call that
        raises or outlives ``io_timeout_s``, and a request that raises
        :class:`~agile_llmenvs.errors.GenerationServerError`, fail only their episode.
        """
        return SESSION_LOOP.run(
            self._continuous.collect(
                backend, params, dynamic_sampling=dynamic_sampling, max_attempts=max_attempts
            )
        )

    async def aplay_group(
        self, backend: AsyncTokenBackend, params: SamplingParams
    ) -> tuple[Trajectory, ...]:
        """Play the next task's group as :meth:`collect_continuous` plays each of its groups;
        the trajectories in member order. Awaits ``group_size`` free slots first (groups are
        served in the order they asked). Must run on the session loop
        (:data:`~agile_llmenvs.transport.session_loop.SESSION_LOOP`).
        """
        return await self._continuous.next_group(backend, params)

    # -- per-episode path --------------------------------------------------------------------

    def reset_episode(self) -> EpisodeHandle:
        """Hold a free slot and start an episode on it (thread-safe).

        Raises:
            SlotTimeoutError: no slot became free within ``slot_acquire_timeout_s``.
        """
        with self._lock:
            ok = self._lock.wait_for(
                lambda: any(s.episode_id is None for s in self._slots),
                timeout=self.slot_acquire_timeout_s,
            )
            if not ok:
                raise SlotTimeoutError(
                    f"no rollout slot became free within {self.slot_acquire_timeout_s} s"
                )
            index = next(i for i, s in enumerate(self._slots) if s.episode_id is None)
            episode_id, self._next_episode = self._next_episode, self._next_episode + 1
            group, task = self._group_member()
            slot = self._slots[index]
            slot.episode_id, slot.failure, slot.release_pending = episode_id, None, False
        prompts = self._run({index: self._reset_call(index, task)})
        prompt = prompts.get(index) or []
        done = slot.failure is not None or self._harness(index).done
        return EpisodeHandle(index, episode_id, group, task, prompt, done)

    def step_episode(
        self,
        handle: EpisodeHandle,
        completion_ids: Sequence[int],
        sampling_logps: Sequence[float] | None = None,
    ) -> TurnResult:
        """Play one turn of the handle's episode (thread-safe).

        Raises:
            StaleEpisodeError: the episode was finalized (before or during this call).
        """
        slot = self._slots[handle.slot]
        with self._lock:
            self._check_current(handle)
            slot.in_flight = True
        harness = self._harness(handle.slot)
        try:
            results = self._run({handle.slot: lambda: harness.step(completion_ids, sampling_logps)})
        finally:
            with self._lock:
                slot.in_flight = False
                stale = slot.episode_id != handle.episode_id or slot.release_pending
                if slot.release_pending:
                    self._release(handle.slot)
        if stale:
            raise StaleEpisodeError(
                f"episode {handle.episode_id} was finalized while its "
                "step was in flight; the result is discarded"
            )
        if handle.slot not in results:
            return TurnResult([], 0.0, True, {"error": slot.failure})
        return results[handle.slot]

    def finalize_episode(self, handle: EpisodeHandle) -> Trajectory:
        """End the handle's episode, release its slot and return its trajectory."""
        with self._lock:
            self._check_current(handle)
            slot = self._slots[handle.slot]
            if slot.in_flight:  # the step's thread owns the harness: release when it returns
                slot.release_pending = True
                episode = failed_episode("finalized while a step was in flight")
                return Trajectory(handle.group, handle.slot, handle.task, episode)
            episode = self._slot_episode(handle.slot, "finalized before it ended")
            self._release(handle.slot)
        return Trajectory(handle.group, handle.slot, handle.task, episode)

    def _slot_episode(self, index: int, abort_reason: str) -> EpisodeData:
        """The slot's episode data; a running episode is aborted, a failed slot's is a value."""
        slot = self._slots[index]
        if slot.failure is not None or slot.harness is None:
            return failed_episode(slot.failure or "the slot has no env")
        if not slot.harness.done:
            slot.harness.abort(abort_reason)
        return slot.harness.get_episode_data()

    def _group_member(self) -> tuple[int, Task]:
        if self._open_group is None or self._open_group[2] == 0:
            self._open_group = (self._group_counter, self.assigner.next_task(), self.group_size)
            self._group_counter += 1
        group, task, left = self._open_group
        self._open_group = (group, task, left - 1)
        return group, task

    def _check_current(self, handle: EpisodeHandle) -> None:
        slot = self._slots[handle.slot]
        if slot.episode_id != handle.episode_id or slot.release_pending:
            raise StaleEpisodeError(
                f"episode {handle.episode_id} is no longer on slot {handle.slot}; it was finalized"
            )

    def _release(self, index: int) -> None:
        slot = self._slots[index]
        slot.episode_id, slot.release_pending = None, False
        self._lock.notify_all()

    # -- slots and env calls -----------------------------------------------------------------

    def _harness(self, index: int) -> RolloutHarness:
        slot = self._slots[index]
        if slot.harness is None:
            slot.harness = self.env_factory(**self.env_config)
        return slot.harness

    def _reset_call(self, index: int, task: Task | None = None) -> Callable[[], list[int]]:
        task = task or self._tasks[index // self.group_size]
        return lambda: self._harness(index).reset(**task.reset_kwargs())

    def _run(self, calls: dict[int, Callable[[], Any]]) -> dict[int, Any]:
        """Run each slot's env call; a call that raises or outlives ``io_timeout_s`` fails its
        slot (recorded, not raised).

        Calls run concurrently on worker threads, which enforce the timeout. A hop to a worker
        costs more than a fast in-process env's whole turn, so an in-process env class that
        has shown its calls are fast runs inline instead (see
        :class:`~agile_llmenvs.transport.calls.CallPolicy`); a few slow inline calls in a row
        send it back to the threads.
        """
        inline = {i: c for i, c in calls.items() if self._calls.inline(self._env_class(i))}
        futures: dict[int, Future[Any]] = {
            i: self._pool.submit(self._timed, i, c, False)
            for i, c in calls.items()
            if i not in inline
        }
        results = {}
        for index, call in inline.items():
            try:
                results[index] = self._timed(index, call, True)
            except Exception as exc:
                self._slots[index].failure = f"{type(exc).__name__}: {exc}"
        done, _ = wait(futures.values(), timeout=self.io_timeout_s)
        for index, future in futures.items():
            if future not in done:
                self._replace(index, f"the env call exceeded io_timeout_s={self.io_timeout_s}")
            elif (error := future.exception()) is not None:
                self._slots[index].failure = f"{type(error).__name__}: {error}"
            else:
                results[index] = future.result()
        return results

    def _timed(self, index: int, call: Callable[[], Any], inline: bool) -> Any:
        env_class = self._env_class(index)
        start = time.perf_counter()
        try:
            return call()
        finally:
            self._calls.record(env_class, time.perf_counter() - start)

    def _env_class(self, index: int) -> type:
        """The class whose calls the policy judges: an in-process env's, else the client's
        (remote calls always go to threads: their waiting is what runs concurrently)."""
        client = self._harness(index).client
        if isinstance(client, InProcessEnvClient):
            env = client.env
            return type(getattr(env, "inner", env))
        return _RemoteCalls

    def _replace(self, index: int, reason: str) -> None:
        slot = self._slots[index]
        slot.failure = reason
        hung, slot.harness = slot.harness, None  # a fresh env is built on the slot's next use
        if hung is not None:
            self._pool.submit(_close_quietly, hung)

    def close(self) -> None:
        """Close every slot's env."""
        for slot in self._slots:
            if slot.harness is not None:
                _close_quietly(slot.harness)
                slot.harness = None
        self._pool.shutdown(wait=False, cancel_futures=True)


class _RemoteCalls:
    """Stands for every env reached over the wire: its calls always run on threads."""


def _context(harness: RolloutHarness) -> list[int]:
    """The harness's next prompt, with the images it shows."""
    images = harness.context_images
    return harness.context_ids if images is None else ImagePrompt(harness.context_ids, images)


def _close_quietly(harness: RolloutHarness) -> None:
    with contextlib.suppress(Exception):
        harness.close()


def _distributed(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: the values passed, else torch.distributed's, else ``(0, 1)``."""
    if rank is not None and world_size is not None:
        return rank, world_size
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return (
                dist.get_rank() if rank is None else rank,
                dist.get_world_size() if world_size is None else world_size,
            )
    except ImportError:  # pragma: no cover - torch is a core dependency
        pass
    # outside torch.distributed one process is the default; check_rank judges what was passed
    return 0 if rank is None else rank, 1 if world_size is None else world_size
