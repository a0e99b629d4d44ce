"""The quick start's cost per step with the thread count chosen for its model, quiet and busy.

Runs the quick start (GRPO on the built-in tiny model, 8 groups x 8, 8 new tokens) for
``STEPS`` steps, each run in a fresh process into a temporary folder, four ways: with the
automatic thread count (``training.cpu_threads`` unset: one thread for the tiny model) and with
torch's default count forced (what ran before the choice existed), each on a quiet machine and
beside two busy processes (each spinning a pure-Python loop on a core). Reports per step, over
the training call (setup included):

* ``busy_over_quiet_cpu``: the automatic count's CPU-seconds busy over quiet (target <= 1.5):
  idle threads spinning for a core another process holds burn CPU and time;
* ``auto_over_default_busy_wall``: wall time beside the busy processes, the automatic count
  over torch's default (target <= 1.0);
* for reference: ``auto_over_default_wall``, the same quiet (on 2 idle cores two threads are
  faster), and ``default_busy_over_quiet_cpu``.

``--sweep`` instead times the quick start on tiny models of several widths with one thread
and with torch's default, the measure behind
:data:`agile_llmenvs.training.policy.threads.SMALL_MODEL_PARAMETERS` (not part of the table).
Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "quickstart.yaml"
BUSY_NEIGHBOURS = 2

# One run, in a process of its own so torch starts at its own default thread count.
_RUN = """
import json, sys, tempfile, time
import torch
from agile_llmenvs.specs import ModelSpec, load_manifest
from agile_llmenvs.training import train_grpo
from agile_llmenvs.training.policy import model_dir
from transformers import AutoConfig, AutoModelForCausalLM

def parameters(spec):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir(spec)))
    return sum(p.numel() for p in model.parameters())

manifest_path, steps, threads, model_path = sys.argv[1:5]
manifest = load_manifest(manifest_path)
default_threads = torch.get_num_threads()
update = {"max_steps": int(steps), "tensorboard": False, "output_dir": tempfile.mkdtemp()}
if threads != "auto":
    update["cpu_threads"] = default_threads if threads == "default" else int(threads)
manifest = manifest.model_copy(update={"training": manifest.training.model_copy(update=update)})
if model_path:
    manifest = manifest.model_copy(update={"model": ModelSpec(path=model_path)})
wall, cpu = time.perf_counter(), time.process_time()
result = train_grpo(manifest)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
steps_timed = sorted(row["step_time_s"] for row in result.metrics[1:])
print(json.dumps({
    "wall_s": wall, "cpu_s": cpu, "threads": torch.get_num_threads(),
    "parameters": parameters(manifest.model),
    "default_threads": default_threads, "median_step_s": steps_timed[len(steps_timed) // 2],
}))
"""


def run_once(steps: int, threads: str, model_path: str = "") -> dict[str, Any]:
    """One quick-start run of ``steps`` steps in a fresh process; its timings."""
    env = {key: value for key, value in os.environ.items() if not key.endswith("_NUM_THREADS")}
    done = subprocess.run(
        [sys.executable, "-c", _RUN, str(MANIFEST), str(steps), threads, model_path],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the run failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


class BusyNeighbours:
    """Processes that each keep a core busy with a pure-Python loop, while in the context."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BusyNeighbours:
        for _ in range(self.count):
            self.processes.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        time.sleep(0.5)  # spinning before the measure starts
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


def per_step(result: dict[str, Any], steps: int) -> dict[str, float]:
    return {
        "wall_s": result["wall_s"] / steps,
        "cpu_s": result["cpu_s"] / steps,
        "threads": result["threads"],
    }


def measure(steps: int) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for threads in ("auto", "default"):
        runs[f"{threads}_quiet"] = per_step(run_once(steps, threads), steps)
        with BusyNeighbours(BUSY_NEIGHBOURS):
            runs[f"{threads}_busy"] = per_step(run_once(steps, threads), steps)
    report: dict[str, Any] = {"figure": "quickstart_threads", "steps": steps, **runs}
    for threads in ("auto", "default"):
        busy, quiet = runs[f"{threads}_busy"], runs[f"{threads}_quiet"]
        report[f"{threads}_busy_over_quiet_cpu"] = round(busy["cpu_s"] / quiet["cpu_s"], 3)
    report["busy_over_quiet_cpu"] = report.pop("auto_busy_over_quiet_cpu")
    report["auto_over_default_wall"] = round(
        runs["auto_quiet"]["wall_s"] / runs["default_quiet"]["wall_s"], 3
    )
    report["auto_over_default_busy_wall"] = round(
        runs["auto_busy"]["wall_s"] / runs["default_busy"]["wall_s"], 3
    )
    report["load_avg_1m"] = os.getloadavg()[0]  # at the end; other processes swamp these
    return report


def sweep(steps: int, widths: list[int]) -> dict[str, Any]:
    """Median step time on tiny models of ``widths``, quiet and beside the busy processes: one
    thread over torch's default."""
    from agile_llmenvs.tiny_model import build_tiny_model

    rows: dict[str, Any] = {}
    for width in widths:
        folder = Path(tempfile.gettempdir()) / f"tiny-width-{width}"
        path = str(build_tiny_model(folder, hidden_size=width))
        row: dict[str, Any] = {}
        for where in ("quiet", "busy"):
            with BusyNeighbours(BUSY_NEIGHBOURS if where == "busy" else 0):
                one, default = (run_once(steps, threads, path) for threads in ("1", "default"))
            row[f"{where}_one_over_default"] = round(
                one["median_step_s"] / default["median_step_s"], 3
            )
            row[f"{where}_one_thread_step_s"] = one["median_step_s"]
            row[f"{where}_default_step_s"] = default["median_step_s"]
        row["parameters"] = one["parameters"]
        rows[str(width)] = row
        print(width, row, flush=True)
    return {
        "figure": "quickstart_threads_sweep",
        "steps": steps,
        "widths": rows,
        "load_avg_1m": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", nargs="?", type=int, default=60)
    parser.add_argument("--sweep", nargs="*", type=int, metavar="WIDTH")
    args = parser.parse_args()
    if args.sweep is not None:
        print(json.dumps(sweep(args.steps, args.sweep or [64, 128, 256, 512, 1024])))
        return
    report = measure(args.steps)
    for key, value in report.items():
        print(f"{key:>24}: {value}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
