"""Peak memory and throughput of GRPO's and SFT's learning step at a real model's width.

A random-init Qwen2 at Qwen2.5-0.5B's width and vocabulary (hidden 896, 14 heads, 2 KV heads,
MLP 4,864, vocab 151,936, tied embeddings), ``--layers`` deep, fp32, AdamW. Each sample is
``--tokens`` tokens, the last ``--sampled`` of them scored (GRPO: sampled by the policy; SFT:
the response). Figures, for each algorithm:

- ``peak_gb_small`` / ``peak_gb_large``: peak resident memory during one learning step at
  the smallest / largest sample count, above the floor measured in the same run after a
  warm-up step (weights + gradients + AdamW state). Target <= 3 GB at every sample count.
- ``peak_ratio``: the peak at the largest sample count over the peak at the smallest.
  Target <= 1.1 (memory flat in batch size).
- ``throughput_ratio``: learning tokens/s over a bare forward and backward of the same tokens
  at the same micro-batch size (the model's own loss over full logits). Target >= 0.85.

On CPU the peak is the process's high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` before each step); on a GPU (``--device cuda``) it is
``torch.cuda.max_memory_allocated``. Last line: JSON.

    python bench/train_memory.py                      # CPU: 4 layers, 8 and 32 samples
    python bench/train_memory.py --device cuda --layers 24 --samples 64 --micro-batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from _memory import Memory
from _qwen import VOCAB, qwen_05b_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PEAK_TARGET_GB = 3.0
PEAK_RATIO_TARGET = 1.1
THROUGHPUT_TARGET = 0.85


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--sampled", type=int, default=768)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--algorithms", nargs="+", default=["grpo", "sft"])
    args = parser.parse_args()

    learner = _learner(args.layers, args.device)
    memory = Memory(args.device)
    _warm_up(learner, args)
    floor = memory.current()
    report: dict[str, Any] = {
        "layers": args.layers,
        "tokens": args.tokens,
        "sampled": args.sampled,
        "micro_batch_size": args.micro_batch,
        "device": args.device,
        "samples": sorted(args.samples),
        "floor_gb": floor,
    }
    bare_tps = _bare_tokens_per_s(learner, args, min(args.samples))
    report["bare_tokens_per_s"] = bare_tps
    for algorithm in args.algorithms:
        step = _STEPS[algorithm]
        peaks, tps = {}, 0.0
        for samples in args.samples:
            memory.reset_peak()
            start = time.perf_counter()
            step(learner, args, samples)
            seconds = time.perf_counter() - start
            peaks[samples] = memory.peak() - floor
            if samples == min(args.samples):
                tps = samples * args.tokens / seconds
            print(f"{algorithm} {samples} samples: {peaks[samples]:.2f} GB, {seconds:.1f} s")
        report[algorithm] = {
            "peak_gb_small": peaks[min(peaks)],
            "peak_gb_large": peaks[max(peaks)],
            "peak_ratio": peaks[max(peaks)] / peaks[min(peaks)],
            "tokens_per_s": tps,
            "throughput_ratio": tps / bare_tps,
        }
    report["targets"] = {
        "peak_gb": PEAK_TARGET_GB,
        "peak_ratio": PEAK_RATIO_TARGET,
        "throughput_ratio": THROUGHPUT_TARGET,
    }
    print(json.dumps(report))


def _learner(layers: int, device: str) -> Any:
    from accelerate import Accelerator
    from transformers import Qwen2ForCausalLM

    from agile_llmenvs.training.policy import Learner, make_optimizer, make_scheduler

    config = qwen_05b_config(layers)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device)
    accelerator = Accelerator(cpu=device == "cpu")
    optimizer = make_optimizer(model, learning_rate=1e-6, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = make_scheduler(optimizer, "constant", warmup_steps=0, total_steps=1)
    return Learner(accelerator, model, optimizer, scheduler, max_grad_norm=1.0)


def _samples(args: argparse.Namespace, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids ``[samples, tokens]`` and the mask of the scored last ``sampled`` targets."""
    generator = torch.Generator().manual_seed(samples)
    ids = torch.randint(0, VOCAB, (samples, args.tokens), generator=generator)
    scored = torch.zeros(samples, args.tokens - 1, dtype=torch.bool)
    scored[:, args.tokens - 1 - args.sampled :] = True
    return ids.to(args.device), scored.to(args.device)


def _grpo_step(learner: Any, args: argparse.Namespace, samples: int) -> None:
    from agile_llmenvs.training.grpo import PolicyBatch, UpdateSettings, grpo_update

    ids, scored = _samples(args, samples)
    batch = PolicyBatch(
        ids,
        torch.ones_like(ids),
        scored,
        torch.full(scored.shape, -12.0, device=ids.device) * scored,  # near random-init logps
        torch.linspace(-1.0, 1.0, samples, device=ids.device),
    )
    settings = UpdateSettings(micro_batch_size=args.micro_batch)
    grpo_update(learner, batch, settings)


def _sft_step(learner: Any, args: argparse.Namespace, samples: int) -> None:
    from agile_llmenvs.llm_envs.dataset_env import SFTBatch
    from agile_llmenvs.training.policy import micro_batch_slices
    from agile_llmenvs.training.supervised import SFTObjective

    ids, scored = _samples(args, samples)
    labels = ids.clone()
    labels[:, 1:][~scored] = -100
    labels[:, 0] = -100
    prompt_lengths = torch.full((samples,), args.tokens - args.sampled, device=ids.device)
    batch = SFTBatch(ids, torch.ones_like(ids), labels, prompt_lengths)
    objective = SFTObjective(chunk_tokens=256)
    total = objective.units(batch)
    learner.model.train()
    learner.step(
        micro_batch_slices(samples, args.micro_batch),
        lambda rows: objective.loss(learner.model, batch, rows, total)[0],
    )


_STEPS: dict[str, Callable[[Any, argparse.Namespace, int], None]] = {
    "grpo": _grpo_step,
    "sft": _sft_step,
}


def _warm_up(learner: Any, args: argparse.Namespace) -> None:
    """One step on a short batch: gradients and AdamW state exist from here on (the floor)."""
    short = argparse.Namespace(**{**vars(args), "tokens": 16, "sampled": 8})
    _sft_step(learner, short, samples=1)


def _bare_tokens_per_s(learner: Any, args: argparse.Namespace, samples: int) -> float:
    """Forward (full logits, the model's own loss) and backward of the same tokens, no step."""
    ids, _ = _samples(args, samples)
    learner.model.train()
    start = time.perf_counter()
    for start_row in range(0, samples, args.micro_batch):
        rows = slice(start_row, start_row + args.micro_batch)
        learner.model(input_ids=ids[rows], labels=ids[rows]).loss.backward()
    seconds = time.perf_counter() - start
    learner.optimizer.zero_grad(set_to_none=False)
    return samples * args.tokens / seconds


if __name__ == "__main__":
    main()
