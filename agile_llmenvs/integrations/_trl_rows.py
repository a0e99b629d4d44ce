"""TRL's rows: one token sample as ``prompt_ids`` / ``completion_ids`` / ``env_mask``, and the
rows of one GRPO group filled with the samples of episodes played in order.

TRL trains on ``prompt_ids + completion_ids`` with the loss on completion tokens where
``env_mask`` is 1. A sample's ids are split before its first sampled token, so every id the
policy sampled is in the completion and every id before it is prompt; the env's and the chat
template's ids after it stay in the completion with ``env_mask`` 0. Nothing is re-tokenised:
``prompt_ids + completion_ids`` is the sample's ``token_ids``. What a reward function reads as
the completion is the policy's part only: the ids it sampled, turn by turn (``policy_turns``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agile_llmenvs.core import EpisodeData, StopReason, TokenSample
from agile_llmenvs.llm_envs.tasks import Task

__all__ = ["GroupRows", "PlayedEpisode", "TRLRow", "columns", "masked_row", "sample_row"]


@dataclass(frozen=True)
class TRLRow:
    """One row of what a ``rollout_func`` returns to TRL.

    Attributes:
        prompt_ids: The sample's ids before its first sampled id.
        completion_ids: The rest of the sample's ids.
        env_mask: 1 where the policy sampled the completion id, 0 where the env or the chat
            template inserted it (TRL's loss mask inside the completion).
        logprobs: The sampler's log-prob of each completion id (0.0 on env ids, as TRL's own
            tool loop writes them).
        reward: The episode's total reward; None for a masked row, which TRL then leaves out
            of its group's mean and std and gives advantage 0.
        stop_reason: Why the sample's episode ended; None for a masked row.
        policy_turns: The ids the policy sampled in each turn of the sample, in turn order
            (none for a masked row or a sample with no sampled id).
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    env_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    reward: float | None
    stop_reason: str | None
    policy_turns: tuple[tuple[int, ...], ...] = ()


def sample_row(sample: TokenSample, episode: EpisodeData) -> TRLRow:
    """The TRL row of one of ``episode``'s samples.

    A sample with no sampled id (an episode whose first prompt was over the context limit)
    keeps its ids, its last id as a one-id completion with ``env_mask`` 0: it trains nothing,
    and its reward still counts in its group, as in our own GRPO loop.
    """
    ids, mask = sample.token_ids, sample.action_mask
    if len(ids) < 2:
        raise ValueError(f"a token sample needs at least 2 ids to split, got {len(ids)}")
    # action_mask[k] describes ids[k + 1]: the first sampled id is ids[first + 1]
    first = next((k for k, sampled in enumerate(mask) if sampled), len(mask) - 1)
    env_mask = tuple(int(sampled) for sampled in mask[first:])
    logps = sample.aligned_logps()[first:]
    return TRLRow(
        prompt_ids=ids[: first + 1],
        completion_ids=ids[first + 1 :],
        env_mask=env_mask,
        logprobs=tuple(lp if sampled else 0.0 for lp, sampled in zip(logps, env_mask, strict=True)),
        reward=episode.total_reward,
        stop_reason=str(episode.stop_reason),
        policy_turns=_policy_turns(sample),
    )


def _policy_turns(sample: TokenSample) -> tuple[tuple[int, ...], ...]:
    """The sample's sampled ids grouped by turn (``turn_ids[k]`` describes ``token_ids[k + 1]``)."""
    turns: dict[int, list[int]] = {}
    for k, turn in enumerate(sample.turn_ids):
        if turn >= 0:
            turns.setdefault(turn, []).append(sample.token_ids[k + 1])
    return tuple(tuple(turns[turn]) for turn in sorted(turns))


def masked_row(pad_id: int) -> TRLRow:
    """A row that trains nothing: one pad id of prompt, one of completion, ``env_mask`` 0 and
    no reward (see :class:`TRLRow`)."""
    return TRLRow((pad_id,), (pad_id,), (0,), (0.0,), None, None)


def columns(rows: Sequence[TRLRow], decode: Callable[[Sequence[int]], str]) -> dict[str, list[Any]]:
    """What ``rollout_func`` returns: TRL's id columns plus ``env_reward``, ``env_stop_reason``
    and ``policy_completion``, which TRL passes to the reward functions by name.

    A row's ``policy_completion`` is the policy's text in TRL's conversational form: one
    assistant message per turn, each turn's sampled ids through ``decode``, with none of the
    env's or the template's text between them (one empty message for a row without turns).
    """
    return {
        "prompt_ids": [list(r.prompt_ids) for r in rows],
        "completion_ids": [list(r.completion_ids) for r in rows],
        "logprobs": [list(r.logprobs) for r in rows],
        "env_mask": [list(r.env_mask) for r in rows],
        "env_reward": [r.reward for r in rows],
        "env_stop_reason": [r.stop_reason for r in rows],
        "policy_completion": [
            [{"role": "assistant", "content": decode(ids)} for ids in r.policy_turns or [()]]
            for r in rows
        ],
    }


@dataclass(frozen=True)
class PlayedEpisode:
    """One episode a rollout played, and the rows its samples filled.

    Attributes:
        group: The TRL group (index in the global generation batch) it was played for.
        task: The task it played.
        episode: The harness's own record: token-exact samples, rewards, stop reason.
        rows: Indices (in the rollout's prompts) of the rows its samples filled, in sample
            order; empty when it failed or found its group full.
    """

    group: int
    task: Task
    episode: EpisodeData
    rows: tuple[int, ...] = ()

    @property
    def failed(self) -> bool:
        """Whether the env failed this episode (its error is in ``episode.info``)."""
        return self.episode.stop_reason is StopReason.ENV_ERROR

    @property
    def discarded(self) -> bool:
        """Whether it finished but found no row left in its group."""
        return not self.failed and not self.rows


@dataclass
class GroupRows:
    """The rows of one TRL group on this process, filled in the order episodes were started.

    Each finished episode's samples take the next free rows, in order; a sample that finds
    no row left is dropped (counted in ``dropped_samples``). Which episodes keep rows
    depends only on the episodes started before them, never on their own outcome.

    Attributes:
        group: The group's index in the global generation batch.
        rows: The indices of the group's rows in this process's prompts.
        task: The task every episode of the group plays.
        filled: The rows filled so far.
        dropped_samples: Samples that found the group full.
        exhausted: No more episodes are played for it (its last wave filled no row).
    """

    group: int
    rows: range
    task: Task
    filled: list[TRLRow] = field(default_factory=list)
    dropped_samples: int = 0
    exhausted: bool = False

    @property
    def remaining(self) -> int:
        """Rows still free."""
        return len(self.rows) - len(self.filled)

    def place(self, episode: EpisodeData) -> PlayedEpisode:
        """Give the episode's samples the next free rows (none if it failed)."""
        placed: list[int] = []
        if episode.stop_reason is not StopReason.ENV_ERROR:
            for sample in episode.samples:
                if not self.remaining:
                    self.dropped_samples += 1
                    continue
                placed.append(self.rows[len(self.filled)])
                self.filled.append(sample_row(sample, episode))
        return PlayedEpisode(self.group, self.task, episode, tuple(placed))

    def mask_remaining(self, pad_id: int) -> int:
        """Fill every free row with a masked row; returns how many."""
        count = self.remaining
        self.filled += [masked_row(pad_id)] * count
        return count
