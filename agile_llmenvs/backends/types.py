"""The backend contract: sampling parameters, what a generation returns, and the protocols.

Every backend is chat-level (:class:`Backend`): a list of conversations in, one
:class:`Completion` per conversation out, in one call. Local backends (HF, vLLM) also satisfy
:class:`TokenBackend`: token ids in, sampled token ids and their log-probs out, so training
data is built from exactly the ids the policy sampled. The values a generation returns
(:class:`Completion`, :class:`Generation`, :class:`ToolCall`) and the chat messages are the
core vocabulary (:mod:`agile_llmenvs.core.chat`), re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from agile_llmenvs.core.chat import (
    Completion,
    FinishReason,
    Generation,
    Message,
    Messages,
    ToolCall,
    Tools,
)

__all__ = [
    "AsyncTokenBackend",
    "Backend",
    "Completion",
    "FinishReason",
    "Generation",
    "Message",
    "Messages",
    "SamplingParams",
    "TokenBackend",
    "TokenDistribution",
    "ToolCall",
    "Tools",
]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion; the same object is shared by every backend.

    The distribution is shaped in vLLM's order, which the HF backend and the trainer follow
    too: the repetition penalty on the raw logits, then the temperature, then ``min_p``,
    ``top_k`` and ``top_p`` truncate it. Nothing else shapes it: a checkpoint's
    ``generation_config.json`` sampling settings are not applied by the local backends.

    Attributes:
        max_tokens: Most new tokens per completion.
        temperature: Softmax temperature; ``0.0`` is greedy decoding.
        top_p: Nucleus sampling mass; ``1.0`` disables it.
        top_k: Sample from the ``top_k`` likeliest tokens only; ``None`` disables it.
        min_p: Drop tokens less likely than ``min_p`` times the likeliest; ``0.0`` disables it.
        repetition_penalty: Divides the positive logits (multiplies the negative ones) of every
            token already in the context, prompt included; ``1.0`` disables it. Local backends
            only (HF, vLLM).
        truncated_logprobs: Whether the recorded log-probs are of the truncated, renormalised
            distribution that was sampled (``top_k`` / ``top_p`` / ``min_p``), or of the whole
            vocabulary's. vLLM records the truncated one whatever this says; the HF backend
            follows it.
        stop: Strings that end a completion; the text is cut before the first one found.
        seed: Seed of the sampler, where the backend supports one.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    truncated_logprobs: bool = True
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (temperature 0)."""
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenDistribution:
    """The distribution a sampled token's log-prob is taken under, by sampler and trainer alike.

    ``log p(x) = log_softmax(keep(penalize(f(logits)) / temperature))[x]``: ``f`` the model's
    own post-head transform, ``penalize`` the repetition penalty over the tokens already in the
    context, ``keep`` the ``min_p`` / ``top_k`` / ``top_p`` truncation (vLLM's order) when
    ``truncated``; outside the kept set the logits are ``-inf``. The trainer always keeps the
    token it scores in the set: after an update it may fall outside the policy's own nucleus,
    and its log-prob stays finite.

    Attributes:
        temperature: Logits are divided by it (``> 0``).
        top_k: Keep the ``top_k`` likeliest tokens; ``None`` keeps all.
        top_p: Keep the likeliest tokens holding this much mass; ``1.0`` keeps all.
        min_p: Keep tokens at least ``min_p`` times as likely as the likeliest.
        repetition_penalty: The penalty of tokens already in the context (``1.0``: none).
        truncated: Renormalise over the kept tokens; False: the whole vocabulary's log-softmax.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    truncated: bool = True

    @classmethod
    def of(cls, params: SamplingParams) -> TokenDistribution:
        """The distribution ``params`` sample from (greedy: temperature 1, untruncated)."""
        if params.greedy:
            return cls(repetition_penalty=params.repetition_penalty, truncated=False)
        return cls(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            truncated=params.truncated_logprobs,
        )

    @property
    def truncates(self) -> bool:
        """Whether log-probs are renormalised over a truncated set."""
        return self.truncated and (self.top_k is not None or self.top_p < 1.0 or self.min_p > 0)

    @property
    def penalizes(self) -> bool:
        """Whether a repetition penalty applies."""
        return self.repetition_penalty != 1.0


@runtime_checkable
class Backend(Protocol):
    """A chat-level generation backend: one call generates for a whole batch."""

    def generate_chat(self, messages: Messages, params: SamplingParams) -> Completion:
        """Generate one completion for one conversation."""
        ...

    def generate_chat_batch(
        self, batch: Sequence[Messages], params: SamplingParams
    ) -> list[Completion]:
        """Generate one completion per conversation, in order, as one batched call."""
        ...

    def generate_with_tools_batch(
        self, batch: Sequence[Messages], tools: Tools, params: SamplingParams
    ) -> list[Completion]:
        """As :meth:`generate_chat_batch`, offering ``tools`` to the model."""
        ...

    def close(self) -> None:
        """Release the backend's resources (models, connections, threads)."""
        ...


@runtime_checkable
class TokenBackend(Backend, Protocol):
    """A local backend that generates over token ids (HF, vLLM)."""

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (with its chat template)."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        """Sample one continuation per prompt of token ids, as one batched call."""
        ...


@runtime_checkable
class AsyncTokenBackend(Protocol):
    """A backend that generates one prompt of token ids per awaitable call, so each episode
    asks for its next turn as soon as its env replies (a ``vllm serve`` batches them itself).

    Calls run on :data:`~agile_llmenvs.transport.session_loop.SESSION_LOOP`'s loop, the one
    remote env sessions use, so rollouts need no thread per episode.
    """

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (with its chat template)."""
        ...

    @property
    def version(self) -> int:
        """The policy version now served: 0 at start, raised by each weight sync."""
        ...

    async def agenerate(self, prompt: Sequence[int], params: SamplingParams) -> Generation:
        """Sample one continuation of ``prompt``; a failure raises
        :class:`~agile_llmenvs.errors.GenerationServerError` for this request only."""
        ...
