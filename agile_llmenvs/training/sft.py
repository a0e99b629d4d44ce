"""Supervised fine-tuning: cross-entropy of the response tokens of each dataset row."""

from __future__ import annotations

from typing import Any

import torch

from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training.common import TrainResult
from agile_llmenvs.training.losses import sft_loss
from agile_llmenvs.training.supervised import LossFn, train_on_dataset

__all__ = ["SFT_METRICS", "train_sft"]

#: The columns of an SFT run's ``metrics.csv``, in order.
SFT_METRICS = ("step", "loss", "grad_norm", "tokens", "step_time_s")


def train_sft(manifest: RunManifest, *, resume: bool = False) -> TrainResult:
    """Fine-tune the manifest's model on its SFT dataset env (masked cross-entropy).

    Args:
        manifest: A manifest with ``env_type: dataset``, ``objective: sft`` and
            ``training.algorithm: sft``.
        resume: Continue from the checkpoint in ``output_dir``.
    """
    return train_on_dataset(
        manifest, resume=resume, name="sft", metric_keys=SFT_METRICS, make_loss=_make_loss
    )


def _make_loss(model: Any, accelerator: Any) -> LossFn:
    def loss_fn(model: Any, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        tokens = float((batch.labels[:, 1:] != -100).sum())
        return sft_loss(model, batch), {"tokens": tokens}

    return loss_fn
