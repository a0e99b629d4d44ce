"""The objectives as pure tensor functions: advantages, token log-probs and the three losses.

Shape suffixes: ``G`` groups, ``N`` group members, ``B`` rows, ``T`` positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from agile_llmenvs.llm_envs.dataset_env import SFTBatch

__all__ = [
    "approx_kl",
    "clipped_policy_loss",
    "dpo_loss",
    "group_advantages",
    "masked_mean",
    "sequence_logps",
    "sft_loss",
    "token_logps",
]


def group_advantages(rewards_GN: torch.Tensor, *, scale: bool, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-relative advantage: ``r - mean(group)``, optionally ``/ (std(group) + eps)``.

    Args:
        rewards_GN: Rewards, one row per group.
        scale: Divide by the group's (population) standard deviation.
        eps: Keeps a group of equal rewards at advantage 0 instead of 0/0.

    Returns:
        Advantages, shaped like ``rewards_GN``.
    """
    centred_GN = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    if not scale:
        return centred_GN
    return centred_GN / (rewards_GN.std(dim=1, unbiased=False, keepdim=True) + eps)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is true (0 when nothing is masked in)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def token_logps(model: Any, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> Any:
    """Log-probability of every next token under ``model``: ``[B, T - 1]``.

    Position ``t`` scores ``input_ids_BT[:, t + 1]``, matching the harness's next-token
    aligned ``action_mask``.
    """
    logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT).logits
    logps_BTV = torch.log_softmax(logits_BTV[:, :-1].float(), dim=-1)
    return logps_BTV.gather(-1, input_ids_BT[:, 1:, None])[..., 0]


def clipped_policy_loss(
    logps_BT: torch.Tensor,
    sampling_logps_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    action_mask_BT: torch.Tensor,
    *,
    clip_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, averaged over every sampled token of the batch.

    ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)`` with ``ratio = exp(logp -
    sampling_logp)``: the sampler's log-prob is the behaviour policy, so the ratio also
    corrects any mismatch between the generation and the training forward pass.

    Returns:
        The loss, and the fraction of sampled tokens whose ratio was clipped.
    """
    ratio_BT = torch.exp(logps_BT - sampling_logps_BT)
    advantages_BT = advantages_B[:, None]
    unclipped_BT = ratio_BT * advantages_BT
    clipped_BT = torch.clamp(ratio_BT, 1.0 - clip_eps, 1.0 + clip_eps) * advantages_BT
    loss = masked_mean(-torch.minimum(unclipped_BT, clipped_BT), action_mask_BT)
    clip_fraction = masked_mean((unclipped_BT != clipped_BT).float(), action_mask_BT)
    return loss, clip_fraction.detach()


def approx_kl(
    logps_BT: torch.Tensor, ref_logps_BT: torch.Tensor, action_mask_BT: torch.Tensor
) -> torch.Tensor:
    """The k3 estimator of KL(policy || reference), ``exp(d) - d - 1`` with ``d = ref - logp``,
    averaged over sampled tokens (non-negative, unbiased for on-policy samples)."""
    delta_BT = ref_logps_BT - logps_BT
    return masked_mean(torch.exp(delta_BT) - delta_BT - 1.0, action_mask_BT)


def sft_loss(model: Any, batch: SFTBatch) -> torch.Tensor:
    """Cross-entropy of the response tokens (labels not ``-100``), a mean over tokens."""
    logps_BT = token_logps(model, batch.input_ids, batch.attention_mask)
    labels_BT = batch.labels[:, 1:]
    return -masked_mean(logps_BT, labels_BT != -100)


def sequence_logps(
    model: Any, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, labels_BT: Any
) -> torch.Tensor:
    """Sum of the log-probs of each row's labelled (response) tokens: ``[B]``."""
    logps_BT = token_logps(model, input_ids_BT, attention_mask_BT)
    mask_BT = (labels_BT[:, 1:] != -100).to(logps_BT.dtype)
    return (logps_BT * mask_BT).sum(dim=1)


def dpo_loss(
    chosen_logps_B: torch.Tensor,
    rejected_logps_B: torch.Tensor,
    ref_chosen_logps_B: torch.Tensor,
    ref_rejected_logps_B: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sigmoid DPO loss ``-log sigmoid(beta * margin)``, a mean over rows.

    ``margin = (logp_c - ref_c) - (logp_r - ref_r)``: how much more the policy than the
    reference prefers the chosen response.

    Returns:
        The loss, and the mean margin (detached).
    """
    margin_B = (chosen_logps_B - ref_chosen_logps_B) - (rejected_logps_B - ref_rejected_logps_B)
    loss = -torch.nn.functional.logsigmoid(beta * margin_B).mean()
    return loss, margin_B.mean().detach()
