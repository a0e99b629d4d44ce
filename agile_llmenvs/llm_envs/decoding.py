"""Decoding sampled ids to the text an env receives, exactly as the tokenizer does, but fast.

A SentencePiece tokenizer in ``tokenizers`` (Llama 2, Mistral, Gemma) decodes through the chain
``Replace("▁", " ")``, ``ByteFallback``, ``Fuse`` and, for Llama and Mistral,
``Strip(" ", 1, 0)``. The Rust chain costs about 0.25 µs a token (a regex replace per piece);
for the ids that need nothing but the replace, the same text is the pieces with ``▁`` already
replaced, joined, with the leading space stripped: a list join. :class:`PieceDecoder` is made
only for that exact chain, and hands back to the Rust decoder any ids it does not cover
(byte-fallback pieces, added tokens other than skipped special ones, ids outside the vocabulary,
or special tokens kept).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PieceDecoder", "tokenizer_decoder"]

Decode = Callable[[Sequence[int], bool], str]
"""``decode(ids, skip_special_tokens)``: the text of ``ids``."""

_SPACE = "\u2581"
_HEAD = [
    {"type": "Replace", "pattern": {"String": _SPACE}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
]


class PieceDecoder:
    """The text of ids whose pieces need only ``▁`` replaced, equal to the Rust chain's.

    Args:
        pieces: Each id's piece with ``▁`` replaced by a space; ``""`` for a special token
            (skipped), None for an id the Rust decoder must handle.
        strip: Leading spaces ``Strip`` removes (0: no ``Strip`` in the chain).
    """

    def __init__(self, pieces: Sequence[str | None], strip: int) -> None:
        self.pieces = list(pieces)
        self.strip = strip
        self.handled_elsewhere = frozenset(i for i, piece in enumerate(pieces) if piece is None)

    @classmethod
    def of(cls, backend: Any) -> PieceDecoder | None:
        """The decoder of a ``tokenizers.Tokenizer`` with the SentencePiece chain (None for
        any other decoder)."""
        try:
            chain = json.loads(backend.decoder.__getstate__())
        except Exception:  # no decoder, or one that cannot be read
            return None
        steps = chain.get("decoders") if chain.get("type") == "Sequence" else None
        if not steps or steps[:3] != _HEAD or len(steps) > 4:
            return None
        strip = 0
        if len(steps) == 4:
            last = steps[3]
            if last.get("type") != "Strip" or last.get("content") != " " or last.get("stop"):
                return None
            strip = int(last.get("start", 0))
        vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
        pieces: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for token, index in vocab.items():
            if not _is_byte(token):
                pieces[index] = token.replace(_SPACE, " ")
        for index, added in backend.get_added_tokens_decoder().items():
            pieces[index] = "" if added.special else None
        return cls(pieces, strip)

    def decode(self, ids: Sequence[int]) -> str | None:
        """The text of ``ids`` with special tokens skipped; None when an id needs the Rust
        decoder."""
        if not isinstance(ids, list | tuple):  # a tensor's items hash by identity
            ids = [int(i) for i in ids]
        if not self.handled_elsewhere.isdisjoint(ids) or (ids and min(ids) < 0):
            return None
        try:
            text = "".join([self.pieces[i] for i in ids])  # type: ignore[misc]
        except IndexError:
            return None
        strip = self.strip
        while strip and text[:1] == " ":
            text, strip = text[1:], strip - 1
        return text


def tokenizer_decoder(tokenizer: Any) -> Decode:
    """The fastest exact ``tokenizer.decode``: :class:`PieceDecoder` where it applies, else
    the Rust tokenizer's own decode (a sixth of the Python wrapper's cost) when the tokenizer
    adds no clean-up of its own, else ``tokenizer.decode``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):

        def python(ids: Sequence[int], skip_special_tokens: bool) -> str:
            return str(tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

        return python
    pieces = PieceDecoder.of(backend)

    def rust(ids: Sequence[int], skip_special_tokens: bool) -> str:
        if pieces is not None and skip_special_tokens:
            text = pieces.decode(ids)
            if text is not None:
                return text
        return str(backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    return rust


def _is_byte(token: str) -> bool:
    """A byte-fallback piece (``<0x0A>``), as ``ByteFallback`` reads one."""
    if len(token) != 6 or not token.startswith("<0x") or not token.endswith(">"):
        return False
    try:
        int(token[3:5], 16)
    except ValueError:
        return False
    return True
