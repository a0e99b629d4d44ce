"""Chat framing: the exact ids a harness inserts between turns, sliced from the tokenizer's
own chat template.

A conversation is rendered with placeholder messages and the text around the placeholders is
cut out: the close of an assistant turn, the header of the next message, and the close of that
message plus the generation prompt. Each piece is tokenized once and cached per role, so a
turn costs one tokenization of the new observation and nothing that grows with the transcript.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agile_llmenvs.errors import AgileLLMEnvsError

__all__ = ["ChatFramer", "ChatTemplateError", "TurnFrame", "apply_chat_template"]

logger = logging.getLogger(__name__)

Message = Mapping[str, Any]
_A, _B, _C = "\u27e6A\u27e7", "\u27e6B\u27e7", "\u27e6C\u27e7"  # placeholders no template rewrites
_THINK = "<think>scratch</think>answer"
_SHARED: weakref.WeakKeyDictionary[Any, dict[tuple[str, str, bool], dict[str, Any]]] = (
    weakref.WeakKeyDictionary()
)
#: First-prompt texts whose ids a framer remembers (cleared when full).
_PROMPT_MEMO_SIZE = 4096
_CHATML = ("<|im_end|>\n", "<|im_start|>{role}\n", "<|im_end|>\n<|im_start|>assistant\n")


class ChatTemplateError(AgileLLMEnvsError, ValueError):
    """The tokenizer's chat template cannot be sliced into turn frames (strict mode)."""


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    tokenize: bool = True,
    **kwargs: Any,
) -> Any:
    """``tokenizer.apply_chat_template`` returning plain ids (or text), whatever the version.

    transformers 5 returns a ``BatchEncoding`` when tokenizing; this returns ``list[int]``.
    """
    out = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs
    )
    if tokenize and isinstance(out, Mapping):
        out = out["input_ids"]
    if tokenize and hasattr(out, "tolist"):
        out = out.tolist()
    return list(out) if tokenize else out


@dataclass(frozen=True)
class TurnFrame:
    """The ids around one observation turn.

    Attributes:
        close_assistant: Closes the sampled assistant turn (e.g. ``<|im_end|>\\n``).
        open_message: Opens the observation's message (e.g. ``<|im_start|>user\\n``).
        close_and_prompt: Closes it and opens the next assistant turn.
    """

    close_assistant: tuple[int, ...]
    open_message: tuple[int, ...]
    close_and_prompt: tuple[int, ...]


class ChatFramer:
    """Builds first prompts and per-turn insertions from a tokenizer's chat template.

    Args:
        tokenizer: A Hugging Face tokenizer.
        strict: Raise :class:`ChatTemplateError` when the template cannot be sliced; otherwise
            fall back to ChatML framing with a warning.
        use_template: False: no chat template at all; texts are concatenated as they are.
        chat_template_kwargs: Extra keyword arguments for ``apply_chat_template``.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        strict: bool = True,
        use_template: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.strict = strict
        self.use_template = use_template
        self.kwargs = dict(chat_template_kwargs or {})
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        template = getattr(tokenizer, "chat_template", None)
        self._has_template = bool(template)
        # Frames depend only on the tokenizer, its template and the kwargs: share them across
        # every harness of the run (one per rollout slot), so none pays for slicing again.
        key = (str(template), repr(sorted(self.kwargs.items())), strict)
        self._cache: dict[str, Any] = _SHARED.setdefault(tokenizer, {}).setdefault(key, {})
        if "prefix_stable" not in self._cache:
            self._cache["prefix_stable"] = self._check_prefix_stable() if use_template else True
        self.prefix_stable: bool = self._cache["prefix_stable"]

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens added (the Rust tokenizer when available)."""
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode_remembered(self, text: str) -> tuple[int, ...]:
        """``encode(text)``, remembered across the run's harnesses: the members of a GRPO
        group reset to the same prompt, so only the first of them tokenizes it."""
        memo: dict[str, tuple[int, ...]] = self._cache.setdefault("prompt_texts", {})
        ids = memo.get(text)
        if ids is None:
            if len(memo) >= _PROMPT_MEMO_SIZE:
                memo.clear()
            ids = memo[text] = tuple(self.encode(text))
        return ids

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The ids of ``messages`` followed by the generation prompt."""
        if not self.use_template:
            return self.encode("\n\n".join(str(m["content"]) for m in messages))
        if self._has_template:
            pieces = self._prompt_pieces(tuple(str(m["role"]) for m in messages))
            if pieces is None:
                return apply_chat_template(self.tokenizer, messages, **self.kwargs)
            ids = list(pieces[0])
            for message, piece in zip(messages, pieces[1:], strict=True):
                ids += self._encode_remembered(str(message["content"]))
                ids += piece
            return ids
        self._fallback("it has no chat template")
        text = "".join(
            _CHATML[1].format(role=m["role"]) + str(m["content"]) + _CHATML[0] for m in messages
        )
        return self.encode(text + "<|im_start|>assistant\n")

    def frame(self, role: str = "user") -> TurnFrame:
        """The cached frame of an observation in a ``role`` message after an assistant turn."""
        key = f"frame:{role}"
        if key not in self._cache:
            self._cache[key] = self._build_frame(role)
        frame: TurnFrame = self._cache[key]
        return frame

    def turn_ids(
        self, completion_ids: Sequence[int], observation: str, role: str = "user"
    ) -> list[int]:
        """Ids inserted after a sampled completion: frame + observation + generation prompt.

        A completion that already ends with the close of the assistant turn (its
        end-of-turn token) does not get that close twice.
        """
        if not self.use_template:
            return self.encode(observation)
        frame = self.frame(role)
        close = frame.close_assistant
        overlap = _overlap(completion_ids, close)
        return [
            *close[overlap:],
            *frame.open_message,
            *self.encode(observation),
            *frame.close_and_prompt,
        ]

    # -- slicing -----------------------------------------------------------------------------

    def _prompt_pieces(self, roles: tuple[str, ...]) -> tuple[tuple[int, ...], ...] | None:
        """The template ids around each message of a prompt with these roles (cached).

        Rendering the template costs ~10x tokenizing the observation; a first prompt is
        assembled from cached pieces instead, when slicing reproduces the template's ids
        exactly (checked once, on sample text); otherwise None: render it.
        """
        key = f"prompt:{'/'.join(roles)}"
        if key not in self._cache:
            self._cache[key] = self._slice_prompt(roles)
        pieces: tuple[tuple[int, ...], ...] | None = self._cache[key]
        return pieces

    def _slice_prompt(self, roles: tuple[str, ...]) -> tuple[tuple[int, ...], ...] | None:
        if len(roles) > 3 or not self.prefix_stable:
            return None
        marks = [f"\u27e6P{i}\u27e7" for i in range(len(roles))]
        try:
            text = self._render(
                [{"role": r, "content": m} for r, m in zip(roles, marks, strict=True)], True
            )
        except Exception:
            return None
        if any(text.count(mark) != 1 for mark in marks):
            return None
        pieces, rest = [], text
        for mark in marks:
            head, rest = rest.split(mark)
            pieces.append(tuple(self.encode(head)))
        pieces.append(tuple(self.encode(rest)))
        sample = [{"role": r, "content": f"Sample {r} text: 12 words, (x)."} for r in roles]
        assembled = list(pieces[0])
        for message, piece in zip(sample, pieces[1:], strict=True):
            assembled += self.encode(message["content"]) + list(piece)
        if assembled != apply_chat_template(self.tokenizer, sample, **self.kwargs):
            return None
        return tuple(pieces)

    def _render(self, messages: Sequence[Message], generation: bool) -> str:
        text = apply_chat_template(
            self.tokenizer,
            messages,
            add_generation_prompt=generation,
            tokenize=False,
            **self.kwargs,
        )
        return str(text)

    def _build_frame(self, role: str) -> TurnFrame:
        pieces = self._slice(role) if self._has_template else None
        if pieces is None:
            self._fallback("its chat template cannot be sliced into turn frames")
            pieces = (_CHATML[0], _CHATML[1].format(role=role), _CHATML[2])
        return TurnFrame(*(tuple(self.encode(piece)) for piece in pieces))

    def _slice(self, role: str) -> tuple[str, str, str] | None:
        try:
            head = [{"role": "user", "content": _A}, {"role": "assistant", "content": _B}]
            before = self._render(head, generation=False)
            after = self._render([*head, {"role": role, "content": _C}], generation=True)
        except Exception:  # a template that rejects the role or the sequence
            return None
        if not after.startswith(before) or before.count(_B) != 1 or after.count(_C) != 1:
            return None
        close_assistant = before[before.index(_B) + len(_B) :]
        suffix = after[len(before) :]
        open_message, close_and_prompt = suffix.split(_C)
        return close_assistant, open_message, close_and_prompt

    def _check_prefix_stable(self) -> bool:
        """Whether rendering a longer conversation keeps the shorter one's text as a prefix
        (False for templates that rewrite earlier turns, e.g. drop earlier think blocks)."""
        if not self._has_template:
            return True
        first = [{"role": "user", "content": _A}, {"role": "assistant", "content": _THINK}]
        more = [*first, {"role": "user", "content": _C}, {"role": "assistant", "content": _B}]
        try:
            return self._render(more, False).startswith(self._render(first, False))
        except Exception:
            return True

    def _fallback(self, why: str) -> None:
        name = getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)
        message = f"tokenizer {name!r}: {why}"
        if self.strict:
            raise ChatTemplateError(
                f"{message}; give it a chat template (chat_template_path) or pass "
                "strict_chat_template_boundary=False to frame turns as ChatML"
            )
        logger.warning("%s; framing turns as ChatML", message)


def _overlap(completion: Sequence[int], close: Sequence[int]) -> int:
    """The longest k such that the completion ends with the first k ids of ``close``."""
    for k in range(min(len(close), len(completion)), 0, -1):
        if list(completion[-k:]) == list(close[:k]):
            return k
    return 0
