"""Run with 2 processes (gloo on CPU): each writes its file of a weight-sync folder.

Usage: ``sharded_weight_files.py MODEL_DIR MODE FOLDER``; ``MODE`` is ``whole`` (every process
holds the model, as data parallel does), ``fsdp`` (FSDP2-sharded), ``fsdp-lora`` (LoRA
adapters with seeded non-zero ``B``, then sharded) or ``fsdp-lora-ends`` (as ``fsdp-lora``, on
an untied model, with adapters on ``embed_tokens`` and ``lm_head`` too; an embedding adapter's
``A`` seeded, as peft starts it at zero). Before sharding, rank 0 saves the weights a
server should load to ``FOLDER/../expected.pt``: the model's own, or peft's
``merge_and_unload`` of a copy.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from agile_llmenvs.weights import local_weights, write_weights

if __name__ == "__main__":
    model_dir, mode, folder = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    accelerator = Accelerator(cpu=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    lora = mode.startswith("fsdp-lora")
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "v_proj", "down_proj"]
        if mode == "fsdp-lora-ends":
            targets += ["embed_tokens", "lm_head"]
        torch.manual_seed(0)  # A's random start: the same on every process, as in training
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():  # B starts at zero (no change): give the adapters some weight
            for name, param in model.named_parameters():
                if "lora_B" in name or "lora_embedding_A" in name:
                    param.add_(torch.randn(param.shape, generator=generator) * 0.5)
        expected = copy.deepcopy(model).merge_and_unload()
    else:
        expected = model
    if accelerator.is_main_process:
        state = {name: p.detach().clone() for name, p in expected.named_parameters()}
        torch.save(state, folder.parent / "expected.pt")
    sharded = mode.startswith("fsdp")
    if sharded:
        base = model.get_base_model() if lora else model
        for layer in base.model.layers:
            fully_shard(layer)
        fully_shard(model)
    write_weights(
        folder,
        local_weights(model),
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        sharded=sharded,
        chunk_bytes=4096,  # several chunks per tensor
    )
