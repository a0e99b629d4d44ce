"""LoRA through ``peft``: adapters on the policy, its base model as the reference, and what a
generation engine needs: the merged weights, or the adapters alone in peft's layout."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from agile_llmenvs.errors import OptionalDependencyError
from agile_llmenvs.specs.manifest import LoRASpec

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "AdaptersOffReference",
    "adapter_rank",
    "apply_lora",
    "is_lora",
    "merged_weights",
    "write_adapters",
]

ADAPTER = "default"
#: The files of peft's layout (``PeftModel.save_pretrained``), as vLLM loads an adapter.
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise OptionalDependencyError(
            "peft", extra="train", feature="LoRA training (training.lora)"
        ) from exc
    return peft


def apply_lora(model: Any, spec: LoRASpec) -> Any:
    """Wrap ``model`` in adapters on ``spec.target_modules``; only the adapters train.

    Raises:
        OptionalDependencyError: ``peft`` is not installed (the ``train`` extra).
    """
    peft = _peft()
    config = peft.LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft asks transformers 5 a question it has renamed; nothing for the user to do
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        return peft.get_peft_model(model, config, adapter_name=ADAPTER)


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a ``peft`` model (without importing peft when it is not)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


class AdaptersOffReference:
    """The fixed reference of a LoRA policy: the same module with its adapters switched off.

    Called like a model (``reference(input_ids=..., attention_mask=...)``), in eval mode and
    without gradients; it shares every weight with the policy, so it costs no memory.
    """

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def get_base_model(self) -> Any:
        """The Hugging Face model under the adapters (what log-prob scoring hooks into)."""
        return self.policy.get_base_model()

    def __call__(self, **inputs: Any) -> Any:
        """The base model's forward pass on ``inputs``."""
        was_training = self.policy.training
        self.policy.eval()
        try:
            with torch.no_grad(), self.policy.disable_adapter():
                return self.policy(**inputs)
        finally:
            self.policy.train(was_training)


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

    peft = _peft()
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
