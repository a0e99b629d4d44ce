"""HFBackend on the tiny model: one batched generate per call, exact ids and log-probs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fakes import digit_messages

from agile_llmenvs.backends import (
    Backend,
    HFBackend,
    SamplingParams,
    TokenBackend,
    ToolCall,
    parse_tool_calls,
)

# Prompts of different lengths, so that the batch needs padding.
CONVERSATIONS = [
    *digit_messages(3, 7),
    [
        {"role": "system", "content": "Answer with one digit and nothing else, please."},
        {"role": "user", "content": "Say the digit 5."},
    ],
]


def _spy_generate(backend: HFBackend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the model's own ``generate`` calls (batch sizes), still running it for real."""
    sizes: list[int] = []
    real = backend.model.generate

    def counted(*args: Any, **kwargs: Any) -> Any:
        sizes.append(int(kwargs["input_ids"].shape[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(backend.model, "generate", counted)
    return sizes


def test_is_a_token_backend(hf_backend: HFBackend) -> None:
    assert isinstance(hf_backend, Backend)
    assert isinstance(hf_backend, TokenBackend)


def test_one_model_generate_call_per_batch(
    hf_backend: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = _spy_generate(hf_backend, monkeypatch)
    completions = hf_backend.generate_chat_batch(CONVERSATIONS, SamplingParams(max_tokens=3))
    assert sizes == [3]
    assert len(completions) == 3
    assert hf_backend.generate_chat_batch([], SamplingParams()) == []
    assert sizes == [3]


def test_left_padded_batch_matches_each_prompt_alone(hf_backend: HFBackend) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0)
    batched = hf_backend.generate_chat_batch(CONVERSATIONS, params)
    for conversation, together in zip(CONVERSATIONS, batched, strict=True):
        alone = hf_backend.generate_chat(conversation, params)
        assert together.generation is not None
        assert alone.generation is not None
        assert together.generation.token_ids == alone.generation.token_ids
        assert together.generation.logprobs == pytest.approx(alone.generation.logprobs, abs=1e-4)


def _scored_logprobs(
    backend: HFBackend, prompt: list[int], completion: tuple[int, ...], temperature: float
) -> list[float]:
    """``log_softmax(logits / temperature)`` of each completion id, from one plain forward."""
    full_1L = torch.tensor([prompt + list(completion)])
    with torch.no_grad():
        logits_LV = backend.model(full_1L).logits[0].float()
    logps_LV = torch.log_softmax(logits_LV / temperature, dim=-1)
    positions = range(len(prompt) - 1, full_1L.shape[1] - 1)
    return [logps_LV[p, full_1L[0, p + 1]].item() for p in positions]


def test_logprobs_are_the_models_own_for_the_sampled_ids(hf_backend: HFBackend) -> None:
    prompt = hf_backend.encode_chat(CONVERSATIONS[0])
    (generation,) = hf_backend.generate([prompt], SamplingParams(max_tokens=5, seed=11))
    expected = _scored_logprobs(hf_backend, prompt, generation.token_ids, 1.0)
    assert len(generation.logprobs) == len(generation.token_ids)
    assert list(generation.logprobs) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("seed", [3, 4])
def test_logprobs_are_those_of_the_temperature_scaled_logits(
    hf_backend: HFBackend, seed: int
) -> None:
    prompt = hf_backend.encode_chat(CONVERSATIONS[2])
    params = SamplingParams(max_tokens=8, temperature=0.5, top_p=1.0, seed=seed)
    (generation,) = hf_backend.generate([prompt], params)
    expected = _scored_logprobs(hf_backend, prompt, generation.token_ids, 0.5)
    assert len(generation.token_ids) >= 1
    assert list(generation.logprobs) == pytest.approx(expected, abs=1e-5)
    unscaled = _scored_logprobs(hf_backend, prompt, generation.token_ids, 1.0)
    assert list(generation.logprobs) != pytest.approx(unscaled, abs=1e-3)


def test_top_p_sampling_records_full_vocabulary_scaled_logprobs_reproducibly(
    hf_backend: HFBackend,
) -> None:
    prompts = [hf_backend.encode_chat(m) for m in CONVERSATIONS]
    params = SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, seed=5)
    first = hf_backend.generate(prompts, params)
    for prompt, generation in zip(prompts, first, strict=True):
        expected = _scored_logprobs(hf_backend, prompt, generation.token_ids, 0.7)
        assert list(generation.logprobs) == pytest.approx(expected, abs=1e-5)
    assert hf_backend.generate(prompts, params) == first


def test_truncation_is_not_renormalised_into_the_logprobs(hf_backend: HFBackend) -> None:
    prompt = hf_backend.encode_chat(CONVERSATIONS[1])
    greedy = hf_backend.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))
    params = SamplingParams(max_tokens=6, temperature=0.8, top_k=1, seed=0)
    (top_1,) = hf_backend.generate([prompt], params)
    assert top_1.token_ids == greedy[0].token_ids  # one token kept: the argmax, every step
    expected = _scored_logprobs(hf_backend, prompt, top_1.token_ids, 0.8)
    assert list(top_1.logprobs) == pytest.approx(expected, abs=1e-5)
    assert max(top_1.logprobs) < -1e-3  # renormalised over one token, each would be 0.0


def test_generate_keeps_no_per_step_logits_and_adds_no_warpers(
    hf_backend: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    real = hf_backend.model.generate

    def spied(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_backend.model, "generate", spied)
    prompt = hf_backend.encode_chat(CONVERSATIONS[0])
    params = SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, top_k=5, seed=1)
    hf_backend.generate([prompt], params)
    hf_backend.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))
    for kwargs in calls:
        for flag in ("output_logits", "output_scores", "return_dict_in_generate"):
            assert not kwargs.get(flag), flag
        assert len(kwargs["logits_processor"]) == 1
    sampled = calls[0]
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (1.0, 1.0, 0)


def test_sampling_ends_at_eos_or_the_token_budget(hf_backend: HFBackend) -> None:
    eos = hf_backend.tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = [hf_backend.encode_chat(m) for m in digit_messages(*range(10))]
    reasons = set()
    for seed in range(5):  # the random model stops early on some rows, not others
        for g in hf_backend.generate(prompts, SamplingParams(max_tokens=12, seed=seed)):
            reasons.add(g.finish_reason)
            if g.finish_reason == "stop":
                assert g.token_ids[-1] == eos
                assert eos not in g.token_ids[:-1]
            else:
                assert len(g.token_ids) == 12
                assert eos not in g.token_ids
            text = hf_backend.tokenizer.decode(list(g.token_ids), skip_special_tokens=True)
            assert g.text == text
    assert reasons == {"stop", "length"}


def _printable_pair(text: str) -> str | None:
    """A two-character ASCII stretch of ``text`` past its start, if it has one."""
    pairs = (text[i : i + 2] for i in range(3, len(text) - 1))
    return next((p for p in pairs if p.isascii() and p.isprintable()), None)


def test_stop_string_cuts_text_and_ids(hf_backend: HFBackend) -> None:
    prompt = hf_backend.encode_chat(CONVERSATIONS[1])
    for seed in range(20):
        (free,) = hf_backend.generate([prompt], SamplingParams(max_tokens=16, seed=seed))
        stop = _printable_pair(free.text)
        if stop is not None:
            break
    assert stop is not None
    params = SamplingParams(max_tokens=16, seed=seed, stop=(stop,))
    (stopped,) = hf_backend.generate([prompt], params)
    assert stopped.text == free.text[: free.text.index(stop)]
    assert stopped.finish_reason == "stop"
    n = len(stopped.token_ids)
    assert stopped.token_ids == free.token_ids[:n]
    assert stopped.logprobs == pytest.approx(free.logprobs[:n], abs=1e-5)
    tokenizer = hf_backend.tokenizer
    assert stop in tokenizer.decode(list(stopped.token_ids))
    assert stop not in tokenizer.decode(list(stopped.token_ids[:-1]))


def test_seeded_sampling_repeats_and_leaves_global_rng_alone(hf_backend: HFBackend) -> None:
    params = SamplingParams(max_tokens=8, seed=21)
    torch.manual_seed(0)
    before = torch.rand(1).item()
    torch.manual_seed(0)
    first = hf_backend.generate_chat_batch(CONVERSATIONS, params)
    after = torch.rand(1).item()
    second = hf_backend.generate_chat_batch(CONVERSATIONS, params)
    assert before == after
    assert [c.generation.token_ids for c in first if c.generation] == [
        c.generation.token_ids for c in second if c.generation
    ]


def test_sampling_params_reject_bad_values() -> None:
    with pytest.raises(ValueError, match=r"^max_tokens must be >= 1, got 0$"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -0.5$"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 0.0$"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match=r"^top_k must be >= 1 or None, got 0$"):
        SamplingParams(top_k=0)
    assert SamplingParams(stop=["a"]).stop == ("a",)  # type: ignore[arg-type]
    assert SamplingParams(temperature=0.0).greedy


def test_tool_calls_are_read_from_hermes_blocks() -> None:
    text = (
        'First <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> then '
        "<tool_call>{not json}</tool_call> and <tool_call>\n"
        '{"name": "noop"}\n</tool_call>'
    )
    assert parse_tool_calls(text) == (ToolCall("add", {"a": 1}), ToolCall("noop", {}))
    assert parse_tool_calls("no calls here") == ()
