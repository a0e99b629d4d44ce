"""Tiny random-init models of transformers' causal LM families, built offline from configs.

:func:`check_family` builds one family at a tiny size, sharpens its output layer (so a missed
post-head transform shows) and compares the scored path's log-probs with the model's own
``log_softmax(forward(...).logits / T)``.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from agile_llmenvs.backends.types import TokenDistribution
from agile_llmenvs.errors import LogitTransformError
from agile_llmenvs.training.objective import (
    LogitTransform,
    probe_logit_transform,
    scored_token_logps,
)
from agile_llmenvs.training.objective.logprobs import _unwrap

VOCAB = 512
#: Tiny sizes, set on a config wherever it has the field (under any of the usual names).
TINY = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim"), 64),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers"), 2),
    **dict.fromkeys(("decoder_layers", "encoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads"), 4),
    **dict.fromkeys(("decoder_attention_heads", "encoder_attention_heads"), 4),
    "num_key_value_heads": 2,
    "head_dim": 16,
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size"), 128),
    **dict.fromkeys(("decoder_ffn_dim", "encoder_ffn_dim"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "n_group", "topk_group"), 1),
    **dict.fromkeys(("linear_num_heads", "num_heads"), 8),
    **dict.fromkeys(("linear_head_dim", "linear_key_head_dim", "linear_value_head_dim"), 16),
    **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads"), 4),
    "num_kv_shared_layers": 0,
    **dict.fromkeys(("state_size", "hidden_size_per_layer_input"), 16),
    "vocab_size_per_layer_input": 512,
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 8),
    "v_head_dim": 16,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    **dict.fromkeys(("pad_token_id", "padding_idx"), 0),
    "rotary_dim": 8,
    "unpadded_vocab_size": VOCAB,
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
#: Post-head transform fields set to values that change the logits a lot.
TRANSFORMS = {
    "final_logit_softcapping": 2.0,
    "logits_soft_cap": 2.0,
    "output_logit_soft_cap": 2.0,
    "logits_scaling": 4.0,
    "logit_scale": 0.25,
    "output_multiplier": 0.5,
}
SHARPEN = 8.0
#: Sharpening of its own where x8 takes the logits past ~100, where fp32's rounding of the
#: logits alone reaches 1e-5 (CPM-Ant has no final norm: its logits reach 300 at x8).
SHARPEN_BY_FAMILY = {"cpmant": 1.0}
#: Fields a family needs set together with the tiny sizes.
FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "mamba2": {"n_groups": 1},
    "reformer": {"is_decoder": True},
}
TEMPERATURES = (1.0, 0.7)
TOLERANCE = 1e-5


class FamilySkipped(Exception):
    """The family does not build offline at a tiny size, or its forward does not run plainly."""


@dataclass(frozen=True)
class FamilyResult:
    """What the scored path did with one family: ``transform`` found, or ``refused`` with a
    :class:`LogitTransformError` message; ``max_error`` over both temperatures."""

    transform: LogitTransform | None
    refused: str | None = None
    max_error: float = 0.0


def check_family(model_type: str) -> FamilyResult:
    """Build ``model_type`` tiny, score it, and compare with its own log-softmax.

    Raises:
        FamilySkipped: It does not build, or its own forward fails on plain token ids.
    """
    model = _build(model_type)
    ids, attention, mask = _inputs(model.config)
    try:
        with torch.no_grad(), _quiet():
            logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits.float()
    except Exception as exc:
        raise FamilySkipped(f"forward on token ids: {_short(exc)}") from exc
    try:
        transform = probe_logit_transform(model, _unwrap(model), ids.device)
    except LogitTransformError as exc:
        return FamilyResult(None, refused=str(exc))
    max_error = 0.0
    for temperature in TEMPERATURES:
        with torch.no_grad():
            ours = scored_token_logps(
                model, ids, attention, mask, distribution=TokenDistribution(temperature=temperature)
            )
        own = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
        own = own.gather(-1, ids[:, 1:, None])[..., 0] * mask
        max_error = max(max_error, (ours.logps_BT - own).abs().max().item())
    return FamilyResult(transform, max_error=max_error)


def _build(model_type: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(model_type)
        config = type(config)(**_tiny_fields(config), **FAMILY_FIELDS.get(model_type, {}))
        torch.manual_seed(0)
        with _quiet():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:
        raise FamilySkipped(f"build: {_short(exc)}") from exc
    model.eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(SHARPEN_BY_FAMILY.get(model_type, SHARPEN))
    return model


def _tiny_fields(config: Any) -> dict[str, Any]:
    """The config's fields at tiny sizes, sub-configs (``text_config``...) shrunk the same."""
    fields: dict[str, Any] = {}
    values: dict[str, Any] = config.to_dict()
    layers = next((values[name] for name in LAYER_COUNTS if name in values), None)
    for name, value in values.items():
        if name in TINY or name in TRANSFORMS:
            fields[name] = TINY.get(name, TRANSFORMS.get(name))
        elif isinstance(value, list) and value and len(value) == layers:
            fields[name] = value[:2]  # one entry a layer (layer types, ...)
        elif name == "per_layer_config" and isinstance(value, dict):
            fields[name] = {key: entry for key, entry in value.items() if int(key) < 2}
        elif isinstance(value, dict) and name.endswith("_config"):
            sub = getattr(config, name, None)
            fields[name] = _tiny_fields(sub) if hasattr(sub, "to_dict") else value
    if "qk_rope_head_dim" in values and "head_dim" in values:
        fields["head_dim"] = TINY["qk_rope_head_dim"]  # multi-head latent attention's rope part
    return fields


def _inputs(config: Any) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(VOCAB // 4, VOCAB - 16, (2, 10), generator=generator)
    attention = torch.ones_like(ids)
    mask = torch.rand(2, 9, generator=generator) > 0.3
    return ids, attention, mask


@contextlib.contextmanager
def _quiet() -> Any:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _short(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:160]}"
