"""What a learning step optimises: the losses as tensor functions (advantages, per-token losses
and their weights, DPO's), and the log-probs of the scored tokens they take."""

from __future__ import annotations

from agile_llmenvs.training.objective.logit_transform import LogitTransform, probe_logit_transform
from agile_llmenvs.training.objective.logprobs import (
    DEFAULT_CHUNK_TOKENS,
    ScoredLogps,
    probe_once,
    scored_token_logps,
)
from agile_llmenvs.training.objective.losses import (
    LossType,
    PolicyTokenLoss,
    ScaleRewards,
    TokenCounts,
    approx_kl,
    dpo_loss,
    group_advantages,
    group_means,
    group_rewards,
    policy_token_loss,
    reward_scale,
    token_weights,
)

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "LogitTransform",
    "LossType",
    "PolicyTokenLoss",
    "ScaleRewards",
    "ScoredLogps",
    "TokenCounts",
    "approx_kl",
    "dpo_loss",
    "group_advantages",
    "group_means",
    "group_rewards",
    "policy_token_loss",
    "probe_logit_transform",
    "probe_once",
    "reward_scale",
    "scored_token_logps",
    "token_weights",
]
