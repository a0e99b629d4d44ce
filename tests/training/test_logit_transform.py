"""Scored log-probs equal the model's own ``log_softmax(forward(...).logits / T)``, whatever the
forward does after the output layer; a model whose logits cannot be reproduced is refused."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from training.logit_families import (
    TOLERANCE,
    FamilyResult,
    FamilySkipped,
    _build,
    _inputs,
    check_family,
)

from agile_llmenvs.backends.types import TokenDistribution
from agile_llmenvs.errors import LogitTransformError
from agile_llmenvs.training.objective import (
    LogitTransform,
    probe_logit_transform,
    scored_token_logps,
)
from agile_llmenvs.training.objective.logit_transform import _fit, _probe_logits

#: The fast subset: plain families and the post-head transforms the issue names.
FAST = {
    "qwen2": LogitTransform(),
    "llama": LogitTransform(),
    "gemma2": LogitTransform(softcap=2.0),
    "gemma3_text": LogitTransform(softcap=2.0),
    "granite": LogitTransform(scale=0.25),  # logits / logits_scaling
    "cohere": LogitTransform(scale=0.25),  # logits * logit_scale
    "cohere2": LogitTransform(scale=0.25),
}
#: Families of the full sweep whose forward transforms the output layer's logits.
TRANSFORMED = {
    "beam": LogitTransform(softcap=2.0),
    "cohere2_moe": LogitTransform(scale=0.25),
    "granite_swa": LogitTransform(scale=0.25),
    "granitemoe": LogitTransform(scale=0.25),
    "granitemoe_swa": LogitTransform(scale=0.25),
    "granitemoeshared": LogitTransform(scale=0.25),
    "granitemoehybrid": LogitTransform(scale=0.25),
    "gemma3n_text": LogitTransform(softcap=2.0),
    "gemma4": LogitTransform(softcap=2.0),
    "gemma4_text": LogitTransform(softcap=2.0),
    "gemma4_unified": LogitTransform(softcap=2.0),
    "gemma4_unified_text": LogitTransform(softcap=2.0),
    "inkling_text": LogitTransform(scale=1 / 24),  # hidden / logits_mup_width_multiplier
    "inkling2_text": LogitTransform(softcap=2.0),
    "inkling2_loop_text": LogitTransform(softcap=2.0),
    "recurrent_gemma": LogitTransform(softcap=2.0),  # logits_soft_cap
    "xlstm": LogitTransform(softcap=2.0),  # output_logit_soft_cap
    "hyperclovax": LogitTransform(scale=4.0),  # logits * logits_scaling, unlike Granite
    "minicpm3": LogitTransform(scale=4.0),  # hidden / (hidden_size / dim_model_base)
    "gemma3": LogitTransform(),  # Gemma3ForConditionalGeneration does not soft-cap
    "nanochat": LogitTransform(softcap=2.0),
    "vaultgemma": LogitTransform(softcap=2.0),
}

#: Families refused: a BERT-style head (dense, activation, norm) runs before the output layer,
#: the decoder's output is not the output layer's input (ELECTRA, RemBERT), or `get_decoder()`
#: returns the whole model (Llama 4 text, Mllama) or the output layer (ModernBERT decoder), or
#: the logits come from another stream than the decoder's output (ProphetNet's n-gram streams).
REFUSED = sorted(
    [
        "bert",
        "big_bird",
        "camembert",
        "data2vec-text",
        "electra",
        "ernie",
        "llama4",
        "llama4_text",
        "megatron-bert",
        "mllama",
        "modernbert-decoder",
        "prophetnet",
        "rembert",
        "roberta",
        "roberta-prelayernorm",
        "roc_bert",
        "roformer",
        "xlm-roberta",
        "xlm-roberta-xl",
    ]
)


@pytest.mark.parametrize("model_type", sorted(FAST))
def test_scored_logps_equal_the_models_own_at_both_temperatures(model_type: str) -> None:
    result = check_family(model_type)
    assert result == FamilyResult(FAST[model_type], max_error=result.max_error)
    assert result.max_error <= TOLERANCE


@pytest.mark.parametrize("model_type", ["gemma2", "granite"])
def test_gradients_through_the_transform_match_autograd(model_type: str) -> None:
    model = _build(model_type)
    ids, attention, mask = _inputs(model.config)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    scored = scored_token_logps(
        model, ids, attention, mask, distribution=TokenDistribution(temperature=0.7), chunk_tokens=5
    )
    (scored.logps_BT * weights).sum().backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    own = torch.log_softmax(logits[:, :-1] / 0.7, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    (own * mask * weights).sum().backward()
    for mine, theirs in zip(ours, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", ["gemma2", "granite", "cohere"])
def test_the_probe_finds_the_transform_in_bf16_and_under_autocast(model_type: str) -> None:
    model = _build(model_type)
    ids, _, _ = _inputs(model.config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert probe_logit_transform(model, model, ids.device) == FAST[model_type]
    half = _build(model_type).to(torch.bfloat16)
    assert probe_logit_transform(half, half, ids.device) == FAST[model_type]


def _biased_qwen2() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    class BiasedQwen2(Qwen2ForCausalLM):
        """Adds a bias to the logits after the output layer: nothing the probe can fit."""

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(*args, **kwargs)
            out.logits = out.logits + torch.linspace(0, 3, out.logits.shape[-1])
            return out

    config = Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(0)
    return BiasedQwen2(config)


def test_a_model_whose_logits_cannot_be_reproduced_is_refused() -> None:
    model = _biased_qwen2()
    ids = torch.randint(0, 128, (1, 6))
    expected = (
        "BiasedQwen2's logits are not its output layer's logits of the decoder's last hidden "
        "state under a transform the scored path can reproduce: the closest fit, z = NUM * y "
        "(y the output layer's logits, z the forward's), is off by up to NUM (tolerance NUM) "
        "on a 8-token probe. The scored path applies the output layer a chunk at a time and "
        "would train on other log-probs than the sampler's. Supported: a scale, then a tanh "
        "soft cap read from the config's `final_logit_softcapping`, `logits_soft_cap`, "
        "`output_logit_soft_cap`; describe another transform in "
        "agile_llmenvs/training/objective/logit_transform.py"
    )
    pattern = re.escape(expected).replace("NUM", r"[0-9.e+-]+")
    with pytest.raises(LogitTransformError, match=f"^{pattern}$"):
        scored_token_logps(model, ids, torch.ones_like(ids), torch.ones(1, 5, dtype=torch.bool))


def test_the_probe_runs_once_per_model() -> None:
    model = _build("gemma2")
    ids, attention, mask = _inputs(model.config)
    shapes: list[tuple[int, ...]] = []
    model.lm_head.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    scored_token_logps(model, ids, attention, mask)
    scored_token_logps(model, ids, attention, mask)
    vocab = model.config.vocab_size
    assert shapes == [(1, 8, vocab), (2, 1, vocab), (2, 1, vocab)]  # probe, then one each


@pytest.mark.slow
def test_every_causal_lm_family_scores_its_own_logps_or_is_refused() -> None:
    """The whole of ``MODEL_FOR_CAUSAL_LM_MAPPING`` (about a minute on 2 cores): each family
    builds tiny and matches its own log-probs, is refused with a LogitTransformError, or is
    skipped (printed with the reason) because it does not build offline at a tiny size."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    passed: dict[str, FamilyResult] = {}
    refused: dict[str, str] = {}
    skipped: dict[str, str] = {}
    # one intra-op thread: the forward's matmuls and the chunked path's then sum in one order;
    # with two, a few families' sharpened logits (~100) differ by fp32 rounding alone (2e-5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = {}
        for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            try:
                results[model_type] = check_family(model_type)
            except FamilySkipped as exc:
                skipped[model_type] = str(exc)
    finally:
        torch.set_num_threads(threads)
    for model_type, result in results.items():
        if result.refused is not None:
            refused[model_type] = result.refused
        else:
            passed[model_type] = result
    for title, rows in (("refused", refused), ("skipped", skipped)):
        print(f"\n{len(rows)} {title}:")
        print("\n".join(f"  {name}: {reason[:150]}" for name, reason in rows.items()))
    print(f"\n{len(passed)} passed")
    assert {name: r.max_error for name, r in passed.items() if r.max_error > TOLERANCE} == {}
    assert sorted(refused) == REFUSED
    for name, transform in {**FAST, **TRANSFORMED}.items():
        assert passed[name].transform == transform, name


def _llama_with_unused_cap(head_scale: float) -> Any:
    """A tiny Llama whose config names `final_logit_softcapping: 30`, which Llama's forward
    does not apply, with its output layer multiplied by ``head_scale``."""
    model = _build("llama")
    model.config.final_logit_softcapping = 30.0
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def _own_logps(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    ids, attention, mask = _inputs(model.config)
    with torch.no_grad():
        ours = scored_token_logps(model, ids, attention, mask).logps_BT
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    own = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return ours * mask, own * mask


def test_an_unused_soft_cap_the_probe_cannot_rule_out_is_probed_again() -> None:
    # logits of at most ~0.001 against a cap of 30: 30 tanh(y / 30) and y differ by y^3 / 2700,
    # far below fp32's precision, so the first probe fits both
    model = _llama_with_unused_cap(1e-4)
    ids, _, _ = _inputs(model.config)
    head, forward = _probe_logits(model, model, ids.device)
    assert _fit(model, head, forward) == [LogitTransform(softcap=30.0), LogitTransform()]
    # the second probe multiplies the output layer's logits to 60 at most: plainly not capped
    assert probe_logit_transform(model, model, ids.device) == LogitTransform()
    # the head grows (as training may make it): the cached transform still scores exactly,
    # where the cap would be off by up to 50 - 30 tanh(50 / 30) = 22 nats a logit
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)
    ours, own = _own_logps(model)
    torch.testing.assert_close(ours, own, rtol=0, atol=TOLERANCE)


def test_a_cap_the_forward_applies_is_found_from_logits_far_below_it() -> None:
    model = _build("gemma2")  # final_logit_softcapping 2, applied
    with torch.no_grad():
        model.lm_head.weight.mul_(1e-5)
    ids, _, _ = _inputs(model.config)
    assert len(_fit(model, *_probe_logits(model, model, ids.device))) == 2
    assert probe_logit_transform(model, model, ids.device) == LogitTransform(softcap=2.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e5)
    ours, own = _own_logps(model)
    torch.testing.assert_close(ours, own, rtol=0, atol=TOLERANCE)


def test_a_cap_the_probe_cannot_decide_on_is_refused() -> None:
    from transformers import LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class DirectHeadLlama(LlamaForCausalLM):
        """Computes its logits from the output layer's weight, not by calling the layer."""

        def forward(self, input_ids: Any = None, attention_mask: Any = None, **_: Any) -> Any:
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask)[0]
            logits = torch.nn.functional.linear(hidden, self.lm_head.weight)
            return CausalLMOutputWithPast(logits=logits)

    small = _llama_with_unused_cap(1e-4)
    model = DirectHeadLlama(small.config)
    model.load_state_dict(small.state_dict())
    ids, _, _ = _inputs(model.config)
    expected = (
        "DirectHeadLlama's config names a soft cap, and its logits on the probe are too small "
        "to tell whether its forward applies it; a second probe multiplies the output layer's "
        "logits, but the forward does not call the output layer (`get_output_embeddings()`) "
        "as a module. The scored path cannot know which log-probs the sampler draws from: "
        "remove the soft cap from the config if the forward does not apply it"
    )
    with pytest.raises(LogitTransformError, match=f"^{re.escape(expected)}$"):
        probe_logit_transform(model, model, ids.device)
