"""Supervised fine-tuning: cross-entropy of the response tokens of each dataset row."""

from __future__ import annotations

from typing import Any

import torch

from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training.run import RunSettings, TrainResult
from agile_llmenvs.training.supervised.loop import labelled_logps, train_on_dataset

__all__ = ["SFT_METRICS", "SFTObjective", "train_sft"]

#: The columns of an SFT run's ``metrics.csv``, in order.
SFT_METRICS = ("step", "loss", "grad_norm", "tokens", "step_time_s", "learning_rate")


def train_sft(
    manifest: RunManifest, *, resume: bool = False, overwrite: bool = False
) -> TrainResult:
    """Fine-tune the manifest's model on its SFT dataset env (masked cross-entropy).

    The loss is the mean over every response token of the batch (of every process).

    Args:
        manifest: A manifest with ``env_type: dataset``, ``objective: sft`` and
            ``training.algorithm: sft``.
        resume: Continue from the checkpoint in ``output_dir``, if this manifest may
            (:data:`~agile_llmenvs.training.run.folder.RESUMABLE_CHANGES`).
        overwrite: Replace the run ``output_dir`` holds; without it (or ``resume``) a
            folder that holds a run is refused with a ``CheckpointError``.
    """
    settings = RunSettings.of(manifest)
    return train_on_dataset(
        settings,
        resume=resume,
        overwrite=overwrite,
        metric_keys=SFT_METRICS,
        make_objective=lambda model, accelerator: SFTObjective(settings.chunk_tokens),
    )


class SFTObjective:
    """``-sum(log p(response token)) / response tokens of the global batch``."""

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens

    def rows(self, batch: Any) -> int:
        """Rows of the batch."""
        return int(batch.input_ids.shape[0])

    def units(self, batch: Any) -> float:
        """Response tokens of the batch."""
        return float((batch.labels[:, 1:] != -100).sum())

    def loss(
        self, model: Any, batch: Any, rows: slice, total_units: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's summed cross-entropy over the global token count."""
        logps_BT, mask_BT = labelled_logps(
            model,
            batch.input_ids[rows],
            batch.attention_mask[rows],
            batch.labels[rows],
            chunk_tokens=self.chunk_tokens,
            images_B=batch.images_B[rows],
        )
        loss = -(logps_BT * mask_BT).sum() / max(total_units, 1.0)
        return loss, {"tokens": float(mask_BT.sum())}

    def metrics(self, sums: dict[str, float], total_units: float) -> dict[str, float]:
        """The step's response tokens."""
        return {"tokens": sums["tokens"]}
