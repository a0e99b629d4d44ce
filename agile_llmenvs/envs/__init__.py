"""Turn specs into live environments.

:func:`make_env` dispatches on the spec: gymnasium vector envs, vectorised PettingZoo parallel
envs, contextual bandits over tables, offline datasets and LLM dataset envs; rollout envs get
a factory of harnesses from :func:`make_rollout_env_factory`.

Names are imported on first use, so a subprocess worker that needs one builder (a PettingZoo
worker, say) does not pay for pandas and the rest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agile_llmenvs.envs.bandit import BanditEnv, BanditEnvProtocol, make_bandit_env
    from agile_llmenvs.envs.dispatch import make_env
    from agile_llmenvs.envs.gym import make_gym_env, make_pz_env, make_single_env
    from agile_llmenvs.envs.llm import make_llm_env
    from agile_llmenvs.envs.offline import OfflineEnv, make_offline_env
    from agile_llmenvs.envs.rollout import make_rollout_env_factory

_EXPORTS = {
    "BanditEnv": "bandit",
    "BanditEnvProtocol": "bandit",
    "OfflineEnv": "offline",
    "make_bandit_env": "bandit",
    "make_env": "dispatch",
    "make_gym_env": "gym",
    "make_llm_env": "llm",
    "make_offline_env": "offline",
    "make_pz_env": "gym",
    "make_rollout_env_factory": "rollout",
    "make_single_env": "gym",
}

__all__ = [
    "BanditEnv",
    "BanditEnvProtocol",
    "OfflineEnv",
    "make_bandit_env",
    "make_env",
    "make_gym_env",
    "make_llm_env",
    "make_offline_env",
    "make_pz_env",
    "make_rollout_env_factory",
    "make_single_env",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
