"""``credit: tree``: the continuations branched from an episode's turn boundaries train too.

An episode and the continuations branched from its states form a tree (one level: branches
are not branched again). Write ``G_x(t) = r_t + ... + r_{T_x - 1}`` for the return from turn
``t`` of a path ``x`` (the episode's own rewards before ``t``, the continuation's from ``t``).
The *siblings at* ``s_t`` are the paths that act from ``s_t`` with the current policy: the
episode itself and its finished continuations branched at ``t``. Their mean is the state's
value, ``V(s_t) = mean of G_x(t) over the siblings``; ``V(s_0)`` is the group's mean return
(the group's episodes are the root's siblings) and ``V(s_T) = 0``.

* The episode's turns share ``turn_mc``'s terms with these values: between consecutive
  valued states ``b < c``, turns ``b .. c-1`` get ``r_b + ... + r_{c-1} + V(s_c) - V(s_b)``
  (:func:`~agile_llmenvs.training.credit.advantages.mc_segments`). Its first segment is GRPO's
  term over the group (Tree-GRPO's inter-tree advantage); the later ones compare it with its
  siblings.
* A continuation ``x`` branched at ``t`` gets ``G_x(t) - V(s_t)`` on each of its own turns
  ``t ..``: its return against its siblings' (Tree-GRPO's intra-tree advantage).
* Every term of a group is divided by one scale, ``turn_mc``'s
  (:func:`~agile_llmenvs.training.credit.advantages.turn_scale`: the reward std plus eps,
  raised to the RMS of the group's terms, the continuations' included).

A continuation's sample starts with the episode's prefix; those ids are the episode's and are
trained once, in the episode's own row: in the continuation's row they are context (action
mask off). A continuation whose env failed is neither a sibling nor trained; one cut by
``credit_max_tokens`` counts the rewards it had, as under ``turn_mc``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from agile_llmenvs.core import EpisodeData, StopReason, TokenSample, Trajectory
from agile_llmenvs.training.credit.advantages import (
    TurnAdvantages,
    group_baselines,
    group_turn_scales,
    mc_segments,
    segment_advantages,
    term_squares,
)

__all__ = ["Branch", "TreeTerms", "branch_samples", "tree_terms", "tree_turn_advantages"]


@dataclass(frozen=True)
class Branch:
    """A continuation that trains: the state it left (the episode's slot and turn ``t``) and
    the episode it played from there (its rewards before ``t`` are the episode's)."""

    slot: int
    turn: int
    episode: EpisodeData

    @property
    def return_from_turn(self) -> float:
        """``G(t)``: the rewards of its own turns."""
        return float(sum(self.episode.rewards[self.turn :]))


@dataclass(frozen=True)
class TreeTerms:
    """One episode's tree before scaling.

    Attributes:
        segments: The episode's ``(b, c, term)`` for each pair of consecutive valued states.
        branches: Each finished continuation's term ``G_x(t) - V(s_t)``, in the order given.
        values: ``V(s_t)`` of each valued state.
    """

    segments: list[tuple[int, int, float]]
    branches: list[float]
    values: dict[int, float]


def tree_terms(rewards: Sequence[float], branches: Sequence[Branch], baseline: float) -> TreeTerms:
    """An episode's terms (see the module docstring), before scaling.

    Args:
        rewards: The episode's per-turn rewards, ``T`` of them.
        branches: Its finished continuations (``0 < turn < T``; others are ignored: a branch
            at ``t`` outside the episode's turns has no siblings there).
        baseline: ``V(s_0)``: the mean return of the episode's group.
    """
    turns = len(rewards)
    siblings: dict[int, list[float]] = {}
    for branch in branches:
        if 0 < branch.turn < turns:
            own = float(sum(rewards[branch.turn :]))
            siblings.setdefault(branch.turn, [own]).append(branch.return_from_turn)
    values = {t: sum(returns) / len(returns) for t, returns in siblings.items()}
    return TreeTerms(
        segments=mc_segments(rewards, values, baseline),
        branches=[
            b.return_from_turn - values[b.turn] if b.turn in values else 0.0 for b in branches
        ],
        values=values,
    )


def branch_samples(branch: Branch, advantage: float) -> list[tuple[TokenSample, list[float]]]:
    """The continuation's training rows: each of its samples holding one of its own turns,
    the episode's prefix there as context (action mask off, its log-probs dropped), with the
    per-turn advantages (``advantage`` on its turns, 0 before ``t``)."""
    turns = branch.episode.num_turns
    per_turn = [0.0] * branch.turn + [advantage] * (turns - branch.turn)
    rows: list[tuple[TokenSample, list[float]]] = []
    for sample in branch.episode.samples:
        own = [
            sampled and turn >= branch.turn
            for sampled, turn in zip(sample.action_mask, sample.turn_ids, strict=True)
        ]
        if not any(own):
            continue
        logps = sample.aligned_logps() if sample.sampling_logps else []
        kept_logps = tuple(value for value, keep in zip(logps, own, strict=False) if keep)
        rows.append(
            (
                TokenSample(
                    sample.token_ids,
                    tuple(own),
                    tuple(t if keep else -1 for t, keep in zip(sample.turn_ids, own, strict=True)),
                    kept_logps,
                    sample.images,
                ),
                per_turn,
            )
        )
    return rows


def tree_turn_advantages(
    trajectories: Sequence[Trajectory],
    rewards_GN: torch.Tensor,
    kept_GN: torch.Tensor,
    scale_G1: torch.Tensor,
    branches: Sequence[Branch],
    *,
    normalise: bool = True,
    batch_scale: bool = False,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> TurnAdvantages:
    """Per-turn advantages of a GRPO batch under ``tree``, and its continuations' rows.

    Args:
        trajectories: The batch, ``[G * N]`` in group order.
        rewards_GN: Episode returns.
        kept_GN: The members that train (a branch of a member that does not train neither).
        scale_G1: What each group's advantages were divided by (a scalar for ``batch``).
        branches: The batch's finished continuations.
        normalise: ``scale_rewards`` is not ``none``: divide by :func:`turn_scale`.
        batch_scale: ``scale_rewards: batch``: the RMS is the whole batch's.
        sum_over_processes: Sums a tensor over the processes holding the rest of the batch.

    Returns:
        The episodes' per-turn advantages (``per_turn``; a multi-turn episode with no
        finished continuation keeps GRPO's and is counted in ``fallback_episodes``) and the
        continuations' rows (``branch_rows``, see :func:`branch_samples`).
    """
    groups, size = rewards_GN.shape
    baselines = group_baselines(rewards_GN, kept_GN)
    by_slot: dict[int, list[Branch]] = {}
    for branch in branches:
        if branch.episode.stop_reason is not StopReason.ENV_ERROR:
            by_slot.setdefault(branch.slot, []).append(branch)
    trees: list[tuple[TreeTerms, list[Branch]] | None] = []
    fallback = 0
    squares_G2 = torch.zeros(groups, 2, dtype=torch.float64)  # sum of squares, count
    for index, (t, keep) in enumerate(zip(trajectories, kept_GN.flatten().tolist(), strict=True)):
        if not keep:
            trees.append(None)
            continue
        own = by_slot.get(t.slot, [])
        terms = tree_terms(t.episode.rewards, own, baselines[index // size])
        fallback += int(t.episode.num_turns >= 2 and not terms.values)
        trees.append((terms, own))
        squares_G2[index // size] += term_squares(
            [term for _, _, term in terms.segments] + terms.branches
        )
    scales = group_turn_scales(
        squares_G2,
        scale_G1,
        normalise,
        batch_scale=batch_scale,
        sum_over_processes=sum_over_processes,
    )
    per_turn: list[list[float] | None] = []
    rows: list[tuple[TokenSample, list[float]]] = []
    for index, tree in enumerate(trees):
        if tree is None:
            per_turn.append(None)
            continue
        terms, own = tree
        scale = scales[index // size]
        per_turn.append(segment_advantages(terms.segments, scale))
        for branch, term in zip(own, terms.branches, strict=True):
            if branch.turn in terms.values:
                rows.extend(branch_samples(branch, term / scale))
    return TurnAdvantages(per_turn, fallback, rows)
