"""Hugging Face ``datasets`` rows (local files or the local cache) scored by a rubric."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from agile_llmenvs.llm_envs.rubric import RubricEnv, load_rubric
from agile_llmenvs.specs import LLMEnvSpec

__all__ = ["make"]

_URLISH = ("http://", "https://")


def make(
    source: str,
    *,
    rubric_file_path: str,
    rubric_name: str | None = None,
    columns: dict[str, str] | None = None,
    prompt_template: dict[str, Any] | None = None,
    max_reward: float | None = None,
    split: str = "train",
    train_test_split: float | None = None,
    seed: int = 0,
) -> RubricEnv:
    """A single-turn env over the rows of ``source``, scored by a rubric.

    ``source`` is a local rows file (jsonl, json, csv, parquet, arrow) or a Hugging Face
    dataset id read from the local cache (nothing is downloaded). The rows are read once per
    argument set and shared by every env built from them.

    Raises:
        DatasetError: the rows cannot be read or lack a mapped column.
        EnvBuildError: the rubric cannot be loaded, or the rows lack what it needs.
    """
    rows = _rows(source, json.dumps(columns, sort_keys=True), split, train_test_split, seed)
    return RubricEnv(
        rows,
        load_rubric(rubric_file_path, rubric_name),
        prompt_template=prompt_template,
        max_reward=max_reward,
    )


@functools.lru_cache(maxsize=16)
def _rows(
    source: str, columns_json: str, split: str, fraction: float | None, seed: int
) -> list[dict[str, Any]]:
    from agile_llmenvs.llm_envs.rows import load_rows

    local = Path(source).exists() and not source.startswith(_URLISH)
    spec = LLMEnvSpec(
        env_type="dataset",
        objective="sft",
        dataset_path=source if local else None,
        hf_dataset_id=None if local else source,
        columns=json.loads(columns_json),
        train_test_split=fraction,
    )
    train, test = load_rows(spec, seed)
    return list((test if split == "test" else train).to_list())
