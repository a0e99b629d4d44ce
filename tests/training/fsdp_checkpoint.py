"""Run with 2 processes (gloo on CPU): save an FSDP2-sharded policy's checkpoint after one
AdamW step, load it into a fresh sharded policy, and take one more step with each.

Usage: ``fsdp_checkpoint.py MODEL_DIR OUTPUT_DIR``; rank 0 saves the full parameters of both
continuations to ``OUTPUT_DIR/continued.pt`` (equal when the weights and AdamW state came
back whole) and ``OUTPUT_DIR/saved.pt`` (the weights as saved).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))

from update_cases import load_model, synthetic_batch

from agile_llmenvs.training.grpo import UpdateSettings, grpo_update
from agile_llmenvs.training.policy import Learner
from agile_llmenvs.training.run import load_checkpoint, save_checkpoint


def _sharded_learner(model_dir: Path, accelerator: Any) -> Learner:
    model = load_model(model_dir)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Learner(accelerator, model, optimizer, scheduler, max_grad_norm=1e9)


def _full(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])


if __name__ == "__main__":
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    accelerator = Accelerator(cpu=True)
    batch = synthetic_batch(load_model(model_dir))
    settings = UpdateSettings()
    first = _sharded_learner(model_dir, accelerator)
    grpo_update(first, batch, settings)
    save_checkpoint(
        out, first, step=1, tokenizer=AutoTokenizer.from_pretrained(model_dir), rank_state={}
    )
    saved = _full(first.model)
    resumed = _sharded_learner(model_dir, accelerator)
    step, _ = load_checkpoint(out, resumed)
    assert step == 1
    loaded = _full(resumed.model)
    grpo_update(first, batch, settings)
    grpo_update(resumed, batch, settings)
    continued = (_full(first.model), _full(resumed.model))
    if accelerator.is_main_process:
        torch.save({"saved": saved, "loaded": loaded}, out / "saved.pt")
        torch.save(continued, out / "continued.pt")
