"""Run with 2 processes (gloo on CPU): the adapters of an FSDP2-sharded LoRA policy, written
for an adapters-only weight sync.

Usage: ``sharded_adapters.py MODEL_DIR FOLDER``. Before sharding, rank 0 saves the adapters
with peft's own ``save_pretrained`` to ``FOLDER/../expected``; after it, every process calls
:func:`~agile_llmenvs.training.generation.write_shared_adapters` (rank 0 names the folder).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from agile_llmenvs.specs import LoRASpec
from agile_llmenvs.training.generation import write_shared_adapters
from agile_llmenvs.training.policy import apply_lora

if __name__ == "__main__":
    model_dir, folder = Path(sys.argv[1]), Path(sys.argv[2])
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    torch.manual_seed(0)  # A's random start: the same on every process, as in training
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), LoRASpec(r=4))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # B starts at zero: give it values to gather
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    if rank == 0:
        model.save_pretrained(folder.parent / "expected")
    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(model)
    written = write_shared_adapters(model, folder if rank == 0 else None, rank=rank)
    assert written == folder, (written, folder)
