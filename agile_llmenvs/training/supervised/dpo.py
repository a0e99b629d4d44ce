"""Direct preference optimisation: prefer each row's chosen response, measured against the
starting model (a frozen copy, sharded like the policy under FSDP, or a LoRA policy's base
with its adapters off)."""

from __future__ import annotations

from typing import Any

import torch

from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training.objective import dpo_loss
from agile_llmenvs.training.policy import idle_forward, reference_model
from agile_llmenvs.training.run import RunSettings, TrainResult
from agile_llmenvs.training.supervised.loop import labelled_logps, train_on_dataset

__all__ = ["DEFAULT_DPO_BETA", "DPO_METRICS", "DPOObjective", "train_dpo"]

#: The columns of a DPO run's ``metrics.csv``, in order.
DPO_METRICS = ("step", "loss", "margin", "accuracy", "grad_norm", "step_time_s", "learning_rate")
#: DPO's temperature when the manifest leaves ``training.beta`` unset.
DEFAULT_DPO_BETA = 0.1


def train_dpo(
    manifest: RunManifest, *, resume: bool = False, overwrite: bool = False
) -> TrainResult:
    """Train the manifest's model with the sigmoid DPO loss on its preference dataset env.

    The loss is the mean over every pair of the batch (of every process).

    Args:
        manifest: A manifest with ``env_type: dataset``, ``objective: preference`` and
            ``training.algorithm: dpo``; ``training.beta`` is DPO's temperature.
        resume: Continue from the checkpoint in ``output_dir``, if this manifest may
            (:data:`~agile_llmenvs.training.run.folder.RESUMABLE_CHANGES`). The reference
            is the model the manifest names, not the checkpoint.
        overwrite: Replace the run ``output_dir`` holds; without it (or ``resume``) a
            folder that holds a run is refused with a ``CheckpointError``.
    """
    settings = RunSettings.of(manifest)
    beta = DEFAULT_DPO_BETA if settings.beta is None else settings.beta

    def make_objective(model: Any, accelerator: Any) -> DPOObjective:
        reference = reference_model(model, accelerator.device)
        return DPOObjective(reference, beta, settings.chunk_tokens)

    return train_on_dataset(
        settings,
        resume=resume,
        overwrite=overwrite,
        metric_keys=DPO_METRICS,
        make_objective=make_objective,
    )


class DPOObjective:
    """Each micro-batch's chosen and rejected rows in one forward pass each, for the policy
    and the reference; the loss is a sum over pairs over the global pair count.

    It runs a reference (:class:`~agile_llmenvs.training.supervised.RunsAReference`): under
    FSDP a process with fewer micro-batches passes through both models, as :meth:`loss` does.
    """

    def __init__(self, reference: Any, beta: float, chunk_tokens: int) -> None:
        self.reference, self.beta, self.chunk_tokens = reference, beta, chunk_tokens

    def rows(self, batch: Any) -> int:
        """Pairs of the batch."""
        return int(batch.chosen_input_ids.shape[0])

    def units(self, batch: Any) -> float:
        """Pairs of the batch."""
        return float(self.rows(batch))

    def loss(
        self, model: Any, batch: Any, rows: slice, total_units: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The pairs' summed DPO loss over the global pair count; sums of margin and wins."""
        input_ids = torch.cat([batch.chosen_input_ids[rows], batch.rejected_input_ids[rows]])
        attention_mask = torch.cat(
            [batch.chosen_attention_mask[rows], batch.rejected_attention_mask[rows]]
        )
        labels = torch.cat([batch.chosen_labels[rows], batch.rejected_labels[rows]])
        chosen, rejected = self._sequence_logps(model, input_ids, attention_mask, labels)
        with torch.no_grad():
            ref_chosen, ref_rejected = self._sequence_logps(
                self.reference, input_ids, attention_mask, labels
            )
        loss_B, margin_B = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=self.beta)
        wins = float((margin_B > 0).sum())
        return loss_B.sum() / max(total_units, 1.0), {"margin": float(margin_B.sum()), "wins": wins}

    def idle_loss(self, model: Any) -> torch.Tensor:
        """A zero loss through ``model``, then the reference (as :meth:`loss` runs them)."""
        device = next(model.parameters()).device
        loss = idle_forward(model, device)
        with torch.no_grad():
            idle_forward(self.reference, device)
        return loss

    def metrics(self, sums: dict[str, float], total_units: float) -> dict[str, float]:
        """Mean margin, and the share of pairs the policy prefers more than the reference."""
        pairs = max(total_units, 1.0)
        return {"margin": sums["margin"] / pairs, "accuracy": sums["wins"] / pairs}

    def _sequence_logps(
        self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) sums of each response's token log-probs."""
        logps_BT, mask_BT = labelled_logps(
            model, input_ids, attention_mask, labels, chunk_tokens=self.chunk_tokens
        )
        chosen, rejected = (logps_BT * mask_BT).sum(dim=1).chunk(2)
        return chosen, rejected
