"""LoRA through ``peft`` on the trainer's side: adapters on the policy, and its base model as
the reference. What a generation engine needs of a LoRA policy (the merged weights, or the
adapters in peft's layout) is :mod:`agile_llmenvs.weights.adapters`."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from agile_llmenvs.specs.manifest import LoRASpec
from agile_llmenvs.weights import ADAPTER, require_peft

__all__ = ["AdaptersOffReference", "apply_lora"]


def apply_lora(model: Any, spec: LoRASpec) -> Any:
    """Wrap ``model`` in adapters on ``spec.target_modules``; only the adapters train.

    Raises:
        OptionalDependencyError: ``peft`` is not installed (the ``train`` extra).
    """
    peft = require_peft()
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
