"""LoRA through ``peft``: adapters on the policy, its base model as the reference, and the
merged weights a generation engine needs."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from agile_llmenvs.errors import OptionalDependencyError
from agile_llmenvs.specs.manifest import LoRASpec

__all__ = ["AdaptersOffReference", "apply_lora", "is_lora", "merged_weights"]

ADAPTER = "default"


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
