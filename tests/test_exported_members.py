"""The fixed public import paths export exactly their documented names."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "agile_llmenvs.specs": {
        "GymEnvSpec",
        "OfflineEnvSpec",
        "LLMEnvSpec",
        "BanditEnvSpec",
        "EnvServiceSpec",
        "EnvSpec",
        "RunManifest",
        "load_manifest",
    },
    "agile_llmenvs.envs": {
        "make_env",
        "make_gym_env",
        "make_pz_env",
        "make_bandit_env",
        "make_llm_env",
        "make_rollout_env_factory",
        "make_single_env",
    },
    "agile_llmenvs.errors": {"AgileLLMEnvsError"},
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_public_names_are_exported(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert PUBLIC[module_name] <= set(module.__all__)
    for name in module.__all__:
        assert hasattr(module, name), f"{module_name}.__all__ names missing {name!r}"


def test_every_error_derives_from_the_root() -> None:
    from agile_llmenvs import errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.AgileLLMEnvsError)
