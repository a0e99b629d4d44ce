"""LoRA adapters as a generation engine takes them: a ``peft`` policy's weights with its
adapters merged in, or the adapters alone in peft's layout (what vLLM loads as an adapter).

The trainer's side of LoRA (putting adapters on the policy, its base model as the reference)
is :mod:`agile_llmenvs.training.policy.lora`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from agile_llmenvs.errors import OptionalDependencyError

__all__ = [
    "ADAPTER",
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "adapter_rank",
    "is_lora",
    "merged_weights",
    "require_peft",
    "write_adapters",
]

#: The adapter's name in the peft model (peft's default).
ADAPTER = "default"
#: The files of peft's layout (``PeftModel.save_pretrained``), as vLLM loads an adapter.
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def require_peft() -> Any:
    """The ``peft`` module.

    Raises:
        OptionalDependencyError: ``peft`` is not installed (the ``train`` extra).
    """
    try:
        import peft
    except ImportError as exc:
        raise OptionalDependencyError(
            "peft", extra="train", feature="LoRA training (training.lora)"
        ) from exc
    return peft


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a ``peft`` model (without importing peft when it is not)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def merged_weights(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights under the base model's own names, adapters merged in
    (``W + scale * B A``) without touching the model; a plain model's parameters as they are.
    """
    if not is_lora(model):
        return {name: param.detach() for name, param in model.named_parameters()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    weights = {
        name.replace(".base_layer.", "."): param.detach()
        for name, param in base.named_parameters()
        if ".lora_" not in name
    }
    with torch.no_grad():
        for module_name, module in base.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                layer: Any = module  # lora.Linear and kin: get_delta_weight is theirs
                weight = layer.get_base_layer().weight
                merged = weight + layer.get_delta_weight(ADAPTER).to(weight.dtype)
                weights[f"{module_name}.weight"] = merged
    return weights


def write_adapters(model: Any, folder: Path, *, main: bool = True) -> Path:
    """Write the adapters of ``model`` (a peft model) into ``folder`` in peft's layout
    (:data:`ADAPTER_WEIGHTS_FILE` and :data:`ADAPTER_CONFIG_FILE`), and return ``folder``.

    Under FSDP2 every process must call it, in step: each adapter tensor is gathered whole
    (a collective; adapters are small), and only the ``main`` process writes.
    """
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    peft = require_peft()
    gathered: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if ".lora_" not in name or f".{ADAPTER}." not in name:
            continue
        tensor = param.detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if main:
            gathered[name] = tensor.cpu().contiguous()
    if main:
        # peft's own renaming: the adapter's name leaves the keys, as save_pretrained writes
        tensors = peft.get_peft_model_state_dict(model, state_dict=gathered, adapter_name=ADAPTER)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        model.peft_config[ADAPTER].save_pretrained(str(folder))
    return folder


def adapter_rank(folder: Path) -> int:
    """The largest adapter rank of the adapters in ``folder`` (its ``r`` and any
    ``rank_pattern``), as a server checks it against its ``--max-lora-rank``."""
    config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
    return max([int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())])
