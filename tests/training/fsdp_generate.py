"""Run with 2 processes (gloo on CPU): HFBackend generates on an FSDP2-sharded policy, each
process its own prompt and budget (so they finish at different steps), and saves its ids.

Usage: ``fsdp_generate.py MODEL_DIR OUTPUT_DIR``; rank ``r`` writes ``OUTPUT_DIR/rank{r}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))

from update_cases import load_model

from agile_llmenvs.backends import HFBackend, SamplingParams

PROMPTS = ([5, 6, 7], [9, 10, 11, 12, 13])
BUDGETS = (3, 9)

if __name__ == "__main__":
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    rank = Accelerator(cpu=True).process_index
    model = load_model(model_dir)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    backend = HFBackend.from_model(model.eval(), AutoTokenizer.from_pretrained(model_dir))
    params = SamplingParams(max_tokens=BUDGETS[rank], temperature=1.0, seed=rank)
    generation = backend.generate([PROMPTS[rank]], params)[0]
    torch.save(
        {"ids": list(generation.token_ids), "logps": list(generation.logprobs)},
        out / f"rank{rank}.pt",
    )
