"""Training loops over the package's envs: GRPO (rollout envs), SFT and DPO (dataset envs).

Each loop takes a :class:`~agile_llmenvs.specs.RunManifest` (its ``training`` section,
:class:`~agile_llmenvs.specs.TrainingSpec`, is the one config) and returns a
:class:`TrainResult`; metrics, a plot and checkpoints go to ``training.output_dir``.
The names import torch on first use, not with the package (the command line imports
``agile_llmenvs.training.command`` for ``--help``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agile_llmenvs._lazy import lazy_attributes

if TYPE_CHECKING:
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

__getattr__, __dir__ = lazy_attributes(
    __name__,
    globals(),
    {
        "CheckpointError": "agile_llmenvs.errors",
        "PolicyBatch": "agile_llmenvs.training.grpo",
        "TrainResult": "agile_llmenvs.training.common",
        "TrainingSpec": "agile_llmenvs.specs",
        "train_dpo": "agile_llmenvs.training.dpo",
        "train_grpo": "agile_llmenvs.training.grpo",
        "train_sft": "agile_llmenvs.training.sft",
    },
)
