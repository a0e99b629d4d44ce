"""LoRA policies on the tiny model for weight-sync tests: an untied copy of a model (its
``lm_head`` a matrix of its own), and adapters with every ``B`` (or an embedding's ``A``)
made non-zero, so that a sync that drops an adapter changes what the sampler computes."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

#: What peft starts at zero: a linear adapter's ``B``, an embedding adapter's ``A``.
_ZERO_AT_START = ("lora_B", "lora_embedding_A")


def untied_copy(model_dir: Path, out: Path, *, seed: int = 0) -> Path:
    """Save ``model_dir``'s model with ``tie_word_embeddings: false`` and an ``lm_head`` of
    its own (the embedding plus seeded noise), with its tokenizer files, at ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = False
    tied = AutoModelForCausalLM.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config).float()
    state = {k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"}
    embedding = state["model.embed_tokens.weight"]
    generator = torch.Generator().manual_seed(seed)
    state["lm_head.weight"] = embedding + 0.02 * torch.randn(embedding.shape, generator=generator)
    model.load_state_dict(state, strict=True)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(out)
    for path in model_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_")):
            shutil.copy(path, out / path.name)
    if (model_dir / "generation_config.json").exists():
        shutil.copy(model_dir / "generation_config.json", out / "generation_config.json")
    return out


def lora_on(model_dir: Path, targets: Sequence[str], *, r: int = 4, seed: int = 1) -> Any:
    """The model under adapters of rank ``r`` on ``targets`` (peft's own matching), every
    adapter tensor peft starts at zero filled with seeded noise, in eval mode."""
    from transformers import AutoModelForCausalLM

    from agile_llmenvs.specs import LoRASpec
    from agile_llmenvs.training.policy import apply_lora

    spec = LoRASpec(r=r, alpha=2 * r, target_modules=list(targets))
    policy = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), spec)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if any(part in name for part in _ZERO_AT_START):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return policy.eval()
