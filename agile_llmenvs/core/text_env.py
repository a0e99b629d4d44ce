"""The one adapter between the two faces: any :class:`TextEnv` as an :class:`Environment`.

A ``TextEnv`` is stateful, so each episode needs an env instance of its own. Given a factory,
the adapter makes one per ``reset`` and closes it when the episode ends, so a runner can keep
any number of episodes in flight through one ``Environment``. Given a single instance, it
runs one episode at a time: a new ``reset`` leaves the previous episode's states stale.
Either way ``pure_step`` is False by default: a state stands for a live env that moves on when
stepped, so stepping a state twice raises :class:`~agile_llmenvs.errors.StaleStateError`.

A factory of deterministic envs may be declared ``pure_step=True``: each step then rebuilds the
episode from the state value alone (a fresh instance, reset with the state's seed and task, the
state's earlier actions replayed), so any state may be stepped any number of times. That costs
one reset and ``step_count`` replayed steps per step: nothing extra for single-turn envs.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from agile_llmenvs.core.contract import (
    SupportsDatasetSize,
    SupportsMaxTurns,
    SupportsTools,
    TextEnv,
)
from agile_llmenvs.core.types import Action, EnvironmentSpec, State, StepResult
from agile_llmenvs.errors import EnvExecutionError, StaleStateError

__all__ = ["TextEnvironment", "adopt_episode", "from_text_env", "render_action"]


def render_action(action: Action) -> str:
    """The text a ``TextEnv`` reads for ``action``.

    Tool calls that an API reported apart from the text are appended in the Hermes form
    (``<tool_call>{...}</tool_call>``) that local models write themselves, so an env parses
    one form whichever backend produced the action.
    """
    if not action.tool_calls or "<tool_call>" in action.text:
        return action.text
    calls = [
        "<tool_call>"
        + json.dumps({"name": c.name, "arguments": dict(c.arguments)})
        + "</tool_call>"
        for c in action.tool_calls
    ]
    return "\n".join([action.text, *calls]) if action.text else "\n".join(calls)


@dataclass
class _Episode:
    env: TextEnv
    step_count: int = 0


class TextEnvironment:
    """A :class:`TextEnv` (or a factory of them) behind the state-passing interface.

    Build it with :func:`from_text_env`.
    """

    def __init__(
        self,
        factory: Callable[[], TextEnv],
        *,
        name: str,
        single: TextEnv | None = None,
        pure_step: bool = False,
    ) -> None:
        if pure_step and single is not None:
            raise ValueError("pure_step=True needs a factory of envs, not one instance")
        self._factory = factory
        self._single = single
        self._pure = pure_step
        self._episodes: dict[int, _Episode] = {}
        self._ids = itertools.count()
        probe = single if single is not None else factory()
        try:
            self._spec = _spec_of(probe, name, pure_step)
        finally:
            if single is None:
                probe.close()

    @property
    def spec(self) -> EnvironmentSpec:
        """What the env is and offers (read from a probe instance)."""
        return self._spec

    def reset(
        self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[State, dict[str, Any]]:
        """Start an episode; ``options`` are passed to ``TextEnv.reset`` as the task."""
        task = dict(options or {})
        if self._pure:
            return self._reset_pure(seed, task)
        if self._single is not None:
            self._episodes.clear()  # the instance moves on: earlier states go stale
            env = self._single
        else:
            env = self._factory()
        try:
            observation, info = env.reset(seed=seed, **task)
            _check_info(info, self._spec.name, 0)
        except BaseException:
            if self._single is None:
                env.close()
            raise
        episode_id = next(self._ids)
        self._episodes[episode_id] = _Episode(env)
        messages = ({"role": "user", "content": observation},)
        state = State(observation, messages, task=task, episode_id=episode_id, seed=seed)
        return state, dict(info)

    def _reset_pure(self, seed: int | None, task: dict[str, Any]) -> tuple[State, dict[str, Any]]:
        env = self._factory()
        try:
            observation, info = env.reset(seed=seed, **task)
        finally:
            env.close()
        _check_info(info, self._spec.name, 0)
        messages = ({"role": "user", "content": observation},)
        state = State(observation, messages, task=task, episode_id=next(self._ids), seed=seed)
        return state, dict(info)

    def step(self, state: State, action: Action) -> StepResult:
        """Apply ``action`` to the live env behind ``state``.

        Raises:
            StaleStateError: ``state`` was stepped already, its episode ended or was
                released, or a newer reset took the single env instance (for a pure-step
                env: only when the episode ended).
        """
        if self._pure:
            return self._step_pure(state, action)
        episode = self._episodes.get(state.episode_id)
        if episode is None or episode.step_count != state.step_count or state.done:
            raise StaleStateError(
                f"episode {state.episode_id} at step {state.step_count} cannot be stepped: "
                "the env behind it has moved on (this env's step is not pure: step each "
                "state once, and pass a factory to from_text_env to run several episodes)"
            )
        text = render_action(action)
        try:
            observation, reward, terminated, truncated, info = episode.env.step(text)
            _check_reward(reward, self._spec.name, state.step_count + 1)
            _check_info(info, self._spec.name, state.step_count + 1)
        except BaseException:
            self.release(state)
            raise
        episode.step_count += 1
        result = _advance(state, text, observation, reward, terminated, truncated, info)
        if result.done:
            self.release(state)
        return result

    def _step_pure(self, state: State, action: Action) -> StepResult:
        if state.done:
            raise StaleStateError(
                f"episode {state.episode_id} ended at step {state.step_count}; "
                "a finished state cannot be stepped"
            )
        text = render_action(action)
        env = self._factory()
        try:
            env.reset(seed=state.seed, **state.task)
            for message in state.messages:
                if message["role"] == "assistant":
                    env.step(str(message["content"]))
            observation, reward, terminated, truncated, info = env.step(text)
        finally:
            env.close()
        _check_reward(reward, self._spec.name, state.step_count + 1)
        _check_info(info, self._spec.name, state.step_count + 1)
        return _advance(state, text, observation, reward, terminated, truncated, info)

    def release(self, state: State) -> None:
        """End ``state``'s episode and close its env (a no-op when ended, or pure-step)."""
        episode = self._episodes.pop(state.episode_id, None)
        if episode is not None and self._single is None:
            episode.env.close()

    def close(self) -> None:
        """Close every env of an episode still running, and the single instance if any."""
        for episode_id in list(self._episodes):
            episode = self._episodes.pop(episode_id)
            if self._single is None:
                episode.env.close()
        if self._single is not None:
            self._single.close()


def adopt_episode(env: TextEnv, state: State, *, name: str | None = None) -> TextEnvironment:
    """``env``'s running episode, as it is now, behind the state-passing interface.

    ``env`` was reset and stepped elsewhere (by a rollout harness, say) to the point
    ``state`` describes; the returned environment drives that live episode from ``state``
    on, as if it had played it itself, so a strategy can checkpoint it (ProcessFork ships
    ``env`` as it is). Its ``close`` closes ``env``: leave it open where another owns ``env``.
    """
    environment = TextEnvironment(lambda: env, name=name or type(env).__name__, single=env)
    environment._episodes[state.episode_id] = _Episode(env, state.step_count)
    return environment


def _check_reward(reward: Any, env_name: str, step: int) -> None:
    """Refuse a reward that is not a finite number, as the wire and the rollout harness do:
    the episode then ends in an env error, and one NaN does not reach an average."""
    try:
        value = float(reward)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise EnvExecutionError(
            f"env {env_name!r}, step {step}: the reward is {reward!r}, not a finite number; "
            "return a finite float"
        )


def _check_info(info: Mapping[str, Any] | None, env_name: str, step: int) -> None:
    """Refuse a non-finite number anywhere in ``info`` (nested too), as a non-finite reward
    is refused: the episode ends in an env error naming the key path."""
    found = _non_finite_in(info or {}, "info")
    if found is not None:
        where = f"step {step}" if step else "reset"
        path, value = found
        raise EnvExecutionError(
            f"env {env_name!r}, {where}: {path} is {value!r}, not a finite number; "
            "return finite numbers in info"
        )


def _non_finite_in(value: Any, path: str) -> tuple[str, float] | None:
    """The key path and value of the first non-finite number in ``value`` (mappings,
    sequences, numpy scalars and arrays), if any."""
    if isinstance(value, float | np.floating):
        return None if math.isfinite(value) else (path, float(value))
    if isinstance(value, np.ndarray):
        if value.dtype.kind != "f" or bool(np.isfinite(value).all()):
            return None
        index = tuple(int(i) for i in np.argwhere(~np.isfinite(value))[0])
        return f"{path}{list(index)}", float(value[index])
    if isinstance(value, Mapping):
        items: Any = ((f"{path}[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for item_path, item in items:
        found = _non_finite_in(item, item_path)
        if found is not None:
            return found
    return None


def _advance(
    state: State,
    text: str,
    observation: str,
    reward: float,
    terminated: bool,
    truncated: bool,
    info: dict[str, Any],
) -> StepResult:
    done = bool(terminated or truncated)
    turns = [{"role": "assistant", "content": text}]
    if observation or not done:
        turns.append({"role": "user", "content": observation})
    next_state = replace(
        state,
        observation=observation,
        messages=(*state.messages, *turns),
        step_count=state.step_count + 1,
        done=done,
    )
    return StepResult(next_state, float(reward), bool(terminated), bool(truncated), info)


def _spec_of(env: TextEnv, name: str, pure_step: bool) -> EnvironmentSpec:
    return EnvironmentSpec(
        name=name,
        pure_step=pure_step,
        dataset_size=env.dataset_size if isinstance(env, SupportsDatasetSize) else None,
        max_turns=env.max_turns if isinstance(env, SupportsMaxTurns) else None,
        tools=tuple(env.tools) if isinstance(env, SupportsTools) else (),
    )


def from_text_env(
    env: TextEnv | Callable[[], TextEnv],
    *,
    name: str | None = None,
    pure_step: bool = False,
) -> TextEnvironment:
    """Adapt a ``TextEnv`` (or a zero-argument factory of them) to :class:`Environment`.

    Args:
        env: A factory (a ``TextEnv`` class, say), so that each episode gets its own
            instance (what batched runners need), or one instance, for one episode at a time.
        name: A label for results; defaults to the env's class (or the factory's) name.
        pure_step: Declare the factory's envs deterministic given the seed and task: each
            step then rebuilds the episode from the state (see the module docstring), so
            states may be stepped many times and branched for free.

    Returns:
        The adapted environment.

    Raises:
        TypeError: ``env`` is neither a ``TextEnv`` nor callable.
        ValueError: ``pure_step=True`` with a single instance instead of a factory.
    """
    if isinstance(env, TextEnv) and not isinstance(env, type):  # a class is a factory
        label = name or type(env).__name__
        return TextEnvironment(lambda: env, name=label, single=env, pure_step=pure_step)
    if not callable(env):
        raise TypeError(
            f"from_text_env needs a TextEnv or a factory of them; got {type(env).__name__}"
        )
    label = name or getattr(env, "__name__", None) or type(env).__name__
    return TextEnvironment(env, name=label, pure_step=pure_step)
