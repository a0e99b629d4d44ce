"""make_env: dispatch a spec to its builder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from agile_llmenvs.envs.bandit import make_bandit_env
from agile_llmenvs.envs.gym import make_gym_env, make_pz_env
from agile_llmenvs.envs.llm import make_llm_env, rollout_env_error
from agile_llmenvs.envs.offline import make_offline_env
from agile_llmenvs.specs import BanditEnvSpec, GymEnvSpec, LLMEnvSpec, OfflineEnvSpec

__all__ = ["make_env"]


def make_env(
    spec: GymEnvSpec | OfflineEnvSpec | LLMEnvSpec | BanditEnvSpec,
    *,
    multi_agent: bool = False,
    extra_wrappers: list[type] | None = None,
    tokenizer: Any | None = None,
    features: pd.DataFrame | str | Path | None = None,
    targets: pd.DataFrame | str | Path | None = None,
    seed: int | None = None,
) -> Any:
    """Build the live environment described by ``spec``.

    Args:
        spec: Any env spec; its type picks the builder.
        multi_agent: Build a ``gym`` spec as a vectorised PettingZoo parallel env.
        extra_wrappers: Wrapper classes applied after the spec's own (gym and PettingZoo).
        tokenizer: The tokenizer of a dataset LLM env.
        features: In-memory (or file) features of a bandit env, overriding the spec's.
        targets: In-memory (or file) targets of a bandit env, overriding the spec's.
        seed: When given, the env is reset once with it so later draws are reproducible.

    Returns:
        A gymnasium ``SyncVectorEnv``/``AsyncVectorEnv``, an ``AsyncPettingZooVecEnv``, a
        bandit env, an :class:`OfflineEnv`, or a ``DatasetEnv``.
    """
    if isinstance(spec, OfflineEnvSpec):
        offline = make_offline_env(spec)
        _seed(offline.env, seed)
        return offline
    if isinstance(spec, GymEnvSpec):
        builder = make_pz_env if multi_agent else make_gym_env
        env = builder(spec, extra_wrappers=extra_wrappers)
        _seed(env, seed)
        return env
    if isinstance(spec, BanditEnvSpec):
        return make_bandit_env(spec, features=features, targets=targets, seed=seed)
    if spec.env_type == "rollout":
        raise rollout_env_error(spec)
    return make_llm_env(spec, tokenizer, seed=seed)


def _seed(env: Any, seed: int | None) -> None:
    if seed is None:
        return
    env.reset(seed=seed)
    if hasattr(env, "action_space") and not callable(env.action_space):
        env.action_space.seed(seed)
