"""Chat framing: the exact ids a harness puts around each turn, from the tokenizer's own template.

- A prompt is the template's rendering of the messages, tokenized once and whole, as
  ``apply_chat_template(..., tokenize=True)`` does.
- After a sampled completion the harness appends the template's text from the end of the
  assistant's content to the end of the next generation prompt (the close of the assistant
  turn, the observation's message, the generation prompt), tokenized as one string that
  continues the context, so a SentencePiece tokenizer marks no word start the template's own
  rendering does not. A completion that already ends with the turn's end-of-turn token
  skips the close up to that token: nothing the model produced is spliced in twice.
- Whether appending is exact depends on the template, and on the conversation's shape: it is
  probed once per shape (with or without a system message; observations in a user or a tool
  message) on a three-turn conversation. Appending is exact when each longer rendering starts
  with the shorter one followed by the sampled content, and the text after each assistant
  turn is the same at every depth. Templates that rewrite earlier turns (drop earlier
  ``<think>`` blocks, move the system prompt into the last user message, open the generation
  prompt with reasoning the rendering later drops) fail it; the harness then re-renders the
  whole conversation and starts a new training sample.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.llm_envs.decoding import Decode, tokenizer_decoder

__all__ = ["ChatFramer", "ChatTemplateError", "TurnFrame", "apply_chat_template"]

logger = logging.getLogger(__name__)

Message = Mapping[str, Any]
# Placeholders no template rewrites or strips.
_S, _U, _X = "\u27e6S\u27e7", "\u27e6U\u27e7", "\u27e6X\u27e7"
_A1, _A2 = "\u27e6A1\u27e7", "\u27e6A2\u27e7"
_O2, _O3 = "\u27e6O2\u27e7", "\u27e6O3\u27e7"
_PADDED = " \n\u27e6O2\u27e7 \n"  # does the template pass content through unchanged?
_THINK = "<think>scratch</think>"
_SHARED: weakref.WeakKeyDictionary[Any, dict[tuple[str, str, bool], dict[str, Any]]] = (
    weakref.WeakKeyDictionary()
)
#: Prompts whose ids a framer remembers (cleared when full).
_PROMPT_MEMO_SIZE = 4096
_CHATML = ("<|im_end|>\n", "<|im_start|>{role}\n", "<|im_end|>\n<|im_start|>assistant\n")


class ChatTemplateError(AgileLLMEnvsError, ValueError):
    """The tokenizer has no chat template to frame the conversation (strict mode)."""


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
    """The template's text around one observation that follows an assistant turn.

    Attributes:
        close: Closes the assistant turn, from the end of its content (``<|im_end|>\\n``).
        open: Opens the observation's message (``<|im_start|>user\\n``).
        prompt: Closes that message and opens the next assistant turn.
        verbatim: The template puts an observation's content in unchanged (no ``trim``), so
            ``close + open + content + prompt`` is its rendering of any content.
    """

    close: str
    open: str
    prompt: str
    verbatim: bool


class ChatFramer:
    """Builds prompts and per-turn insertions from a tokenizer's chat template.

    Args:
        tokenizer: A Hugging Face tokenizer.
        strict: Raise :class:`ChatTemplateError` when the tokenizer has no chat template;
            otherwise frame as ChatML with a warning.
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
        template = self.kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None)
        self.template_source = str(template) if template else ""
        self._has_template = bool(template)
        # Probes depend only on the tokenizer, its template and the kwargs: share them across
        # every harness of the run (one per rollout slot), so none pays for probing again.
        key = (self.template_source, repr(sorted(self.kwargs.items())), strict)
        self._cache: dict[str, Any] = _SHARED.setdefault(tokenizer, {}).setdefault(key, {})
        if "anchor" not in self._cache:
            self._cache["anchor"] = _anchor(tokenizer, self.encode)
            self._cache["decode"] = tokenizer_decoder(tokenizer)
        self._decode: Decode = self._cache["decode"]
        self._anchor: tuple[str, int] | None = self._cache["anchor"]

    # -- tokenizing ----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as the start of a sequence, without special tokens added (by the
        Rust tokenizer's encoding without character offsets where it has one: half the cost)."""
        if self._backend is not None:
            return list(self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """``tokenizer.decode``, by the fastest exact path (see :mod:`.decoding`)."""
        return self._decode(ids, skip_special_tokens)

    def encode_continuation(self, text: str) -> list[int]:
        """Ids of ``text`` where it follows other ids, as inside a longer rendering.

        Tokenized after a special token, so a tokenizer that marks the start of a sequence
        (SentencePiece's ``▁``) does not mark it here.
        """
        if self._anchor is None:
            return self.encode(text)
        anchor, anchor_id = self._anchor
        ids = self.encode(anchor + text)
        return ids[1:] if ids and ids[0] == anchor_id else self.encode(text)

    def encode_continuations(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode_continuation` of each text, in one batched call."""
        anchor = self._anchor[0] if self._anchor is not None else ""
        batch = [anchor + text for text in texts]
        if self._backend is not None:
            encodings = self._backend.encode_batch_fast(batch, add_special_tokens=False)
            rows = [list(encoding.ids) for encoding in encodings]
        else:
            rows = [list(r) for r in self.tokenizer(batch, add_special_tokens=False)["input_ids"]]
        if self._anchor is None:
            return rows
        anchor_id = self._anchor[1]
        return [
            row[1:] if row[:1] == [anchor_id] else self.encode(text)
            for row, text in zip(rows, texts, strict=True)
        ]

    # -- prompts -------------------------------------------------------------------------------

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The ids of ``messages`` followed by the generation prompt: the template's own."""
        if not self.use_template:
            return self.encode("\n\n".join(str(m["content"]) for m in messages))
        if not self._has_template:
            self._fallback("it has no chat template")
            text = "".join(
                _CHATML[1].format(role=m["role"]) + str(m["content"]) + _CHATML[0] for m in messages
            )
            return self.encode(text + "<|im_start|>assistant\n")
        key = _memo_key(messages)
        memo: dict[Any, tuple[int, ...]] = self._cache.setdefault("prompts", {})
        ids = memo.get(key) if key is not None else None
        if ids is None:
            ids = tuple(self.encode(self.render(messages, generation=True)))
            if key is not None:
                if len(memo) >= _PROMPT_MEMO_SIZE:
                    memo.clear()
                memo[key] = ids
        return list(ids)

    def render(self, messages: Sequence[Message], *, generation: bool) -> str:
        """The template's text of ``messages`` (with the generation prompt when asked)."""
        text = apply_chat_template(
            self.tokenizer,
            messages,
            add_generation_prompt=generation,
            tokenize=False,
            **self.kwargs,
        )
        return str(text)

    # -- turns ---------------------------------------------------------------------------------

    def frame(self, role: str = "user", *, system: bool = False) -> TurnFrame | None:
        """The frame of a ``role`` observation after an assistant turn, when appending it
        equals the template's rendering for conversations of this shape (None otherwise)."""
        if not self.use_template:
            return TurnFrame("", "", "", verbatim=True)
        if not self._has_template:
            self._fallback("it has no chat template")
            return TurnFrame(_CHATML[0], _CHATML[1].format(role=role), _CHATML[2], True)
        key = f"frame:{role}:{system}"
        if key not in self._cache:
            self._cache[key] = self._probe(role, system)
        frame: TurnFrame | None = self._cache[key]
        return frame

    def appendable(self, role: str = "user", *, system: bool = False) -> bool:
        """Whether turns can be appended to the context (the template is prefix-stable for
        conversations of this shape); False: each turn re-renders the conversation."""
        return self.frame(role, system=system) is not None

    @property
    def prefix_stable(self) -> bool:
        """Whether user turns can be appended to a conversation without a system message."""
        return self.appendable("user", system=False)

    def turn_ids(
        self,
        completion_ids: Sequence[int],
        observations: Sequence[Message],
        *,
        system: bool = False,
    ) -> list[int] | None:
        """Ids to append after a sampled completion: the rest of the assistant turn, the
        observation messages and the next generation prompt.

        None when appending cannot equal the template's rendering (see :meth:`frame`).
        """
        if not self.use_template:
            if not observations:
                raise ValueError("turn_ids needs at least one observation message")
            return self.encode_continuation("\n\n".join(str(m["content"]) for m in observations))
        parts = self.turn_text(completion_ids, observations, system=system)
        if parts is None:
            return None
        text, skip = parts
        return self.encode_continuation(text)[skip:]

    def turn_text(
        self,
        completion_ids: Sequence[int],
        observations: Sequence[Message],
        *,
        system: bool = False,
    ) -> tuple[str, int] | None:
        """The template's text that :meth:`turn_ids` tokenizes, and how many of its leading
        ids the completion already produced (its end-of-turn token). None as for
        :meth:`turn_ids`. Observations may hold content parts (images): the text then holds
        the template's placeholder of each image."""
        if not observations:
            raise ValueError("turn_ids needs at least one observation message")
        role = str(observations[0]["role"])
        frame = self.frame(role, system=system)
        if frame is None:
            return None
        only = observations[0]
        text: str | None
        plain = set(only) <= {"role", "content"} and isinstance(only["content"], str)
        if len(observations) == 1 and frame.verbatim and plain:
            text = frame.close + frame.open + str(only["content"]) + frame.prompt
        else:
            text = self._rendered_turn(observations, system)
        if text is None:
            return None
        return text, self._skip(completion_ids, frame)

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The ids that end an assistant turn in this template, through its first special
        token (``<|im_end|>``, ``<end_of_turn>``, ``' </s>'``...): what the model samples to
        stop. The tokenizer's eos without a template."""
        if "end_of_turn" not in self._cache:
            self._cache["end_of_turn"] = self._end_of_turn()
        ids: tuple[int, ...] = self._cache["end_of_turn"]
        return ids

    @property
    def content_gap(self) -> str:
        """Spaces the template puts between the generation prompt and an assistant's content
        (Llama-2's ``' ' + content``): the start of what the model samples."""
        turn = self._assistant_turn()
        return "" if turn is None else turn[0]

    @property
    def reasoning(self) -> tuple[str, str] | None:
        """The template's reasoning delimiters (``<think>``, ``</think>``), if it has them."""
        return ("<think>", "</think>") if "</think>" in self.template_source else None

    @property
    def starts_in_reasoning(self) -> bool:
        """Whether the generation prompt opens a reasoning block (DeepSeek-R1 style)."""
        if "starts_in_reasoning" not in self._cache:
            opens = False
            if self._has_template and self.use_template and self.reasoning:
                try:
                    text = self.render([{"role": "user", "content": _U}], generation=True)
                    opens = text.rstrip().endswith(self.reasoning[0])
                except Exception:  # a template that cannot render one user message
                    opens = False
            self._cache["starts_in_reasoning"] = opens
        value: bool = self._cache["starts_in_reasoning"]
        return value

    def observation_role(self, role: str) -> str:
        """``role`` when the template renders it in a message of its own, ``user`` otherwise
        (a template without a ``tool`` role gets tool results as user turns)."""
        if role == "user" or not self.use_template or not self._has_template:
            return "user"
        key = f"role:{role}"
        if key not in self._cache:
            head = [{"role": "user", "content": _U}, {"role": "assistant", "content": _A1}]
            try:
                own = self.render([*head, {"role": role, "content": _O2}], generation=True)
                as_user = self.render([*head, {"role": "user", "content": _O2}], generation=True)
                self._cache[key] = role if own.count(_O2) == 1 and own != as_user else "user"
            except Exception:  # a template that rejects the role
                self._cache[key] = "user"
        known: str = self._cache[key]
        return known

    # -- probing -------------------------------------------------------------------------------

    def _probe(self, role: str, system: bool) -> TurnFrame | None:
        head: list[dict[str, Any]] = [{"role": "system", "content": _S}] if system else []
        head.append({"role": "user", "content": _U})
        a1, a2 = _THINK + _A1, _THINK + _A2
        turns = [
            {"role": "assistant", "content": a1},
            {"role": role, "content": _O2},
            {"role": "assistant", "content": a2},
            {"role": role, "content": _O3},
        ]
        try:
            p1 = self.render(head, generation=True)
            p2 = self.render([*head, *turns[:2]], generation=True)
            p3 = self.render([*head, *turns], generation=True)
            padded_turn = [turns[0], {"role": role, "content": _PADDED}]
            padded = self.render([*head, *padded_turn], generation=True)
            closed = self.render([*head, {"role": "assistant", "content": _A1}], generation=False)
        except Exception:  # a template that rejects this shape (a system or a tool message)
            return None
        post1, post2 = _after_content(p1, a1, p2), _after_content(p2, a2, p3)
        if post1 is None or post2 is None or post1.count(_O2) != 1:
            return None
        if post1.replace(_O2, _X) != post2.replace(_O3, _X):
            return None
        # The close is what the rendering of a last assistant turn and of a continued one share
        # (Phi-3 appends eos after a last turn, not after one that is followed).
        ended = closed[closed.rindex(_A1) + len(_A1) :] if closed.count(_A1) == 1 else ""
        close = _common_prefix(ended, post1)
        open_, prompt = post1[len(close) :].split(_O2)
        verbatim = _after_content(p1, a1, padded) == post1.replace(_O2, _PADDED)
        return TurnFrame(close, open_, prompt, verbatim)

    def _rendered_turn(self, observations: Sequence[Message], system: bool) -> str | None:
        """The text after an assistant turn's content, rendered by the template itself (for
        templates that transform content, and for several observation messages)."""
        head: list[dict[str, Any]] = [{"role": "system", "content": _S}] if system else []
        head.append({"role": "user", "content": _U})
        assistant = {"role": "assistant", "content": _A1}
        try:
            prompt = self.render(head, generation=True)
            longer = self.render([*head, assistant, *observations], generation=True)
        except Exception:
            return None
        return _after_content(prompt, _A1, longer)

    def _skip(self, completion_ids: Sequence[int], frame: TurnFrame) -> int:
        """How many leading ids of the turn's insertion the completion already produced."""
        key = f"close_ids:{frame.close}"
        if key not in self._cache:
            self._cache[key] = tuple(self.encode_continuation(frame.close))
        close: tuple[int, ...] = self._cache[key]
        if not completion_ids or not close:
            return 0
        last = completion_ids[-1]
        if last in close and last in self._special_ids():
            return close.index(last) + 1  # the model closed its turn itself
        return 0

    def _special_ids(self) -> frozenset[int]:
        if "special_ids" not in self._cache:
            ids = set(getattr(self.tokenizer, "all_special_ids", ()) or ())
            added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
            for token_id, token in added.items():
                if getattr(token, "special", False):
                    ids.add(int(token_id))
            self._cache["special_ids"] = frozenset(ids)
        special: frozenset[int] = self._cache["special_ids"]
        return special

    def _assistant_turn(self) -> tuple[str, str] | None:
        """``(gap, close)`` of one assistant turn after a user message: the spaces before
        its content and the text after it (None: no template, or it cannot render one)."""
        if "assistant_turn" not in self._cache:
            self._cache["assistant_turn"] = self._render_assistant_turn()
        turn: tuple[str, str] | None = self._cache["assistant_turn"]
        return turn

    def _render_assistant_turn(self) -> tuple[str, str] | None:
        if not self.use_template or not self._has_template:
            return None
        try:
            user = [{"role": "user", "content": _U}]
            prompt = self.render(user, generation=True)
            closed = self.render([*user, {"role": "assistant", "content": _A1}], generation=False)
        except Exception:
            return None
        if closed.count(_A1) != 1:
            return None
        start = closed.index(_A1)
        gap = closed[len(prompt) : start] if closed.startswith(prompt) else ""
        return (gap if not gap.strip(" ") else ""), closed[start + len(_A1) :]

    def _end_of_turn(self) -> tuple[int, ...]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        fallback = () if eos is None else (int(eos),)
        turn = self._assistant_turn()
        if turn is None:
            return fallback
        close = self.encode_continuation(turn[1])
        special = self._special_ids()
        first = next((i for i, token in enumerate(close) if token in special), None)
        return fallback if first is None else tuple(close[: first + 1])

    def _fallback(self, why: str) -> None:
        name = getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)
        message = f"tokenizer {name!r}: {why}"
        if self.strict:
            raise ChatTemplateError(
                f"{message}; give it a chat template (chat_template_path) or pass "
                "strict_chat_template_boundary=False to frame turns as ChatML"
            )
        logger.warning("%s; framing turns as ChatML", message)


def _after_content(prompt: str, content: str, longer: str) -> str | None:
    """The text of ``longer`` after ``content``, when ``longer`` is ``prompt``, spaces the
    template puts before an assistant's content (Llama-2's ``' ' + content``), then
    ``content``; None otherwise (the rendering is not prefix-stable)."""
    if not longer.startswith(prompt):
        return None
    rest = longer[len(prompt) :]
    rest = rest[len(rest) - len(rest.lstrip(" ")) :]
    return rest[len(content) :] if rest.startswith(content) else None


def _common_prefix(a: str, b: str) -> str:
    """The longest text both strings start with."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _anchor(tokenizer: Any, encode: Any) -> tuple[str, int] | None:
    """A special token that tokenizes alone and splits the text after it (for
    :meth:`ChatFramer.encode_continuation`)."""
    for token in getattr(tokenizer, "all_special_tokens", ()) or ():
        try:
            alone, followed = encode(token), encode(token + "a b")
        except Exception:
            continue
        if len(alone) == 1 and followed[:1] == alone:
            return str(token), int(alone[0])
    return None


def _memo_key(messages: Sequence[Message]) -> tuple[tuple[str, str], ...] | None:
    """A hashable key of plain role/content messages (None for richer ones)."""
    key = []
    for message in messages:
        if len(message) != 2 or "role" not in message or "content" not in message:
            return None
        key.append((str(message["role"]), str(message["content"])))
    return tuple(key)
