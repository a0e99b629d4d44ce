"""Tests of the built-in offline tiny vision-language model (agile_llmenvs.tiny_vlm)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from image_envs import square
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from agile_llmenvs.tiny_vlm import (
    IMAGE_TOKEN,
    TinyVLMError,
    build_tiny_vlm,
    default_tiny_vlm_dir,
    is_vision_model,
    load_processor,
)


def test_it_builds_offline_and_is_deterministic(tmp_path: Path) -> None:
    first = build_tiny_vlm(tmp_path / "a")  # ~10 s on 2 cores, mostly training the tokenizer
    second = build_tiny_vlm(tmp_path / "b")
    weights_a, weights_b = (
        load_file(first / "model.safetensors"),
        load_file(second / "model.safetensors"),
    )
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert any(k.startswith("visual.") for k in weights_a)  # a vision tower
    assert is_vision_model(first)
    assert build_tiny_vlm(first) == first  # the same build is returned as it is


def test_the_model_and_its_processor_load_and_agree(tiny_vlm_dir: Path) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    processor = load_processor(tiny_vlm_dir)
    tokenizer = processor.tokenizer
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert model.config.get_text_config().vocab_size == len(tokenizer)
    # 56 x 56 pixels: 4 x 4 patches of 14, merged 2 x 2 into 4 tokens; 1176 = 3 x 2 x 14 x 14
    out = processor(
        text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[square((9, 9, 9))]
    )
    assert list(out["input_ids"][0]).count(model.config.image_token_id) == 4
    assert tuple(out["pixel_values"].shape) == (16, 1176)
    # larger images are scaled down to at most 56 x 56 pixels' worth
    big = processor(text=["<|image_pad|>"], images=[square((9, 9, 9), 224, 224)])
    assert big["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_a_different_build_is_not_overwritten_silently(tmp_path: Path) -> None:
    (tmp_path / "other.txt").write_text("mine")
    with pytest.raises(TinyVLMError, match="already holds other files"):
        build_tiny_vlm(tmp_path)
    with pytest.raises(TinyVLMError, match="hidden_size a positive multiple of 16"):
        build_tiny_vlm(tmp_path / "x", hidden_size=40)


def test_the_default_cache_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGILE_LLMENVS_CACHE", str(tmp_path))
    assert default_tiny_vlm_dir() == tmp_path / "tiny-vlm-v1"


def test_a_text_model_is_not_a_vision_model(tiny_model_dir: Path) -> None:
    assert not is_vision_model(tiny_model_dir)


def test_eval_configs_name_it_tiny_vlm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agile_llmenvs.config.factories import model_directory

    built = build_tiny_vlm(tmp_path / "tiny-vlm-v1")
    monkeypatch.setenv("AGILE_LLMENVS_CACHE", str(tmp_path))
    assert model_directory("tiny_vlm") == str(built)  # the cached build, not built again
