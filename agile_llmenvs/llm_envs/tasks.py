"""TaskAssigner: which task each GRPO group gets, on each data-parallel rank."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from agile_llmenvs.llm_envs.sum_tree import SumTree

__all__ = ["Task", "TaskAssigner", "TaskRowStats"]

_DEFAULT_SEED = 0x5EED
_SEED_SPACE = 2**31 - 1


@dataclass(frozen=True)
class Task:
    """One episode's task: a reset seed and, for a dataset env, a row."""

    seed: int
    row_index: int | None = None

    def reset_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``RolloutHarness.reset``."""
        kwargs: dict[str, Any] = {"seed": self.seed}
        if self.row_index is not None:
            kwargs["row_index"] = self.row_index
        return kwargs


class TaskRowStats:
    """Per-row recent rate of informative groups (rewards not all equal), decayed.

    A row's sampling weight is ``floor + rate``: rows whose groups taught something are drawn
    more, and no row's chance ever reaches zero.

    Args:
        rows: Rows tracked.
        decay: Weight of the past in each update (``rate = decay * rate + (1 - decay) * x``).
        prior: The rate of a row never seen.
        floor: The weight every row keeps.
    """

    def __init__(
        self, rows: int, *, decay: float = 0.8, prior: float = 0.5, floor: float = 0.05
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay, self.floor = decay, floor
        self.rate = np.full(rows, prior, dtype=np.float64)
        self.tree = SumTree(rows, initial=floor + prior)

    def record(self, index: int, informative: bool) -> None:
        """Account one finished group of row ``index``."""
        rate = self.decay * self.rate[index] + (1.0 - self.decay) * float(informative)
        self.rate[index] = rate
        self.tree.update(index, self.floor + rate)

    def weight(self, index: int) -> float:
        """The row's current sampling weight."""
        return self.tree.weight(index)


class TaskAssigner:
    """Assign each episode a ``(seed, row_index)`` task; a GRPO group shares one.

    Dataset rows are reshuffled every epoch (the same permutation on every rank, from
    ``seed``) and dealt into ``world_size`` disjoint shards; every rank draws
    ``ceil(N / world_size)`` tasks per epoch (a short shard repeats its own first row), so
    ranks stay in lock-step and every row is served each epoch. A procedural env
    (``dataset_size=0``) gets reset seeds instead, disjoint across ranks. With ``adaptive``,
    rows are drawn from the rank's static shard (rows ``r`` with ``r % world_size == rank``) in
    proportion to their :class:`TaskRowStats` weight, fed by :meth:`record_outcome`, in
    O(log n) per draw (a sum tree).

    Args:
        dataset_size: Rows in the env's dataset; 0 for a procedural env.
        seed: Seed of the shuffles, draws and task seeds (None: a fixed default).
        rank: This process's shard index in ``[0, world_size)``.
        world_size: Number of data-parallel shards.
        adaptive: Draw rows by recent informative-group rate instead of the epoch cycle.
    """

    def __init__(
        self,
        dataset_size: int,
        *,
        seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        adaptive: bool = False,
    ) -> None:
        if dataset_size < 0:
            raise ValueError(f"dataset_size must be >= 0, got {dataset_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        if dataset_size and dataset_size < world_size:
            raise ValueError(
                f"{dataset_size} rows cannot give each of {world_size} ranks a shard of its own"
            )
        self.dataset_size, self.rank, self.world_size = dataset_size, rank, world_size
        self.seed = _DEFAULT_SEED if seed is None else seed
        self.adaptive = adaptive and dataset_size > 0
        self.per_epoch = math.ceil(dataset_size / world_size) if dataset_size else 0
        self.epoch = 0
        self.position = 0  # tasks drawn in the current epoch (or ever, when procedural)
        self._shard = self._epoch_shard(0) if dataset_size else np.zeros(0, dtype=np.int64)
        # adaptive draws come from a static shard (row % world_size == rank), one sum tree
        self._static = np.arange(rank, dataset_size, world_size)
        self.stats = TaskRowStats(len(self._static)) if self.adaptive else None
        self._rng = np.random.default_rng([self.seed, rank, 1])

    @property
    def num_epochs(self) -> int:
        """Full passes completed over this rank's shard."""
        if not self.per_epoch:
            return 0
        return (self.epoch * self.per_epoch + self.position) // self.per_epoch

    def shard(self) -> list[int]:
        """This rank's rows in the current epoch, in draw order."""
        return [int(row) for row in self._shard]

    def next_task(self) -> Task:
        """The task of the next group."""
        if not self.dataset_size:
            index = self.position * self.world_size + self.rank
            self.position += 1
            return Task(seed=(self.seed * 1_000_003 + index) % _SEED_SPACE)
        if self.position == self.per_epoch:
            self.epoch += 1
            self.position = 0
            self._shard = self._epoch_shard(self.epoch)
        row = self._adaptive_row() if self.stats is not None else int(self._shard[self.position])
        index = self.epoch * self.per_epoch + self.position
        self.position += 1
        return Task(
            seed=(self.seed * 1_000_003 + index * self.world_size + self.rank) % _SEED_SPACE,
            row_index=row,
        )

    def record_outcome(self, row_index: int, rewards: Any) -> bool:
        """Account a finished group of ``row_index``; returns whether it was informative
        (its rewards were not all equal)."""
        values = np.asarray(list(rewards), dtype=np.float64)
        informative = bool(values.size > 1 and np.ptp(values) > 0)
        if self.stats is not None and row_index % self.world_size == self.rank:
            self.stats.record(row_index // self.world_size, informative)
        return informative

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the exact task sequence."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "position": self.position,
            "rng": self._rng.bit_generator.state,
        }
        if self.stats is not None:
            state["rate"] = self.stats.rate.tolist()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        if self.dataset_size:
            self._shard = self._epoch_shard(self.epoch)
        self._rng.bit_generator.state = state["rng"]
        if self.stats is not None and "rate" in state:
            rates = np.asarray(state["rate"], dtype=np.float64)
            self.stats = TaskRowStats(
                len(self._static), decay=self.stats.decay, floor=self.stats.floor
            )
            for row, rate in enumerate(rates):
                self.stats.rate[row] = rate
                self.stats.tree.update(row, self.stats.floor + rate)

    def _epoch_shard(self, epoch: int) -> np.ndarray:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)
        shard = order[self.rank :: self.world_size]
        if len(shard) < self.per_epoch:  # keep every rank's count equal: repeat its own row
            shard = np.concatenate([shard, shard[: self.per_epoch - len(shard)]])
        return shard

    def _adaptive_row(self) -> int:
        """A row of this rank's static shard, drawn by weight in O(log n)."""
        assert self.stats is not None
        return int(self._static[self.stats.tree.sample(self._rng)])

    def row_weight(self, row_index: int) -> float:
        """The adaptive sampling weight of one of this rank's rows."""
        if self.stats is None or row_index % self.world_size != self.rank:
            raise ValueError(f"row {row_index} has no adaptive weight on rank {self.rank}")
        return self.stats.weight(row_index // self.world_size)
