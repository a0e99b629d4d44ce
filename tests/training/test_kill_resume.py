"""Runs SIGKILLed at any moment resume as if they had never stopped; SIGTERM saves and exits."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from agile_llmenvs.specs import RunManifest
from agile_llmenvs.weights import find_checkpoint

HERE = Path(__file__).resolve().parent
STEPS = 5
# columns that depend only on the data, the seeds and the weights (not on timing)
GRPO_COLUMNS = ("step", "reward_mean", "loss", "kl", "grad_norm", "clip_fraction", "ratio_mean")
SFT_COLUMNS = ("step", "loss", "grad_norm", "tokens", "learning_rate")


def _manifest(make_manifest: Callable[..., RunManifest], algorithm: str, out: Path) -> Path:
    common = {"max_steps": STEPS, "save_every": 1, "keep_checkpoints": 2, "output_dir": str(out)}
    if algorithm == "grpo":
        rubric = {"rubric_file_path": str(HERE / "rubrics.py"), "rubric_name": "digit_share"}
        manifest = make_manifest(
            "quickstart.yaml",
            env=rubric,
            batch_size=2,
            group_size=2,
            max_new_tokens=3,
            mini_batches=2,  # two optimizer steps per GRPO step: a kill can fall between them
            lr_scheduler="linear",
            **common,
        )
    else:
        manifest = make_manifest("sft_digits.yaml", lr_scheduler="cosine", **common)
    path = out.with_suffix(".json")
    path.write_text(manifest.model_dump_json())
    return path


def _run(manifest: Path, kill_at: str, *, resume: bool = False) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(HERE / "killed_run.py"), str(manifest), kill_at]
    command += ["--resume"] if resume else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(HERE.parent)}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def _rows(out: Path, columns: tuple[str, ...]) -> list[tuple[str, ...]]:
    with (out / "metrics.csv").open(newline="") as file:
        return [tuple(row[c] for c in columns) for row in csv.DictReader(file)]


def _steps(out: Path) -> dict[int, list[Any]]:
    """What each step trained on; a step run twice (killed before its checkpoint) must have
    trained on the same rows both times."""
    seen: dict[int, list[Any]] = {}
    for line in (out / "steps.jsonl").read_text().splitlines():
        entry = json.loads(line)
        assert seen.setdefault(entry["step"], entry["rows"]) == entry["rows"], entry["step"]
    return seen


def _weights(out: Path) -> dict[str, Any]:
    checkpoint = find_checkpoint(out)
    assert checkpoint is not None
    assert checkpoint.step == STEPS
    return load_file(str(checkpoint.directory / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {}


def _baseline(
    baselines: dict[str, Path],
    make_manifest: Callable[..., RunManifest],
    algorithm: str,
    root: Path,
) -> Path:
    if algorithm not in baselines:
        out = root / f"straight-{algorithm}"
        done = _run(_manifest(make_manifest, algorithm, out), "none")
        assert done.returncode == 0, done.stderr[-3000:]
        baselines[algorithm] = out
    return baselines[algorithm]


CASES = [
    # (algorithm, kill at, newest complete checkpoint left by the kill)
    ("grpo", "generate:3", 2),  # during step 3's rollout
    ("grpo", "learn:6", 2),  # between step 3's two optimizer steps
    ("grpo", "save:3", 2),  # step 3 done and logged, its save not begun
    ("grpo", "trainer_file:3", 2),  # inside the save: model written, trainer state not
    ("grpo", "publish:3", 2),  # inside the save: every file written, not published
    ("grpo", "prune:3", 3),  # published, older checkpoints not yet pruned
    ("sft", "learn:3", 2),
    ("sft", "save:3", 2),
    ("sft", "trainer_file:3", 2),
    ("sft", "publish:3", 2),
    ("sft", "prune:3", 3),
]


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "kill_at", "newest"), CASES)
def test_a_killed_run_resumes_as_if_never_stopped(
    make_manifest: Callable[..., RunManifest],
    baselines: dict[str, Path],
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    algorithm: str,
    kill_at: str,
    newest: int,
) -> None:
    straight = _baseline(baselines, make_manifest, algorithm, tmp_path_factory.mktemp("base"))
    out = tmp_path / "killed"
    manifest = _manifest(make_manifest, algorithm, out)
    killed = _run(manifest, kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoint = find_checkpoint(out)
    assert checkpoint is not None
    assert checkpoint.step == newest  # a partial save is never taken for a checkpoint
    resumed = _run(manifest, "none", resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    columns = GRPO_COLUMNS if algorithm == "grpo" else SFT_COLUMNS
    assert [int(r[0]) for r in _rows(out, columns)] == list(range(1, STEPS + 1))
    assert _rows(out, columns) == _rows(straight, columns)  # no step missing or repeated
    assert _steps(out) == _steps(straight)  # the same task sequence
    final, expected = _weights(out), _weights(straight)
    assert sorted(final) == sorted(expected)
    for name, tensor in expected.items():
        assert final[name].equal(tensor), name  # bit-identical on CPU
    published = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert published == ["checkpoint-4", "checkpoint-5"]  # keep_checkpoints: 2, no partial


@pytest.mark.slow
def test_sigterm_saves_says_how_to_resume_and_resume_finishes(
    make_manifest: Callable[..., RunManifest], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    manifest = make_manifest(
        "sft_digits.yaml", max_steps=100_000, output_dir=str(out), tensorboard=False
    )
    path = tmp_path / "sft.yaml"
    from agile_llmenvs.specs.manifest import dump_manifest

    dump_manifest(manifest, path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "agile_llmenvs", "train", str(path)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while (
        not (out / "metrics.csv").exists()
        or len((out / "metrics.csv").read_text().splitlines()) < 4
    ):
        assert time.monotonic() < deadline, "the run never got going"
        assert process.poll() is None, process.communicate()
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    # 128 + 15: stopped, not finished (a scheduler reads 0 as done)
    assert process.returncode == 143, stderr.decode()[-3000:]
    checkpoint = find_checkpoint(out)
    assert checkpoint is not None
    last = stdout.decode().strip().splitlines()[-1]
    assert re.fullmatch(
        rf"stopped by SIGTERM after step {checkpoint.step} of 100000 in [\d.]+ s, mean loss "
        rf"\S+ over steps? [\d-]+; checkpoint saved in {re.escape(str(checkpoint.directory))}\. "
        rf"Continue with: agile-llmenvs train {re.escape(str(path))} --resume",
        last,
    ), last
    with (out / "metrics.csv").open(newline="") as file:
        assert [int(r["step"]) for r in csv.DictReader(file)] == list(range(1, checkpoint.step + 1))
    shorter = make_manifest("sft_digits.yaml", max_steps=checkpoint.step + 2, output_dir=str(out))
    dump_manifest(shorter, path)
    resumed = subprocess.run(
        [*command, "--resume"], env=env, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        resumed.stdout.strip()
        .splitlines()[-1]
        .startswith(
            f"trained {checkpoint.step + 2} steps (2 now, resumed at step {checkpoint.step})"
        )
    )
