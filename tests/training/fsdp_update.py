"""Run with 2 processes (gloo on CPU): one GRPO update of the synthetic batch on a policy
sharded by FSDP2 (``fully_shard`` on each decoder layer and the root), rank 0 holding rows 0-4
and rank 1 rows 5-6, two micro-batches on one rank and one on the other.

Usage: ``fsdp_update.py MODEL_DIR LOSS_TYPE OUTPUT_FILE``; rank 0 saves the full parameter
change to ``OUTPUT_FILE``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))

from update_cases import LR, load_model, synthetic_batch

from agile_llmenvs.training.grpo import UpdateSettings, grpo_update
from agile_llmenvs.training.policy import Learner


def _full(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])


if __name__ == "__main__":
    model_dir, loss_type, output = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    accelerator = Accelerator(cpu=True)
    model = load_model(model_dir)
    batch = synthetic_batch(model)  # before sharding: every rank builds the same batch
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    before = _full(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = Learner(accelerator, model, optimizer, scheduler, max_grad_norm=1e9)
    rows = slice(0, 5) if accelerator.process_index == 0 else slice(5, 7)
    local = batch.select(rows)
    settings = UpdateSettings(loss_type=loss_type, max_completion_tokens=20, micro_batch_size=3)  # type: ignore[arg-type]
    metrics = grpo_update(learner, local, settings)
    delta = _full(model) - before
    if accelerator.is_main_process:
        torch.save({"delta": delta, "metrics": metrics}, output)
