"""BatchBuilder: one rank's batch of GRPO groups, assembled from rounds of played groups."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from agile_llmenvs.core.trajectory import RolloutBatch, Trajectory, finished_rewards

__all__ = ["BatchBuilder"]


class BatchBuilder:
    """Assembles a :class:`RolloutBatch` from rounds of played groups (both collection paths).

    With ``dynamic_sampling``, groups whose rewards are all equal (and that carry no
    ``turn_signal``) are set aside and more rounds are wanted, at most ``max_attempts``; the
    batch is then topped up with the uninformative groups, so every rank returns ``groups``
    groups.

    Args:
        groups: Groups the batch holds.
        group_size: Members per group.
        record: Accounts one played group with the task assigner; says if it is informative.
        dynamic_sampling: Refill the batch in place of uninformative groups.
        max_attempts: Most rounds with ``dynamic_sampling``.
        turn_signal: Says whether a group whose rewards are all equal still trains (its turns
            carry credit: ``credit: anchor``); None: none does.
    """

    def __init__(
        self,
        groups: int,
        group_size: int,
        record: Callable[[tuple[Trajectory, ...]], bool],
        *,
        dynamic_sampling: bool,
        max_attempts: int,
        turn_signal: Callable[[tuple[Trajectory, ...]], bool] | None = None,
    ) -> None:
        self.groups, self.group_size, self.record = groups, group_size, record
        self.turn_signal = turn_signal
        self.dynamic_sampling = dynamic_sampling
        self.max_attempts = max_attempts if dynamic_sampling else 1
        self.attempts = 0
        self.kept: list[tuple[Trajectory, ...]] = []
        self.spare: list[tuple[Trajectory, ...]] = []

    def wants_round(self) -> bool:
        """Whether another round should be played."""
        return len(self.kept) < self.groups and self.attempts < self.max_attempts

    def add_round(self, played: list[tuple[Trajectory, ...]]) -> None:
        """Record and keep (or set aside) one round's groups, in order."""
        self.attempts += 1
        for group in played:
            informative = self.record(group)
            if not informative and self.dynamic_sampling and self.turn_signal is not None:
                informative = self.turn_signal(group)
            (self.kept if informative or not self.dynamic_sampling else self.spare).append(group)

    def batch(self) -> RolloutBatch:
        """The batch: contiguous groups renumbered 0..n-1 in the order they were kept."""
        informative = sum(1 for g in self.kept if len(set(finished_rewards(g))) > 1)
        groups = (self.kept + self.spare)[: self.groups]
        flat = tuple(
            t if t.group == number else replace(t, group=number)  # frozen: shared as it is
            for number, g in enumerate(groups)
            for t in g
        )
        failed = sum(t.failed for t in flat)
        return RolloutBatch(flat, self.group_size, informative, self.attempts, failed)
