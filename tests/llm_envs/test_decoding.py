"""The harness's decode of sampled ids equals the Rust tokenizer's, on real SentencePiece
models (``mistral-common``'s v1 and v3) and on the built-in byte-level tokenizer; the Python
piece decoder takes only the ids it can decode exactly."""

from __future__ import annotations

import random
from functools import cache
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from real_tokenizers import load_mistral_tokenizer
from tokenizers import Tokenizer, decoders

from agile_llmenvs.llm_envs.decoding import PieceDecoder, tokenizer_decoder

pytest.importorskip("sentencepiece")
pytest.importorskip("mistral_common")


@cache
def mistral(name: str) -> Any:
    return load_mistral_tokenizer(name)


@cache
def decoder(name: str) -> Any:
    return tokenizer_decoder(mistral(name))


@cache
def gemma_like() -> tuple[Any, PieceDecoder | None]:
    """mistral v1's pieces under Gemma's chain: the replace, byte fallback and fuse, no strip."""
    backend = Tokenizer.from_str(mistral("mistral_v1").backend_tokenizer.to_str())
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend, PieceDecoder.of(backend)


def byte_ids(backend: Any) -> list[int]:
    vocab = backend.get_vocab(with_added_tokens=True)
    return sorted(i for token, i in vocab.items() if token.startswith("<0x") and len(token) == 6)


@st.composite
def id_lists(draw: Any, backend: Any) -> list[int]:
    """Ordinary pieces and special tokens, and in half the lists byte-fallback pieces and ids
    past the vocabulary mixed in."""
    size = backend.get_vocab_size(with_added_tokens=True)
    special = sorted(backend.get_added_tokens_decoder())
    rare = ["byte", "outside"] if draw(st.booleans()) else []
    kinds = st.sampled_from(["piece"] * 8 + ["special", *rare])
    ids = []
    for kind in draw(st.lists(kinds, max_size=40)):
        if kind == "piece":
            ids.append(draw(st.integers(0, size - 1)))
        elif kind == "byte":
            ids.append(draw(st.sampled_from(byte_ids(backend))))
        elif kind == "special":
            ids.append(draw(st.sampled_from(special)))
        else:
            ids.append(size + draw(st.integers(0, 9)))
    return ids


@pytest.mark.parametrize("name", ["mistral_v1", "mistral_v3"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_decode_equals_the_rust_decoder_on_any_ids(name: str, data: Any) -> None:
    backend = mistral(name).backend_tokenizer
    ids = data.draw(id_lists(backend))
    decode = decoder(name)
    for skip in (True, False):
        assert decode(ids, skip) == backend.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", ["mistral_v1", "mistral_v3"])
def test_the_piece_decoder_takes_every_list_of_plain_pieces(name: str) -> None:
    backend = mistral(name).backend_tokenizer
    pieces = PieceDecoder.of(backend)
    assert pieces is not None
    plain = [i for i in range(backend.get_vocab_size()) if pieces.pieces[i]]
    rng = random.Random(0)
    for _ in range(200):
        ids = rng.choices(plain, k=rng.randrange(1, 64))
        assert pieces.decode(ids) == backend.decode(ids, skip_special_tokens=True)


def test_plain_pieces_are_joined_with_one_leading_space_stripped() -> None:
    """Mistral's chain ends with ``Strip(" ", 1, 0)``: ``▁▁Hello▁world,`` reads ``  Hello
    world,`` once ``▁`` is a space, and one space less at the start."""
    tokenizer = mistral("mistral_v3")
    backend = tokenizer.backend_tokenizer
    pieces = PieceDecoder.of(backend)
    assert pieces is not None
    assert pieces.strip == 1
    ids = [backend.token_to_id(t) for t in ["▁", "▁Hello", "▁world", ","]]
    eos = tokenizer.eos_token_id
    assert pieces.decode(ids) == " Hello world,"
    assert pieces.decode([*ids[1:], eos]) == "Hello world,"  # a special token is skipped
    assert pieces.decode([]) == ""
    byte = backend.token_to_id("<0x41>")
    assert pieces.decode(torch.tensor([*ids, byte])) is None  # ids of any kind are read
    assert pieces.decode(torch.tensor(ids)) == " Hello world,"
    assert backend.decode(ids, skip_special_tokens=True) == " Hello world,"


def test_ids_it_cannot_decode_exactly_go_to_the_rust_decoder() -> None:
    tokenizer = mistral("mistral_v3")
    backend = tokenizer.backend_tokenizer
    pieces = PieceDecoder.of(backend)
    assert pieces is not None
    hello = backend.token_to_id("▁Hello")
    emoji = backend.encode("\U0001f9ec", add_special_tokens=False).ids  # no piece: bytes
    utf8 = ["<0xF0>", "<0x9F>", "<0xA7>", "<0xAC>"]  # U+1F9EC in UTF-8
    assert [backend.id_to_token(i) for i in emoji] == ["▁", *utf8]
    assert pieces.decode([hello, *emoji]) is None
    assert pieces.decode([hello, backend.get_vocab_size() + 1]) is None
    assert pieces.decode([hello, -1]) is None
    decode = tokenizer_decoder(tokenizer)
    assert decode([hello, *emoji], True) == "Hello \U0001f9ec"


def test_other_decoder_chains_get_no_piece_decoder() -> None:
    assert PieceDecoder.of(Tokenizer.from_str(mistral("mistral_v3").backend_tokenizer.to_str()))
    tail = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    for chain in (
        [*tail, decoders.Strip(" ", 1, 1)],  # strips at the end too
        [decoders.Replace("▁", "_"), *tail[1:]],
        [decoders.ByteFallback(), decoders.Fuse()],
        [decoders.Metaspace()],
    ):
        backend = Tokenizer.from_str(mistral("mistral_v3").backend_tokenizer.to_str())
        backend.decoder = decoders.Sequence(chain)
        assert PieceDecoder.of(backend) is None, chain


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_a_chain_without_strip_keeps_the_leading_space(data: Any) -> None:
    """Gemma's chain: the replace, byte fallback and fuse, no strip."""
    backend, pieces = gemma_like()
    assert pieces is not None
    assert pieces.strip == 0
    assert pieces.decode([backend.token_to_id("▁Hello")]) == " Hello"
    ids = data.draw(id_lists(backend))
    text = pieces.decode(ids)
    assert text is None or text == backend.decode(ids, skip_special_tokens=True)


def test_a_byte_level_tokenizer_decodes_by_the_rust_decoder(tokenizer: Any) -> None:
    assert PieceDecoder.of(tokenizer.backend_tokenizer) is None
    ids = tokenizer.encode("Hello <|im_end|> world", add_special_tokens=False)
    decode = tokenizer_decoder(tokenizer)
    assert decode(ids, True) == tokenizer.decode(ids, skip_special_tokens=True) == "Hello  world"
