"""What the collector hands a trainer: typed trajectories in contiguous GRPO groups."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from agile_llmenvs.llm_envs.episode import EpisodeData, StopReason
from agile_llmenvs.llm_envs.tasks import Task

__all__ = ["BatchBuilder", "RolloutBatch", "Trajectory", "failed_episode", "finished_rewards"]


@dataclass(frozen=True)
class Trajectory:
    """One episode of a group.

    Attributes:
        group: The group's index in the batch; a group's members share ``task``.
        slot: The rollout slot that played it.
        task: The group's task.
        episode: Token-exact samples, per-turn rewards, log-probs and the stop reason.
        policy_version: The backend's policy version read just before the episode's first
            generation request: versions only rise, so the oldest policy behind any of its
            tokens (None where the policy has no version, as on the lock-step path).
    """

    group: int
    slot: int
    task: Task
    episode: EpisodeData
    policy_version: int | None = None

    @property
    def reward(self) -> float:
        """The episode's total reward."""
        return self.episode.total_reward

    @property
    def failed(self) -> bool:
        """Whether the env failed this episode (its error is in ``episode.info``)."""
        return self.episode.stop_reason is StopReason.ENV_ERROR


@dataclass(frozen=True)
class RolloutBatch:
    """One rank's share of a batch: ``groups * group_size`` trajectories, group by group.

    Attributes:
        trajectories: Contiguous groups of ``group_size``.
        group_size: Members per group.
        informative_groups: Groups whose finished members' rewards are not all equal.
        attempts: Collection rounds run (more than one with dynamic sampling).
    """

    trajectories: tuple[Trajectory, ...]
    group_size: int
    informative_groups: int
    attempts: int = 1
    failed: int = field(default=0)

    def groups(self) -> list[tuple[Trajectory, ...]]:
        """The trajectories split into their groups."""
        size = self.group_size
        return [self.trajectories[i : i + size] for i in range(0, len(self.trajectories), size)]


def failed_episode(reason: str) -> EpisodeData:
    """The episode record of a slot whose env failed or hung."""
    return EpisodeData(
        samples=(), rewards=(), stop_reason=StopReason.ENV_ERROR, info={"error": reason}
    )


def finished_rewards(group: tuple[Trajectory, ...]) -> list[float]:
    """The rewards of the group's members whose env did not fail (a failure is no score)."""
    return [t.reward for t in group if not t.failed]


class BatchBuilder:
    """Assembles a :class:`RolloutBatch` from rounds of played groups (both collection paths).

    With ``dynamic_sampling``, groups whose rewards are all equal are set aside and more
    rounds are wanted, at most ``max_attempts``; the batch is then topped up with the
    uninformative groups, so every rank returns ``groups`` groups.

    Args:
        groups: Groups the batch holds.
        group_size: Members per group.
        record: Accounts one played group with the task assigner; says if it is informative.
        dynamic_sampling: Refill the batch in place of uninformative groups.
        max_attempts: Most rounds with ``dynamic_sampling``.
    """

    def __init__(
        self,
        groups: int,
        group_size: int,
        record: Callable[[tuple[Trajectory, ...]], bool],
        *,
        dynamic_sampling: bool,
        max_attempts: int,
    ) -> None:
        self.groups, self.group_size, self.record = groups, group_size, record
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
            (self.kept if informative or not self.dynamic_sampling else self.spare).append(group)

    def batch(self) -> RolloutBatch:
        """The batch: contiguous groups renumbered 0..n-1 in the order they were kept."""
        informative = sum(1 for g in self.kept if len(set(finished_rewards(g))) > 1)
        groups = (self.kept + self.spare)[: self.groups]
        flat = tuple(replace(t, group=number) for number, g in enumerate(groups) for t in g)
        failed = sum(t.failed for t in flat)
        return RolloutBatch(flat, self.group_size, informative, self.attempts, failed)
