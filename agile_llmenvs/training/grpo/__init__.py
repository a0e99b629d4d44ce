"""GRPO on a rollout env: :func:`train_grpo` (the loop), its setup and rollout envs, the
learning phase (its settings, :class:`UpdateSettings`, are the run's part of them), the
training batch and the evaluation on held-out tasks."""

from __future__ import annotations

from agile_llmenvs.training.grpo.envs import RolloutEnvs
from agile_llmenvs.training.grpo.held_out import EVAL_METRICS, EVAL_SEED_OFFSET, HeldOutEval
from agile_llmenvs.training.grpo.loop import GRPO_METRICS, train_grpo
from agile_llmenvs.training.grpo.policy_batch import PolicyBatch, build_policy_batch
from agile_llmenvs.training.grpo.setup import GRPORun, setup_run, step_seed
from agile_llmenvs.training.grpo.update import GRPO_UPDATE_METRICS, grpo_update
from agile_llmenvs.training.run import UpdateSettings

__all__ = [
    "EVAL_METRICS",
    "EVAL_SEED_OFFSET",
    "GRPO_METRICS",
    "GRPO_UPDATE_METRICS",
    "GRPORun",
    "HeldOutEval",
    "PolicyBatch",
    "RolloutEnvs",
    "UpdateSettings",
    "build_policy_batch",
    "grpo_update",
    "setup_run",
    "step_seed",
    "train_grpo",
]
