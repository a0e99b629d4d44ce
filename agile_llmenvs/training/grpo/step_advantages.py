"""The advantages of one GRPO step: GRPO's over each group, and each turn's share under
``training.credit`` (docs/training.md#turn-level-credit)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from agile_llmenvs.core import RolloutBatch
from agile_llmenvs.training.credit import (
    AnchorSettings,
    StateValues,
    TurnAdvantages,
    batch_turn_advantages,
)
from agile_llmenvs.training.credit.tree import tree_turn_advantages
from agile_llmenvs.training.objective import group_advantages, reward_scale
from agile_llmenvs.training.run import RunSettings

__all__ = ["step_advantages", "sum_over_processes"]


def step_advantages(
    settings: RunSettings,
    accelerator: Any,
    rollout: RolloutBatch,
    rewards_GN: torch.Tensor,
    trained_GN: torch.Tensor,
    values: StateValues | None,
) -> tuple[torch.Tensor, torch.Tensor, TurnAdvantages | None]:
    """GRPO's episode advantages over the members that train, which of them are kept, and
    (``credit`` other than ``episode``) each turn's share, with ``tree``'s continuation rows
    (docs/training.md).

    Args:
        settings: The run's settings (``credit``, ``scale_rewards``, ``anchor``).
        accelerator: The run's accelerator (the batch's groups are spread over its
            processes).
        rollout: The step's batch.
        rewards_GN: Its episode returns.
        trained_GN: The members that may train (finished, and fresh).
        values: ``turn_mc`` / ``tree``: the values of the batch's states and its
            continuations.
    """
    over_processes = sum_over_processes(accelerator)
    advantages_GN, kept_GN = group_advantages(
        rewards_GN,
        scale=settings.scale_rewards,
        finished_GN=trained_GN,
        sum_over_processes=over_processes,
    )
    if settings.credit == "episode":
        return advantages_GN, kept_GN, None
    scale_G1 = reward_scale(
        rewards_GN,
        scale=settings.scale_rewards,
        finished_GN=trained_GN,
        sum_over_processes=over_processes,
    )
    if settings.credit == "tree":
        turns = tree_turn_advantages(
            rollout.trajectories,
            rewards_GN,
            kept_GN,
            scale_G1,
            values.branches if values is not None else [],
            normalise=settings.scale_rewards != "none",
            batch_scale=settings.scale_rewards == "batch",
            sum_over_processes=over_processes,
        )
        return advantages_GN, kept_GN, turns
    turns = batch_turn_advantages(
        settings.credit,
        rollout.trajectories,
        rewards_GN,
        advantages_GN,
        kept_GN,
        scale_G1,
        values.values if values is not None else None,
        anchor=settings.anchor or AnchorSettings(),
        normalise=settings.scale_rewards != "none",
        batch_scale=settings.scale_rewards == "batch",
        sum_over_processes=over_processes,
    )
    return advantages_GN, kept_GN, turns


def sum_over_processes(accelerator: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Sums a CPU tensor over processes: each holds only its share of the batch's groups
    (``None`` on one process, which holds them all)."""
    if accelerator.num_processes == 1:
        return None

    def total(tensor: torch.Tensor) -> torch.Tensor:
        return accelerator.reduce(tensor.to(accelerator.device), reduction="sum").cpu()

    return total
