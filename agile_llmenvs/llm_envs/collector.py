"""RolloutCollector: GRPO groups of token-exact rollouts over one rank's rollout slots."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from agile_llmenvs.core import (
    ImagePrompt,
    RolloutBatch,
    Task,
    Trajectory,
    TurnResult,
    failed_episode,
    finished_rewards,
)
from agile_llmenvs.errors import StaleEpisodeError
from agile_llmenvs.llm_envs.batch_builder import BatchBuilder
from agile_llmenvs.llm_envs.continuous import ContinuousRollouts, Observer
from agile_llmenvs.llm_envs.harness import RolloutHarness
from agile_llmenvs.llm_envs.slots import SlotPool
from agile_llmenvs.llm_envs.tasks import TaskAssigner, check_rank
from agile_llmenvs.transport.session_loop import SESSION_LOOP

if TYPE_CHECKING:  # llm_envs does not import the backends layer
    from agile_llmenvs.backends.types import AsyncTokenBackend, SamplingParams

__all__ = ["EpisodeHandle", "Generate", "Observer", "RolloutCollector", "TurnSignal"]

Generate = Callable[[list[list[int]]], Sequence[Any]]
"""A policy: context ids of every live slot -> sampled ids (or ``(ids, logps)``) for each."""

TurnSignal = Callable[[tuple[Trajectory, ...]], bool]
"""Says whether a played group's turns carry credit, so that ``dynamic_sampling`` keeps it
though its rewards are all equal (``credit: anchor``)."""


@dataclass(frozen=True)
class EpisodeHandle:
    """A slot held by one episode of the per-episode path, from reset to finalize."""

    slot: int
    episode_id: int
    group: int
    task: Task
    prompt_ids: list[int]
    done: bool = False


class RolloutCollector:
    """Batched collector over one rank's share of a global batch.

    ``batch_size`` is the world-wide group count; this rank holds ``(batch_size /
    world_size) * group_size`` harness slots (:attr:`slots`, a :class:`SlotPool`), built
    lazily from ``env_factory``. Drive it lock-step (:meth:`reset` / :meth:`step` /
    :meth:`get_trajectories`, or :meth:`collect` with a policy), continuously
    (:meth:`collect_continuous`, :meth:`aplay_group`) or per episode (:meth:`reset_episode` /
    :meth:`step_episode` / :meth:`finalize_episode`, thread-safe). Env calls of all slots run
    concurrently; a slot whose env call exceeds ``io_timeout_s`` is closed and replaced, and
    only its episode fails.

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
        self.slot_acquire_timeout_s = slot_acquire_timeout_s
        self.rank, self.world_size, self.base_seed = rank, world_size, base_seed
        self.adaptive = adaptive_task_sampling
        self.num_slots = self.groups * group_size
        self.slots = SlotPool(self.num_slots, self._build_harness, io_timeout_s=io_timeout_s)
        self._assigner: TaskAssigner | None = None
        self._assigner_lock = asyncio.Lock()  # the continuous path's awaited first build
        self._tasks: list[Task] = []
        self._open_group: tuple[int, Task, int] | None = None  # (group, task, members left)
        self._group_counter = 0
        self._continuous = ContinuousRollouts(self.slots, self.groups, self.group_size)

    @property
    def io_timeout_s(self) -> float | None:
        """Longest an env call may take (None: unbounded)."""
        return self.slots.io_timeout_s

    @io_timeout_s.setter
    def io_timeout_s(self, value: float | None) -> None:
        self.slots.io_timeout_s = value

    def _build_harness(self) -> RolloutHarness:
        return self.env_factory(**self.env_config)

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
        self.slots.harness(0)

    @property
    def envs(self) -> list[RolloutHarness]:
        """Every slot's harness, in slot order, building any slot's not built yet.

        A new list each time: a slot whose env timed out gets a fresh harness on its next
        use, so hold slot indices rather than this list.
        """
        return [self.slots.harness(i) for i in range(self.num_slots)]

    # -- tasks -------------------------------------------------------------------------------

    @property
    def assigner(self) -> TaskAssigner:
        """The task assigner (built on first use, from the env's ``dataset_size``)."""
        if self._assigner is None:
            self._set_assigner(self.slots.harness(0).dataset_size())
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

    async def _aassigner(self) -> TaskAssigner:
        """The task assigner, built with an awaited ``dataset_size`` on the continuous path
        (a blocking one would put slot 0's remote session on a blocking connection, or stall
        the session loop)."""
        async with self._assigner_lock:
            if self._assigner is None:
                harness = self.slots.harness(0)  # a factory that fails here fails the batch
                harness.async_calls = self._continuous.env_calls
                self._set_assigner(await harness.adataset_size())
        return self.assigner

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
        for index in range(self.num_slots):
            self.slots[index].failure = None
        calls = {i: self._reset_call(i) for i in range(self.num_slots)}
        prompts = self.slots.run(calls)
        return [prompts.get(i) or [] for i in range(self.num_slots)]

    @property
    def live_slots(self) -> list[int]:
        """Slots whose episode is still running."""
        return self.slots.live()

    def contexts(self) -> dict[int, list[int]]:
        """Each live slot's context: the prompt of its next generation (an
        :class:`~agile_llmenvs.core.images.ImagePrompt` when it shows images)."""
        return {i: _context(self.slots.harness(i)) for i in self.live_slots}

    def step(
        self,
        completions: dict[int, Sequence[int]],
        sampling_logps: dict[int, Sequence[float]] | None = None,
    ) -> dict[int, TurnResult]:
        """Play one turn on every slot in ``completions`` (live slots only), concurrently."""
        logps = sampling_logps or {}
        calls: dict[int, Callable[[], Any]] = {
            i: partial(self.slots.harness(i).step, ids, logps.get(i))
            for i, ids in completions.items()
        }
        return self.slots.run(calls)

    def get_trajectories(self) -> list[Trajectory]:
        """Every slot's trajectory, in contiguous groups (a failed env gives a failed value)."""
        trajectories = []
        for i in range(self.num_slots):
            group = i // self.group_size
            episode = self.slots.episode(i, "collected before it ended")
            trajectories.append(Trajectory(group, i, self._tasks[group], episode))
        return trajectories

    def collect(
        self,
        generate: Generate,
        *,
        dynamic_sampling: bool = False,
        max_attempts: int = 4,
        observe: Observer | None = None,
        turn_signal: TurnSignal | None = None,
    ) -> RolloutBatch:
        """Play a whole batch with ``generate`` as the policy.

        With ``dynamic_sampling``, groups whose rewards are all equal are dropped and the
        batch is refilled from new tasks, for at most ``max_attempts`` rounds; the batch is
        then topped up with uninformative groups so every rank returns the same count. A
        group for which ``turn_signal`` says True is kept whatever its rewards (its turns
        carry credit). ``observe`` is called with the harness of every live slot (by slot)
        after the resets and after each turn, before the next generation: the point to
        checkpoint their episodes (``credit: turn_mc``).
        """
        builder = self._batch_builder(dynamic_sampling, max_attempts, turn_signal)
        while builder.wants_round():
            builder.add_round(self._play(generate, observe))
        return builder.batch()

    def _batch_builder(
        self, dynamic_sampling: bool, max_attempts: int, turn_signal: TurnSignal | None
    ) -> BatchBuilder:
        """Assembles one batch of this rank's groups from rounds (both paths use it)."""
        return BatchBuilder(
            self.groups,
            self.group_size,
            self._record,
            dynamic_sampling=dynamic_sampling,
            max_attempts=max_attempts,
            turn_signal=turn_signal,
        )

    def _play(
        self, generate: Generate, observe: Observer | None = None
    ) -> list[tuple[Trajectory, ...]]:
        self.reset()
        while live := self.contexts():
            if observe is not None:
                observe({i: self.slots.harness(i) for i in live})
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
        turn_signal: TurnSignal | None = None,
        observe: Observer | None = None,
    ) -> RolloutBatch:
        """Play a whole batch as :meth:`collect` does (the same tasks in the same order,
        contiguous groups, dynamic sampling and ``turn_signal``, failures as values), with
        every episode asking ``backend`` for its next turn as soon as its env replies, instead
        of every slot waiting for the slowest at each turn. All groups of a round play at
        once, on the session loop (this call blocks until the batch is done).

        Request ``r`` (the turn) of episode ``e`` (numbered across batches) is sampled with
        seed ``request_seed(params.seed, e, r)``; each trajectory records the backend's
        ``version`` read before its first request (``policy_version``). An env call that
        raises or outlives ``io_timeout_s``, and a request that raises
        :class:`~agile_llmenvs.errors.GenerationServerError`, fail only their episode.
        ``observe`` sees each episode's harness (``{slot: harness}``) on the session loop
        before each of its requests, as :meth:`collect`'s sees the live slots before each
        generation.
        """
        builder = self._batch_builder(dynamic_sampling, max_attempts, turn_signal)
        return SESSION_LOOP.run(self._collect_continuous(builder, backend, params, observe))

    async def _collect_continuous(
        self,
        builder: BatchBuilder,
        backend: AsyncTokenBackend,
        params: SamplingParams,
        observe: Observer | None = None,
    ) -> RolloutBatch:
        assigner = await self._aassigner()
        return await self._continuous.collect(builder, assigner.next_task, backend, params, observe)

    async def aplay_group(
        self, backend: AsyncTokenBackend, params: SamplingParams
    ) -> tuple[Trajectory, ...]:
        """Play the next task's group as :meth:`collect_continuous` plays each of its groups;
        the trajectories in member order. Awaits ``group_size`` free slots first (groups are
        served in the order they asked). Must run on the session loop
        (:data:`~agile_llmenvs.transport.session_loop.SESSION_LOOP`).
        """
        assigner = await self._aassigner()
        return await self._continuous.next_group(backend, params, assigner.next_task)

    # -- per-episode path --------------------------------------------------------------------

    def reset_episode(self) -> EpisodeHandle:
        """Hold a free slot and start an episode on it (thread-safe).

        Raises:
            SlotTimeoutError: no slot became free within ``slot_acquire_timeout_s``.
        """
        pool = self.slots
        with pool.lock:
            index = pool.wait_free(self.slot_acquire_timeout_s)
            episode_id = pool.number_episodes()
            group, task = self._group_member()
            pool.hold(index, episode_id)
        prompts = pool.run({index: self._reset_call(index, task)})
        prompt = prompts.get(index) or []
        done = pool[index].failure is not None or pool.harness(index).done
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
        pool = self.slots
        slot = pool[handle.slot]
        with pool.lock:
            self._check_current(handle)
            slot.in_flight = True
        harness = pool.harness(handle.slot)
        try:
            results = pool.run({handle.slot: lambda: harness.step(completion_ids, sampling_logps)})
        finally:
            with pool.lock:
                slot.in_flight = False
                stale = slot.episode_id != handle.episode_id or slot.release_pending
                if slot.release_pending:
                    pool.release(handle.slot)
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
        pool = self.slots
        with pool.lock:
            self._check_current(handle)
            slot = pool[handle.slot]
            if slot.in_flight:  # the step's thread owns the harness: release when it returns
                slot.release_pending = True
                episode = failed_episode("finalized while a step was in flight")
                return Trajectory(handle.group, handle.slot, handle.task, episode)
            episode = pool.episode(handle.slot, "finalized before it ended")
            pool.release(handle.slot)
        return Trajectory(handle.group, handle.slot, handle.task, episode)

    def _group_member(self) -> tuple[int, Task]:
        if self._open_group is None or self._open_group[2] == 0:
            self._open_group = (self._group_counter, self.assigner.next_task(), self.group_size)
            self._group_counter += 1
        group, task, left = self._open_group
        self._open_group = (group, task, left - 1)
        return group, task

    def _check_current(self, handle: EpisodeHandle) -> None:
        slot = self.slots[handle.slot]
        if slot.episode_id != handle.episode_id or slot.release_pending:
            raise StaleEpisodeError(
                f"episode {handle.episode_id} is no longer on slot {handle.slot}; it was finalized"
            )

    # -- slots -------------------------------------------------------------------------------

    def _reset_call(self, index: int, task: Task | None = None) -> Callable[[], list[int]]:
        task = task or self._tasks[index // self.group_size]
        return lambda: self.slots.harness(index).reset(**task.reset_kwargs())

    def close(self) -> None:
        """Close every slot's env."""
        self.slots.close()


def _context(harness: RolloutHarness) -> list[int]:
    """The harness's next prompt, with the images it shows."""
    images = harness.context_images
    return harness.context_ids if images is None else ImagePrompt(harness.context_ids, images)


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
