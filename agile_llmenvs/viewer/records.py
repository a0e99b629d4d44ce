"""What the viewer reads from a run folder: the logged episodes and the reward curve.

The record models mirror what :mod:`agile_llmenvs.training.run.rollout_log` writes (its module
docstring is the format). They are parsed here, not imported from the trainer's side, so
that ``agile-llmenvs show`` never imports torch.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agile_llmenvs._run_files import METRICS_FILE, ROLLOUTS_FILE
from agile_llmenvs.errors import AgileLLMEnvsError

__all__ = [
    "METRICS_FILE",
    "ROLLOUTS_FILE",
    "EpisodeRecord",
    "RewardPoint",
    "RolloutLogError",
    "SampleRecord",
    "SpanRecord",
    "TaskRecord",
    "read_reward_curve",
    "read_rollouts",
    "select_steps",
]


# Fields a later version adds are ignored, so an older viewer still shows a newer run.
_RECORD_CONFIG = ConfigDict(extra="ignore", frozen=True)


class RolloutLogError(AgileLLMEnvsError, ValueError):
    """A run folder has no logged episodes to show, or its log does not parse."""


class SpanRecord(BaseModel):
    """A run of ids of one source and turn, decoded for display."""

    model_config = _RECORD_CONFIG

    source: str = Field(pattern="^(prompt|sampled|env)$")
    turn: int
    text: str


class SampleRecord(BaseModel):
    """One token sample: ids, per-id provenance and turn, and the decoded spans."""

    model_config = _RECORD_CONFIG

    token_ids: list[int]
    provenance: str = Field(pattern="^[pse]*$")
    turn_ids: list[int]
    spans: list[SpanRecord]

    @model_validator(mode="after")
    def _check_aligned(self) -> SampleRecord:
        lengths = {len(self.token_ids), len(self.provenance), len(self.turn_ids)}
        if len(lengths) != 1:
            raise ValueError(
                f"token_ids, provenance and turn_ids must be aligned, got lengths "
                f"{len(self.token_ids)}, {len(self.provenance)} and {len(self.turn_ids)}"
            )
        return self


class TaskRecord(BaseModel):
    """The episode's task: its reset seed and, for a dataset env, its row."""

    model_config = _RECORD_CONFIG

    seed: int
    row_index: int | None = None


class EpisodeRecord(BaseModel):
    """One logged episode."""

    model_config = _RECORD_CONFIG

    step: int = Field(ge=1)
    group: int
    slot: int
    task: TaskRecord | None = None
    reward: float
    rewards: list[float]
    stop_reason: str
    samples: list[SampleRecord]
    error: str | None = None


@dataclass(frozen=True)
class RewardPoint:
    """One step of the reward curve (``eval_reward_mean`` is NaN on steps without one)."""

    step: int
    reward_mean: float
    eval_reward_mean: float = math.nan


def read_rollouts(path: Path) -> list[EpisodeRecord]:
    """The episodes logged in ``path``, in file order.

    A last line cut short (a run killed while writing) is left out.

    Raises:
        RolloutLogError: The file is missing or empty, or a line is not a logged episode.
    """
    if not path.is_file():
        raise RolloutLogError(f"{path} does not exist: {_HOW_TO_LOG}")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    episodes = []
    for number, line in enumerate(lines, start=1):
        try:
            episodes.append(EpisodeRecord.model_validate_json(line))
        except ValidationError as exc:
            problem = exc.errors()[0]
            if number == len(lines) and problem["type"] == "json_invalid":
                break
            where = ".".join(str(part) for part in problem["loc"]) or "(line)"
            raise RolloutLogError(
                f"{path}:{number}: not a logged episode ({where}: {problem['msg']}); the file "
                "is written by the GRPO trainer, one JSON object a line"
            ) from exc
    if not episodes:
        raise RolloutLogError(f"{path} holds no episodes: {_HOW_TO_LOG}")
    return episodes


_HOW_TO_LOG = (
    "the GRPO trainer writes it every `training.log_rollouts_every` steps "
    "(set it above 0 in the manifest; the default is 10)"
)


def read_reward_curve(path: Path) -> list[RewardPoint]:
    """The ``reward_mean`` (and ``eval_reward_mean``) of each step in a metrics CSV; empty
    when the file is missing. Steps whose reward cell is empty are left out."""
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    points = []
    for row in rows:
        reward = _number(row.get("reward_mean"))
        if row.get("step") and not math.isnan(reward):
            points.append(
                RewardPoint(int(float(row["step"])), reward, _number(row.get("eval_reward_mean")))
            )
    return points


def _number(cell: str | None) -> float:
    try:
        return float(cell) if cell else math.nan
    except ValueError:
        return math.nan


def select_steps(logged: Sequence[int], wanted: Sequence[range] | None, limit: int) -> list[int]:
    """The steps to show: those of ``logged`` in one of the ``wanted`` ranges (all when None),
    at most ``limit`` of them (0: no limit) spread evenly from the first to the last."""
    steps = sorted({step for step in logged if wanted is None or any(step in r for r in wanted)})
    if limit <= 0 or len(steps) <= limit:
        return steps
    if limit == 1:
        return [steps[-1]]
    last = len(steps) - 1
    return [steps[round(i * last / (limit - 1))] for i in range(limit)]
