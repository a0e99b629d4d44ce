"""Direct preference optimisation: prefer each row's chosen response, measured against the
starting model (a frozen copy, or a LoRA policy's base with its adapters off)."""

from __future__ import annotations

from typing import Any

import torch

from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training.common import TrainResult, reference_model, training_spec
from agile_llmenvs.training.losses import dpo_loss, sequence_logps
from agile_llmenvs.training.supervised import LossFn, train_on_dataset

__all__ = ["DEFAULT_DPO_BETA", "DPO_METRICS", "train_dpo"]

#: The columns of a DPO run's ``metrics.csv``, in order.
DPO_METRICS = ("step", "loss", "margin", "accuracy", "grad_norm", "step_time_s")
#: DPO's temperature when the manifest leaves ``training.beta`` unset.
DEFAULT_DPO_BETA = 0.1


def train_dpo(manifest: RunManifest, *, resume: bool = False) -> TrainResult:
    """Train the manifest's model with the sigmoid DPO loss on its preference dataset env.

    Args:
        manifest: A manifest with ``env_type: dataset``, ``objective: preference`` and
            ``training.algorithm: dpo``; ``training.beta`` is DPO's temperature.
        resume: Continue from the checkpoint in ``output_dir``. The reference is the model
            the manifest names, not the checkpoint.
    """
    beta = training_spec(manifest).beta
    beta = DEFAULT_DPO_BETA if beta is None else beta

    def make_loss(model: Any, accelerator: Any) -> LossFn:
        return _DPOLoss(reference_model(model, accelerator.device), beta)

    return train_on_dataset(
        manifest, resume=resume, name="dpo", metric_keys=DPO_METRICS, make_loss=make_loss
    )


class _DPOLoss:
    """Chosen and rejected in one forward pass each, for the policy and the reference."""

    def __init__(self, reference: Any, beta: float) -> None:
        self.reference, self.beta = reference, beta

    def __call__(self, model: Any, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        input_ids = torch.cat([batch.chosen_input_ids, batch.rejected_input_ids])
        attention_mask = torch.cat([batch.chosen_attention_mask, batch.rejected_attention_mask])
        labels = torch.cat([batch.chosen_labels, batch.rejected_labels])
        chosen, rejected = sequence_logps(model, input_ids, attention_mask, labels).chunk(2)
        with torch.no_grad():
            ref = sequence_logps(self.reference, input_ids, attention_mask, labels)
        ref_chosen, ref_rejected = ref.chunk(2)
        loss, margin = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=self.beta)
        accuracy = ((chosen - ref_chosen) > (rejected - ref_rejected)).float().mean()
        return loss, {"margin": margin.item(), "accuracy": accuracy.item()}
