"""The model shape the benchmark scripts measure at: Qwen2.5-0.5B's width and vocabulary."""

from __future__ import annotations

from typing import Any

__all__ = ["VOCAB", "qwen_05b_config"]

#: Qwen2.5's vocabulary.
VOCAB = 151_936


def qwen_05b_config(layers: int, **extra: Any) -> Any:
    """A ``Qwen2Config`` of Qwen2.5-0.5B's width (hidden 896, 14 heads, 2 KV heads, MLP
    4,864), vocabulary and tied embeddings, ``layers`` deep; ``extra`` adds fields (token
    ids)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        **extra,
    )
