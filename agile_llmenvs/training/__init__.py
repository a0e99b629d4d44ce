"""Training loops over the package's envs: GRPO (rollout envs), SFT and DPO (dataset envs).

Each loop takes a :class:`~agile_llmenvs.specs.RunManifest` (its ``training`` section,
:class:`~agile_llmenvs.specs.TrainingSpec`, is the one config, read once at the top of the run
into :class:`~agile_llmenvs.training.run.RunSettings`) and returns a :class:`TrainResult`;
metrics, a plot and checkpoints go to ``training.output_dir``.
The names import torch on first use, not with the package (the command line imports
``agile_llmenvs.training.command`` for ``--help``).

The sub-packages, each with its face in its ``__init__``:

* :mod:`~agile_llmenvs.training.grpo` -- GRPO: the loop, its setup, the update, the batch and
  the held-out evaluation.
* :mod:`~agile_llmenvs.training.supervised` -- SFT and DPO and the dataset loop they share.
* :mod:`~agile_llmenvs.training.credit` -- turn-level credit: advantages per turn, Monte-Carlo
  values of mid-episode states.
* :mod:`~agile_llmenvs.training.objective` -- the losses and the scored-token log-probs.
* :mod:`~agile_llmenvs.training.generation` -- what generates rollouts from the policy: the
  sampler, in-process vLLM engines, ``vllm serve`` processes and their weight syncs.
* :mod:`~agile_llmenvs.training.policy` -- the policy: loading, LoRA, FSDP2 sharding, the
  optimizer, one learning step, CPU threads.
* :mod:`~agile_llmenvs.training.run` -- the run and its folder: its settings, the record
  every loop keeps (``RunBook``), checkpoints, metrics, trackers, the rollout log, progress,
  signals, env failures, the result.

Weights outside the trainer (checkpoint folders, sync folders, the vLLM worker side) are
:mod:`agile_llmenvs.weights`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agile_llmenvs._lazy import lazy_attributes

if TYPE_CHECKING:
    from agile_llmenvs.errors import CheckpointError
    from agile_llmenvs.specs import TrainingSpec
    from agile_llmenvs.training.grpo import PolicyBatch, train_grpo
    from agile_llmenvs.training.run import TrainResult
    from agile_llmenvs.training.supervised import train_dpo, train_sft

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
        "TrainResult": "agile_llmenvs.training.run",
        "TrainingSpec": "agile_llmenvs.specs",
        "train_dpo": "agile_llmenvs.training.supervised",
        "train_grpo": "agile_llmenvs.training.grpo",
        "train_sft": "agile_llmenvs.training.supervised",
    },
)
