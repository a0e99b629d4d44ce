"""The state a rollout harness keeps while an episode runs (apart from its configuration)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from agile_llmenvs.core.episode import StopReason, TokenSample
from agile_llmenvs.core.images import SampleImages
from agile_llmenvs.llm_envs.restart import TurnText

__all__ = ["EpisodeState"]


@dataclass
class EpisodeState:
    """A running episode's state in a harness (apart from its configuration): the current
    sample being built, the finished ones, and what a context restart needs."""

    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    images: SampleImages = field(default_factory=SampleImages)
    samples: list[TokenSample] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    texts: list[TurnText] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt_text: str = ""
    reset_kwargs: dict[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    stop_reason: StopReason | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def turn(self) -> int:
        return len(self.rewards)

    def append(self, ids: Sequence[int], *, turn: int | None) -> None:
        """Append ids; ``turn`` is the turn index when the policy sampled them, else None."""
        if not ids:
            return
        # a sample's first id is context, never a target: it has no mask entry
        count = len(ids) if self.ids else len(ids) - 1
        self.ids.extend(ids)
        self.mask.extend(repeat(turn is not None, count))
        self.turn_ids.extend(repeat(-1 if turn is None else turn, count))

    def close_sample(self) -> None:
        """Store the current sequence as a finished sample and start an empty one."""
        if self.ids:
            self.samples.append(
                TokenSample(
                    tuple(self.ids),
                    tuple(self.mask),
                    tuple(self.turn_ids),
                    tuple(self.logps),
                    self.images if self.images.images else None,
                )
            )
        self.ids, self.mask, self.turn_ids, self.logps = [], [], [], []
        if self.images.images:  # an empty one is kept: it is frozen
            self.images = SampleImages()
