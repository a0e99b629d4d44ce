"""Tests of the built-in offline tiny model (agile_llmenvs.tiny_model)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from agile_llmenvs import tiny_model
from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.tiny_model import (
    MARKER_FILE,
    SPECIAL_TOKENS,
    TinyModelError,
    build_tiny_model,
    default_tiny_model_dir,
    ensure_tiny_model,
)

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER_FILE,
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One default build (seed 0), at the place ensure_tiny_model uses under a temp cache."""
    out = tmp_path_factory.mktemp("cache") / "tiny-model-v1"
    start = time.perf_counter()
    path = build_tiny_model(out)
    print(f"\ntiny model build took {time.perf_counter() - start:.2f} s")
    return path


@pytest.fixture(scope="module")
def tok(built: Path) -> Any:
    return AutoTokenizer.from_pretrained(built)


@pytest.fixture(scope="module")
def model(built: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(built)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _snapshot(path: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in path.iterdir()}


def test_build_layout_and_marker(built: Path) -> None:
    assert built.is_absolute()
    assert {p.name for p in built.iterdir()} >= EXPECTED_FILES
    assert json.loads((built / MARKER_FILE).read_text()) == {
        "format_version": 1,
        "seed": 0,
        "vocab_size": 450,
        "hidden_size": 64,
        "num_layers": 2,
    }
    assert not [p for p in built.parent.iterdir() if p != built]  # no temp dirs left behind


def test_loads_with_auto_classes(tok: Any, model: Any) -> None:
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (64, 2, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.max_position_embeddings == 2048
    assert cfg.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert cfg.vocab_size == len(tok) == 450
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (im_end, endoftext, endoftext)
    assert model.generation_config.eos_token_id == im_end
    assert model.generation_config.pad_token_id == endoftext
    assert (tok.eos_token, tok.pad_token, tok.bos_token, tok.unk_token) == (
        "<|im_end|>",
        "<|endoftext|>",
        None,
        None,
    )
    assert (tok.eos_token_id, tok.pad_token_id) == (im_end, endoftext)


def test_auto_tokenizer_keeps_the_trained_pipeline(built: Path, tok: Any) -> None:
    from tokenizers import Tokenizer

    saved = Tokenizer.from_file(str(built / "tokenizer.json"))
    assert json.loads(tok.backend_tokenizer.to_str()) == json.loads(saved.to_str())


def test_chat_template_generation_prompt(tok: Any) -> None:
    messages = [{"role": "user", "content": "say 3"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nsay 3<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_chat_template_system_and_assistant(tok: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )
    no_system = tok.apply_chat_template(messages[1:2], tokenize=False)
    assert no_system == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"  # no default system


def test_chat_template_assistant_mask(tok: Any) -> None:
    messages = [{"role": "user", "content": "say 3"}, {"role": "assistant", "content": "3"}]
    out = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(masked) == "3<|im_end|>"


@pytest.mark.parametrize("token", SPECIAL_TOKENS)
def test_special_tokens_are_single_ids(tok: Any, token: str) -> None:
    ids = tok.encode(token, add_special_tokens=False)
    assert len(ids) == 1
    assert ids == [tok.convert_tokens_to_ids(token)]
    assert tok.decode(ids) == token
    assert token in tok.all_special_tokens
    assert tok.decode(ids, skip_special_tokens=True) == ""


def test_special_token_ids_distinct(tok: Any) -> None:
    assert len({tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}) == len(SPECIAL_TOKENS)


def test_digits_round_trip(tok: Any) -> None:
    digit_ids = []
    for digit in "0123456789":
        ids = tok.encode(digit, add_special_tokens=False)
        assert len(ids) == 1
        assert tok.decode(ids) == digit
        digit_ids.append(ids[0])
    assert len(set(digit_ids)) == 10
    assert tok.encode("9081726354", add_special_tokens=False) == [
        digit_ids[int(d)] for d in "9081726354"
    ]


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! What is 12 + 7? The answer is 19.",
        "  two  spaces,\ttabs and\nnew lines\n\n",
        "Ünïcödé ☃ and emoji 😀 {json: [1, 2]}",
        "<|im_start|>user\nhi<|im_end|>\n",
    ],
)
def test_encode_decode_round_trip(tok: Any, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.encode(text) == ids  # the tokenizer adds no bos/eos of its own
    assert tok.decode(ids) == text


def test_forward_logits_shape(tok: Any, model: Any) -> None:
    enc = tok("What is 2 + 2?", return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], 450)
    assert torch.isfinite(logits).all()


def test_greedy_generate(tok: Any, model: Any) -> None:
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "say 3"}], add_generation_prompt=True, tokenize=False
    )
    enc = tok(prompt, return_tensors="pt")
    kwargs = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False}
    first = model.generate(**enc, **kwargs)
    second = model.generate(**enc, **kwargs)
    assert first.shape == (1, enc["input_ids"].shape[1] + 5)
    assert torch.equal(first, second)
    assert isinstance(tok.decode(first[0, -5:]), str)


def test_same_seed_is_byte_identical(built: Path, tmp_path: Path) -> None:
    rng_before = torch.random.get_rng_state()
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # caller's RNG untouched
    first, second = _weights(built), _weights(again)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert all(t.dtype == torch.float32 for t in first.values())
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors", "config.json"):
        assert (built / name).read_bytes() == (again / name).read_bytes(), name
    model_a = AutoModelForCausalLM.from_pretrained(built).state_dict()
    model_b = AutoModelForCausalLM.from_pretrained(again).state_dict()
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)


def test_different_seed_changes_weights_only(built: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "seed1", seed=1)
    first, second = _weights(built), _weights(other)
    assert first.keys() == second.keys()
    assert not torch.equal(first["model.embed_tokens.weight"], second["model.embed_tokens.weight"])
    assert (built / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_fast_path_does_not_rebuild(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _snapshot(built)

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt an existing build")

    monkeypatch.setattr(tiny_model, "_write_build", fail)
    assert build_tiny_model(built) == built
    assert build_tiny_model(str(built), seed=0, vocab_size=450) == built
    assert _snapshot(built) == before  # marker mtime (and every file) unchanged


def test_ensure_uses_cache_env(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = (built / MARKER_FILE).stat().st_mtime_ns
    monkeypatch.setenv("AGILE_LLMENVS_CACHE", str(built.parent))
    assert default_tiny_model_dir() == built
    assert ensure_tiny_model() == built
    assert (built / MARKER_FILE).stat().st_mtime_ns == before


def test_default_dir_without_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGILE_LLMENVS_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_tiny_model_dir() == tmp_path / ".cache" / "agile_llmenvs" / "tiny-model-v1"


def test_mismatched_args_raise(built: Path) -> None:
    before = _snapshot(built)
    with pytest.raises(TinyModelError, match="overwrite=True") as info:
        build_tiny_model(built, seed=1)
    assert isinstance(info.value, AgileLLMEnvsError)
    assert str(built) in str(info.value)
    with pytest.raises(TinyModelError):
        build_tiny_model(built, hidden_size=32)
    assert _snapshot(built) == before


def test_overwrite_replaces_build(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "m", seed=0, hidden_size=32, num_layers=1)
    build_tiny_model(out, seed=3, hidden_size=32, num_layers=1, overwrite=True)
    assert json.loads((out / MARKER_FILE).read_text())["seed"] == 3
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_foreign_directory_is_not_clobbered(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(TinyModelError, match="other files"):
        build_tiny_model(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_empty_existing_directory_is_used(tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert build_tiny_model(out, hidden_size=16, num_layers=1) == out
    assert {p.name for p in out.iterdir()} >= EXPECTED_FILES


def test_interrupted_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_model, "_build_model", boom)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_model(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kwargs", [{"vocab_size": 100}, {"hidden_size": 60}, {"hidden_size": 0}, {"num_layers": 0}]
)
def test_invalid_sizes_raise(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(TinyModelError):
        build_tiny_model(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()
