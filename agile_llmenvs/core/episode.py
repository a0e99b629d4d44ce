"""The records of an episode: its task, why it stopped, and its token-exact training samples.

The rollout harness fills them (its running state is
:class:`~agile_llmenvs.llm_envs.episode_state.EpisodeState`); trainers read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from agile_llmenvs.core.images import SampleImages

__all__ = ["EpisodeData", "StopReason", "Task", "TokenSample", "TurnResult"]


@dataclass(frozen=True)
class Task:
    """One episode's task: a reset seed and, for a dataset env, a row."""

    seed: int
    row_index: int | None = None

    def reset_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``RolloutHarness.reset``."""
        kwargs: dict[str, Any] = {"seed": self.seed}
        if self.row_index is not None:
            kwargs["row_index"] = self.row_index
        return kwargs


class StopReason(StrEnum):
    """Why an episode ended."""

    TERMINATED = "terminated"  # the env ended the task
    TRUNCATED = "truncated"  # the env cut the episode (a time limit of its own)
    MAX_TURNS = "max_turns"  # the harness's turn budget ran out
    PROMPT_LIMIT = "prompt_limit"  # the first prompt alone was over max_model_len
    CONTEXT_LIMIT = "context_limit"  # the next observation would pass max_model_len
    ENV_ERROR = "env_error"  # the env failed (an exception, a lost connection, a timeout)
    ABORTED = "aborted"  # the caller ended the episode early


@dataclass(frozen=True)
class TokenSample:
    """One token-exact training sequence.

    ``token_ids`` are exactly the ids the policy sampled plus the template and observation ids
    the harness inserted; nothing was decoded and re-encoded. Masks are aligned with
    next-token targets: position ``i`` describes ``token_ids[i + 1]``.

    Attributes:
        token_ids: The sequence, length ``T``.
        action_mask: Length ``T - 1``; True exactly where the target was sampled by the policy.
        turn_ids: Length ``T - 1``; the turn index where ``action_mask`` is True, else -1.
        sampling_logps: The sampler's log-probabilities of the sampled ids, concatenated in
            order (length ``sum(action_mask)``); NaN for ids of a turn the policy gave none
            for (the trainer then scores them itself before its first update).
        images: The images the sequence shows (a vision-language policy's), in the order of
            their placeholder tokens in ``token_ids``, with the processor's tensors; None
            when it shows none.
    """

    token_ids: tuple[int, ...]
    action_mask: tuple[bool, ...]
    turn_ids: tuple[int, ...]
    sampling_logps: tuple[float, ...] = ()
    images: SampleImages | None = None

    def aligned_logps(self) -> list[float]:
        """``sampling_logps`` scattered onto the ``T - 1`` targets (NaN off the mask)."""
        values = iter(self.sampling_logps)
        return [next(values) if sampled else math.nan for sampled in self.action_mask]


@dataclass(frozen=True)
class EpisodeData:
    """Everything a trainer needs from one episode.

    Attributes:
        samples: One token-exact sequence per segment: one, unless the context was restarted
            (``segment_prompt_tokens``) or the chat template rewrites earlier turns.
        rewards: The reward of each turn, in order.
        stop_reason: Why the episode ended.
        info: The last env info, plus the harness's own keys (``prompt_limit``,
            ``malformed_tool_calls``, ``error``, ...).
    """

    samples: tuple[TokenSample, ...]
    rewards: tuple[float, ...]
    stop_reason: StopReason
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def total_reward(self) -> float:
        """The sum of the per-turn rewards."""
        return float(sum(self.rewards))

    @property
    def num_turns(self) -> int:
        """Turns played."""
        return len(self.rewards)

    @property
    def sample(self) -> TokenSample:
        """The episode's only sample.

        Raises:
            ValueError: the episode has several segments; read :attr:`samples`.
        """
        if len(self.samples) != 1:
            raise ValueError(
                f"this episode has {len(self.samples)} segments; read `.samples`, one "
                "training sequence per segment"
            )
        return self.samples[0]

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The only sample's token ids (see :attr:`sample`)."""
        return self.sample.token_ids

    @property
    def action_mask(self) -> tuple[bool, ...]:
        """The only sample's action mask (see :attr:`sample`)."""
        return self.sample.action_mask

    @property
    def turn_ids(self) -> tuple[int, ...]:
        """The only sample's turn ids (see :attr:`sample`)."""
        return self.sample.turn_ids

    @property
    def sampling_logps(self) -> tuple[float, ...]:
        """The only sample's sampling log-probabilities (see :attr:`sample`)."""
        return self.sample.sampling_logps


@dataclass(frozen=True)
class TurnResult:
    """What :meth:`RolloutHarness.step` returns.

    Attributes:
        prompt_ids: Ids to append to the context before generating the next turn (empty
            when done). When ``new_sample`` is True they are the whole new context instead.
        reward: The turn's reward.
        done: Whether the episode ended.
        info: The env's info for this turn, plus harness keys.
        new_sample: The context starts over with ``prompt_ids`` (a new segment).
    """

    prompt_ids: list[int]
    reward: float
    done: bool
    info: dict[str, Any]
    new_sample: bool = False
