"""Manifests for the training tests: the shipped digits data, short runs, tmp output dirs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agile_llmenvs.specs import ModelSpec, RunManifest, TrainingSpec, load_manifest

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
HERE = Path(__file__).resolve().parent

MakeManifest = Callable[..., RunManifest]


@pytest.fixture
def make_manifest(tiny_model_dir: Path, tmp_path: Path) -> MakeManifest:
    """A shipped manifest with the session's tiny model, an output dir under ``tmp_path`` and
    ``training`` / ``env`` fields overridden."""

    def make(name: str, *, env: dict[str, Any] | None = None, **training: Any) -> RunManifest:
        manifest = load_manifest(MANIFESTS / name)
        assert manifest.training is not None
        settings = {"output_dir": str(tmp_path / "run"), **training}
        return manifest.model_copy(
            update={
                "model": ModelSpec(path=str(tiny_model_dir)),
                "env": manifest.env.model_copy(update=env or {}),
                "training": TrainingSpec.model_validate(
                    {**manifest.training.model_dump(exclude_unset=True), **settings}
                ),
            }
        )

    return make


@pytest.fixture
def dense_env() -> dict[str, Any]:
    """Env overrides: the digits rows scored by the share of digits in the completion."""
    return {"rubric_file_path": str(HERE / "rubrics.py"), "rubric_name": "digit_share"}
