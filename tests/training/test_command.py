"""``agile-llmenvs train``: dispatch on the algorithm, and errors as exit statuses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from agile_llmenvs.cli import main
from agile_llmenvs.specs import RunManifest, dump_manifest


def test_train_runs_the_manifest_algorithm(
    make_manifest: Callable[..., RunManifest], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = make_manifest("sft_digits.yaml", max_steps=2)
    path = tmp_path / "sft.yaml"
    dump_manifest(manifest, path)
    assert main(["train", str(path)]) == 0
    assert "trained 2 steps" in capsys.readouterr().out
    assert main(["train", str(path), "--resume"]) == 0  # nothing left to run, still fine


def test_train_reports_a_manifest_without_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "env_only.yaml"
    path.write_text("env: {env_type: gym, name: CartPole-v1}\n")
    assert main(["train", str(path)]) == 2
    assert "no `training` section" in capsys.readouterr().err
