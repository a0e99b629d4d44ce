"""Build gymnasium vector envs and vectorised PettingZoo parallel envs from a GymEnvSpec."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

from agile_llmenvs._imports import load_env_config, load_object
from agile_llmenvs.errors import AgileLLMEnvsError, EnvBuildError
from agile_llmenvs.specs import GymEnvSpec

__all__ = ["WrapperLike", "make_gym_env", "make_pz_env", "make_single_env"]

WrapperLike = tuple[Any, dict[str, Any]] | str | Callable[..., Any]
"""A wrapper: an import path, a class/callable, or ``(path or class, kwargs)``."""


def make_single_env(spec: GymEnvSpec, *, multi_agent: bool = False) -> Any:
    """Create a single (non-vectorised) env instance, with the spec's wrappers applied.

    Returns a ``gymnasium.Env``, or a PettingZoo ``ParallelEnv`` when ``multi_agent``.

    Raises:
        EnvBuildError: the env cannot be built (unknown id, constructor error, ...).
        ImportPathError: an entrypoint, factory or wrapper path does not resolve.
    """
    env = _build_raw(spec, multi_agent=multi_agent)
    env = _apply_wrappers(env, spec.env_wrappers or [])
    if not multi_agent:
        env = _cast_observations(env, spec.default_type)
    return env


def make_gym_env(
    spec: GymEnvSpec,
    extra_wrappers: list[type] | None = None,
    wrappers: Sequence[WrapperLike] | None = None,
) -> AsyncVectorEnv | SyncVectorEnv:
    """Instantiate the vectorised gymnasium env: ``num_envs`` copies, sync or in subprocesses.

    Args:
        spec: The env spec.
        extra_wrappers: Wrapper classes applied (without arguments) after all others.
        wrappers: Wrappers applied after the spec's ``env_wrappers``.
    """
    env_fn = _env_thunk(spec, multi_agent=False, wrappers=_extra(wrappers, extra_wrappers))
    env_fns = [env_fn] * spec.num_envs
    if spec.sync:
        return SyncVectorEnv(env_fns)
    return AsyncVectorEnv(env_fns)


def make_pz_env(
    spec: GymEnvSpec,
    extra_wrappers: list[type] | None = None,
    wrappers: Sequence[WrapperLike] | None = None,
) -> Any:
    """Instantiate ``num_envs`` PettingZoo parallel envs as one vector env.

    Each copy runs in its own subprocess (``AsyncPettingZooVecEnv``) unless ``spec.sync``.
    ``name`` is the env module (its ``parallel_env`` is called) unless an ``entrypoint`` or
    ``factory`` builds the env.
    """
    from agile_llmenvs.envs.pettingzoo_vec import AsyncPettingZooVecEnv, SyncPettingZooVecEnv

    env_fn = _env_thunk(spec, multi_agent=True, wrappers=_extra(wrappers, extra_wrappers))
    env_fns = [env_fn] * spec.num_envs
    if spec.sync:
        return SyncPettingZooVecEnv(env_fns)
    return AsyncPettingZooVecEnv(env_fns)


def _extra(wrappers: Sequence[WrapperLike] | None, classes: list[type] | None) -> list[Any]:
    return [*(wrappers or []), *(classes or [])]


def _env_thunk(spec: GymEnvSpec, *, multi_agent: bool, wrappers: list[Any]) -> Callable[[], Any]:
    def thunk() -> Any:
        env = make_single_env(spec, multi_agent=multi_agent)
        return _apply_wrappers(env, wrappers)

    return thunk


def _build_raw(spec: GymEnvSpec, *, multi_agent: bool) -> Any:
    kwargs = load_env_config(spec.env_config)
    try:
        if spec.factory is not None:
            factory = load_object(spec.factory, file=spec.path)
            return factory(spec.entrypoint or spec.env_id, **kwargs)
        if spec.entrypoint is not None:
            return load_object(spec.entrypoint, file=spec.path)(**kwargs)
        if multi_agent:
            return _pettingzoo_module(spec.env_id).parallel_env(**kwargs)
        return gym.make(spec.env_id, **kwargs)
    except AgileLLMEnvsError:
        raise
    except Exception as exc:
        raise EnvBuildError(
            f"cannot build env {spec.entrypoint or spec.env_id!r}: {type(exc).__name__}: {exc}"
        ) from exc


def _pettingzoo_module(name: str) -> Any:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise EnvBuildError(
            f"multi-agent env {name!r}: expected an importable PettingZoo env module such as "
            f"'pettingzoo.butterfly.pistonball_v6' ({exc})"
        ) from exc
    if not hasattr(module, "parallel_env"):
        raise EnvBuildError(f"multi-agent env {name!r}: the module has no `parallel_env`")
    return module


def _apply_wrappers(env: Any, wrappers: Sequence[Any]) -> Any:
    for entry in wrappers:
        target, kwargs = entry if isinstance(entry, tuple) else (entry, {})
        wrapper = load_object(target) if isinstance(target, str) else target
        try:
            env = wrapper(env, **kwargs)
        except Exception as exc:
            raise EnvBuildError(
                f"env_wrappers: {getattr(wrapper, '__name__', wrapper)!r} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    return env


def _cast_observations(env: gym.Env[Any, Any], default_type: str) -> gym.Env[Any, Any]:
    space = env.observation_space
    dtype = np.dtype(default_type)
    is_float_box = isinstance(space, gym.spaces.Box) and np.issubdtype(space.dtype, np.floating)
    if not (is_float_box and np.issubdtype(dtype, np.floating) and space.dtype != dtype):
        return env
    assert isinstance(space, gym.spaces.Box)
    cast_space = gym.spaces.Box(space.low.astype(dtype), space.high.astype(dtype), dtype=dtype)
    return gym.wrappers.TransformObservation(env, partial(np.asarray, dtype=dtype), cast_space)
