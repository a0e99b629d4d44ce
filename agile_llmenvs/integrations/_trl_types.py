"""The value types of a :class:`~agile_llmenvs.integrations.trl.TRLEnv`: its settings, its counts
over every rollout, and what one rollout played."""

from __future__ import annotations

import dataclasses

from agile_llmenvs.integrations._trl_rows import PlayedEpisode, TRLRow

__all__ = ["RolloutReport", "TRLEnvConfig", "TRLEnvStats"]


@dataclasses.dataclass(frozen=True)
class TRLEnvConfig:
    """Settings of a :class:`TRLEnv`.

    Attributes:
        num_tasks: Dataset rows of a procedural env (one per reset seed); a dataset env has
            one row per dataset row.
        seed: Seed of the task seeds and of a dataset env's train/test split (None: the
            manifest's ``seed``, else 0).
        max_tokens_per_turn: Most tokens generated per turn (None: the trainer's
            ``max_completion_length``).
        max_model_len: Context budget of an episode (None: the manifest's
            ``model.max_model_len``, else the model's ``max_position_embeddings``).
        max_waves: Rounds of episodes played to fill a group's rows (refilling after
            failures, or after episodes that restarted less than expected).
        io_timeout_s: Longest one env call (a reset or a turn) may take; a call past it fails
            its episode only (None: unbounded). The rollout collector's default.
    """

    num_tasks: int = 256
    seed: int | None = None
    max_tokens_per_turn: int | None = None
    max_model_len: int | None = None
    max_waves: int = 2
    io_timeout_s: float | None = 600.0

    def __post_init__(self) -> None:
        for name in ("num_tasks", "max_tokens_per_turn", "max_model_len", "max_waves"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.io_timeout_s is not None and not self.io_timeout_s > 0:
            raise ValueError(f"io_timeout_s must be positive, got {self.io_timeout_s}")


@dataclasses.dataclass
class TRLEnvStats:
    """Counts over every rollout so far.

    Attributes:
        rollouts: ``rollout_func`` calls.
        rows: Rows returned to TRL.
        episodes: Episodes played.
        samples: Samples of the episodes that finished.
        failed_episodes: Episodes the env failed.
        discarded_episodes: Finished episodes that found their group full.
        dropped_samples: Samples that found their group full.
        masked_rows: Rows returned as masked rows.
    """

    rollouts: int = 0
    rows: int = 0
    episodes: int = 0
    samples: int = 0
    failed_episodes: int = 0
    discarded_episodes: int = 0
    dropped_samples: int = 0
    masked_rows: int = 0

    @property
    def samples_per_episode(self) -> float:
        """Mean samples of a finished episode (1.0 before any)."""
        finished = self.episodes - self.failed_episodes
        return self.samples / finished if finished and self.samples else 1.0


@dataclasses.dataclass(frozen=True)
class RolloutReport:
    """What one rollout played and returned.

    Attributes:
        rows: The rows returned to TRL, aligned with its prompts.
        episodes: Every episode played, in the order they were started.
        dropped_samples: Samples that found their group full.
    """

    rows: tuple[TRLRow, ...]
    episodes: tuple[PlayedEpisode, ...]
    dropped_samples: int = 0

    @property
    def masked_rows(self) -> tuple[int, ...]:
        """Indices of the rows that are masked rows (they train nothing)."""
        return tuple(i for i, row in enumerate(self.rows) if row.reward is None)

    @property
    def failed_episodes(self) -> int:
        """Episodes the env failed."""
        return sum(e.failed for e in self.episodes)

    @property
    def discarded_episodes(self) -> int:
        """Finished episodes that found their group full."""
        return sum(e.discarded for e in self.episodes)
