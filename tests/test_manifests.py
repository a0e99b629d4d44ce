"""Every shipped manifest validates, and together they cover every env type."""

from __future__ import annotations

from pathlib import Path

import pytest

from agile_llmenvs.specs import LLMEnvSpec, load_manifest

MANIFESTS = sorted((Path(__file__).resolve().parents[1] / "manifests").glob("*.yaml"))


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_validates(path: Path) -> None:
    manifest = load_manifest(path)
    for field in ("path", "dataset_path", "features", "targets", "rubric_file_path"):
        value = getattr(manifest.env, field, None)
        if value is not None:
            assert Path(value).exists(), f"{path.name}: {field} {value!r} does not exist"


def test_one_example_per_env_type() -> None:
    kinds = set()
    for path in MANIFESTS:
        manifest = load_manifest(path)
        env = manifest.env
        kinds.add(env.env_type)
        if isinstance(env, LLMEnvSpec) and env.env_type == "rollout":
            kinds.add(f"rollout:{env.source}")
        if manifest.multi_agent:
            kinds.add("pettingzoo")
    assert {
        "gym",
        "offline",
        "bandit",
        "rollout",
        "dataset",
        "pettingzoo",
        "rollout:dataset",
        "rollout:entrypoint",
        "rollout:env_url",
    } <= kinds


@pytest.mark.parametrize(
    "name",
    [
        "rollout_entrypoint.yaml",
        "grpo_gem_guess.yaml",
        "grpo_reasoning_gym.yaml",
        "rollout_digits.yaml",
    ],
)
def test_rollout_manifests_build_and_reset(name: str, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from agile_llmenvs.envs import make_rollout_env_factory

    manifest = load_manifest(MANIFESTS[0].parent / name)
    spec = manifest.env
    assert isinstance(spec, LLMEnvSpec)
    for requirement in (spec.env_packages or {}).get("pip", []):
        pytest.importorskip({"gem-llm": "gem", "reasoning-gym": "reasoning_gym"}[requirement])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    factory, max_turns = make_rollout_env_factory(spec, tokenizer, seed=manifest.seed)
    assert max_turns >= 1
    harness = factory()
    assert harness.reset(seed=0, row_index=0 if harness.dataset_size() else None)
    harness.close()
