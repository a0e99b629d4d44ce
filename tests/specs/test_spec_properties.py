"""Property tests: random bad manifests only ever raise pydantic's ValidationError."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from agile_llmenvs.errors import ManifestError
from agile_llmenvs.specs import LLMEnvSpec, RunManifest, load_manifest

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
VALID = [yaml.safe_load(p.read_text()) for p in sorted(MANIFESTS.glob("*.yaml"))]
FIELD_NAMES = sorted(
    {*LLMEnvSpec.model_fields, *RunManifest.model_fields, "dataset_path", "features", "sync"}
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "gym",
            "offline",
            "rollout",
            "dataset",
            "bandit",
            "sft",
            "preference",
            "grpo",
            "a:B",
            "ws://h:1",
            "float32",
            "rows.jsonl",
        ]
    ),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=6)), inner, max_size=4
        ),
    ),
    max_leaves=10,
)


def _validate_only_with_validation_errors(data: Any) -> None:
    with contextlib.suppress(ValidationError):
        RunManifest.model_validate(data)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_random_data_raises_only_validation_error(data: Any) -> None:
    _validate_only_with_validation_errors(data)
    _validate_only_with_validation_errors({"env": data})


@settings(max_examples=400, deadline=None)
@given(
    base=st.sampled_from(VALID),
    section=st.sampled_from(["env", "training", "model", None]),
    key=st.sampled_from(FIELD_NAMES),
    value=json_values,
)
def test_mutated_valid_manifests_raise_only_validation_error(
    base: dict[str, Any], section: str | None, key: str, value: Any
) -> None:
    data = copy.deepcopy(base)
    target = data if section is None else data.setdefault(section, {})
    if isinstance(target, dict):
        target[key] = value
    _validate_only_with_validation_errors(data)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=60))
def test_random_yaml_files_raise_manifest_or_validation_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(text, encoding="utf-8")
    with contextlib.suppress(ManifestError, ValidationError):
        load_manifest(path)


@pytest.mark.parametrize("data", VALID, ids=[p.stem for p in sorted(MANIFESTS.glob("*.yaml"))])
def test_valid_manifests_stay_valid_through_a_round_trip(data: dict[str, Any]) -> None:
    manifest = RunManifest.model_validate(data)
    assert RunManifest.model_validate_json(manifest.model_dump_json()) == manifest
    assert (
        RunManifest.model_validate(yaml.safe_load(yaml.safe_dump(manifest.model_dump(mode="json"))))
        == manifest
    )
