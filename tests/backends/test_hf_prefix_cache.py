"""The HF backend's prefix cache: a call reuses the keys and values of the previous call's rows
whose tokens its prompts start with, and samples what a fresh call samples.

Every test runs the same calls on two backends over one model, one keeping its cache and one
not, with the same seeds: the sampled ids must be equal and the log-probs equal up to float
rounding, and the count of prompt tokens not run again (``reused``) is derived by hand from
what the previous call held: each row's prompt and the tokens it generated, but never the
last generated column of the call (``generate`` samples it and stops, never running it).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from agile_llmenvs.backends import HFBackend, SamplingParams
from agile_llmenvs.backends._hf_prefix import supports_prefix_cache
from agile_llmenvs.core import Generation
from agile_llmenvs.envs.corridor import CorridorEnv
from agile_llmenvs.llm_envs import RolloutCollector, RolloutHarness
from agile_llmenvs.training.generation import Sampler

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Any) -> tuple[HFBackend, HFBackend]:
    """(keeps its cache, does not): two backends over one model."""
    cached = HFBackend(tiny_model_dir)
    fresh = HFBackend.from_model(cached.model, cached.tokenizer, prefix_cache=False)
    return cached, fresh


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 400, (n,), generator=g).tolist() for n in lengths]


def _both(
    pair: tuple[HFBackend, HFBackend], prompts: list[list[int]], seed: int, **params: Any
) -> tuple[list[Generation], int]:
    """The cached backend's generations (checked against the fresh one's) and its reuse."""
    cached, fresh = pair
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, **params)
    got = cached.generate(prompts, sampling)
    reused = cached._prefix.reused if cached._prefix is not None else 0
    want = fresh.generate(prompts, sampling)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want, strict=True):
        assert list(g.logprobs) == pytest.approx(list(w.logprobs), abs=1e-5)
    return got, reused


def _held(prompt: list[int], generation: Generation, widest: int) -> int:
    """Tokens the cache holds for a row: its prompt and its generated ids, but not the call's
    last generated column (``widest``: the longest generation of the call)."""
    return len(prompt) + min(len(generation.token_ids), widest - 1)


def test_a_next_turn_reuses_each_rows_prompt_and_generation(
    pair: tuple[HFBackend, HFBackend],
) -> None:
    pair[0].clear_prefix_cache()
    prompts = _prompts([12, 30, 7, 21], seed=0)
    first, reused = _both(pair, prompts, seed=1)
    assert reused == 0  # nothing kept before
    widest = max(len(g.token_ids) for g in first)
    observations = _prompts([3, 9, 1, 5], seed=2)
    turn2 = [
        p + list(g.token_ids) + o for p, g, o in zip(prompts, first, observations, strict=True)
    ]
    _, reused = _both(pair, turn2, seed=3)
    assert reused == sum(_held(p, g, widest) for p, g in zip(prompts, first, strict=True))


def test_rows_may_drop_out_repeat_and_change_order(pair: tuple[HFBackend, HFBackend]) -> None:
    pair[0].clear_prefix_cache()
    prompts = _prompts([10, 16, 25], seed=4)
    first, _ = _both(pair, prompts, seed=5)
    widest = max(len(g.token_ids) for g in first)
    turn2 = [p + list(g.token_ids) + [7, 8] for p, g in zip(prompts, first, strict=True)]
    order = [2, 0, 2]  # row 1's episode ended; row 2 branched twice
    _, reused = _both(pair, [turn2[i] for i in order], seed=6)
    assert reused == sum(_held(prompts[i], first[i], widest) for i in order)


def test_a_generation_cut_short_reuses_the_part_kept(pair: tuple[HFBackend, HFBackend]) -> None:
    pair[0].clear_prefix_cache()
    prompts = _prompts([14, 9], seed=7)
    first, _ = _both(pair, prompts, seed=8)
    assert all(len(g.token_ids) >= 3 for g in first), "the seed samples at least 3 tokens"
    # as a stop string would: only the first token of each generation is kept, then a token
    # the generation's second is not
    cut = [
        [*p, g.token_ids[0], 400 if g.token_ids[1] != 400 else 401]
        for p, g in zip(prompts, first, strict=True)
    ]
    _, reused = _both(pair, cut, seed=9)
    assert reused == sum(len(p) + 1 for p in prompts)


def test_changed_weights_and_unmatched_prompts_prefill_whole(
    pair: tuple[HFBackend, HFBackend],
) -> None:
    cached, _ = pair
    cached.clear_prefix_cache()
    prompts = _prompts([11, 13], seed=10)
    first, _ = _both(pair, prompts, seed=11)
    turn2 = [p + list(g.token_ids) + [9] for p, g in zip(prompts, first, strict=True)]
    weight = next(cached.model.parameters())
    with torch.no_grad():
        weight.mul_(1.0)  # an in-place write: the values are the same, but it is a new version
    second, reused = _both(pair, turn2, seed=12)
    assert reused == 0
    turn3 = [p + list(g.token_ids) + [9] for p, g in zip(turn2, second, strict=True)]
    unrelated = _prompts([6], seed=13)[0]
    _, reused = _both(pair, [*turn3, unrelated], seed=14)
    assert reused == 0  # the last prompt starts with no row's tokens: all prefill


def test_a_repetition_penalty_prefills_whole(pair: tuple[HFBackend, HFBackend]) -> None:
    pair[0].clear_prefix_cache()
    prompts = _prompts([8, 12], seed=15)
    first, _ = _both(pair, prompts, seed=16)
    turn2 = [p + list(g.token_ids) + [5] for p, g in zip(prompts, first, strict=True)]
    _, reused = _both(pair, turn2, seed=17, repetition_penalty=1.3)
    assert reused == 0


def test_only_models_attending_every_earlier_column_keep_a_cache() -> None:
    full = SimpleNamespace(layer_types=["full_attention"] * 2)
    sliding = SimpleNamespace(layer_types=["sliding_attention", "full_attention"])
    recurrent = SimpleNamespace(layer_types=["linear_attention", "full_attention"])
    windowed = SimpleNamespace(sliding_window=4096)
    unused_window = SimpleNamespace(sliding_window=4096, use_sliding_window=False)
    plain = SimpleNamespace()
    encoder_decoder = SimpleNamespace(is_encoder_decoder=True)
    verdicts = [
        supports_prefix_cache(SimpleNamespace(config=config))
        for config in (full, sliding, recurrent, windowed, unused_window, plain, encoder_decoder)
    ]
    assert verdicts == [True, False, False, False, True, True, False]


def _corridor(backend: HFBackend, tokenizer: Any) -> tuple[list[Any], list[float]]:
    """One collection of the corridor (2 groups of 4, 4 turns): every sample's ids, masks and
    turn ids, and every sampled log-prob, in order."""

    def factory() -> RolloutHarness:
        return RolloutHarness.local(CorridorEnv(max_turns=4), tokenizer, max_turns=4)

    collector = RolloutCollector(factory, batch_size=2, group_size=4, base_seed=0)
    sampler = Sampler(backend, SamplingParams(max_tokens=4, temperature=1.0, seed=0))
    try:
        batch = collector.collect(sampler)
    finally:
        collector.close()
    samples = [s for t in batch.trajectories for s in t.episode.samples]
    ids = [(s.token_ids, s.action_mask, s.turn_ids) for s in samples]
    return ids, [lp for s in samples for lp in s.sampling_logps]


def _same_collection(cached: HFBackend, fresh: HFBackend, tokenizer: Any) -> list[int]:
    """Checks a corridor collection with the cache against one without; the prompt tokens
    each of the cached backend's calls reused."""
    reuses: list[int] = []
    prefix = cached._prefix
    assert prefix is not None
    real = prefix.plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        planned = real(*args, **kwargs)
        reuses.append(prefix.reused)
        return planned

    prefix.plan = counted  # type: ignore[method-assign]
    try:
        ids, logps = _corridor(cached, tokenizer)
    finally:
        del prefix.plan
    want_ids, want_logps = _corridor(fresh, tokenizer)
    assert ids == want_ids
    assert logps == pytest.approx(want_logps, abs=1e-5)
    return reuses


def test_a_collection_samples_as_without_the_cache(pair: tuple[HFBackend, HFBackend]) -> None:
    cached, fresh = pair
    cached.clear_prefix_cache()
    reuses = _same_collection(cached, fresh, cached.tokenizer)
    assert reuses[0] == 0  # the first turn: nothing kept
    assert all(r > 0 for r in reuses[1:]), reuses  # every later turn reuses


@pytest.mark.parametrize("case", ["qwen3", "llama31"])
def test_a_collection_on_a_real_template_samples_as_without_the_cache(case: str) -> None:
    """A real SentencePiece tokenizer (Mistral's v3) rendering Qwen3's template (not
    prefix-stable: the harness starts a new sample when a turn's prompt is not the last one
    extended) and Llama 3.1's, on a random model of its vocabulary."""
    pytest.importorskip("sentencepiece")
    pytest.importorskip("mistral_common")
    from real_tokenizers import load_mistral_tokenizer
    from template_corpus import get_case, with_template
    from transformers import Qwen2Config, Qwen2ForCausalLM

    template = get_case(case)
    tokenizer = with_template(lambda: load_mistral_tokenizer("mistral_v3"), template)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(
        "<|im_end|>" if case == "qwen3" else "<|eot_id|>"
    )
    cached = HFBackend.from_model(model, tokenizer)
    fresh = HFBackend.from_model(model, tokenizer, prefix_cache=False)
    reuses = _same_collection(cached, fresh, tokenizer)
    assert reuses[0] == 0
    assert all(r > 0 for r in reuses[1:]), reuses
