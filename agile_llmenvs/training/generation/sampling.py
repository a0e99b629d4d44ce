"""The collector's policy in the training loops: one batched generate per turn."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from agile_llmenvs.backends.types import Generation, SamplingParams
from agile_llmenvs.core.images import prompt_images
from agile_llmenvs.training.policy import GenerationSync

__all__ = ["Sampler"]

_ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


class _Generator(Protocol):
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]: ...


@dataclass
class Sampler:
    """Generates every live context of a turn in one call, timed, seeded per call.

    Attributes:
        backend: What generates (``HFBackend`` over the policy, or a vLLM engine's backend).
        params: Sampling settings; a ``seed`` is advanced by one every call.
        seconds: Time spent in ``generate`` since it was last reset.
        calls: Generate calls since it was last reset.
        sync: For a sharded policy: pairs this process's calls with the others'.
    """

    backend: _Generator
    params: SamplingParams
    seconds: float = 0.0
    calls: int = 0
    sync: GenerationSync | None = None

    def __call__(
        self, contexts: list[list[int]]
    ) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
        start = time.perf_counter()
        if not getattr(self.backend, "supports_images", False) and any(prompt_images(contexts)):
            raise ValueError(
                f"{type(self.backend).__name__} generates from ids alone but these prompts show "
                "images: generate with the HF backend (training.generation_backend: hf)"
            )
        if self.sync is not None:
            self.sync.before_generate()
        seed = None if self.params.seed is None else self.params.seed + self.calls
        generations = self.backend.generate(contexts, dataclasses.replace(self.params, seed=seed))
        self.calls += 1
        self.seconds += time.perf_counter() - start
        return [(g.token_ids, g.logprobs) for g in generations]

    def release(self) -> None:
        """After a collection: drop what the backend kept for its next call (the HF
        backend's prefix cache), so that learning has that memory."""
        clear = getattr(self.backend, "clear_prefix_cache", None)
        if clear is not None:
            clear()

    def drain(self) -> None:
        """After a collection: join the other processes' remaining generate calls (sharded
        policy only; a no-op otherwise)."""
        if self.sync is not None:
            self.sync.drain(lambda: self.backend.generate([[0]], _ONE_TOKEN))
