# ruff: noqa: RUF001, RUF002 (DeepSeek's tokens are spelt with fullwidth bars, on purpose)
"""Chat templates of real model families, for tests that must hold beyond ChatML.

Each :class:`TemplateCase` names a Jinja file under ``tests/templates/`` written after the family's
published template, quirks included (Qwen's default system prompt and ``<think>`` stripping,
Llama-2's ``.strip()`` and ``' </s>'``, Mistral v0.3's system prompt in the last user turn, Gemma's
refusal of a system role, ...). :func:`with_template` turns any Hugging Face tokenizer, the
package's tiny byte-level one included, into one that renders like that family: the template as
``chat_template``, the family's ``bos_token``/``eos_token``, and its special tokens as single
tokens. Nothing is downloaded.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["CASES", "TEMPLATES_DIR", "TemplateCase", "get_case", "with_template"]

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"


@cache
def _read_template(name: str) -> str:
    # Hub templates carry no trailing newline; Jinja drops one anyway, so this changes nothing.
    return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8").removesuffix("\n")


@dataclass(frozen=True)
class TemplateCase:
    """One model family's chat format.

    ``special_tokens`` are the tokens the family's tokenizer treats as special (bos and eos among
    them); ``added_tokens`` are tokens it keeps whole without calling them special (Qwen's
    ``<think>``/``<tool_call>``, DeepSeek's ``<｜User｜>``), so ``skip_special_tokens=True`` keeps
    them as the real tokenizer does.
    """

    name: str
    special_tokens: tuple[str, ...]
    bos_token: str | None
    eos_token: str
    system: bool
    tool_role: bool
    reasoning: tuple[str, str] | None = None
    added_tokens: tuple[str, ...] = ()

    @property
    def template(self) -> str:
        """The Jinja source, from ``tests/templates/<name>.jinja``."""
        return _read_template(self.name)

    @property
    def single_tokens(self) -> tuple[str, ...]:
        """Every token :func:`with_template` makes sure encodes as one id."""
        named = (self.bos_token, self.eos_token)
        tokens = [*self.special_tokens, *(t for t in named if t is not None), *self.added_tokens]
        return tuple(dict.fromkeys(tokens))


_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_DEEPSEEK_TOOL_TOKENS = tuple(
    f"<｜{name}｜>"
    for name in (
        "tool▁calls▁begin",
        "tool▁calls▁end",
        "tool▁call▁begin",
        "tool▁call▁end",
        "tool▁sep",
        "tool▁outputs▁begin",
        "tool▁outputs▁end",
        "tool▁output▁begin",
        "tool▁output▁end",
    )
)

CASES: tuple[TemplateCase, ...] = (
    TemplateCase(
        name="chatml_qwen25",
        special_tokens=_QWEN_SPECIALS,
        bos_token=None,
        eos_token="<|im_end|>",
        system=True,
        tool_role=True,
        added_tokens=("<tool_call>", "</tool_call>"),
    ),
    TemplateCase(
        name="qwen3",
        special_tokens=_QWEN_SPECIALS,
        bos_token=None,
        eos_token="<|im_end|>",
        system=True,
        tool_role=True,
        reasoning=("<think>", "</think>"),
        added_tokens=(
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        ),
    ),
    TemplateCase(
        name="llama2",
        special_tokens=("<s>", "</s>"),
        bos_token="<s>",
        eos_token="</s>",
        system=True,
        tool_role=False,
    ),
    TemplateCase(
        name="mistral_v01",
        special_tokens=("<s>", "</s>"),
        bos_token="<s>",
        eos_token="</s>",
        system=False,
        tool_role=False,
    ),
    TemplateCase(
        name="mistral_v03",
        special_tokens=(
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        bos_token="<s>",
        eos_token="</s>",
        system=True,
        tool_role=True,
    ),
    TemplateCase(
        name="llama31",
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        system=True,
        tool_role=True,
    ),
    TemplateCase(
        name="gemma",
        special_tokens=("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"),
        bos_token="<bos>",
        eos_token="<eos>",
        system=False,
        tool_role=False,
    ),
    TemplateCase(
        name="deepseek_r1",
        special_tokens=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>",
        system=True,
        tool_role=True,
        reasoning=("<think>", "</think>"),
        added_tokens=(
            "<｜User｜>",
            "<｜Assistant｜>",
            "<think>",
            "</think>",
            *_DEEPSEEK_TOOL_TOKENS,
        ),
    ),
    TemplateCase(
        name="phi3",
        special_tokens=("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        bos_token=None,
        eos_token="<|endoftext|>",
        system=True,
        tool_role=False,
    ),
)


def get_case(name: str) -> TemplateCase:
    """The case called ``name``."""
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no template case {name!r}; known: {[c.name for c in CASES]}")


def _is_single_token(tokenizer: Any, token: str) -> bool:
    ids = tokenizer.encode(token, add_special_tokens=False)
    return len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == token


def _fresh_tokenizer(source: Any) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    if isinstance(source, PreTrainedTokenizerBase):  # checked first: tokenizers are callable
        return copy.deepcopy(source)
    if isinstance(source, str | os.PathLike):
        return AutoTokenizer.from_pretrained(source)
    if callable(source):
        tokenizer = source()
        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise TypeError(f"the loader returned {type(tokenizer).__name__}, not a tokenizer")
        return tokenizer
    raise TypeError(f"expected a tokenizer directory, a loader or a tokenizer, got {source!r}")


def with_template(
    tokenizer_dir_or_loader: str | os.PathLike[str] | Callable[[], Any] | Any,
    case: TemplateCase,
) -> Any:
    """A fresh tokenizer that renders ``case``'s chat format.

    ``tokenizer_dir_or_loader`` is a directory for ``AutoTokenizer.from_pretrained``, a
    zero-argument callable returning a *new* tokenizer on each call, or a tokenizer (deep-copied,
    never changed). On the result: ``chat_template`` is ``case.template``; the case's special
    tokens that are not already single tokens are added as special tokens, its ``added_tokens``
    likewise as plain added tokens; ``eos_token``/``bos_token`` are the case's (``bos_token`` is
    ``None`` for families whose template renders none). Added tokens grow ``len(tokenizer)``: a
    model used with it needs ``resize_token_embeddings(len(tokenizer))``.
    """
    from tokenizers import AddedToken

    tokenizer = _fresh_tokenizer(tokenizer_dir_or_loader)
    special = [t for t in case.single_tokens if t not in case.added_tokens]
    missing = [t for t in special if not _is_single_token(tokenizer, t)]
    if missing:
        tokenizer.add_special_tokens(
            {"extra_special_tokens": missing}, replace_extra_special_tokens=False
        )
    plain = [t for t in case.added_tokens if not _is_single_token(tokenizer, t)]
    if plain:
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in plain])
    tokenizer.chat_template = case.template
    tokenizer.eos_token = case.eos_token
    tokenizer.bos_token = case.bos_token
    # Tokenizers that add bos/eos themselves (SentencePiece Llama) must add the new ones.
    if getattr(tokenizer, "add_bos_token", False) or getattr(tokenizer, "add_eos_token", False):
        update = getattr(tokenizer, "update_post_processor", None)
        if update is not None:
            update()
    return tokenizer
