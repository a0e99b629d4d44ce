"""``bench/gpu_suite.sh``: its syntax, its usage, and the one JSON line it ends with (built
from the steps' records by ``bench/_gpu_suite.py``), exactly."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "bench" / "gpu_suite.sh"
STEPS = [
    "setup",
    "train_memory",
    "fsdp_plugin_one_gpu",
    "grpo_model",
    "grpo_vllm",
    "grpo_hf",
    "fsdp_plugin_test",
]
METRICS_HEADER = "step,reward_mean,tokens_per_s,step_time_s,gen_time_s,learn_time_s,"
METRICS_HEADER += "weight_sync_time_s\n"


@pytest.fixture(scope="module")
def helper() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_gpu_suite", REPO / "bench" / "_gpu_suite.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bash(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", *args], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )


def test_the_script_parses() -> None:
    done = _bash("-n", str(SUITE))
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="needs shellcheck")
def test_shellcheck_finds_nothing() -> None:
    done = subprocess.run(["shellcheck", str(SUITE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_help_names_every_step_and_a_wrong_argument_is_refused() -> None:
    done = _bash(str(SUITE), "--help")
    assert done.returncode == 0
    assert done.stdout.startswith("One GPU check (issue #30)")
    for step in STEPS:
        assert f"\n  {step} " in done.stdout
    wrong = _bash(str(SUITE), "--nope")
    assert wrong.returncode == 2
    assert wrong.stderr.startswith("gpu_suite: unknown argument --nope\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_without_a_gpu_setup_fails_and_every_other_step_is_skipped(tmp_path: Path) -> None:
    wheels = str(tmp_path / "absent")  # not the checkout's .whl, if it holds any
    env = {**os.environ, "GPU_SUITE_PYTHON": sys.executable, "GPU_SUITE_WHEELS": wheels}
    done = _bash(str(SUITE), "--logs", str(tmp_path), env=env)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == json.loads((tmp_path / "suite.json").read_text())
    setup = report["steps"].pop("setup")
    assert (setup["status"], setup["exit_status"], setup["limit_s"]) == ("failed", 1, 90)
    assert setup["error"].endswith("no CUDA device: run the suite with --cpu-dry-run")
    assert setup["figures"]["gpu_count"] == 0
    assert report["steps"] == {
        step: {"status": "skipped", "reason": "setup failed"} for step in STEPS[1:]
    }
    assert (report["suite"], report["mode"], report["gpu"], report["ok"]) == (
        "gpu",
        "gpu",
        None,
        False,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["setup.log", "suite.json"]


def _write_step(
    work: Path, name: str, record: str, log: str | None = None, figures: str | None = None
) -> None:
    (work / "status" / name).write_text(record + "\n")
    with (work / "order").open("a") as file:
        file.write(name + "\n")
    if log is not None:
        (work / "logs" / f"{name}.log").write_text(log)
    if figures is not None:
        (work / "figures" / f"{name}.json").write_text(figures)


def test_the_report_keeps_every_steps_figures_whatever_the_others_did(
    helper: ModuleType, tmp_path: Path
) -> None:
    for folder in ("status", "logs", "figures"):
        (tmp_path / folder).mkdir()
    probe = {"gpu": "NVIDIA H200", "gpu_count": 1, "torch": "2.11.0+cu130", "vllm": None}
    _write_step(tmp_path, "setup", "ok\t0\t90\t100.0\t104.5\t", json.dumps(probe) + "\n")
    _write_step(
        tmp_path,
        "train_memory",
        "ok\t0\t150\t104.5\t150.0\t",
        'grpo 8 samples\n{"old": 1}\n{"layers": 24}\nnot json {\n',
    )
    _write_step(
        tmp_path,
        "fsdp_plugin_one_gpu",
        "failed\t1\t120\t150.0\t160.0\t",
        'a\n\nb\n{"distributed_type": "NO"}\nTraceback\nValueError: boom\n',
    )
    _write_step(tmp_path, "grpo_vllm", "skipped\t\t\t\t\tvllm is not installed")
    _write_step(
        tmp_path,
        "grpo_hf",
        "timeout\t124\t40\t160.0\t200.0\t",
        "step 1\n",
        figures='{"steps_done": 3, "finished": false}',
    )
    report = helper.suite_report(tmp_path, tmp_path / "logs", "gpu")
    assert report == {
        "suite": "gpu",
        "mode": "gpu",
        "gpu": "NVIDIA H200",
        "gpu_count": 1,
        "torch": "2.11.0+cu130",
        "vllm": None,
        "steps": {
            "setup": {"status": "ok", "seconds": 4.5, "limit_s": 90, "figures": probe},
            "train_memory": {
                "status": "ok",
                "seconds": 45.5,
                "limit_s": 150,
                "figures": {"layers": 24},
            },
            "fsdp_plugin_one_gpu": {
                "status": "failed",
                "seconds": 10.0,
                "limit_s": 120,
                "figures": {"distributed_type": "NO"},
                "exit_status": 1,
                "error": "a | b | Traceback | ValueError: boom",
            },
            "grpo_vllm": {"status": "skipped", "reason": "vllm is not installed"},
            "grpo_hf": {
                "status": "timeout",
                "seconds": 40.0,
                "limit_s": 40,
                "figures": {"steps_done": 3, "finished": False},
                "exit_status": 124,
                "error": "step 1",
            },
        },
        "seconds": 100.0,
        "ok": False,
    }


def test_grpo_figures_leave_the_first_step_out_of_the_medians(
    helper: ModuleType, tmp_path: Path
) -> None:
    metrics = tmp_path / "metrics.csv"
    metrics.write_text(
        METRICS_HEADER
        + "1,0,100,9.0,8.0,0.5,0.25\n"
        + "2,0.5,1000,1.0,0.5,0.25,0.125\n"
        + "3,0.25,3000,3.0,0.75,0.5,0.5\n"
        + "4,0.75,2000,2.0,1.0,1.0,0.25\n"
    )
    assert helper.grpo_figures(metrics, max_steps=5) == {
        "steps_done": 4,
        "finished": False,
        "first_step_time_s": 9.0,
        "step_time_s": 2.0,
        "gen_time_s": 0.75,
        "learn_time_s": 0.5,
        "weight_sync_time_s": 0.25,
        "tokens_per_s": 2000,
        "reward_mean_last": 0.75,
    }
    assert helper.grpo_figures(tmp_path / "absent.csv", max_steps=5) == {
        "steps_done": 0,
        "finished": False,
    }
