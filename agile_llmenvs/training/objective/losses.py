"""The objectives as pure tensor functions: advantages, per-token losses and their weights.

Shape suffixes: ``G`` groups, ``N`` group members, ``B`` rows, ``T`` positions.

A learning step's loss is always ``sum over the batch's scored tokens of weight * loss``;
the weights (:func:`token_weights`) carry the normalisation, so splitting a batch into
micro-batches, or over processes, leaves the sum, and the gradient, unchanged (for every loss
type but ``bnpo``, which TRL normalises by each micro-batch's own tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "LossType",
    "PolicyTokenLoss",
    "ScaleRewards",
    "TokenCounts",
    "approx_kl",
    "dpo_loss",
    "group_advantages",
    "group_means",
    "group_rewards",
    "policy_token_loss",
    "reward_scale",
    "token_weights",
]

LossType = Literal["grpo", "dapo", "dr_grpo", "bnpo"]
"""How GRPO's per-token losses are averaged; see :func:`token_weights`."""

ScaleRewards = Literal["group", "batch", "none"]
"""What GRPO's advantages are divided by (TRL's ``scale_rewards``); see :func:`group_advantages`."""


def group_rewards(rewards: Sequence[float], group_size: int) -> torch.Tensor:
    """Episode rewards as ``[G, N]`` groups, in float64: rewards that differ far below a
    float32's resolution at their size (100.0 against 100.00001) keep their difference, so
    their group's advantages keep its sign and size."""
    return torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)


def group_advantages(
    rewards_GN: torch.Tensor,
    *,
    scale: ScaleRewards,
    finished_GN: torch.Tensor | None = None,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
    eps: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's group-relative advantage: ``r - mean(group)``, divided by ``std + eps`` as
    TRL's ``scale_rewards`` says.

    ``scale`` picks the std: ``group``, that of the member's group; ``batch``, that of every
    kept reward of the global batch, about the batch's mean (not the groups'); ``none``, no
    division. Both are Bessel-corrected (``n - 1``), as ``torch.std`` and TRL's ``nanstd``.

    Only the members that finished count: a member whose env failed has no reward (its 0 is
    not a score), so the group's mean and std are over the others, and a group left with fewer
    than two finished members carries no comparison and is dropped (nor does its lone member
    count in the batch's std).

    Args:
        rewards_GN: Rewards, one row per group.
        scale: ``group``, ``batch`` or ``none``.
        finished_GN: True for members that finished (default: all of them).
        sum_over_processes: Sums a tensor over the processes holding the rest of the batch,
            for ``batch`` (default: this process holds all of it).
        eps: Keeps a group of equal rewards at advantage 0 instead of 0/0 (TRL's ``1e-4``).

    Returns:
        ``(advantages_GN, kept_GN)``: advantages (0 where not kept), and which members train:
        the finished members of groups with at least two of them.
    """
    if finished_GN is None:
        finished_GN = torch.ones_like(rewards_GN, dtype=torch.bool)
    mean_G1, kept_GN = group_means(rewards_GN, finished_GN)
    centred_GN = (rewards_GN - mean_G1) * finished_GN.to(rewards_GN.dtype)
    centred_GN = centred_GN / reward_scale(
        rewards_GN,
        scale=scale,
        finished_GN=finished_GN,
        sum_over_processes=sum_over_processes,
        eps=eps,
    )
    return torch.where(kept_GN, centred_GN, torch.zeros_like(centred_GN)), kept_GN


def group_means(
    rewards_GN: torch.Tensor, finished_GN: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's mean reward over its finished members (``[G, 1]``), and which members
    train: the finished members of groups with at least two of them."""
    weight_GN = finished_GN.to(rewards_GN.dtype)
    count_G1 = weight_GN.sum(dim=1, keepdim=True)
    mean_G1 = (rewards_GN * weight_GN).sum(dim=1, keepdim=True) / count_G1.clamp(min=1.0)
    return mean_G1, finished_GN & (count_G1 >= 2)


def reward_scale(
    rewards_GN: torch.Tensor,
    *,
    scale: ScaleRewards,
    finished_GN: torch.Tensor | None = None,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
    eps: float = 1e-4,
) -> torch.Tensor:
    """What :func:`group_advantages` divides each group's centred rewards by (``[G, 1]``, or
    a scalar for ``batch``): the std ``scale`` names plus ``eps``, or 1 for ``none``.

    Raises:
        ValueError: ``scale`` is not ``group``, ``batch`` or ``none``.
    """
    if finished_GN is None:
        finished_GN = torch.ones_like(rewards_GN, dtype=torch.bool)
    mean_G1, kept_GN = group_means(rewards_GN, finished_GN)
    weight_GN = finished_GN.to(rewards_GN.dtype)
    if scale == "group":
        count_G1 = weight_GN.sum(dim=1, keepdim=True)
        centred_GN = (rewards_GN - mean_G1) * weight_GN
        variance_G1 = (centred_GN**2).sum(dim=1, keepdim=True) / (count_G1 - 1).clamp(min=1.0)
        return variance_G1.sqrt() + eps
    if scale == "batch":
        return _batch_std(rewards_GN, kept_GN, sum_over_processes) + eps
    if scale != "none":
        raise ValueError(f"unknown scale {scale!r}: expected 'group', 'batch' or 'none'")
    return torch.ones_like(mean_G1)


def _batch_std(
    rewards_GN: torch.Tensor,
    kept_GN: torch.Tensor,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """The Bessel-corrected std of the kept rewards of every process, about their mean.

    Two sums over processes, the count and total first, then the squared deviations from the
    mean: a one-pass ``sum(r^2) - n * mean^2`` would cancel away rewards that differ far below
    their size."""
    total = sum_over_processes or (lambda tensor: tensor)
    weight_GN = kept_GN.to(rewards_GN.dtype)
    count, reward_sum = total(torch.stack([weight_GN.sum(), (rewards_GN * weight_GN).sum()]))
    mean = reward_sum / count.clamp(min=1.0)
    squares = total((((rewards_GN - mean) * weight_GN) ** 2).sum().reshape(1))[0]
    return (squares / (count - 1).clamp(min=1.0)).sqrt()


@dataclass(frozen=True)
class TokenCounts:
    """What a loss type normalises by, counted over one optimizer step's batch.

    Attributes:
        rows: Sequences in the global batch (every process).
        tokens: Sampled tokens in the global batch.
        processes: Processes the batch is spread over.
        micro_batches: Micro-batches the step accumulates: the most any process runs (TRL's
            gradient accumulation steps; a process with fewer runs the rest as empty ones).
        max_completion_tokens: ``dr_grpo``'s constant length of a completion.
    """

    rows: int
    tokens: int
    processes: int
    micro_batches: int
    max_completion_tokens: int


def token_weights(
    loss_type: LossType, action_mask_BT: torch.Tensor, counts: TokenCounts
) -> torch.Tensor:
    """Each sampled token's weight in the global loss ``sum(weight * per-token loss)``.

    With ``n_b`` the sampled tokens of row ``b``, ``R`` the rows and ``N`` the sampled tokens
    of the global batch, ``P`` the processes, ``A`` the step's micro-batches and ``n_m`` the
    sampled tokens of this micro-batch (``action_mask_BT``'s):

    - ``grpo``: ``1 / (R * n_b)``: a mean over each sequence's tokens, then over sequences;
    - ``dapo``: ``1 / N``: a mean over every sampled token of the global batch;
    - ``dr_grpo``: ``1 / (R * max_completion_tokens)``: a sum over tokens over a constant;
    - ``bnpo``: ``1 / (P * A * n_m)``: TRL's mean over each micro-batch's tokens, divided by
      the accumulation steps, then averaged over processes (as DDP averages gradients).

    Args:
        loss_type: The normalisation.
        action_mask_BT: The micro-batch's sampled tokens.
        counts: The optimizer step's counts.

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
        micro_tokens = mask_BT.sum().clamp(min=1.0)  # a tensor: no wait for the device
        return mask_BT / (counts.processes * counts.micro_batches * micro_tokens)
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
    # one advantage per row (the episode's), or per token (turn-level credit)
    advantages_BT = advantages_B[:, None] if advantages_B.dim() == 1 else advantages_B
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
