"""``agile_llmenvs.training`` exports exactly its documented names."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import agile_llmenvs.training as training


def test_training_exports() -> None:
    assert set(training.__all__) == {
        "CheckpointError",
        "PolicyBatch",
        "TrainResult",
        "TrainingSpec",
        "train_dpo",
        "train_grpo",
        "train_sft",
    }
    for name in training.__all__:
        assert hasattr(training, name)


SUB_PACKAGES = ("credit", "generation", "grpo", "objective", "policy", "run", "supervised")


@pytest.mark.parametrize("name", SUB_PACKAGES)
def test_each_sub_package_face_exports_what_it_names(name: str) -> None:
    face = importlib.import_module(f"agile_llmenvs.training.{name}")
    for exported in face.__all__:
        assert hasattr(face, exported), f"training.{name}.__all__ names missing {exported!r}"


def test_training_holds_few_modules_of_its_own() -> None:
    folder = Path(training.__file__).parent
    assert sorted(p.name for p in folder.glob("*.py")) == [
        "__init__.py",
        "command.py",
        "eval_config.py",
    ]
    assert sorted(p.name for p in folder.iterdir() if (p / "__init__.py").is_file()) == list(
        SUB_PACKAGES
    )
