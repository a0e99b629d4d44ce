"""No other library's progress bar outside ``--debug``: training from Python, and validate.

Each test first shows the bar does appear where nothing turns it off, so an absence means
something.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training import train_grpo

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "manifests" / "data" / "digits.jsonl"


def test_training_from_python_shows_no_loading_or_writing_bar(
    make_manifest: Callable[..., RunManifest],
    tiny_model_dir: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.enable_progress_bar()
    AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert "Loading weights" in capfd.readouterr().err  # the bar, where nothing stops it
    train_grpo(make_manifest("quickstart.yaml", max_steps=1, batch_size=2, group_size=2))
    err = capfd.readouterr().err
    assert "Loading weights" not in err
    assert "Writing model shards" not in err
    assert transformers_logging.is_progress_bar_enabled()  # the caller's setting, restored


def _python(code: str, cache: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1"},
    )
    return done.stderr


def test_validate_shows_no_generating_bar(tmp_path: Path) -> None:
    # a fresh datasets cache each, so the rows are converted (and the bar due) anew
    shown = _python(
        f"import datasets; datasets.load_dataset('json', data_files={str(DIGITS)!r})",
        tmp_path / "plain",
    )
    assert "Generating train split" in shown
    validated = _python(
        "from agile_llmenvs.cli import main; "
        f"raise SystemExit(main(['validate', {str(ROOT / 'manifests' / 'quickstart.yaml')!r}]))",
        tmp_path / "validate",
    )
    assert "Generating train split" not in validated
