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
