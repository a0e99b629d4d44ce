"""Turn-level credit (``training.credit``): how an episode's advantage is shared among its
turns, the Monte-Carlo values of mid-episode states that ``turn_mc`` measures them by, and
``tree``'s advantages, which train the continuations too (:mod:`.tree`)."""

from __future__ import annotations

from agile_llmenvs.training.credit.advantages import (
    AnchorSettings,
    TurnAdvantages,
    anchor_key,
    anchor_signal,
    anchor_turn_advantages,
    batch_turn_advantages,
    mc_segments,
    mc_turn_advantages,
    returns_to_go,
    turn_scale,
)
from agile_llmenvs.training.credit.turn_values import (
    BranchTextEnv,
    CreditSettings,
    StateValues,
    TurnCheckpoints,
    collector_checkpoints,
    estimate_values,
    within_budget,
)

__all__ = [
    "AnchorSettings",
    "BranchTextEnv",
    "CreditSettings",
    "StateValues",
    "TurnAdvantages",
    "TurnCheckpoints",
    "anchor_key",
    "anchor_signal",
    "anchor_turn_advantages",
    "batch_turn_advantages",
    "collector_checkpoints",
    "estimate_values",
    "mc_segments",
    "mc_turn_advantages",
    "returns_to_go",
    "turn_scale",
    "within_budget",
]
