"""What scoring under the sampler's shaped distribution costs the learning step.

The scored path applies the output layer a chunk of positions at a time; under top-k / top-p /
min-p truncation and a repetition penalty it also finds each position's kept set and context
(``agile_llmenvs/backends/_shaping.py``), in the forward and again in the backward pass. This
times a forward and backward of ``scored_token_logps`` on a one-layer Qwen2 at Qwen2.5-0.5B's
width and vocabulary (151,936), fp32, where the output layer is most of the work, under each
setting, against plain temperature scaling measured in the same run, interleaved (the floor).

Figures, for each setting: ``time_ratio``, its median time over the floor's, and
``peak_ratio``, its peak memory above the resident floor over the floor setting's. Last line:
JSON.

    python bench/scored_shaping.py                 # 2 rows of 512 tokens, 384 scored each
    python bench/scored_shaping.py --device cuda --rows 8 --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
from _memory import Memory
from _qwen import VOCAB, qwen_05b_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SETTINGS: dict[str, dict[str, Any]] = {
    "plain": {"temperature": 0.7},
    "top_k_top_p": {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
    "top_p": {"temperature": 0.7, "top_p": 0.8},
    "penalty_top_k_top_p": {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "repetition_penalty": 1.1,
    },
    "min_p": {"temperature": 1.0, "min_p": 0.05},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--scored", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from agile_llmenvs.backends.types import TokenDistribution

    model = _model(args.device)
    ids, attention, mask = _inputs(args)
    distributions = {name: TokenDistribution(**kw) for name, kw in SETTINGS.items()}
    _step(model, ids, attention, mask, distributions["plain"])  # warm-up: probe, allocator
    memory = Memory(args.device)
    floor = memory.current()
    seconds: dict[str, list[float]] = {name: [] for name in distributions}
    peaks: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, distribution in distributions.items():  # interleaved with the floor
            memory.reset_peak()
            start = time.perf_counter()
            _step(model, ids, attention, mask, distribution)
            seconds[name].append(time.perf_counter() - start)
            peaks[name] = max(peaks.get(name, 0.0), memory.peak() - floor)
            print(f"{name}: {seconds[name][-1]:.2f} s, peak {peaks[name]:.2f} GB", flush=True)
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    report: dict[str, Any] = {
        "positions": int(mask.sum()),
        "floor_s": round(medians["plain"], 3),
        "floor_peak_gb": round(peaks["plain"], 3),
    }
    for name in distributions:
        if name == "plain":
            continue
        report[name] = {
            "time_s": round(medians[name], 3),
            "time_ratio": round(medians[name] / medians["plain"], 3),
            "peak_gb": round(peaks[name], 3),
            "peak_ratio": round(peaks[name] / max(peaks["plain"], 1e-9), 3),
        }
    print(json.dumps(report))


def _model(device: str) -> Any:
    from transformers import Qwen2ForCausalLM

    config = qwen_05b_config(1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device)
    with torch.no_grad():  # a trained model's peaked next-token distributions, roughly
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def _inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (args.rows, args.tokens), generator=generator)
    mask = torch.zeros(args.rows, args.tokens - 1, dtype=torch.bool)
    mask[:, -args.scored :] = True
    device = torch.device(args.device)
    return ids.to(device), torch.ones_like(ids).to(device), mask.to(device)


def _step(model: Any, ids: Any, attention: Any, mask: Any, distribution: Any) -> None:
    from agile_llmenvs.training.objective import scored_token_logps

    model.zero_grad(set_to_none=True)
    scored = scored_token_logps(model, ids, attention, mask, distribution=distribution)
    scored.logps_BT.sum().backward()
    if ids.device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
