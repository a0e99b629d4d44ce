"""The trainer's policy made whole, for the multi-process scripts' greedy checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agile_llmenvs.training.policy import is_sharded


def whole_copy(policy: Any, model_dir: str | Path, *, on_rank: int | None = 0) -> Any:
    """An unsharded copy of ``policy`` (a policy that is not sharded is its own copy) on
    process ``on_rank`` (``None``: on every process), ``None`` elsewhere. Every process must
    call it: a sharded policy's shards are gathered."""
    rank = torch.distributed.get_rank()
    wanted = on_rank is None or rank == on_rank
    if not is_sharded(policy):
        return policy if wanted else None
    whole = [p.full_tensor().detach().clone() for p in policy.parameters()]
    if not wanted:
        return None
    from transformers import AutoModelForCausalLM

    from agile_llmenvs.weights import ADAPTER, is_lora

    copy = AutoModelForCausalLM.from_pretrained(model_dir)
    if is_lora(policy):  # the same adapters on an unsharded base, the parameters in order
        from peft import get_peft_model

        copy = get_peft_model(copy, policy.peft_config[ADAPTER], adapter_name=ADAPTER)
    with torch.no_grad():
        for param, value in zip(copy.parameters(), whole, strict=True):
            param.copy_(value)
    return copy.eval()
