"""Context restart: the prompt of a new segment when an episode outgrows its token budget.

The new prompt summarises the actions taken so far and keeps the latest turns verbatim (as
messages), so the policy can go on without the whole transcript. Its text is prompt only: it
is rendered fresh and never trained on, and the new segment is its own training sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TurnText", "restart_messages"]

_MAX_ACTION_CHARS = 200


@dataclass(frozen=True)
class TurnText:
    """One played turn as text: the prompt the policy saw and the action it took."""

    prompt: str
    action: str


def restart_messages(
    turns: Sequence[TurnText],
    observation: str,
    *,
    keep_turns: int,
    instruction: str = "",
    system_prompt: str | None = None,
) -> list[dict[str, Any]]:
    """Messages that restart an episode's context.

    Args:
        turns: Every turn played so far, oldest first.
        observation: The observation the policy answers next.
        keep_turns: How many of the latest turns to keep verbatim.
        instruction: The episode's instruction, repeated first.
        system_prompt: The system message, if any.
    """
    keep = min(max(keep_turns, 0), len(turns))
    earlier, kept = turns[: len(turns) - keep], turns[len(turns) - keep :]
    head = [instruction] if instruction else []
    if earlier:
        actions = "\n".join(
            f"{index + 1}. {_clip(turn.action)}" for index, turn in enumerate(earlier)
        )
        head.append(f"Earlier in this episode you took these actions, in order:\n{actions}")
    prompts = [turn.prompt for turn in kept] + [observation]
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": "\n\n".join([*head, prompts[0]])})
    for turn, next_prompt in zip(kept, prompts[1:], strict=True):
        messages.append({"role": "assistant", "content": turn.action})
        messages.append({"role": "user", "content": next_prompt})
    return messages


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_ACTION_CHARS else text[: _MAX_ACTION_CHARS - 3] + "..."
