"""Context restart: the prompt of a new segment when an episode outgrows its token budget.

The new prompt summarises the actions taken so far and keeps the latest turns verbatim (as
messages), so the policy can go on without the whole transcript. Its text is prompt only: it
is rendered fresh and never trained on, and the new segment is its own training sample.
:func:`fit_restart` fits it within the budget: the oldest actions of the summary go first,
then the verbatim turns, oldest first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FittedRestart", "TurnText", "fit_restart", "restart_messages"]

_MAX_ACTION_CHARS = 200
#: The share of the budget a restart prompt aims for, so the new segment has room for turns.
_TARGET_SHARE = 0.75


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
    drop_actions: int = 0,
) -> list[dict[str, Any]]:
    """Messages that restart an episode's context.

    Args:
        turns: Every turn played so far, oldest first.
        observation: The observation the policy answers next.
        keep_turns: How many of the latest turns to keep verbatim.
        instruction: The episode's instruction, repeated first.
        system_prompt: The system message, if any.
        drop_actions: How many of the oldest summarised actions to leave out (the summary
            says how many).
    """
    keep = min(max(keep_turns, 0), len(turns))
    earlier, kept = turns[: len(turns) - keep], turns[len(turns) - keep :]
    drop = min(max(drop_actions, 0), len(earlier))
    head = [instruction] if instruction else []
    if earlier and drop == len(earlier):
        head.append(f"Earlier in this episode you took {drop} actions (not listed, for length).")
    elif earlier:
        listed = [f"{i + 1}. {_clip(turn.action)}" for i, turn in enumerate(earlier) if i >= drop]
        if drop:
            listed.insert(0, f"(actions 1-{drop} left out, for length)")
        actions = "\n".join(listed)
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


@dataclass(frozen=True)
class FittedRestart:
    """A restart prompt fitted within a token budget.

    Attributes:
        ids: The prompt's ids.
        fits: Whether it is within the budget (False: even the shortest restart, the
            instruction and the latest observation alone, is over it; ``ids`` is that one).
        summary: What was left out, for the episode's ``info["restart"]``:
            ``prompt_tokens``, ``kept_turns``, ``summarised_actions``, ``dropped_actions``.
    """

    ids: list[int]
    fits: bool
    summary: dict[str, int] = field(default_factory=dict)


def fit_restart(
    turns: Sequence[TurnText],
    observation: str,
    *,
    budget: int,
    render: Callable[[list[dict[str, Any]]], list[int]],
    keep_turns: int,
    instruction: str = "",
    system_prompt: str | None = None,
) -> FittedRestart:
    """The longest restart prompt within ``budget`` tokens (``render`` gives a prompt's ids).

    It aims for three quarters of the budget, so the new segment has room for turns before it
    restarts again: it keeps as many of the ``keep_turns`` latest turns verbatim as fit, and
    of the summarised actions leaves out the oldest first (a binary search over how many).
    When nothing fits the aim, the shortest restart (instruction and observation only) is
    taken if it is within the budget itself.
    """
    target = max(1, int(budget * _TARGET_SHARE))

    def build(keep: int, drop: int) -> list[int]:
        return render(
            restart_messages(
                turns,
                observation,
                keep_turns=keep,
                instruction=instruction,
                system_prompt=system_prompt,
                drop_actions=drop,
            )
        )

    def fitted(ids: list[int], keep: int, drop: int) -> FittedRestart:
        summarised = len(turns) - keep
        summary = {
            "prompt_tokens": len(ids),
            "kept_turns": keep,
            "summarised_actions": summarised - drop,
            "dropped_actions": drop,
        }
        return FittedRestart(ids, len(ids) <= budget, summary)

    for keep in range(min(max(keep_turns, 0), len(turns)), -1, -1):
        earlier = len(turns) - keep
        low, high = 0, earlier  # the fewest dropped actions that fit lies in [low, high]
        ids = build(keep, high)
        if len(ids) > target:
            continue
        best = (ids, high)
        while low < high:
            middle = (low + high) // 2
            ids = build(keep, middle)
            if len(ids) <= target:
                best, high = (ids, middle), middle
            else:
                low = middle + 1
        return fitted(best[0], keep, best[1])
    return fitted(build(0, len(turns)), 0, len(turns))
