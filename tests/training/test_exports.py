"""``agile_llmenvs.training`` exports exactly its documented names."""

from __future__ import annotations

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
