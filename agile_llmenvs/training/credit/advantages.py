"""Turn-level credit: how an episode's advantage is shared among its turns (``training.credit``).

Shape suffixes as in :mod:`~agile_llmenvs.training.objective.losses`. An episode of ``T`` turns has
rewards ``r_0 .. r_{T-1}`` and states ``s_0 .. s_T``: ``s_t`` is what turn ``t`` acts from
(``s_0`` the reset's), ``s_T`` the end. Every function here returns one advantage per turn.

* ``turn_mc`` (:func:`mc_turn_advantages`): ``V(s_t)`` is the mean return of continuations
  branched from ``s_t``; ``V(s_0)`` is the group's mean return (the group's members are its
  continuations) and ``V(s_T) = 0``. Between consecutive valued states ``b < c`` the turns
  ``b .. c-1`` share ``A = (r_b + ... + r_{c-1} + V(s_c) - V(s_b)) / scale``: with every state
  valued, ``A_t = (r_t + V(s_{t+1}) - V(s_t)) / scale``; with none, GRPO's ``(R - mean) / scale``.
  The scale (:func:`turn_scale`) is ``scale_rewards``' std plus eps, raised to the RMS of the
  turn terms when they are wider: a group whose returns are all equal still has turn terms,
  and dividing them by ``0 + eps`` would multiply them by 10,000.
* ``anchor`` (:func:`anchor_turn_advantages`, GiGPO, arXiv 2505.10978): turns of a group's
  episodes that act from the same observation (the same ids since the previous action) form
  an anchor group, whatever their episodes' lengths; ``A_t = A_episode + omega * step_t``, with
  ``step_t = (G_t - mean G) / (std G + eps)`` over the anchor group (``G_t - mean G`` under
  ``scale_rewards: none``) and ``G_t = r_t + gamma * G_{t+1}`` the discounted return to go; a
  turn alone in its anchor group has ``step_t = 0``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import torch

from agile_llmenvs.core import TokenSample, Trajectory

__all__ = [
    "AnchorSettings",
    "TurnAdvantages",
    "anchor_key",
    "anchor_signal",
    "anchor_turn_advantages",
    "batch_turn_advantages",
    "group_baselines",
    "group_turn_scales",
    "mc_segments",
    "mc_turn_advantages",
    "returns_to_go",
    "segment_advantages",
    "term_squares",
    "turn_scale",
]

#: Keeps an anchor group of equal returns at step term 0 instead of 0/0 (GRPO's eps).
EPS = 1e-4

Member = tuple[Sequence[float], Sequence[tuple[int, ...]]]
"""One episode as :func:`anchor_turn_advantages` reads it: rewards and anchor key per turn."""


@dataclass(frozen=True)
class AnchorSettings:
    """``anchor``'s settings, the manifest's ``credit_gamma`` and ``credit_omega``.

    Attributes:
        gamma: The discount of the returns to go anchor groups compare (GiGPO's 0.95).
        omega: The weight of the step term beside the episode's advantage (GiGPO's 1).
    """

    gamma: float = 0.95
    omega: float = 1.0


def returns_to_go(rewards: Sequence[float], gamma: float = 1.0) -> list[float]:
    """``G_t = r_t + gamma * G_{t+1}`` for each turn (``G_T = 0``; undiscounted by default)."""
    total, out = 0.0, []
    for reward in reversed(rewards):
        total = reward + gamma * total
        out.append(total)
    return out[::-1]


def mc_segments(
    rewards: Sequence[float], values: Mapping[int, float], baseline: float
) -> list[tuple[int, int, float]]:
    """One episode's ``turn_mc`` turn terms before scaling: ``(b, c, r_b + ... + r_{c-1} +
    V(s_c) - V(s_b))`` for each pair of consecutive valued states ``b < c``.

    Args:
        rewards: The episode's per-turn rewards, ``T`` of them.
        values: ``V(s_t)`` of the branched states, by ``t`` (``0 < t < T``; others ignored).
        baseline: ``V(s_0)``: the mean return of the episode's group.
    """
    turns = len(rewards)
    cuts = [0, *sorted(t for t in values if 0 < t < turns), turns]
    value = {0: baseline, turns: 0.0, **{t: values[t] for t in cuts[1:-1]}}
    return [
        (start, end, sum(rewards[start:end]) + value[end] - value[start])
        for start, end in pairwise(cuts)
    ]


def mc_turn_advantages(
    rewards: Sequence[float], values: Mapping[int, float], baseline: float, scale: float
) -> list[float]:
    """One episode's per-turn advantages from Monte-Carlo state values (``turn_mc``): each
    turn its segment's term (:func:`mc_segments`) over ``scale``.

    Args:
        rewards: The episode's per-turn rewards, ``T`` of them.
        values: ``V(s_t)`` of the branched states, by ``t`` (``0 < t < T``; others ignored).
        baseline: ``V(s_0)``: the mean return of the episode's group.
        scale: What the terms are divided by (:func:`turn_scale`).

    Returns:
        ``T`` advantages, turn by turn.
    """
    return segment_advantages(mc_segments(rewards, values, baseline), scale)


def segment_advantages(segments: Sequence[tuple[int, int, float]], scale: float) -> list[float]:
    """Per-turn advantages from ``(b, c, term)`` segments: each turn ``b .. c-1`` its
    segment's term over ``scale``."""
    advantages: list[float] = []
    for start, end, term in segments:
        advantages.extend([term / scale] * (end - start))
    return advantages


def term_squares(terms: Sequence[float]) -> torch.Tensor:
    """``[sum of squares, count]`` of turn terms, what :func:`group_turn_scales` sums."""
    return torch.tensor([sum(t * t for t in terms), float(len(terms))], dtype=torch.float64)


def group_baselines(rewards_GN: torch.Tensor, kept_GN: torch.Tensor) -> list[float]:
    """Each group's mean return over its kept members: ``V(s_0)``."""
    counts = kept_GN.sum(dim=1).clamp(min=1)
    return ((rewards_GN * kept_GN).sum(dim=1) / counts).tolist()


def turn_scale(reward_scale: float, squares: float, count: int) -> float:
    """What ``turn_mc``'s turn terms are divided by: ``max(reward_scale, RMS of the terms)``.

    ``reward_scale`` is the group's (or batch's) reward std plus eps, GRPO's: with it alone
    the terms of one episode sum to GRPO's advantage. But the terms are not its parts: a
    group whose returns are all equal has std 0 and turn terms that are not (the values of
    its states differ), and ``term / (0 + eps)`` is up to 10,000 times the term. Each term has
    mean 0 under the policy (it estimates an advantage), so the RMS of the terms about 0 is
    their own std; dividing by at least it keeps every advantage within ``sqrt(count)``
    (``|x| <= sqrt(sum x^2)``), and leaves the scale GRPO's wherever the rewards spread more
    than the terms do.

    Args:
        reward_scale: ``scale_rewards``' std plus eps.
        squares: The sum of the squared terms the scale is for.
        count: How many terms.
    """
    if count == 0:
        return reward_scale
    return max(reward_scale, math.sqrt(squares / count))


def group_turn_scales(
    squares_G2: torch.Tensor,
    scale_G1: torch.Tensor,
    normalise: bool,
    *,
    batch_scale: bool = False,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[float]:
    """Each group's :func:`turn_scale` from its turn terms' ``(sum of squares, count)``
    (``squares_G2``), over the whole batch (every process's) for ``batch_scale``; the reward
    scale alone when not ``normalise``."""
    groups = squares_G2.shape[0]
    if batch_scale:
        totals = squares_G2.sum(dim=0)
        totals = sum_over_processes(totals) if sum_over_processes is not None else totals
        squares_G2 = totals.expand(groups, 2)
    reward_scales = torch.broadcast_to(scale_G1, (groups, 1)).flatten().tolist()
    return [
        turn_scale(scale, float(squares), int(count)) if normalise else scale
        for scale, (squares, count) in zip(reward_scales, squares_G2.tolist(), strict=True)
    ]


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


def _anchor_groups(
    members: Sequence[Member | None], gamma: float
) -> tuple[list[list[float] | None], dict[tuple[int, ...], list[float]]]:
    """Each member's discounted returns to go, and the returns of every anchor key."""
    anchored: defaultdict[tuple[int, ...], list[float]] = defaultdict(list)
    to_go: list[list[float] | None] = []
    for member in members:
        if member is None:
            to_go.append(None)
            continue
        rewards, keys = member
        returns = returns_to_go(rewards, gamma)
        to_go.append(returns)
        for key, value in zip(keys, returns, strict=True):
            anchored[key].append(value)
    return to_go, dict(anchored)


def _step_terms(peers: Sequence[float], normalise: bool, eps: float) -> tuple[float, float]:
    """An anchor group's mean and what its centred returns are divided by (Bessel's std plus
    eps, or 1)."""
    mean = sum(peers) / len(peers)
    if not normalise:
        return mean, 1.0
    variance = sum((value - mean) ** 2 for value in peers) / (len(peers) - 1)
    return mean, math.sqrt(variance) + eps


def anchor_turn_advantages(
    groups: Sequence[Sequence[Member | None]],
    episode_advantages: Sequence[Sequence[float]],
    settings: AnchorSettings = AnchorSettings(),
    *,
    normalise: bool = True,
    eps: float = EPS,
) -> list[list[list[float] | None]]:
    """Per-turn advantages of every member of every group by anchor state (``anchor``, GiGPO).

    Args:
        groups: Per group, per member: ``(rewards per turn, anchor key per turn)``, or None for
            a member that does not train.
        episode_advantages: Per group, per member: GRPO's advantage.
        settings: The discount and the step term's weight.
        normalise: Divide each anchor group's centred returns by its std plus ``eps``
            (GiGPO's ``mean_std_norm``); False centres them only (``mean_norm``).
        eps: Added to an anchor group's std.

    Returns:
        Per group, per member: ``A_episode + omega * step_t`` for each turn, or None where
        ``groups`` had None.
    """
    out: list[list[list[float] | None]] = []
    for members, advantages in zip(groups, episode_advantages, strict=True):
        to_go, anchored = _anchor_groups(members, settings.gamma)
        stats = {
            key: _step_terms(peers, normalise, eps)
            for key, peers in anchored.items()
            if len(peers) > 1
        }
        group: list[list[float] | None] = []
        for member, member_to_go, advantage in zip(members, to_go, advantages, strict=True):
            if member is None or member_to_go is None:
                group.append(None)
                continue
            turns = []
            for key, value in zip(member[1], member_to_go, strict=True):
                mean, scale = stats.get(key, (value, 1.0))
                turns.append(advantage + settings.omega * (value - mean) / scale)
            group.append(turns)
        out.append(group)
    return out


def anchor_signal(group: Sequence[Trajectory], gamma: float) -> bool:
    """Whether a played group carries turn signal under ``anchor``: two of its finished
    episodes' turns act from one observation with different discounted returns to go (the
    group then trains under ``dynamic_sampling`` even when its rewards are all equal)."""
    members: list[Member | None] = [
        None if t.failed else (t.episode.rewards, _anchor_keys(t)) for t in group
    ]
    _, anchored = _anchor_groups(members, gamma)
    return any(len(peers) > 1 and max(peers) > min(peers) for peers in anchored.values())


def _anchor_keys(trajectory: Trajectory) -> list[tuple[int, ...]]:
    episode = trajectory.episode
    return [anchor_key(episode.samples, k) for k in range(episode.num_turns)]


@dataclass(frozen=True)
class TurnAdvantages:
    """A batch's per-turn advantages (one entry per trajectory: its turns', or None for a
    member that does not train), the episodes that fell back to their episode's, and
    (``tree``) the continuations' training rows with their per-turn advantages."""

    per_turn: list[list[float] | None]
    fallback_episodes: int
    branch_rows: list[tuple[TokenSample, list[float]]] = field(default_factory=list)


def batch_turn_advantages(
    credit: str,
    trajectories: Sequence[Trajectory],
    rewards_GN: torch.Tensor,
    advantages_GN: torch.Tensor,
    kept_GN: torch.Tensor,
    scale_G1: torch.Tensor,
    values: Mapping[int, Mapping[int, float]] | None = None,
    *,
    anchor: AnchorSettings = AnchorSettings(),
    normalise: bool = True,
    batch_scale: bool = False,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> TurnAdvantages:
    """Per-turn advantages of a GRPO batch for ``credit`` (``turn_mc`` or ``anchor``).

    Every kept member gets one advantage per turn (each sample's tokens through its
    ``turn_ids``, which count the episode's turns). A ``turn_mc`` member of two or more turns
    whose slot has no valued state (its env could not branch) has one segment, GRPO's, and is
    counted as a fallback.

    Args:
        credit: ``turn_mc`` or ``anchor``.
        trajectories: The batch, ``[G * N]`` in group order.
        rewards_GN: Episode returns.
        advantages_GN: GRPO's episode advantages.
        kept_GN: The members that train.
        scale_G1: What each group's advantages were divided by (a scalar for ``batch``).
        values: ``turn_mc``: by slot, ``V(s_t)`` by ``t``.
        anchor: ``anchor``'s discount and step weight.
        normalise: ``scale_rewards`` is not ``none``: ``anchor`` divides by each anchor
            group's std, ``turn_mc`` by :func:`turn_scale`.
        batch_scale: ``scale_rewards: batch``: ``turn_mc``'s RMS is the whole batch's.
        sum_over_processes: Sums a tensor over the processes holding the rest of the batch
            (for ``batch_scale``).
    """
    groups, size = rewards_GN.shape
    kept = kept_GN.flatten().tolist()
    if credit == "anchor":
        members: list[Member | None] = [
            (t.episode.rewards, _anchor_keys(t)) if keep else None
            for t, keep in zip(trajectories, kept, strict=True)
        ]
        nested = anchor_turn_advantages(
            [members[g * size : (g + 1) * size] for g in range(groups)],
            advantages_GN.tolist(),
            anchor,
            normalise=normalise,
        )
        return TurnAdvantages([turns for group in nested for turns in group], 0)
    return _mc_batch(
        trajectories,
        rewards_GN,
        kept_GN,
        scale_G1,
        values or {},
        normalise,
        batch_scale,
        sum_over_processes,
    )


def _mc_batch(
    trajectories: Sequence[Trajectory],
    rewards_GN: torch.Tensor,
    kept_GN: torch.Tensor,
    scale_G1: torch.Tensor,
    values: Mapping[int, Mapping[int, float]],
    normalise: bool,
    batch_scale: bool,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor] | None,
) -> TurnAdvantages:
    """``turn_mc``'s part of :func:`batch_turn_advantages`."""
    groups, size = rewards_GN.shape
    baselines = group_baselines(rewards_GN, kept_GN)
    segments: list[list[tuple[int, int, float]] | None] = []
    fallback = 0
    squares_G2 = torch.zeros(groups, 2, dtype=torch.float64)  # sum of squares, count
    for index, (t, keep) in enumerate(zip(trajectories, kept_GN.flatten().tolist(), strict=True)):
        if not keep:  # kept implies finished
            segments.append(None)
            continue
        valued = values.get(t.slot, {})
        fallback += int(t.episode.num_turns >= 2 and not valued)
        terms = mc_segments(t.episode.rewards, valued, baselines[index // size])
        segments.append(terms)
        squares_G2[index // size] += term_squares([term for _, _, term in terms])
    scales = group_turn_scales(
        squares_G2,
        scale_G1,
        normalise,
        batch_scale=batch_scale,
        sum_over_processes=sum_over_processes,
    )
    per_turn = [
        None if terms is None else segment_advantages(terms, scales[index // size])
        for index, terms in enumerate(segments)
    ]
    return TurnAdvantages(per_turn, fallback)
