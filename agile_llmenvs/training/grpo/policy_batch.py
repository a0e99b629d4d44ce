"""GRPO's training batch: every token sample of a rollout as right-padded tensors."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from agile_llmenvs.core import RolloutBatch, TokenSample
from agile_llmenvs.core.images import SampleImages

__all__ = ["PolicyBatch", "build_policy_batch"]


@dataclass(frozen=True)
class PolicyBatch:
    """One rank's rollouts as right-padded training tensors; one row per token sample.

    Attributes:
        input_ids_BT: Each sample's token ids, then pad ids.
        attention_mask_BT: 1 on the sample's tokens.
        action_mask_BT: ``[B, T - 1]``; True where the next token was sampled by the policy.
        sampling_logps_BT: ``[B, T - 1]``; the sampler's log-prob of that token (0 off the
            mask; NaN where the sampler gave none).
        advantages_B: The advantage of the episode each row belongs to; or, with
            turn-level credit, ``[B, T - 1]``: each target's turn's advantage (0 off the mask).
        images_B: The images each row shows (a vision-language policy's), with their
            tensors; empty when no row shows any.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    action_mask_BT: torch.Tensor
    sampling_logps_BT: torch.Tensor
    advantages_B: torch.Tensor
    images_B: tuple[SampleImages | None, ...] = ()

    @property
    def rows(self) -> int:
        """Rows (token samples) in the batch."""
        return int(self.input_ids_BT.shape[0])

    def to(self, device: torch.device | str) -> PolicyBatch:
        """The same batch on ``device``."""
        ids, attention, actions, sampling, advantages = (t.to(device) for t in self._tensors())
        return PolicyBatch(ids, attention, actions, sampling, advantages, self.images_B)

    def select(self, rows: slice) -> PolicyBatch:
        """``rows`` of the batch, cut to the longest of them (none: an empty batch)."""
        lengths = self.attention_mask_BT[rows].sum(dim=1)
        width = int(lengths.max().item()) if lengths.numel() else 2
        return PolicyBatch(
            self.input_ids_BT[rows, :width],
            self.attention_mask_BT[rows, :width],
            self.action_mask_BT[rows, : width - 1],
            self.sampling_logps_BT[rows, : width - 1],
            self.advantages_B[rows]
            if self.advantages_B.dim() == 1
            else self.advantages_B[rows, : width - 1],
            self.images_B[rows],
        )

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.input_ids_BT,
            self.attention_mask_BT,
            self.action_mask_BT,
            self.sampling_logps_BT,
            self.advantages_B,
        )


def build_policy_batch(
    rollout: RolloutBatch,
    advantages: torch.Tensor,
    pad_id: int,
    kept: Sequence[bool] | None = None,
    turn_advantages: Sequence[Sequence[float] | None] | None = None,
    extra_rows: Sequence[tuple[TokenSample, Sequence[float]]] = (),
) -> PolicyBatch:
    """Lay out every token sample of ``rollout``, with its episode's advantage.

    An episode restarted into several samples gives several rows sharing one advantage; a
    failed episode gives none, and neither does one whose ``kept`` is False (a member of a
    group left with fewer than two finished episodes). A turn the sampler gave no log-probs
    for has NaN there (:func:`grpo_update` scores it with the policy).

    With ``turn_advantages`` (one entry per trajectory: its advantage per turn, or None for
    the episode's), each sampled token gets its turn's advantage, through the sample's
    ``turn_ids``, and ``advantages_B`` is ``[B, T - 1]``. ``extra_rows`` (``tree``'s
    continuations) follow the rollout's rows, each with its per-turn advantages.

    Raises:
        ValueError: a sample's log-probs are neither one per sampled token nor absent.
    """
    samples, row_advantages, row_turns = [], [], []
    keep = kept if kept is not None else [True] * len(rollout.trajectories)
    per_turn = turn_advantages if turn_advantages is not None else [None] * len(keep)
    for trajectory, advantage, keep_it, turns in zip(
        rollout.trajectories, advantages.tolist(), keep, per_turn, strict=True
    ):
        if not keep_it:
            continue
        for sample in trajectory.episode.samples:
            samples.append(sample)
            row_advantages.append(advantage)
            row_turns.append(turns)
    for sample, turns in extra_rows:
        samples.append(sample)
        row_advantages.append(0.0)  # every sampled target takes its turn's value
        row_turns.append(turns)
    rows = len(samples)
    width = max((len(sample.token_ids) for sample in samples), default=2)
    padded = [(sample, width - len(sample.token_ids)) for sample in samples]
    # flat numpy buffers: torch.tensor on Python lists costs ~4x as much
    ids = _flat(((*s.token_ids, *(pad_id,) * pad) for s, pad in padded), np.int64)
    actions = _flat(((*s.action_mask, *(False,) * pad) for s, pad in padded), np.bool_)
    sampled = _flat((_sampled_logps(sample) for sample in samples), np.float32)
    input_ids = torch.from_numpy(ids).view(rows, width)
    action_mask = torch.from_numpy(actions).view(rows, width - 1)
    lengths = torch.tensor([len(sample.token_ids) for sample in samples])
    attention_mask = (torch.arange(width) < lengths[:, None]).long()
    sampling_logps = torch.zeros(rows, width - 1)
    # each row's sampled tokens, in order, are its mask's True positions, rows in order
    sampling_logps[action_mask] = torch.from_numpy(sampled)
    advantages_B = torch.tensor(row_advantages, dtype=torch.float32)
    if turn_advantages is not None:
        advantages_B = _token_advantages(samples, advantages_B, row_turns, action_mask)
    images = tuple(sample.images for sample in samples)
    images_B = images if any(images) else ()
    return PolicyBatch(
        input_ids, attention_mask, action_mask, sampling_logps, advantages_B, images_B
    )


def _token_advantages(
    samples: Sequence[TokenSample],
    advantages_B: torch.Tensor,
    turns: Sequence[Sequence[float] | None],
    action_mask_BT: torch.Tensor,
) -> torch.Tensor:
    """``[B, T - 1]``: each sampled target's turn's advantage (a row without per-turn values
    gets its episode's on every target), 0 off the mask."""
    rows, width = action_mask_BT.shape
    advantages_BT = advantages_B[:, None].expand(rows, width).clone()
    for row, (sample, values) in enumerate(zip(samples, turns, strict=True)):
        if values is None:
            continue
        turn_ids = torch.tensor(sample.turn_ids, dtype=torch.long).clamp(min=0)
        per_turn = torch.tensor(values, dtype=torch.float32)
        advantages_BT[row, : len(turn_ids)] = per_turn[turn_ids]
    return torch.where(action_mask_BT, advantages_BT, torch.zeros_like(advantages_BT))


def _sampled_logps(sample: TokenSample) -> Sequence[float]:
    """The sample's log-probs, one per sampled token (NaN for all when it has none)."""
    sampled = sum(sample.action_mask)
    if len(sample.sampling_logps) == sampled:
        return sample.sampling_logps
    if not sample.sampling_logps:
        return (math.nan,) * sampled
    raise ValueError(
        f"a token sample has {len(sample.sampling_logps)} sampling log-probs for {sampled} "
        "sampled tokens: give one per sampled token, or none (the trainer then scores them)"
    )


def _flat(rows: Iterable[Iterable[Any]], dtype: type) -> np.ndarray:
    """The rows' values, concatenated, as one numpy array."""
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype)
