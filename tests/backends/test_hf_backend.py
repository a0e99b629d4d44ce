"""HFBackend on the tiny model: one batched generate per call, exact ids and log-probs."""

from __future__ import annotations

import dataclasses
import logging
import math
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


def _forward_logits(backend: HFBackend, prompt: list[int], completion: tuple[int, ...]) -> Any:
    """``[len(completion), V]``: the logits each completion id was sampled from."""
    full_1L = torch.tensor([prompt + list(completion)])
    with torch.no_grad():
        logits_LV = backend.model(full_1L).logits[0].float()
    return logits_LV[len(prompt) - 1 : -1]


def _nucleus_logprobs(logits_NV: Any, ids: tuple[int, ...], top_p: float) -> list[float]:
    """Log-probs renormalised over each step's nucleus: the likeliest tokens, in order, up to
    and including the one whose cumulative probability reaches ``top_p``."""
    out = []
    for logits_V, token in zip(logits_NV, ids, strict=True):
        probs_V = torch.softmax(logits_V.double(), dim=-1)
        order = probs_V.argsort(descending=True).tolist()
        kept, mass = [], 0.0
        for candidate in order:
            kept.append(candidate)
            mass += float(probs_V[candidate])
            if mass >= top_p:
                break
        assert token in kept
        out.append(float(probs_V[token].log()) - math.log(float(probs_V[kept].sum())))
    return out


def test_top_p_sampling_records_the_nucleus_logprobs_reproducibly(hf_backend: HFBackend) -> None:
    prompts = [hf_backend.encode_chat(m) for m in CONVERSATIONS]
    params = SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, seed=5)
    first = hf_backend.generate(prompts, params)
    truncated_steps = 0
    for prompt, generation in zip(prompts, first, strict=True):
        logits_NV = _forward_logits(hf_backend, prompt, generation.token_ids) / 0.7
        expected = _nucleus_logprobs(logits_NV, generation.token_ids, 0.9)
        assert list(generation.logprobs) == pytest.approx(expected, abs=1e-5)
        full = torch.log_softmax(logits_NV, dim=-1)
        untruncated = [float(full[n, t]) for n, t in enumerate(generation.token_ids)]
        truncated_steps += sum(a > b + 1e-3 for a, b in zip(expected, untruncated, strict=True))
    assert truncated_steps > 10  # the nucleus left out real mass at most steps
    assert hf_backend.generate(prompts, params) == first
    # the whole vocabulary's log-probs, when asked for
    full_params = dataclasses.replace(params, truncated_logprobs=False)
    for prompt, generation in zip(prompts, hf_backend.generate(prompts, full_params), strict=True):
        expected = _scored_logprobs(hf_backend, prompt, generation.token_ids, 0.7)
        assert list(generation.logprobs) == pytest.approx(expected, abs=1e-5)


def test_top_k_of_one_renormalises_each_step_to_certainty(hf_backend: HFBackend) -> None:
    prompt = hf_backend.encode_chat(CONVERSATIONS[1])
    greedy = hf_backend.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))
    params = SamplingParams(max_tokens=6, temperature=0.8, top_k=1, seed=0)
    (top_1,) = hf_backend.generate([prompt], params)
    assert top_1.token_ids == greedy[0].token_ids  # one token kept: the argmax, every step
    assert top_1.logprobs == (0.0,) * len(top_1.token_ids)  # log 1: one token holds the mass
    untruncated = dataclasses.replace(params, truncated_logprobs=False)
    (full,) = hf_backend.generate([prompt], untruncated)
    expected = _scored_logprobs(hf_backend, prompt, full.token_ids, 0.8)
    assert list(full.logprobs) == pytest.approx(expected, abs=1e-5)
    assert max(full.logprobs) < -1e-3


def test_min_p_keeps_tokens_near_the_likeliest(hf_backend: HFBackend) -> None:
    prompt = hf_backend.encode_chat(CONVERSATIONS[0])
    params = SamplingParams(max_tokens=8, temperature=1.0, min_p=0.2, seed=2)
    (generation,) = hf_backend.generate([prompt], params)
    logits_NV = _forward_logits(hf_backend, prompt, generation.token_ids)
    for logits_V, token, recorded in zip(
        logits_NV, generation.token_ids, generation.logprobs, strict=True
    ):
        probs_V = torch.softmax(logits_V.double(), dim=-1)
        kept_V = probs_V >= 0.2 * probs_V.max()  # at least a fifth of the likeliest's
        assert kept_V[token]
        assert recorded == pytest.approx(
            float(probs_V[token].log() - probs_V[kept_V].sum().log()), abs=1e-5
        )


def test_repetition_penalty_is_sampled_and_recorded_over_the_whole_context(
    hf_backend: HFBackend,
) -> None:
    prompts = [hf_backend.encode_chat(m) for m in CONVERSATIONS]  # left-padded: lengths differ
    params = SamplingParams(max_tokens=8, temperature=0.7, repetition_penalty=1.3, seed=4)
    generations = hf_backend.generate(prompts, params)
    penalised_steps = 0
    for prompt, generation in zip(prompts, generations, strict=True):
        logits_NV = _forward_logits(hf_backend, prompt, generation.token_ids)
        for n, (logits_V, token) in enumerate(zip(logits_NV, generation.token_ids, strict=True)):
            context = set(prompt) | set(generation.token_ids[:n])  # not the padding
            shaped_V = logits_V.double().clone()
            for seen in context:  # positive logits divided by 1.3, others multiplied
                value = float(logits_V[seen])
                shaped_V[seen] = value / 1.3 if value > 0 else value * 1.3
            expected = torch.log_softmax(shaped_V / 0.7, dim=-1)[token]
            plain = torch.log_softmax(logits_V.double() / 0.7, dim=-1)[token]
            assert generation.logprobs[n] == pytest.approx(float(expected), abs=1e-5)
            penalised_steps += abs(float(expected - plain)) > 1e-3
    assert penalised_steps > 10


def test_the_checkpoints_generation_config_adds_nothing_and_is_logged_once(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    backend = HFBackend(tiny_model_dir)
    config = backend.model.generation_config
    config.repetition_penalty, config.min_p, config.no_repeat_ngram_size = 1.1, 0.05, 2
    config.temperature, config.top_k, config.suppress_tokens = 0.6, 20, [5]
    lists: list[Any] = []
    real = backend.model._get_logits_processor

    def spied(*args: Any, **kwargs: Any) -> Any:
        lists.append(real(*args, **kwargs))
        return lists[-1]

    monkeypatch.setattr(backend.model, "_get_logits_processor", spied)
    prompt = backend.encode_chat(CONVERSATIONS[0])
    with caplog.at_level(logging.WARNING, logger="agile_llmenvs.backends.hf"):
        rebuilt = HFBackend.from_model(backend.model, backend.tokenizer)
        HFBackend.from_model(backend.model, backend.tokenizer)  # the same model: not again
    # this logger's records only: another test's leftovers may log meanwhile
    (warning,) = [r for r in caplog.records if r.name == "agile_llmenvs.backends.hf"]
    assert warning.getMessage().startswith(
        "Qwen2ForCausalLM's generation_config sets min_p=0.05, no_repeat_ngram_size=2, "
        "repetition_penalty=1.1, suppress_tokens=[5], temperature=0.6, top_k=20: not applied."
    )
    (sampled,) = rebuilt.generate([prompt], SamplingParams(max_tokens=6, seed=1))
    rebuilt.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))
    for processors in lists:  # only the sampler: no penalty, no n-gram ban, no warper
        assert [type(p).__name__ for p in processors] == ["SampledLogprobs"]
    expected = _scored_logprobs(rebuilt, prompt, sampled.token_ids, 1.0)
    assert list(sampled.logprobs) == pytest.approx(expected, abs=1e-5)
    assert config.repetition_penalty == 1.1  # the model's own config is left alone


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
        for flag in ("output_logits", "output_scores", "output_attentions"):
            assert not kwargs.get(flag), flag
        # a dict only to hand back the KV cache the prefix cache keeps for the next call
        assert kwargs["return_dict_in_generate"] is True
        assert len(kwargs["logits_processor"]) == 1
        # greedy over the sampler's scores (the sampler draws): transformers adds no warper,
        # and no top-k of 50 as its default would
        assert (kwargs["do_sample"], kwargs["top_k"]) == (False, None)


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


def test_hub_kernels_are_off_unless_asked_for(tiny_model_dir: Any) -> None:
    """transformers kernelizes a model by default when ``kernels`` is installed (downloading
    layers from the Hub on first use, and kernelizing again at each train/eval switch); the
    backend and the training policy load without, unless ``hub_kernels`` asks."""
    from agile_llmenvs.backends import HFConfig
    from agile_llmenvs.specs.manifest import ModelSpec
    from agile_llmenvs.training.policy.loading import load_policy

    assert HFBackend(tiny_model_dir).model.use_kernels is False
    policy, _ = load_policy(ModelSpec(path=str(tiny_model_dir)))
    assert policy.use_kernels is False
    pytest.importorskip("kernels")
    asked = HFBackend(tiny_model_dir, config=HFConfig(hub_kernels=True))
    assert asked.model.use_kernels is True
    policy, _ = load_policy(ModelSpec(path=str(tiny_model_dir), hub_kernels=True))
    assert policy.use_kernels is True
