"""TRL reward functions that see the policy's text only.

TRL hands every reward function ``completions``, which it decodes from each row's
``completion_ids``; in a multi-turn episode those hold the env's observations and the chat
template's turn markers between the policy's turns. TRL passes ``completions`` itself, so a
``rollout_func`` cannot replace it (a column of that name would clash with TRL's keyword);
:func:`policy_text_reward` wraps a reward function so that its ``completions`` is the rollout's
``policy_completion`` column instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["RewardFunc", "policy_text_reward"]

RewardFunc = Callable[..., Any]
"""A TRL reward function: keyword columns in, one reward (or None) per row out."""


def policy_text_reward(func: RewardFunc) -> RewardFunc:
    """``func`` with ``completions`` set to the policy's text only.

    TRL calls the wrapper as it calls any reward function; the wrapper calls ``func`` with
    every column TRL passed, ``completions`` replaced by ``policy_completion``: one assistant
    message per turn the policy played (``[{"role": "assistant", "content": ...}, ...]``, the
    form TRL's own multi-turn completions take, less the env's messages). A single-turn row
    is thus exactly TRL's ``[{"role": "assistant", "content": text}]``, and a reward function
    that reads ``completion[0]["content"]`` (TRL's built-in ones do) reads the first turn.
    ``completion_ids`` stay TRL's: the whole completion, the env's ids included. The wrapper
    keeps ``func``'s name (TRL logs each reward under it) and its being async.

    Raises:
        TypeError: ``func`` is a reward model (or a model's name): TRL scores the text it
            decodes itself with those, so they cannot be given the policy's text.
    """
    import torch
    from trl.trainer.utils import get_callable_name, is_async_callable

    if isinstance(func, str | torch.nn.Module):
        raise TypeError(
            "a reward model scores the completions TRL decodes (the env's text included); "
            "wrap it in a reward function that reads `completions` and calls the model"
        )
    wrapped: RewardFunc
    if is_async_callable(func):

        async def wrapped(**columns: Any) -> Any:
            return await func(**_policy_columns(columns))

    else:

        def wrapped(**columns: Any) -> Any:
            return func(**_policy_columns(columns))

    wrapped.__name__ = wrapped.__qualname__ = get_callable_name(func)
    wrapped.__doc__ = getattr(func, "__doc__", None)
    return wrapped


def _policy_columns(columns: dict[str, Any]) -> dict[str, Any]:
    """TRL's reward-function columns with ``completions`` the policy's text only."""
    if "policy_completion" not in columns:
        raise ValueError(
            "no policy_completion column: a policy_text_reward function scores the rows of "
            "TRLEnv.rollout_func (pass it through TRLEnv.trainer_kwargs(reward_funcs=...))"
        )
    return {**columns, "completions": columns["policy_completion"]}
