"""Turn-level credit: how an episode's advantage is shared among its turns (``training.credit``).

Shape suffixes as in :mod:`~agile_llmenvs.training.objective.losses`. An episode of ``T`` turns has
rewards ``r_0 .. r_{T-1}`` and states ``s_0 .. s_T``: ``s_t`` is what turn ``t`` acts from
(``s_0`` the reset's), ``s_T`` the end. Every function here returns one advantage per turn,
already divided by the scale ``scale_rewards`` picks for the episode's group, so an episode
whose turns all share one value gets exactly GRPO's advantage.

* ``turn_mc`` (:func:`mc_turn_advantages`): ``V(s_t)`` is the mean return of continuations
  branched from ``s_t``; ``V(s_0)`` is the group's mean return (the group's members are its
  continuations) and ``V(s_T) = 0``. Between consecutive valued states ``b < c`` the turns
  ``b .. c-1`` share ``A = (r_b + ... + r_{c-1} + V(s_c) - V(s_b)) / scale``: with every state
  valued, ``A_t = (r_t + V(s_{t+1}) - V(s_t)) / scale``; with none, GRPO's ``(R - mean) / scale``.
* ``anchor`` (:func:`anchor_turn_advantages`, GiGPO-style, no extra rollouts): turns of a
  group's episodes that act from the same observation (the same ids since the previous action)
  form an anchor group; ``A_t = A_episode + (G_t - mean G over the anchor group) / scale``,
  with ``G_t = r_t + ... + r_{T-1}`` the return to go; a turn alone in its anchor group keeps
  ``A_episode``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from agile_llmenvs.core import TokenSample, Trajectory

__all__ = [
    "TurnAdvantages",
    "anchor_key",
    "anchor_turn_advantages",
    "batch_turn_advantages",
    "mc_turn_advantages",
    "returns_to_go",
]


def returns_to_go(rewards: Sequence[float]) -> list[float]:
    """``G_t = r_t + ... + r_{T-1}`` for each turn (undiscounted)."""
    total, out = 0.0, []
    for reward in reversed(rewards):
        total += reward
        out.append(total)
    return out[::-1]


def mc_turn_advantages(
    rewards: Sequence[float], values: Mapping[int, float], baseline: float, scale: float
) -> list[float]:
    """One episode's per-turn advantages from Monte-Carlo state values (``turn_mc``).

    Args:
        rewards: The episode's per-turn rewards, ``T`` of them.
        values: ``V(s_t)`` of the branched states, by ``t`` (``0 < t < T``; others ignored).
        baseline: ``V(s_0)``: the mean return of the episode's group.
        scale: What the advantages are divided by (``scale_rewards``'s std plus eps, or 1).

    Returns:
        ``T`` advantages, turn by turn.
    """
    turns = len(rewards)
    cuts = [0, *sorted(t for t in values if 0 < t < turns), turns]
    value = {0: baseline, turns: 0.0, **{t: values[t] for t in cuts[1:-1]}}
    advantages: list[float] = []
    for start, end in pairwise(cuts):
        segment = (sum(rewards[start:end]) + value[end] - value[start]) / scale
        advantages.extend([segment] * (end - start))
    return advantages


def anchor_key(samples: Sequence[TokenSample], turn: int) -> tuple[int, ...]:
    """The ids turn ``turn`` of an episode (its ``samples``) acts from, since the previous
    turn's last sampled id in the same sample (from the sample's start for its first turn):
    the observation the policy was shown, token-exact.

    Raises:
        ValueError: no sample holds ``turn``.
    """
    for sample in samples:
        if turn not in sample.turn_ids:
            continue
        first = sample.turn_ids.index(turn)  # the position describing its first sampled id
        previous = max((i for i in range(first) if 0 <= sample.turn_ids[i] < turn), default=None)
        return tuple(sample.token_ids[0 if previous is None else previous + 2 : first + 1])
    raise ValueError(f"no sample of the episode holds turn {turn}")


def anchor_turn_advantages(
    groups: Sequence[Sequence[tuple[Sequence[float], Sequence[tuple[int, ...]]] | None]],
    episode_advantages: Sequence[Sequence[float]],
    scales: Sequence[float],
) -> list[list[list[float] | None]]:
    """Per-turn advantages of every member of every group by anchor state (``anchor``).

    Args:
        groups: Per group, per member: ``(rewards per turn, anchor key per turn)``, or None for
            a member that keeps its episode advantage (failed, or several samples).
        episode_advantages: Per group, per member: GRPO's advantage.
        scales: Per group: what its advantages are divided by.

    Returns:
        Per group, per member: the advantage of each turn, or None where ``groups`` had None.
    """
    out: list[list[list[float] | None]] = []
    for members, advantages, scale in zip(groups, episode_advantages, scales, strict=True):
        anchored: defaultdict[tuple[int, ...], list[float]] = defaultdict(list)
        to_go: list[list[float] | None] = []
        for member in members:
            if member is None:
                to_go.append(None)
                continue
            rewards, keys = member
            returns = returns_to_go(rewards)
            to_go.append(returns)
            for key, value in zip(keys, returns, strict=True):
                anchored[key].append(value)
        group: list[list[float] | None] = []
        for member, member_to_go, advantage in zip(members, to_go, advantages, strict=True):
            if member is None or member_to_go is None:
                group.append(None)
                continue
            turns = []
            for key, value in zip(member[1], member_to_go, strict=True):
                peers = anchored[key]
                step = (value - sum(peers) / len(peers)) / scale if len(peers) > 1 else 0.0
                turns.append(advantage + step)
            group.append(turns)
        out.append(group)
    return out


@dataclass(frozen=True)
class TurnAdvantages:
    """A batch's per-turn advantages (one entry per trajectory: its turns', or None where the
    episode's advantage stands) and the episodes that fell back to it."""

    per_turn: list[list[float] | None]
    fallback_episodes: int


def batch_turn_advantages(
    credit: str,
    trajectories: Sequence[Trajectory],
    rewards_GN: torch.Tensor,
    advantages_GN: torch.Tensor,
    kept_GN: torch.Tensor,
    scale_G1: torch.Tensor,
    values: Mapping[int, Mapping[int, float]] | None = None,
) -> TurnAdvantages:
    """Per-turn advantages of a GRPO batch for ``credit`` (``turn_mc`` or ``anchor``).

    Only kept episodes of two or more turns get per-turn values (each sample's tokens through
    its ``turn_ids``, which count the episode's turns); a ``turn_mc`` one whose slot has no
    valued state (its env could not branch) falls back to its episode advantage and is
    counted.

    Args:
        credit: ``turn_mc`` or ``anchor``.
        trajectories: The batch, ``[G * N]`` in group order.
        rewards_GN: Episode returns.
        advantages_GN: GRPO's episode advantages.
        kept_GN: The members that train.
        scale_G1: What each group's advantages were divided by (a scalar for ``batch``).
        values: ``turn_mc``: by slot, ``V(s_t)`` by ``t``.
    """
    groups, size = rewards_GN.shape
    scales = torch.broadcast_to(scale_G1, (groups, 1)).flatten().tolist()
    counts = kept_GN.sum(dim=1).clamp(min=1)
    baselines = ((rewards_GN * kept_GN).sum(dim=1) / counts).tolist()
    eligible = [
        bool(keep) and t.episode.num_turns >= 2
        for t, keep in zip(trajectories, kept_GN.flatten().tolist(), strict=True)
    ]
    if credit == "anchor":
        members = [
            (
                t.episode.rewards,
                [anchor_key(t.episode.samples, k) for k in range(t.episode.num_turns)],
            )
            if ok
            else None
            for t, ok in zip(trajectories, eligible, strict=True)
        ]
        nested = anchor_turn_advantages(
            [members[g * size : (g + 1) * size] for g in range(groups)],
            advantages_GN.tolist(),
            scales,
        )
        return TurnAdvantages([turns for group in nested for turns in group], 0)
    per_turn: list[list[float] | None] = []
    fallback = 0
    for index, (trajectory, ok) in enumerate(zip(trajectories, eligible, strict=True)):
        valued = (values or {}).get(trajectory.slot)
        if not ok:  # kept implies finished
            per_turn.append(None)
            continue
        if not valued:
            fallback += 1
            per_turn.append(None)
            continue
        group = index // size
        per_turn.append(
            mc_turn_advantages(trajectory.episode.rewards, valued, baselines[group], scales[group])
        )
    return TurnAdvantages(per_turn, fallback)
