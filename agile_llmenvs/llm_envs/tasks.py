"""TaskAssigner: which task each GRPO group gets, on each data-parallel rank."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from agile_llmenvs.core.episode import Task
from agile_llmenvs.llm_envs.sum_tree import SumTree

__all__ = ["Task", "TaskAssigner", "TaskRowStats", "TaskRowWeight", "check_rank"]

_DEFAULT_SEED = 0x5EED
_SEED_SPACE = 2**31 - 1
_BLOCK = 64  # uniforms drawn at once for adaptive draws


_RANK_FIELDS = {
    "world_size": "the number of data-parallel processes (1 when not distributed)",
    "rank": "this process's index among the data-parallel processes (0 when not distributed)",
}


def check_rank(rank: Any, world_size: Any) -> tuple[int, int]:
    """Validate a data-parallel ``(rank, world_size)`` pair; returns it as ints.

    Raises:
        ValueError: ``world_size`` is not an int >= 1, or ``rank`` is not an int in
            ``[0, world_size)``; the message names the field and how to fix it.
    """
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(
                f"{name} must be an int, got {value!r} ({type(value).__name__}); "
                f"pass {_RANK_FIELDS[name]}"
            )
    rank, world_size = int(rank), int(world_size)
    if world_size < 1:
        raise ValueError(
            f"world_size must be >= 1, got {world_size}; pass {_RANK_FIELDS['world_size']}"
        )
    if rank < 0:
        raise ValueError(
            f"rank must be >= 0, got {rank}; ranks are numbered 0 to world_size - 1 "
            f"(0 to {world_size - 1} here)"
        )
    if rank >= world_size:
        raise ValueError(
            f"rank must be < world_size, got rank={rank} with world_size={world_size}; "
            f"ranks are numbered 0 to {world_size - 1}: pass a smaller rank, or "
            f"world_size={rank + 1} or more"
        )
    return rank, world_size


@dataclass(frozen=True)
class TaskRowWeight:
    """One row's adaptive sampling record, as :meth:`TaskAssigner.row_stats` lists it.

    Args:
        row: The dataset row index.
        rate: Its decayed recent rate of informative groups (the prior for an unseen row).
        weight: Its sampling weight, ``floor + rate``.
    """

    row: int
    rate: float
    weight: float


class TaskRowStats:
    """Per-row recent rate of informative groups (rewards not all equal), decayed.

    This is the whole table of one rank's rows; :meth:`TaskAssigner.row_stats` lists it as
    one :class:`TaskRowWeight` per row.

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
        """The row's current sampling weight, ``floor + rate``."""
        return self.floor + float(self.rate[index])


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

    Raises:
        ValueError: ``rank`` / ``world_size`` are not ints with ``0 <= rank < world_size``
            (see :func:`check_rank`), or a dataset has fewer rows than ranks.
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
        rank, world_size = check_rank(rank, world_size)
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
        # adaptive draws take their uniforms from blocks of _rng's doubles (the same stream
        # one at a time would give): a scalar numpy draw costs more than the tree's walk
        self._block_state: Mapping[str, Any] = self._rng.bit_generator.state
        self._block: list[float] = []
        self._used = 0

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

    def next_row(self) -> int:
        """The row of the next group: the ``row_index`` of :meth:`next_task` (AgileRL's name).

        Each call draws one task, so it advances the same sequence :meth:`next_task` does.

        Raises:
            ValueError: The env is procedural (``dataset_size=0``): it has seeds, not rows.
        """
        if not self.dataset_size:
            raise ValueError(
                "a procedural env (dataset_size=0) has no rows; call next_task() for its seeds"
            )
        row = self.next_task().row_index
        assert row is not None  # a dataset env's tasks always carry a row
        return row

    def record_outcome(
        self,
        row_index: int,
        rewards: Iterable[float] | bool | None = None,
        *,
        informative: bool | None = None,
    ) -> bool:
        """Account a finished group of ``row_index``; returns whether it was informative.

        Pass the group's finished ``rewards`` (informative: not all equal), or, as AgileRL's
        ``record_outcome(row, informative)`` does, whether it was ``informative`` (by keyword,
        or a bool in place of the rewards). With ``adaptive`` the outcome moves the row's
        sampling weight; otherwise rows follow the epoch cycle and it moves nothing.

        Raises:
            TypeError: Neither or both of ``rewards`` and ``informative`` were given.
            ValueError: ``row_index`` is outside this rank's shard: with ``adaptive`` the
                rows ``r`` with ``r % world_size == rank``, otherwise any row of the dataset
                (the epoch cycle deals every row to some rank each epoch).
        """
        if (rewards is None) == (informative is None):
            raise TypeError(
                "record_outcome needs the group's rewards or informative=..., exactly one"
            )
        row = operator.index(row_index)
        self._check_owned(row)
        if isinstance(rewards, (bool, np.bool_)):
            informative = bool(rewards)
        elif rewards is not None:
            values = np.asarray(list(rewards), dtype=np.float64)
            informative = bool(values.size > 1 and np.ptp(values) > 0)
        if self.stats is not None:
            self.stats.record(row // self.world_size, bool(informative))
        return bool(informative)

    def row_stats(self) -> list[TaskRowWeight]:
        """Every row of this rank's adaptive shard with its rate and weight, by row.

        Empty when not ``adaptive``: rows then follow the epoch cycle and have no weights.
        """
        if self.stats is None:
            return []
        stats = self.stats
        return [
            TaskRowWeight(int(row), float(stats.rate[index]), stats.weight(index))
            for index, row in enumerate(self._static)
        ]

    def _check_owned(self, row: int) -> None:
        """Raise unless this rank can have drawn ``row``."""
        if not self.dataset_size:
            raise ValueError(
                f"row {row} is outside rank {self.rank}'s shard: a procedural env "
                "(dataset_size=0) has no rows; record outcomes only for tasks with a row_index"
            )
        last = self.dataset_size - 1
        if self.stats is None:
            if not 0 <= row <= last:
                raise ValueError(
                    f"row {row} is outside rank {self.rank}'s shard: the epoch cycle deals "
                    f"rows 0..{last} across the {self.world_size} rank(s); record only rows "
                    "this assigner drew"
                )
            return
        if not (0 <= row <= last and row % self.world_size == self.rank):
            owned = [int(r) for r in self._static]
            listed = owned if len(owned) <= 4 else [*owned[:3], "...", owned[-1]]
            raise ValueError(
                f"row {row} is outside rank {self.rank}'s shard: with adaptive sampling, rank "
                f"{self.rank} of {self.world_size} owns rows {', '.join(map(str, listed))} "
                f"(r % {self.world_size} == {self.rank}); record each group's outcome on the "
                "rank that drew it"
            )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the exact task sequence."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "position": self.position,
            "rng": self._block_state if self._block else self._rng.bit_generator.state,
            "rng_used": self._used if self._block else 0,
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
        self._block, self._used = [], 0
        if state.get("rng_used"):  # mid-block: draw the block again, skip what was used
            self._uniform()
            self._used = int(state["rng_used"])
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
        """A row of this rank's static shard (``rank + k * world_size``), drawn by weight in
        O(log n)."""
        assert self.stats is not None
        tree = self.stats.tree
        return self.rank + tree.find(self._uniform() * tree.total) * self.world_size

    def _uniform(self) -> float:
        """The next of ``_rng``'s doubles in [0, 1), from the current block of them."""
        if self._used == len(self._block):
            self._block_state = self._rng.bit_generator.state
            self._block = self._rng.random(_BLOCK).tolist()
            self._used = 0
        self._used += 1
        return self._block[self._used - 1]

    def row_weight(self, row_index: int) -> float:
        """The adaptive sampling weight of one of this rank's rows."""
        owned = 0 <= row_index < self.dataset_size and row_index % self.world_size == self.rank
        if self.stats is None or not owned:
            raise ValueError(f"row {row_index} has no adaptive weight on rank {self.rank}")
        return self.stats.weight(row_index // self.world_size)
