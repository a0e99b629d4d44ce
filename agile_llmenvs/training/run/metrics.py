"""A run's per-step metrics: a CSV under a fixed header, TensorBoard scalars, the run's
experiment trackers (``training.report_to``), and a plot."""

from __future__ import annotations

import csv
import logging
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agile_llmenvs._run_files import TENSORBOARD_DIR
from agile_llmenvs.errors import OptionalDependencyError
from agile_llmenvs.training.run.checkpoint import disk_full_error

if TYPE_CHECKING:
    from agile_llmenvs.training.run.trackers import Trackers

__all__ = [
    "MetricsWriter",
    "TailMean",
    "plot_metrics",
    "read_metrics",
    "tail_mean",
]

logger = logging.getLogger(__name__)

_EVENT_FILE_PREFIX = "events.out.tfevents."


class MetricsWriter:
    """Appends one CSV row per step under a fixed header (the stable metric keys), and writes
    the same values as TensorBoard scalars (tag = key, step = the row's ``step``) and to the
    run's experiment trackers.

    Args:
        path: The CSV file; event files go to ``path.parent / "tensorboard"``.
        keys: Its columns, in order; ``step`` first, the x axis of the scalars.
        resume_step: The step a resumed run continues from: the rows and events up to it are
            kept, any after it (a run that went on past its last checkpoint) dropped. ``None``
            starts both over.
        tensorboard: ``None`` writes scalars when ``tensorboard`` is installed (silently
            skipped when not); ``True`` requires it; ``False`` writes none.
        trackers: The run's started trackers (:func:`~agile_llmenvs.training.run.trackers.
            open_trackers`), each row logged to them; :meth:`close` finishes them.

    Raises:
        OptionalDependencyError: ``tensorboard=True`` and it is not installed.
    """

    def __init__(
        self,
        path: Path,
        keys: Sequence[str],
        *,
        resume_step: int | None = None,
        tensorboard: bool | None = None,
        trackers: Trackers | None = None,
    ) -> None:
        self.path, self.keys = path, list(keys)
        self._trackers = trackers
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and path.exists():
                _drop_rows_after(path, resume_step)
            else:
                with path.open("w", newline="", encoding="utf-8") as file:
                    csv.writer(file).writerow(self.keys)
            self._scalars = _summary_writer(path.parent / TENSORBOARD_DIR, tensorboard, resume_step)
        except BaseException:
            if trackers is not None:
                trackers.finish()
            raise

    def write(self, row: Mapping[str, float]) -> None:
        """Append ``row`` (every key of the header, nothing else); a NaN (a metric this step
        does not have, such as an evaluation's) is an empty cell and no scalar.

        Raises:
            CheckpointError: the disk is full (or over quota).
        """
        try:
            with self.path.open("a", newline="", encoding="utf-8") as file:
                csv.DictWriter(file, self.keys).writerow({k: _format(row[k]) for k in self.keys})
        except OSError as exc:
            error = disk_full_error(exc, self.path.parent, f"writing {self.path.name}")
            if error is None:
                raise
            raise error from exc
        if self._scalars is not None:
            step = int(row["step"])
            for key in self.keys:
                if key != "step" and not math.isnan(row[key]):
                    self._scalars.add_scalar(key, float(row[key]), global_step=step)
        if self._trackers is not None:
            self._trackers.log({key: row[key] for key in self.keys})

    def close(self) -> None:
        """Flush and close the event file and finish the trackers (the CSV is written row by
        row)."""
        if self._scalars is not None:
            self._scalars.close()
            self._scalars = None
        if self._trackers is not None:
            self._trackers.finish()
            self._trackers = None


def _drop_rows_after(path: Path, step: int) -> None:
    """Keep the header and the rows up to ``step`` of a metrics CSV, verbatim."""
    with path.open(newline="", encoding="utf-8") as file:
        header, *rows = list(csv.reader(file))
    kept = [row for row in rows if float(row[0]) <= step]
    if len(kept) < len(rows):
        with path.open("w", newline="", encoding="utf-8") as file:
            csv.writer(file).writerows([header, *kept])


def _summary_writer(directory: Path, wanted: bool | None, resume_step: int | None) -> Any:
    """A ``SummaryWriter`` on ``directory``, or None (not wanted, or not installed in auto).

    On resume, events after ``resume_step`` are purged; ``None`` starts the folder over.
    """
    if wanted is False:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        if wanted:
            raise OptionalDependencyError(
                "tensorboard", extra="train", feature="TensorBoard metrics (training.tensorboard)"
            ) from exc
        logger.debug("tensorboard is not installed: metrics go to the CSV only")
        return None
    if resume_step is None and directory.is_dir():
        for stale in directory.glob(f"{_EVENT_FILE_PREFIX}*"):
            stale.unlink()
    purge_step = None if resume_step is None else resume_step + 1
    return SummaryWriter(log_dir=str(directory), purge_step=purge_step)


def _format(value: float) -> str:
    if math.isnan(value):
        return ""
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of a metrics CSV, as floats."""
    with path.open(newline="", encoding="utf-8") as file:
        return [
            {k: float(v) if v != "" else math.nan for k, v in row.items()}
            for row in csv.DictReader(file)
        ]


@dataclass(frozen=True)
class TailMean:
    """The mean of a metric over the last steps of a run: ``steps first..last``."""

    value: float
    first: int
    last: int


def tail_mean(path: Path, key: str, *, last_step: int, share: float = 0.1) -> TailMean | None:
    """The mean of ``key`` over the last ``share`` of a run's ``last_step`` steps (at least
    one step; empty cells skipped), from its metrics CSV; ``None`` without such a value."""
    if last_step < 1 or not path.exists():
        return None
    first = last_step - max(1, math.ceil(share * last_step)) + 1
    values = [
        row[key]
        for row in read_metrics(path)
        if first <= row["step"] <= last_step and not math.isnan(row.get(key, math.nan))
    ]
    if not values:
        return None
    return TailMean(sum(values) / len(values), first, last_step)


def plot_metrics(metrics_path: Path, png_path: Path, keys: Sequence[str]) -> Path | None:
    """Plot ``keys`` against ``step``, one panel each; skipped (None) without matplotlib.

    The figure is drawn on its own Agg canvas, not through ``pyplot``: the process's
    matplotlib backend (a notebook's, say) is left as it is, and ``pyplot`` is not imported.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("matplotlib is not installed: no plot of the run", stacklevel=2)
        return None
    rows = read_metrics(metrics_path)
    steps = [row["step"] for row in rows]
    figure = Figure(figsize=(4.5 * len(keys), 3.2))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(keys), squeeze=False)
    for axis, key in zip(axes[0], keys, strict=True):
        points = [(step, row[key]) for step, row in zip(steps, rows, strict=True)]
        points = [(x, y) for x, y in points if not math.isnan(y)]  # steps without the metric
        sparse = len(points) < len(rows)
        axis.plot([x for x, _ in points], [y for _, y in points], marker="o" if sparse else None)
        axis.set_xlabel("step")
        axis.set_title(key)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    return png_path
