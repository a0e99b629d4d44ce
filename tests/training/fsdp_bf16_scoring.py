"""Run with 2 processes (gloo on CPU): GRPO's first pass on an FSDP2-sharded policy under
``mixed_precision: bf16``, on rows without sampler log-probs, which the policy scores itself
before the update; its forward, called outside any autocast (as generation calls it), computes
in bf16 too.

Usage: ``fsdp_bf16_scoring.py MODEL_DIR OUTPUT_FILE``; rank 0 saves the update's metrics and the
forward's dtype.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent))

from update_cases import LR, load_model, synthetic_batch

from agile_llmenvs.training.grpo import UpdateSettings, grpo_update
from agile_llmenvs.training.policy import Learner, autocast_forward, shard_policy

if __name__ == "__main__":
    model_dir, output = Path(sys.argv[1]), sys.argv[2]
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = load_model(model_dir)
    batch = synthetic_batch(model)  # before sharding: every rank builds the same batch
    missing = torch.where(batch.action_mask_BT, float("nan"), 0.0)
    batch = dataclasses.replace(batch, sampling_logps_BT=missing)
    model = shard_policy(model, accelerator.device)
    autocast_forward(model, accelerator)  # as prepare_policy does for a sharded policy
    dtypes = []
    hook = model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    with torch.no_grad():  # called as generation calls it: outside any autocast context
        model(input_ids=batch.input_ids_BT[:1], attention_mask=batch.attention_mask_BT[:1])
    hook.remove()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = Learner(accelerator, model, optimizer, scheduler, max_grad_norm=1e9)
    rows = slice(0, 4) if accelerator.process_index == 0 else slice(4, 7)
    settings = UpdateSettings(max_completion_tokens=20)
    metrics = grpo_update(learner, batch.select(rows), settings)
    if accelerator.is_main_process:
        torch.save({**metrics, "forward_dtype": str(dtypes[0])}, output)
