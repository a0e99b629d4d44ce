"""Experiment trackers a run reports its metrics to (``training.report_to``), through
accelerate's tracker classes, on the main process.

TensorBoard is not among them: :class:`~agile_llmenvs.training.run.metrics.MetricsWriter` writes
its scalars itself (one path for ``training.tensorboard`` and ``report_to: [tensorboard]``).
W&B, MLflow and Trackio get every metric under its own key and, where TRL names the same
quantity differently, under TRL's key too (:data:`TRL_NAMES`), so TRL dashboards carry over.

A run stores each tracker's run id in its folder
(:data:`~agile_llmenvs._run_files.TRACKER_IDS`: ``{"wandb": id, "mlflow": run_id,
"trackio": name}``); a resumed run continues those runs (the same W&B run, the same MLflow run)
instead of starting new ones.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from agile_llmenvs._run_files import MLFLOW_DIR, RUN_MANIFEST, TRACKER_IDS
from agile_llmenvs.errors import OptionalDependencyError
from agile_llmenvs.specs.manifest import TrainingSpec

__all__ = [
    "PROJECT",
    "TRACKERS",
    "TRL_NAMES",
    "Trackers",
    "open_trackers",
    "tensorboard_setting",
]

logger = logging.getLogger(__name__)

#: The trackers ``training.report_to`` may name.
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
#: The W&B / Trackio project and the MLflow experiment runs go to, unless ``WANDB_PROJECT``,
#: ``TRACKIO_PROJECT`` or ``MLFLOW_EXPERIMENT_NAME`` name another.
PROJECT = "agile-llmenvs"
#: Our metric keys that TRL's trainers log under another name, and that name. Keys both name
#: alike (``loss``, ``reward_std``, ``kl``, ``entropy``, ``grad_norm``, ``learning_rate``)
#: need no second copy; keys TRL has no same quantity for are not renamed.
TRL_NAMES: dict[str, str] = {
    "reward_mean": "reward",
    "clip_fraction": "clip_ratio/region_mean",
    "step_time_s": "step_time",
    "eval_reward_mean": "eval_reward",
    "accuracy": "rewards/accuracies",
}
# Each tracker's import name, and how it installs.
_PACKAGES = {
    "wandb": ("wandb", "trackers"),
    "mlflow": ("mlflow", "trackers"),
    "trackio": ("trackio", "trackers"),
}


def tensorboard_setting(config: TrainingSpec) -> bool | None:
    """``training.tensorboard`` as :class:`MetricsWriter` takes it: required when
    ``report_to`` names TensorBoard, else the field's own value."""
    return True if "tensorboard" in config.report_to else config.tensorboard


class Trackers:
    """The started trackers of a run: each step's row goes to every one.

    Args:
        trackers: accelerate ``GeneralTracker`` instances, started.
    """

    def __init__(self, trackers: list[Any]) -> None:
        self._trackers = trackers

    def log(self, row: Mapping[str, float]) -> None:
        """Log ``row``'s metrics at its ``step`` (NaN cells, metrics this step lacks, skipped)."""
        step = int(row["step"])
        values = {k: float(v) for k, v in row.items() if k != "step" and not math.isnan(v)}
        values.update({TRL_NAMES[k]: v for k, v in values.items() if k in TRL_NAMES})
        for tracker in self._trackers:
            tracker.log(values, step=step)

    def finish(self) -> None:
        """End every tracker's run (W&B writes its files, MLflow marks the run finished)."""
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.finish()


def open_trackers(
    report_to: Sequence[str],
    output_dir: Path,
    *,
    run_name: str | None = None,
    resume: bool = False,
) -> Trackers | None:
    """Start the trackers ``report_to`` names (``training.report_to``; but TensorBoard), named
    ``run_name`` (``training.run_name``; default: the manifest's ``name``, else the folder's);
    ``None`` without any. Call on the main process only, before the metrics file is opened.

    W&B runs offline unless ``WANDB_MODE`` says otherwise or ``WANDB_API_KEY`` is set (no
    network call a run did not ask for; ``wandb sync output_dir/wandb/offline-run-*``
    uploads later, a resumed run's folders into the same run). MLflow logs to a file store,
    ``output_dir/mlruns``, unless ``MLFLOW_TRACKING_URI`` is set.

    Each tracker's run id is stored in ``output_dir/trackers.json``. With ``resume`` (the
    run continues from a checkpoint) the stored runs are continued: W&B's and Trackio's with
    ``resume="allow"``, MLflow's by its run id; a fresh start removes ids a replaced run left.

    Raises:
        OptionalDependencyError: a tracker's package is not installed.
    """
    resuming = resume
    if not resuming:  # ids an overwritten run left are not this run's
        (output_dir / TRACKER_IDS).unlink(missing_ok=True)
    wanted = [name for name in report_to if name != "tensorboard"]
    if not wanted:
        return None
    for name in wanted:
        module, extra = _PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise OptionalDependencyError(
                module, extra=extra, feature=f"training.report_to: {name}"
            )
    run_name = run_name or _manifest_name(output_dir) or output_dir.name
    run_ids = _stored_run_ids(output_dir) if resuming else {}
    started = []
    try:
        for name in wanted:
            tracker = _make_tracker(name, run_name, output_dir, run_ids.get(name))
            tracker.start()
            started.append(tracker)
            run_id = _run_id(name, tracker)
            if run_id is not None:
                run_ids[name] = run_id
    except BaseException:
        Trackers(started).finish()
        raise
    _store_run_ids(output_dir, run_ids)
    return Trackers(started)


def _make_tracker(name: str, run_name: str, output_dir: Path, run_id: str | None) -> Any:
    from accelerate.tracking import MLflowTracker, TrackioTracker, WandBTracker

    if name == "wandb":
        mode = os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
        project = os.environ.get("WANDB_PROJECT", PROJECT)
        resume: dict[str, str] = {"id": run_id, "resume": "allow"} if run_id else {}
        # accelerate passes its first argument to wandb.init as the project
        return WandBTracker(project, name=run_name, dir=str(output_dir), mode=mode, **resume)
    if name == "mlflow":
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            import mlflow

            # MLflow 3 keeps its file store behind this switch (its default is a database,
            # which needs the full mlflow package); a user's own setting stands
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((output_dir / MLFLOW_DIR).resolve().as_uri())
        return MLflowTracker(experiment_name=PROJECT, run_name=run_name, run_id=run_id)
    project = os.environ.get("TRACKIO_PROJECT", PROJECT)
    # Trackio knows a run by its name within the project: a resumed run appends to it
    if run_id is not None:
        return TrackioTracker(project, name=run_id, resume="allow")
    return TrackioTracker(project, name=run_name, resume="never")


def _run_id(name: str, tracker: Any) -> str | None:
    """The id of the run ``tracker`` started (Trackio's: the run's name)."""
    if name == "wandb":
        return str(tracker.run.id)
    if name == "mlflow":
        return str(tracker.active_run.info.run_id)
    return str(tracker.run.name)


def _stored_run_ids(output_dir: Path) -> dict[str, str]:
    """The run ids ``trackers.json`` holds; none when it is missing or unreadable (the
    trackers then start new runs, as on a run's first start)."""
    try:
        stored = json.loads((output_dir / TRACKER_IDS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(stored, dict):
        return {}
    return {k: v for k, v in stored.items() if isinstance(k, str) and isinstance(v, str)}


def _store_run_ids(output_dir: Path, run_ids: Mapping[str, str]) -> None:
    path = output_dir / TRACKER_IDS
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(dict(run_ids), indent=2, sort_keys=True) + "\n", "utf-8")
    partial.replace(path)  # whole or not at all: a resume never reads half a file


def _manifest_name(output_dir: Path) -> str | None:
    """The ``name`` of the manifest the run stored in its folder (``start_run`` wrote it)."""
    try:
        stored = yaml.safe_load((output_dir / RUN_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    name = stored.get("name") if isinstance(stored, dict) else None
    return name if isinstance(name, str) and name else None
