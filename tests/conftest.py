"""Shared fixtures: offline Hugging Face settings and the tiny local model, built once."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

# after the offline settings: it imports the package (and transformers)
from vllm_servers import (
    vllm_lora_server,
    vllm_model_dir,
    vllm_server,
    vllm_server_factory,
    vllm_training_server,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = REPO_ROOT / "manifests"

# real `vllm serve` fixtures
__all__ = [
    "vllm_lora_server",
    "vllm_model_dir",
    "vllm_server",
    "vllm_server_factory",
    "vllm_training_server",
]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's tiny random model and tokenizer, built offline once per session."""
    from agile_llmenvs.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the terminal env's tests where this host cannot run its sandbox (bubblewrap),
    saying why; CI sets ``AGILE_LLMENVS_REQUIRE_SANDBOX=1`` so that they fail there instead."""
    terminal = [item for item in items if "terminal" in item.nodeid]
    if not terminal or os.environ.get("AGILE_LLMENVS_REQUIRE_SANDBOX"):
        return
    from agile_llmenvs.adapters.terminal.jail import check_bubblewrap
    from agile_llmenvs.errors import EnvBuildError

    try:
        check_bubblewrap()
    except EnvBuildError as exc:
        skip = pytest.mark.skip(reason=f"no terminal sandbox on this host: {exc}")
        for item in terminal:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    """Each test starts with no ``accelerate`` state: a trainer run in one test (TRL's, say,
    with another mixed precision) must not decide how the next test's ``Accelerator`` is
    set up, as it would in one process otherwise."""
    yield
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState, PartialState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        PartialState._reset_state()


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's tiny random vision-language model and its processor, built once."""
    from agile_llmenvs.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm") / "model")


def sharpen(model_dir: Path, out_dir: Path, factor: float = 3.0) -> Path:
    """A copy of ``model_dir`` whose output layer (tied to the embeddings) is ``factor`` times
    larger: the tiny random model's next-token distributions are nearly flat, and a peaked one
    shows what top-p, top-k and min-p truncate (at 3, top-p 0.8 keeps about a third of the
    vocabulary instead of three quarters)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def sharp_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a peaked next-token distribution (:func:`sharpen`)."""
    return sharpen(tiny_model_dir, tmp_path_factory.mktemp("sharp-model") / "model")
