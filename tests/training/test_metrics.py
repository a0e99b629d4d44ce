"""The metrics a run writes: the CSV and, when tensorboard is there, the same values as
scalars; resuming keeps what came before the checkpoint and drops what came after."""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from agile_llmenvs.errors import OptionalDependencyError
from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training import train_sft
from agile_llmenvs.training.run import MetricsWriter, read_metrics
from agile_llmenvs.training.supervised import SFT_METRICS

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

KEYS = ("step", "loss", "reward_mean")


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under ``directory``, as ``{tag: [(step, value), ...]}``."""
    accumulator = event_accumulator.EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def _write(writer: MetricsWriter, *rows: tuple[int, float, float]) -> None:
    for step, loss, reward in rows:
        writer.write({"step": step, "loss": loss, "reward_mean": reward})
    writer.close()


def _next_second() -> None:
    """Wait for the clock's next whole second. TensorBoard reads a folder's event files in
    name order, and a name is ``events.out.tfevents.<seconds>.<host>.<pid>.<n>`` with ``n`` a
    per-process counter that is not zero-padded: two writers of one process within one second
    sort wrongly once ``n`` goes from 9 to 10 (as under xdist, where a worker has written
    other tests' events). A resumed run in practice starts in a later second."""
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.01)


def test_every_metric_becomes_a_scalar_and_resume_replaces_what_followed_the_checkpoint(
    tmp_path: Path,
) -> None:
    csv_path = tmp_path / "metrics.csv"
    _write(MetricsWriter(csv_path, KEYS), (1, 0.5, 0.0), (2, 0.25, 0.5), (3, 0.125, 1.0))
    _next_second()
    # the run had checkpointed at step 2: step 3 is run again, then step 4
    _write(MetricsWriter(csv_path, KEYS, resume_step=2), (3, 0.75, 0.25), (4, 1.5, 0.75))

    scalars = _scalars(tmp_path / "tensorboard")
    assert sorted(scalars) == ["loss", "reward_mean"]
    assert scalars["loss"] == [(1, 0.5), (2, 0.25), (3, 0.75), (4, 1.5)]
    assert scalars["reward_mean"] == [(1, 0.0), (2, 0.5), (3, 0.25), (4, 0.75)]
    assert [row["loss"] for row in read_metrics(csv_path)] == [0.5, 0.25, 0.75, 1.5]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_a_fresh_run_starts_the_events_over(tmp_path: Path) -> None:
    csv_path = tmp_path / "metrics.csv"
    _write(MetricsWriter(csv_path, KEYS), (1, 0.5, 0.0), (2, 0.25, 0.5))
    _write(MetricsWriter(csv_path, KEYS), (1, 2.0, 1.0))
    assert _scalars(tmp_path / "tensorboard")["loss"] == [(1, 2.0)]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1


def test_tensorboard_off_writes_the_csv_only(tmp_path: Path) -> None:
    _write(MetricsWriter(tmp_path / "metrics.csv", KEYS, tensorboard=False), (1, 0.5, 0.0))
    assert not (tmp_path / "tensorboard").exists()
    assert read_metrics(tmp_path / "metrics.csv") == [
        {"step": 1.0, "loss": 0.5, "reward_mean": 0.0}
    ]


def test_without_tensorboard_auto_is_silent_and_required_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _write(MetricsWriter(tmp_path / "metrics.csv", KEYS), (1, 0.5, 0.0))
    assert not (tmp_path / "tensorboard").exists()
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.csv")] == [1.0]

    with pytest.raises(OptionalDependencyError) as raised:
        MetricsWriter(tmp_path / "metrics.csv", KEYS, tensorboard=True)
    assert str(raised.value) == (
        "The package 'tensorboard' is needed for TensorBoard metrics (training.tensorboard) "
        'but is not installed; run: pip install "agile-llmenvs[train]"'
    )


def test_sft_run_logs_its_metrics_to_tensorboard_across_a_resume(
    make_manifest: Callable[..., RunManifest],
) -> None:
    first = train_sft(make_manifest("sft_digits.yaml", max_steps=2, tensorboard=True))
    resumed = train_sft(make_manifest("sft_digits.yaml", max_steps=4), resume=True)

    scalars = _scalars(first.output_dir / "tensorboard")
    assert sorted(scalars) == sorted(key for key in SFT_METRICS if key != "step")
    rows = first.metrics + resumed.metrics
    for key in ("loss", "grad_norm", "tokens"):
        assert [step for step, _ in scalars[key]] == [1, 2, 3, 4]
        assert [value for _, value in scalars[key]] == pytest.approx([r[key] for r in rows])


def test_the_plot_is_drawn_without_touching_the_processs_matplotlib_backend(
    tmp_path: Path,
) -> None:
    """A notebook's backend stays as it was (the plot used to call ``matplotlib.use("Agg")``)
    and ``pyplot`` is not imported; the PNG has one 4.5 x 3.2 inch panel a key at 100 dpi."""
    import subprocess

    from PIL import Image

    metrics = tmp_path / "metrics.csv"
    metrics.write_text("step,loss,reward_mean\n1,0.5,0.1\n2,0.25,\n3,0.125,0.3\n")
    png = tmp_path / "metrics.png"
    script = (
        "import sys, matplotlib; matplotlib.use('pdf')\n"
        "from pathlib import Path\n"
        "from agile_llmenvs.training.run.metrics import plot_metrics\n"
        f"plot_metrics(Path({str(metrics)!r}), Path({str(png)!r}), ('loss', 'reward_mean'))\n"
        "print(matplotlib.get_backend(), 'matplotlib.pyplot' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["pdf", "False"]
    with Image.open(png) as image:
        assert image.size == (2 * 450, 320)
