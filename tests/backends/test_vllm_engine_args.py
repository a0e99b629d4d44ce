"""VLLMBackend's engine arguments, against a stand-in ``vllm`` module (no vLLM needed)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from agile_llmenvs.backends import VLLMBackend, VLLMConfig


def _engine_kwargs(
    monkeypatch: pytest.MonkeyPatch, version: str, extra: tuple[tuple[str, Any], ...] = ()
) -> dict[str, Any]:
    """The keyword arguments ``VLLMBackend`` builds ``vllm.LLM`` with, under ``version``."""
    seen: dict[str, Any] = {}

    class RecordingLLM:
        def __init__(self, **kwargs: Any) -> None:
            seen.update(kwargs)

    fake = types.ModuleType("vllm")
    fake.__version__ = version  # type: ignore[attr-defined]
    fake.LLM = RecordingLLM  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    VLLMBackend("unused-model-path", config=VLLMConfig(extra=extra))
    return seen


@pytest.mark.parametrize(
    ("version", "mode"),
    [
        ("0.10.2", "processed_logprobs"),
        ("0.11.0+cpu", "processed_logprobs"),
        ("0.10.1", None),  # processed_logprobs did not include the temperature yet
        ("0.9.2", None),  # no logprobs_mode engine argument at all
        ("unknown", None),
    ],
)
def test_processed_logprobs_only_where_they_include_the_temperature(
    monkeypatch: pytest.MonkeyPatch, version: str, mode: str | None
) -> None:
    assert _engine_kwargs(monkeypatch, version).get("logprobs_mode") == mode


def test_a_logprobs_mode_in_extra_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = (("logprobs_mode", "raw_logprobs"), ("max_num_seqs", 4))
    kwargs = _engine_kwargs(monkeypatch, "0.11.0", extra)
    assert (kwargs["logprobs_mode"], kwargs["max_num_seqs"]) == ("raw_logprobs", 4)
