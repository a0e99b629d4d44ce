"""The objectives as pure tensor functions: advantages, per-token losses and their weights.

Shape suffixes: ``G`` groups, ``N`` group members, ``B`` rows, ``T`` positions.

A learning step's loss is always ``sum over the batch's scored tokens of weight * loss``;
the weights (:func:`token_weights`) carry the normalisation, so splitting a batch into
micro-batches, or over processes, leaves the sum, and the gradient, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "LossType",
    "PolicyTokenLoss",
    "TokenCounts",
    "approx_kl",
    "dpo_loss",
    "group_advantages",
    "group_rewards",
    "policy_token_loss",
    "token_weights",
]

LossType = Literal["grpo", "dapo", "dr_grpo", "bnpo"]
"""How GRPO's per-token losses are averaged; see :func:`token_weights`."""


def group_rewards(rewards: Sequence[float], group_size: int) -> torch.Tensor:
    """Episode rewards as ``[G, N]`` groups, in float64: rewards that differ far below a
    float32's resolution at their size (100.0 against 100.00001) keep their difference, so
    their group's advantages keep its sign and size."""
    return torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)


def group_advantages(
    rewards_GN: torch.Tensor,
    *,
    scale: bool,
    finished_GN: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's group-relative advantage: ``r - mean(group)``, optionally ``/ (std(group) + eps)``.

    Only the members that finished count: a member whose env failed has no reward (its 0 is
    not a score), so the group's mean and std are over the others, and a group left with fewer
    than two finished members carries no comparison and is dropped.

    Args:
        rewards_GN: Rewards, one row per group.
        scale: Divide by the group's (population) standard deviation.
        finished_GN: True for members that finished (default: all of them).
        eps: Keeps a group of equal rewards at advantage 0 instead of 0/0.

    Returns:
        ``(advantages_GN, kept_GN)``: advantages (0 where not kept), and which members train:
        the finished members of groups with at least two of them.
    """
    if finished_GN is None:
        finished_GN = torch.ones_like(rewards_GN, dtype=torch.bool)
    weight_GN = finished_GN.to(rewards_GN.dtype)
    count_G1 = weight_GN.sum(dim=1, keepdim=True)
    kept_GN = finished_GN & (count_G1 >= 2)
    mean_G1 = (rewards_GN * weight_GN).sum(dim=1, keepdim=True) / count_G1.clamp(min=1.0)
    centred_GN = (rewards_GN - mean_G1) * weight_GN
    if scale:
        variance_G1 = (centred_GN**2).sum(dim=1, keepdim=True) / count_G1.clamp(min=1.0)
        centred_GN = centred_GN / (variance_G1.sqrt() + eps)
    return torch.where(kept_GN, centred_GN, torch.zeros_like(centred_GN)), kept_GN


@dataclass(frozen=True)
class TokenCounts:
    """What a loss type normalises by, counted over one optimizer step's batch.

    Attributes:
        rows: Sequences in the global batch (every process).
        tokens: Sampled tokens in the global batch.
        local_tokens: Sampled tokens in this process's share.
        processes: Processes the batch is spread over.
        max_completion_tokens: ``dr_grpo``'s constant length of a completion.
    """

    rows: int
    tokens: int
    local_tokens: int
    processes: int
    max_completion_tokens: int


def token_weights(
    loss_type: LossType, action_mask_BT: torch.Tensor, counts: TokenCounts
) -> torch.Tensor:
    """Each sampled token's weight in the global loss ``sum(weight * per-token loss)``.

    With ``n_b`` the sampled tokens of row ``b``, ``R`` the rows and ``N`` the sampled tokens
    of the global batch, ``N_p`` those of this process and ``P`` the processes:

    - ``grpo``: ``1 / (R * n_b)``: a mean over each sequence's tokens, then over sequences;
    - ``dapo``: ``1 / N``: a mean over every sampled token of the global batch;
    - ``dr_grpo``: ``1 / (R * max_completion_tokens)``: a sum over tokens over a constant;
    - ``bnpo``: ``1 / (P * N_p)``: a mean over this process's tokens, then over processes.

    Returns:
        ``[B, T - 1]`` weights, zero off the action mask.
    """
    mask_BT = action_mask_BT.to(torch.float32)
    if loss_type == "grpo":
        per_row_B1 = mask_BT.sum(dim=1, keepdim=True).clamp(min=1.0)
        return mask_BT / (per_row_B1 * max(counts.rows, 1))
    if loss_type == "dapo":
        return mask_BT / max(counts.tokens, 1)
    if loss_type == "dr_grpo":
        return mask_BT / (max(counts.rows, 1) * counts.max_completion_tokens)
    if loss_type == "bnpo":
        return mask_BT / (counts.processes * max(counts.local_tokens, 1))
    raise ValueError(f"unknown loss_type {loss_type!r}")


@dataclass(frozen=True)
class PolicyTokenLoss:
    """GRPO's per-token loss and what it reports; every ``_BT`` tensor is ``[B, T - 1]``.

    Attributes:
        loss_BT: ``-min(ratio * A, clip(ratio) * A) + beta * kl``.
        ratio_BT: The importance ratio ``exp(logp - sampling_logp)`` (detached).
        clipped_BT: True where the clip removed the token's gradient: ratio above ``1 + eps``
            with a positive advantage, or below ``1 - eps`` with a negative one.
        kl_BT: The k3 estimate of KL(policy || reference) (detached; zero without one).
    """

    loss_BT: torch.Tensor
    ratio_BT: torch.Tensor
    clipped_BT: torch.Tensor
    kl_BT: torch.Tensor


def policy_token_loss(
    logps_BT: torch.Tensor,
    sampling_logps_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    *,
    clip_eps: float,
    ref_logps_BT: torch.Tensor | None = None,
    beta: float = 0.0,
) -> PolicyTokenLoss:
    """PPO's clipped surrogate per token, plus ``beta`` times a k3 KL to a reference.

    The sampler's log-prob is the behaviour policy, so the ratio also corrects any mismatch
    between the generation and the training forward pass.
    """
    ratio_BT = torch.exp(logps_BT - sampling_logps_BT)
    advantages_BT = advantages_B[:, None]
    unclipped_BT = ratio_BT * advantages_BT
    clipped_term_BT = torch.clamp(ratio_BT, 1.0 - clip_eps, 1.0 + clip_eps) * advantages_BT
    loss_BT = -torch.minimum(unclipped_BT, clipped_term_BT)
    kl_BT = torch.zeros_like(loss_BT)
    if ref_logps_BT is not None:
        kl_BT = approx_kl(logps_BT, ref_logps_BT)
        loss_BT = loss_BT + beta * kl_BT
    ratio = ratio_BT.detach()
    clipped_BT = ((ratio > 1.0 + clip_eps) & (advantages_BT > 0)) | (
        (ratio < 1.0 - clip_eps) & (advantages_BT < 0)
    )
    return PolicyTokenLoss(loss_BT, ratio, clipped_BT, kl_BT.detach())


def approx_kl(logps_BT: torch.Tensor, ref_logps_BT: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy || reference) per token, ``exp(d) - d - 1`` with
    ``d = ref - logp`` (non-negative, unbiased for on-policy samples)."""
    delta_BT = ref_logps_BT - logps_BT
    return torch.exp(delta_BT) - delta_BT - 1.0


def dpo_loss(
    chosen_logps_B: torch.Tensor,
    rejected_logps_B: torch.Tensor,
    ref_chosen_logps_B: torch.Tensor,
    ref_rejected_logps_B: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sigmoid DPO loss ``-log sigmoid(beta * margin)`` per row.

    ``margin = (logp_c - ref_c) - (logp_r - ref_r)``: how much more the policy than the
    reference prefers the chosen response.

    Returns:
        The loss of each row, and each row's margin (detached).
    """
    margin_B = (chosen_logps_B - ref_chosen_logps_B) - (rejected_logps_B - ref_rejected_logps_B)
    return -torch.nn.functional.logsigmoid(beta * margin_B), margin_B.detach()
