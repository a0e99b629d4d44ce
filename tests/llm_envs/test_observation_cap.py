"""An observation's text is cut at ``max_observation_bytes`` before it is tokenized: an env that
answers 60 MB used to take minutes and gigabytes to tokenize, only to overflow the context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agile_llmenvs.core import StopReason
from agile_llmenvs.llm_envs import RolloutHarness
from agile_llmenvs.llm_envs.actions import cut_observation
from agile_llmenvs.specs import LLMEnvSpec


def test_a_long_text_is_cut_at_a_characters_end_with_its_size_noted() -> None:
    text = "é" * 20  # 2 bytes each: 40 bytes
    assert (
        cut_observation(text, 10) == "ééééé\n[observation cut: 40 bytes, max_observation_bytes 10]"
    )
    assert cut_observation(text, 40) == text
    assert cut_observation(text, None) == text
    # the 2nd byte limit falls inside the é: the partial character is dropped
    assert cut_observation("aé" * 3, 2).startswith("a\n[observation cut: 9 bytes")


class FloodEnv:
    """Its first step answers with a 60 MB observation."""

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        return "say anything", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "x" * 60_000_000, 0.0, False, False, {}

    def close(self) -> None:
        pass


def test_a_60_mb_observation_is_cut_before_it_is_tokenized(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    action = [*tokenizer.encode("hi", add_special_tokens=False), tokenizer.eos_token_id]
    # a small cap: the policy's next context holds the first 100 bytes and the note
    harness = RolloutHarness.local(FloodEnv(), tokenizer, max_turns=3, max_observation_bytes=100)
    harness.reset(seed=0)
    shown = tokenizer.decode(harness.step(action).prompt_ids)
    assert "x" * 100 + "\n[observation cut: 60,000,000 bytes, max_observation_bytes 100]" in shown
    assert "x" * 101 not in shown
    # the default cap (1,000,000 bytes), against a 512-token context: the episode ends there,
    # after tokenizing a million bytes at most, not sixty
    harness = RolloutHarness.local(FloodEnv(), tokenizer, max_turns=3, max_model_len=512)
    harness.reset(seed=0)
    harness.step(action)
    assert harness.get_episode_data().stop_reason is StopReason.CONTEXT_LIMIT
    assert 512 <= harness.info["context_limit"]["context_tokens"] <= 1_000_100


def test_the_cap_is_a_manifest_setting_with_a_default() -> None:
    assert LLMEnvSpec(env_type="rollout", entrypoint="m:C").max_observation_bytes == 1_000_000
    with pytest.raises(ValueError, match="max_observation_bytes"):
        LLMEnvSpec(env_type="rollout", entrypoint="m:C", max_observation_bytes=0)
