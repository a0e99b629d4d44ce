"""The HTTP wire of ``vllm serve`` as :class:`~agile_llmenvs.backends.VLLMServerBackend` speaks
it: the ``/v1/completions`` body, the :class:`Generation` read back from its reply, and the
settings read from ``GET /server_info``.

The sampled ids come back as ``"token_id:N"`` strings with their log-probs (``logprobs: 0``
and ``return_tokens_as_token_ids``), so nothing is decoded and re-encoded.
"""

from __future__ import annotations

from typing import Any

from agile_llmenvs.backends.types import FinishReason, Generation, SamplingParams
from agile_llmenvs.errors import GenerationServerError

__all__ = [
    "completion_body",
    "generation",
    "lora_problem",
    "lora_settings",
    "prompt_logprobs",
    "transfer_backend",
]

_TOKEN_ID = "token_id:"


def completion_body(
    model: str, prompt: list[int], params: SamplingParams, seed: int | None
) -> dict[str, Any]:
    """The ``/v1/completions`` request for one prompt of token ids."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k is not None else -1,
        # every field explicit, so a model's generation_config.json cannot change what is
        # sampled (the server's defaults come from it)
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logprobs": 0,  # the sampled token's own log-prob only
        "return_tokens_as_token_ids": True,
        # as the in-process engine's defaults: text without special tokens, cut before a stop
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
    }
    if params.stop:
        body["stop"] = list(params.stop)
    if seed is not None:
        body["seed"] = seed
    return body


def generation(reply: Any, url: str, vocab_size: int | None = None) -> Generation:
    """A :class:`Generation` from a ``/v1/completions`` reply of the server at ``url``.

    Raises:
        GenerationServerError: The reply lacks token ids or log-probs, their counts differ,
            or an id is outside ``[0, vocab_size)`` (negative, whatever the size).
    """
    try:
        choice = reply["choices"][0]
        logprobs = choice["logprobs"]
        ids = tuple(_token_id(token) for token in logprobs["tokens"])
        values = tuple(float(v) for v in logprobs["token_logprobs"])
        text = str(choice["text"])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise GenerationServerError(
            f"{url} sent a completion without token ids and log-probs ({exc!r}); is it a "
            "vLLM server (return_tokens_as_token_ids)?",
            url=url,
        ) from exc
    if len(values) != len(ids):
        raise GenerationServerError(
            f"{url} sent {len(ids)} token ids but {len(values)} log-probs", url=url
        )
    outside = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if outside:
        raise GenerationServerError(
            f"{url} sent token id {outside[0]}, outside the vocabulary (0 to "
            f"{'...' if vocab_size is None else vocab_size - 1}): is it serving this model?",
            url=url,
        )
    reason: FinishReason = "stop" if choice.get("finish_reason") == "stop" else "length"
    return Generation(ids, values, text, reason)


def prompt_logprobs(reply: Any, ids: list[int], url: str) -> list[float]:
    """The log-prob of each of ``ids`` after the first from a ``/v1/completions`` reply that
    asked for ``prompt_logprobs`` (vLLM's ``[None, {"<id>": {"logprob": ...}}, ...]``).

    Raises:
        GenerationServerError: The reply lacks them, or not for every token of ``ids``.
    """
    try:
        steps = reply["choices"][0]["prompt_logprobs"][1:]
        values = [
            float(step[str(tok)]["logprob"]) for tok, step in zip(ids[1:], steps, strict=True)
        ]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise GenerationServerError(
            f"{url} sent no prompt log-probs for the {len(ids)} ids asked about ({exc!r}); is "
            "it a vLLM server?",
            url=url,
        ) from exc
    return values


def _token_id(token: str) -> int:
    if not token.startswith(_TOKEN_ID):
        raise ValueError(f"token {token!r} is not 'token_id:N'")
    return int(token[len(_TOKEN_ID) :])


def lora_settings(info: dict[str, Any], url: str) -> tuple[int | None, bool]:
    """From a server's ``/server_info``: its ``--max-lora-rank`` (``None``: no LoRA) and
    whether it loads adapters at run time.

    Raises:
        GenerationServerError: ``info`` does not have vLLM's layout.
    """
    try:
        lora = info["vllm_config"].get("lora_config")
        runtime = info["vllm_env"].get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", False)
    except (KeyError, TypeError, AttributeError) as exc:
        raise GenerationServerError(
            f"{url}/server_info: {type(exc).__name__}: {exc}", url=url
        ) from exc
    return (int(lora["max_lora_rank"]) if lora else None), runtime in (True, "True", "1")


def lora_problem(max_rank: int | None, runtime_updates: bool, rank: int) -> str:
    """What keeps a server from loading adapters of ``rank`` (empty: nothing)."""
    if max_rank is None:
        return "it was started without LoRA (no --enable-lora)"
    if max_rank < rank:
        return f"its --max-lora-rank is {max_rank}, below the policy's lora.r of {rank}"
    if not runtime_updates:
        return "VLLM_ALLOW_RUNTIME_LORA_UPDATING is not set in its environment"
    return ""


def transfer_backend(info: dict[str, Any], url: str) -> Any:
    """From a server's ``/server_info``: the weight-transfer engine it was started with.

    Raises:
        GenerationServerError: ``info`` does not have vLLM's layout.
    """
    try:
        config = info["vllm_config"].get("weight_transfer_config") or {}
    except (KeyError, TypeError, AttributeError) as exc:
        raise GenerationServerError(
            f"{url}/server_info: {type(exc).__name__}: {exc}", url=url
        ) from exc
    return config.get("backend")
