"""What rollout collection hands a trainer: typed trajectories in contiguous GRPO groups."""

from __future__ import annotations

from dataclasses import dataclass, field

from agile_llmenvs.core.episode import EpisodeData, StopReason, Task

__all__ = ["RolloutBatch", "Trajectory", "failed_episode", "finished_rewards"]


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
