"""Training loops over the package's envs: GRPO (rollout envs), SFT and DPO (dataset envs).

Each loop takes a :class:`~agile_llmenvs.specs.RunManifest` (its ``training`` section,
:class:`~agile_llmenvs.specs.TrainingSpec`, is the one config) and returns a
:class:`TrainResult`; metrics, a plot and checkpoints go to ``training.output_dir``.
"""

from __future__ import annotations

from agile_llmenvs.errors import CheckpointError
from agile_llmenvs.specs import TrainingSpec
from agile_llmenvs.training.common import TrainResult
from agile_llmenvs.training.dpo import train_dpo
from agile_llmenvs.training.grpo import PolicyBatch, train_grpo
from agile_llmenvs.training.sft import train_sft

__all__ = [
    "CheckpointError",
    "PolicyBatch",
    "TrainResult",
    "TrainingSpec",
    "train_dpo",
    "train_grpo",
    "train_sft",
]
