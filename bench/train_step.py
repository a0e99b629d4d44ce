"""Where a GRPO step's time goes on the tiny model: generation, env/harness, learning.

Runs the quick start's settings (8 groups x 8, 8 new tokens) for ``STEPS`` steps into a
temporary folder and reports the median of each timing column of ``metrics.csv`` over the
steps after the first (warm-up), and ``overhead_ratio``: the median over those steps of the
share of the step that is neither the backend's generate calls nor the forward, backward and
optimizer step (envs, harness, collector, advantages, batch building). Target: <= 0.05 (#45).
Last line: JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
KEYS = ("step_time_s", "gen_time_s", "env_time_s", "learn_time_s", "tokens_per_s")
MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "quickstart.yaml"
TARGET = 0.05


def main() -> None:
    from agile_llmenvs.specs import load_manifest
    from agile_llmenvs.training import train_grpo

    manifest = load_manifest(MANIFEST)
    assert manifest.training is not None
    with tempfile.TemporaryDirectory() as output_dir:
        training = manifest.training.model_copy(
            update={"max_steps": STEPS, "output_dir": output_dir, "tensorboard": False}
        )
        start = time.perf_counter()
        result = train_grpo(manifest.model_copy(update={"training": training}))
        wall = time.perf_counter() - start
    rows = result.metrics[1:]
    report = {key: statistics.median(row[key] for row in rows) for key in KEYS}
    overhead = [
        (row["step_time_s"] - row["gen_time_s"] - row["learn_time_s"]) / row["step_time_s"]
        for row in rows
    ]
    report.update(overhead_ratio=statistics.median(overhead), target=TARGET)
    # other processes on the cores make torch's threads stall and swamp every other figure
    report.update(steps=STEPS, wall_s=wall, load_avg_1m=os.getloadavg()[0])
    for key, value in report.items():
        print(f"{key:>14}: {value:.4g}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
