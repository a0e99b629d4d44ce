"""Training on dataset envs: SFT (:func:`train_sft`) and DPO (:func:`train_dpo`), and the loop
they share (one optimizer step per dataset batch)."""

from __future__ import annotations

from agile_llmenvs.training.supervised.dpo import (
    DEFAULT_DPO_BETA,
    DPO_METRICS,
    DPOObjective,
    train_dpo,
)
from agile_llmenvs.training.supervised.loop import (
    DatasetObjective,
    RunsAReference,
    dataset_update,
    labelled_logps,
    train_on_dataset,
)
from agile_llmenvs.training.supervised.sft import SFT_METRICS, SFTObjective, train_sft

__all__ = [
    "DEFAULT_DPO_BETA",
    "DPO_METRICS",
    "SFT_METRICS",
    "DPOObjective",
    "DatasetObjective",
    "RunsAReference",
    "SFTObjective",
    "dataset_update",
    "labelled_logps",
    "train_dpo",
    "train_on_dataset",
    "train_sft",
]
