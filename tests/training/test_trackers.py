"""``training.report_to``: a run's metrics in W&B (offline) and MLflow (a file store) are the
rows of its ``metrics.csv``, under our keys and TRL's; the field and its packages validated."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agile_llmenvs._run_files import TRACKER_IDS
from agile_llmenvs.errors import OptionalDependencyError
from agile_llmenvs.specs import RunManifest, TrainingSpec
from agile_llmenvs.training import train_dpo, train_grpo
from agile_llmenvs.training.run import PROJECT, TRL_NAMES, open_trackers, read_metrics
from agile_llmenvs.validation import check_run_manifest

_WANDB_BLOCK = 32768  # the .wandb file: LevelDB's log format, records in 32 KiB blocks


def _wandb_records(path: Path) -> list[Any]:
    """The records of an offline W&B run's ``.wandb`` file, parsed (wandb has no reader)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, position = [], b"", 7  # after the header: ident, magic, version
    while position + 7 <= len(data):
        left = _WANDB_BLOCK - position % _WANDB_BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            position += left
            continue
        length, kind = struct.unpack("<HB", data[position + 4 : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL, or the LAST chunk of a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_runs(output_dir: Path) -> list[tuple[str, str, dict[int, dict[str, float]]]]:
    """Each offline run folder's run id, name and history by ``_step``, oldest first."""
    runs = []
    for path in sorted(output_dir.glob("wandb/offline-run-*/run-*.wandb")):
        run_id, name, history = "", "", {}
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id, name = record.run.run_id, record.run.display_name
            elif kind == "history":
                items = {  # a key with a slash comes as its parts
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                step = items["_step"]
                history[step] = {k: v for k, v in items.items() if not k.startswith("_")}
        runs.append((run_id, name, history))
    return runs


def _wandb_run(output_dir: Path) -> tuple[str, dict[int, dict[str, float]]]:
    """The one offline run's name and its history, by ``_step``."""
    ((_, name, history),) = _wandb_runs(output_dir)
    return name, history


def _expected(row: dict[str, float]) -> dict[str, float]:
    """What a tracker gets for a metrics row: its values, and TRL's names for some."""
    values = {k: v for k, v in row.items() if k != "step" and not math.isnan(v)}
    return values | {TRL_NAMES[k]: v for k, v in values.items() if k in TRL_NAMES}


@pytest.fixture
def offline_trackers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No W&B mode, key or MLflow server from the environment; W&B's own files under tmp."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)


@pytest.mark.usefixtures("offline_trackers")
def test_grpo_reports_the_metrics_rows_to_wandb_and_mlflow(
    make_manifest: Callable[..., RunManifest],
) -> None:
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    manifest = make_manifest("quickstart.yaml", max_steps=2, report_to=["wandb", "mlflow"])
    result = train_grpo(manifest)
    assert result.metrics_path is not None
    rows = read_metrics(result.metrics_path)
    assert [row["step"] for row in rows] == [1.0, 2.0]
    assert manifest.name == "quickstart"

    name, history = _wandb_run(result.output_dir)
    assert name == "quickstart"  # run_name unset: the manifest's name
    assert sorted(history) == [1, 2]
    for row, csv_row in zip(result.metrics, rows, strict=True):
        step = int(row["step"])
        assert history[step] == _expected(row)
        assert history[step] == pytest.approx(_expected(csv_row), rel=1e-5)
        assert history[step]["reward"] == row["reward_mean"]
        assert history[step]["clip_ratio/region_mean"] == row["clip_fraction"]
        assert "eval_reward_mean" not in history[step]  # no evaluation: an empty cell

    client = mlflow.tracking.MlflowClient(
        tracking_uri=(result.output_dir / "mlruns").resolve().as_uri()
    )
    experiment = client.get_experiment_by_name(PROJECT)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "quickstart"
    assert run.info.status == "FINISHED"
    for key in _expected(result.metrics[0]):
        logged = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        expected = [(int(row["step"]), _expected(row)[key]) for row in result.metrics]
        assert logged == expected, key
        assert [value for _, value in logged] == pytest.approx(
            [_expected(row)[key] for row in rows], rel=1e-5
        )


@pytest.mark.usefixtures("offline_trackers")
def test_grpo_reports_to_a_local_trackio_project_and_a_resumed_run_appends_to_its_run(
    make_manifest: Callable[..., RunManifest],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    store = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(store))
    monkeypatch.delenv("TRACKIO_PROJECT", raising=False)
    pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    # trackio reads TRACKIO_DIR once, at import: an earlier import in this process kept another
    for name, module in list(sys.modules.items()):
        if name.startswith("trackio") and hasattr(module, "TRACKIO_DIR"):
            monkeypatch.setattr(module, "TRACKIO_DIR", store)
    settings = {"batch_size": 2, "group_size": 2, "max_new_tokens": 3}
    settings |= {"report_to": ["trackio"], "run_name": "digits-trackio"}
    first = train_grpo(make_manifest("quickstart.yaml", max_steps=2, **settings))
    stored = json.loads((first.output_dir / TRACKER_IDS).read_text(encoding="utf-8"))
    assert stored == {"trackio": "digits-trackio"}
    resumed = train_grpo(make_manifest("quickstart.yaml", max_steps=3, **settings), resume=True)
    assert [row["step"] for row in resumed.metrics] == [3.0]

    assert SQLiteStorage.get_runs(PROJECT) == ["digits-trackio"]  # one run, continued
    logged = SQLiteStorage.get_logs(PROJECT, "digits-trackio")
    assert [entry["step"] for entry in logged] == [1, 2, 3]
    for entry, row in zip(logged, [*first.metrics, *resumed.metrics], strict=True):
        values = {k: v for k, v in entry.items() if k not in ("step", "timestamp")}
        assert values == _expected(row)
        assert values["reward"] == row["reward_mean"]
    assert (store / f"{PROJECT}.db").is_file()  # a local store, no server


@pytest.mark.usefixtures("offline_trackers")
def test_dpo_reports_to_mlflow_with_trls_accuracy_key(
    make_manifest: Callable[..., RunManifest],
) -> None:
    mlflow = pytest.importorskip("mlflow")
    result = train_dpo(make_manifest("dpo_digits.yaml", max_steps=2, report_to=["mlflow"]))
    client = mlflow.tracking.MlflowClient(
        tracking_uri=(result.output_dir / "mlruns").resolve().as_uri()
    )
    (run,) = client.search_runs([client.get_experiment_by_name(PROJECT).experiment_id])
    assert run.info.run_name == "digits-dpo"
    for key in ("loss", "accuracy", "rewards/accuracies", "margin"):
        logged = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        expected = [(int(row["step"]), _expected(row)[key]) for row in result.metrics]
        assert logged == expected, key
    assert not (result.output_dir / "wandb").exists()


@pytest.mark.usefixtures("offline_trackers")
def test_run_name_names_the_runs_and_tensorboard_is_one_path(
    make_manifest: Callable[..., RunManifest],
) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("torch.utils.tensorboard")
    manifest = make_manifest(
        "quickstart.yaml", max_steps=1, report_to=["tensorboard", "wandb"], run_name="lr-5e-4"
    )
    result = train_grpo(manifest)
    name, history = _wandb_run(result.output_dir)
    assert name == "lr-5e-4"
    assert sorted(history) == [1]
    events = list((result.output_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1  # the one SummaryWriter training.tensorboard has always had
    assert not (result.output_dir / "mlruns").exists()


@pytest.mark.usefixtures("offline_trackers")
def test_a_resumed_run_continues_the_same_wandb_and_mlflow_runs(
    make_manifest: Callable[..., RunManifest],
) -> None:
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    settings = {"batch_size": 2, "group_size": 2, "max_new_tokens": 3}
    settings["report_to"] = ["wandb", "mlflow"]
    first = train_grpo(make_manifest("quickstart.yaml", max_steps=2, **settings))
    stored = json.loads((first.output_dir / TRACKER_IDS).read_text(encoding="utf-8"))
    resumed = train_grpo(make_manifest("quickstart.yaml", max_steps=3, **settings), resume=True)
    assert [row["step"] for row in resumed.metrics] == [3.0]
    assert json.loads((first.output_dir / TRACKER_IDS).read_text(encoding="utf-8")) == stored
    rows = read_metrics(first.output_dir / "metrics.csv")

    # offline, W&B writes a folder per start; `wandb sync` uploads both into the one run
    runs = _wandb_runs(first.output_dir)
    assert [(run_id, name, sorted(history)) for run_id, name, history in runs] == [
        (stored["wandb"], "quickstart", [1, 2]),
        (stored["wandb"], "quickstart", [3]),
    ]
    history = runs[0][2] | runs[1][2]
    for row in rows:
        assert history[int(row["step"])] == pytest.approx(_expected(row), rel=1e-5)

    client = mlflow.tracking.MlflowClient(
        tracking_uri=(first.output_dir / "mlruns").resolve().as_uri()
    )
    (run,) = client.search_runs([client.get_experiment_by_name(PROJECT).experiment_id])
    assert run.info.run_id == stored["mlflow"]
    assert run.info.status == "FINISHED"
    for key in ("loss", "reward_mean", "reward"):
        logged = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert [step for step, _ in logged] == [1, 2, 3], key
        assert [value for _, value in logged] == pytest.approx(
            [_expected(row)[key] for row in rows], rel=1e-5
        )


def test_a_fresh_start_does_not_continue_stored_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without ``resume`` (a first start, or an overwrite) the stored ids are not reused:
    the runs are new, and their ids replace the stored ones."""
    started: list[tuple[str, str | None]] = []

    class Tracker:
        def __init__(self, name: str, run_id: str | None) -> None:
            self.name, self.given = name, run_id

        def start(self) -> None:
            started.append((self.name, self.given))

    from agile_llmenvs.training.run import trackers

    monkeypatch.setattr(
        trackers, "_make_tracker", lambda name, _, __, run_id: Tracker(name, run_id)
    )
    monkeypatch.setattr(trackers, "_run_id", lambda name, tracker: tracker.given or f"new-{name}")
    (tmp_path / TRACKER_IDS).write_text('{"wandb": "old-w", "mlflow": "old-m"}', "utf-8")
    config = TrainingSpec.model_validate({"algorithm": "grpo", "report_to": ["wandb", "mlflow"]})
    open_trackers(config.report_to, tmp_path)
    assert started == [("wandb", None), ("mlflow", None)]
    assert json.loads((tmp_path / TRACKER_IDS).read_text("utf-8")) == {
        "mlflow": "new-mlflow",
        "wandb": "new-wandb",
    }
    open_trackers(config.report_to, tmp_path, resume=True)
    assert started[2:] == [("wandb", "new-wandb"), ("mlflow", "new-mlflow")]
    # a fresh start (or an overwrite) without trackers: the ids go too
    assert open_trackers([], tmp_path) is None
    assert not (tmp_path / TRACKER_IDS).exists()


def test_report_to_names_known_trackers_once() -> None:
    def spec(**fields: Any) -> TrainingSpec:
        return TrainingSpec.model_validate({"algorithm": "grpo", **fields})

    with pytest.raises(ValidationError) as raised:
        spec(report_to=["comet_ml"])
    assert "Input should be 'tensorboard', 'wandb', 'mlflow' or 'trackio'" in str(raised.value)
    with pytest.raises(ValidationError, match="names a tracker twice"):
        spec(report_to=["wandb", "wandb"])
    with pytest.raises(ValidationError, match="names tensorboard, but `tensorboard: false`"):
        spec(report_to=["tensorboard"], tensorboard=False)
    assert spec().report_to == []
    assert spec().run_name is None


def test_a_tracker_without_its_package_is_refused_with_the_install(
    make_manifest: Callable[..., RunManifest],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    real_find_spec = importlib.util.find_spec
    missing = {"wandb", "trackio"}
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name in missing else real_find_spec(name, *args),
    )
    manifest = make_manifest("quickstart.yaml", report_to=["wandb", "trackio"])
    problems = [str(p) for p in check_run_manifest(manifest, build=False)]
    assert problems == [
        "training.report_to: The package 'wandb' is needed for W&B tracking but is not "
        'installed; run: pip install "agile-llmenvs[trackers]"',
        "training.report_to: The package 'trackio' is needed for Trackio tracking but is not "
        'installed; run: pip install "agile-llmenvs[trackers]"',
    ]
    assert manifest.training is not None
    with pytest.raises(OptionalDependencyError) as raised:
        open_trackers(manifest.training.report_to, tmp_path)
    assert str(raised.value) == (
        "The package 'wandb' is needed for training.report_to: wandb but is not installed; "
        'run: pip install "agile-llmenvs[trackers]"'
    )
