"""Run with 2 processes (gloo on CPU): a streamed weight sync (``weight_transfer="gloo"``) of a
FSDP2-sharded policy to one ``vllm serve`` started with the ``agile_gloo`` engine.

Usage: ``sharded_gloo_sync.py MODEL_DIR MODE URL OUT``; ``MODE`` is ``fsdp`` (the model's
weights, perturbed) or ``fsdp-lora`` (LoRA adapters with seeded non-zero ``B``, merged). Before
sharding, rank 0 writes the greedy ids of the policy, whole, to ``OUT/want.json``; after the
sync, the server's to ``OUT/got.json``, and each process its backend's version to
``OUT/version-R``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from agile_llmenvs.backends import HFBackend, SamplingParams, VLLMServerBackend
from agile_llmenvs.training.generation import ServerWeightSync

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)

if __name__ == "__main__":
    model_dir, mode, url, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(2)  # the same on every process
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    if mode == "fsdp-lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
        )
        with torch.no_grad():  # B starts at zero (no change): give the adapters some weight
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    backend = VLLMServerBackend(url, tokenizer=model_dir, weight_transfer="gloo")
    messages = [[{"role": "user", "content": f"Say the digit {d}."}] for d in range(4)]
    prompts = [backend.encode_chat(m) for m in messages]
    if rank == 0:
        whole = copy.deepcopy(model)
        whole = whole.merge_and_unload() if mode == "fsdp-lora" else whole
        want = HFBackend.from_model(whole, backend.tokenizer).generate(prompts, GREEDY)
        (out / "want.json").write_text(json.dumps([list(g.token_ids) for g in want]))
    base = model.get_base_model() if mode == "fsdp-lora" else model
    for layer in base.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ServerWeightSync(backend, rank=rank, world_size=2)(model, version=1)
    (out / f"version-{rank}").write_text(str(backend.version))
    if rank == 0:
        got = backend.generate(prompts, GREEDY)
        (out / "got.json").write_text(json.dumps([list(g.token_ids) for g in got]))
    backend.close()
    accelerator.wait_for_everyone()
