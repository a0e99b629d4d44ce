"""What a training run returns: where it wrote, how far it got, and its metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["TrainResult"]


@dataclass(frozen=True)
class TrainResult:
    """What a training run leaves behind.

    Attributes:
        output_dir: The run's folder.
        steps: Optimizer steps completed, counting those before a resume.
        metrics: This process's metric rows, one per step run now.
        metrics_path: The CSV of every step (appended to on resume).
        checkpoint_dir: The last checkpoint.
        stopped_by: The signal that stopped the run before ``max_steps`` (``"SIGTERM"``,
            ``"SIGINT"``), ``None`` when it ran to the end; ``steps`` is where it stopped.
        already_complete: A resume found the run at ``max_steps`` already, and ran nothing
            (no model loaded, no file touched).
    """

    output_dir: Path
    steps: int
    metrics: list[dict[str, float]] = field(default_factory=list)
    metrics_path: Path | None = None
    checkpoint_dir: Path | None = None
    stopped_by: str | None = None
    already_complete: bool = False

    def last(self, key: str) -> float:
        """The value of ``key`` at the last step run now."""
        return self.metrics[-1][key]
