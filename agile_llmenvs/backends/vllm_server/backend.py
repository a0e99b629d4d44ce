"""The backend itself: :class:`VLLMServerBackend` composes the servers (routing and health,
:mod:`.servers`), the wire format (:mod:`.wire`) and the weight sync (:mod:`.weight_sync`)
into the token-in / token-out backend faces."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agile_llmenvs.backends.local import LocalChatBackend, chat_completion
from agile_llmenvs.backends.types import Completion, Generation, SamplingParams
from agile_llmenvs.backends.vllm import _SEED_STRIDE
from agile_llmenvs.backends.vllm_server.servers import (
    Routing,
    ServerPool,
    gather_errors,
    session_loop,
)
from agile_llmenvs.backends.vllm_server.weight_sync import LoRASync, WeightSync, WeightTransfer
from agile_llmenvs.backends.vllm_server.wire import completion_body, generation, prompt_logprobs
from agile_llmenvs.errors import GenerationServerError

__all__ = ["VLLMServerBackend"]


class VLLMServerBackend(LocalChatBackend):
    """Token-in / token-out generation from one or more running ``vllm serve`` processes.

    Sampling follows :class:`~agile_llmenvs.backends.VLLMBackend` exactly: in a batched
    :meth:`generate` with ``params.seed``, request ``i`` gets seed
    ``seed * 65536 + i``, so a server started like the in-process engine (same model, dtype,
    ``--logprobs-mode processed_logprobs``, as
    :class:`~agile_llmenvs.backends.vllm_launch.VLLMServerProcess` starts one) returns the
    same ids and log-probs. The ids include a final end-of-turn id when one was sampled.

    Routing: ``least_loaded`` sends each request to the server with the fewest requests in
    flight from this backend (ties in turn), ``round_robin`` to each in turn. A request whose
    server refuses the connection, drops it, answers 5xx or exceeds ``timeout_s`` fails with
    :class:`~agile_llmenvs.errors.GenerationServerError` (or ``GenerationTimeoutError``)
    naming the server, and is not retried elsewhere (its episode fails, typed); that server
    then gets no requests for 5 s (unless every server is down), after which it is tried
    again.

    Weight sync (:meth:`sync_weights`): the weights go to a folder of safetensors files in
    ``weights_dir`` (one per training process: :mod:`~agile_llmenvs.weights.files`),
    and each server reloads it, tensor by tensor, through ``POST /collective_rpc`` calling the
    worker extension :class:`~agile_llmenvs.weights.WeightSyncWorker`'s
    ``load_policy_weights_from`` (vLLM's in-place ``reload_weights``), then
    ``POST /reset_prefix_cache``. vLLM's own ``/update_weights`` needs a weight-transfer
    engine, and the ones vLLM 0.32 ships (NCCL, CUDA IPC, ...) need a GPU; the file works on
    any device and with servers on other machines that share the filesystem. With
    ``weight_transfer="gloo"`` the weights stream instead, a layer at a time, through those
    routes and vLLM's layerwise reload, over a gloo group of this process and the servers
    (:mod:`~agile_llmenvs.weights.gloo`; start the servers with
    ``--weight-transfer-config '{"backend": "agile_gloo"}'``, as
    ``VLLMServerProcess(weight_transfer="gloo")`` does). Nothing touches a disk, but one
    failing server fails the whole sync (the group is shared), and no server is retired.

    With ``lora_sync="adapters"`` a LoRA (``peft``) policy sends its adapters only (peft's
    layout), which each server loads in place as the adapter
    :data:`~agile_llmenvs.backends.vllm_server.SERVED_ADAPTER` (``POST /v1/load_lora_adapter``);
    from then on requests name that adapter as their model, so the servers generate with
    base + adapters (:meth:`load_adapters_from`).

    Args:
        urls: Base URL of each server (``http://host:port``).
        tokenizer: The served model's tokenizer, or a local folder to load it from (offline).
        model: The served model's name; ``None`` asks the first server (``GET /v1/models``).
        routing: How requests are spread over the servers.
        timeout_s: Most seconds per request (and per server call of a weight sync).
        weights_dir: Where :meth:`sync_weights` writes the weights; every server must be able
            to read it (same machine, or a shared filesystem). ``None``: a temporary folder.
        weight_transfer: ``"files"`` (the folder above) or ``"gloo"`` (streamed, see above).
        transfer_host: With ``"gloo"``: the address the servers reach this process at.
        vocab_size: The ids a reply may hold, ``[0, vocab_size)``: the model's embedding rows
            (a training run passes its policy's); a reply with another is the server's
            failure. None: only negative ids are refused (a tokenizer's length is not the
            bound: a model's padded rows can be sampled).
        lora_sync: How a LoRA policy is synced: ``"merged"`` (the whole model, adapters
            merged in) or ``"adapters"`` (the adapters only; the servers must be started
            with LoRA, as ``VLLMServerProcess(max_lora_rank=R)`` starts them).

    Raises:
        ValueError: ``urls`` is empty or holds a URL that is not ``http(s)://``, or
            ``routing``, ``timeout_s`` or ``lora_sync`` is invalid.
        OptionalDependencyError: ``aiohttp`` is not installed.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        tokenizer: Any | str | os.PathLike[str],
        model: str | None = None,
        routing: Routing = "least_loaded",
        timeout_s: float = 300.0,
        weights_dir: str | os.PathLike[str] | None = None,
        lora_sync: LoRASync = "merged",
        weight_transfer: WeightTransfer = "files",
        transfer_host: str = "127.0.0.1",
        vocab_size: int | None = None,
    ) -> None:
        self._pool = ServerPool(urls, routing=routing, timeout_s=timeout_s)
        self._vocab_size = vocab_size
        self._sync = WeightSync(
            self._pool,
            weights_dir=weights_dir,
            lora_sync=lora_sync,
            weight_transfer=weight_transfer,
            transfer_host=transfer_host,
        )
        self._tokenizer = _load_tokenizer(tokenizer)
        self._model = model
        self._model_lock: asyncio.Lock | None = None

    # --- settings and state ------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer."""
        return self._tokenizer

    @property
    def version(self) -> int:
        """The policy version the servers hold: 0 at start, set by :meth:`sync_weights`."""
        return self._sync.version

    @property
    def urls(self) -> tuple[str, ...]:
        """The base URLs of the servers that take requests, in the order given."""
        return self._pool.urls

    @property
    def retired(self) -> tuple[str, ...]:
        """The servers a failed weight sync took out of the rotation, in order."""
        return self._pool.retired

    @property
    def routing(self) -> Routing:
        """How requests are spread over the servers."""
        return self._pool.routing

    @property
    def timeout_s(self) -> float:
        """Most seconds per request (and per server call of a weight sync)."""
        return self._pool.timeout_s

    @property
    def lora_sync(self) -> LoRASync:
        """How a LoRA policy is synced: ``"merged"`` or ``"adapters"``."""
        return self._sync.lora_sync

    @property
    def weight_transfer(self) -> WeightTransfer:
        """How whole weights reach the servers: ``"files"`` or ``"gloo"``."""
        return self._sync.weight_transfer

    @property
    def transfer_host(self) -> str:
        """With ``"gloo"``: the address the servers reach this process at."""
        return self._sync.transfer_host

    def in_flight(self) -> dict[str, int]:
        """Requests from this backend in flight now, per server URL."""
        return self._pool.in_flight()

    # --- the TokenBackend / AsyncTokenBackend faces ------------------------------------------

    async def agenerate(self, prompt: Sequence[int], params: SamplingParams) -> Generation:
        """Sample one continuation of ``prompt`` on one server; await it on
        ``SESSION_LOOP.loop``.

        Raises:
            GenerationServerError: The server failed this request (``url`` names it).
            GenerationTimeoutError: It did not answer within ``timeout_s``.
        """
        return await self._request(list(prompt), params, params.seed)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        """Sample one continuation per prompt, all requests in flight at once.

        With ``params.seed``, request ``i`` samples with seed ``seed * 65536 + i``, as
        :class:`~agile_llmenvs.backends.VLLMBackend` does.

        Raises:
            GenerationServerError: A request failed (the first failure, in prompt order);
                :meth:`generate_results` returns failures as values instead.
        """
        results = self.generate_results(prompts, params)
        for result in results:
            if isinstance(result, GenerationServerError):
                raise result
        return [r for r in results if isinstance(r, Generation)]

    def generate_results(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation | GenerationServerError]:
        """As :meth:`generate`, with a failed request's error in its place instead of raised,
        so a lock-step caller fails only the episodes whose server failed."""
        if not prompts:
            return []
        return session_loop().run(self._batch(prompts, params))

    def _chat(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Chat completions; a request its server failed is a failed completion (its
        trajectory ends with a backend error), not an exception that sinks the batch."""
        return [
            Completion.failed(f"{type(r).__name__}: {r}")
            if isinstance(r, GenerationServerError)
            else chat_completion(r)
            for r in self.generate_results(prompts, params)
        ]

    async def _batch(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation | GenerationServerError]:
        seeds = [
            None if params.seed is None else params.seed * _SEED_STRIDE + i
            for i in range(len(prompts))
        ]
        requests = [self._request(list(p), params, s) for p, s in zip(prompts, seeds, strict=True)]
        return await gather_errors(requests)

    async def _request(
        self, prompt: list[int], params: SamplingParams, seed: int | None
    ) -> Generation:
        self._pool.client()  # refuses a caller off the session loop before anything else
        model = self._sync.adapter or await self._served_model()
        body = completion_body(model, prompt, params, seed)
        reply, url = await self._pool.post_routed("/v1/completions", body)
        try:
            return generation(reply, url, self._vocab_size)
        except GenerationServerError:
            self._pool.mark_down(url)  # a wrong reply, as a failed one
            raise

    def prompt_logprobs(self, ids: Sequence[int]) -> dict[str, list[float]]:
        """Each server's log-prob of each token of ``ids`` after the first, given the ones
        before it, from its raw logits (the LoRA adapters it serves, if any): what a weight
        sync's check compares with the policy's own. Keyed by server URL.

        Raises:
            GenerationServerError: A server failed the request (``url`` names it).
        """
        return session_loop().run(self._prompt_logprobs(list(ids)))

    async def _prompt_logprobs(self, ids: list[int]) -> dict[str, list[float]]:
        model = self._sync.adapter or await self._served_model()
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        servers = list(self._pool.servers)
        replies = await asyncio.gather(
            *(self._pool.post(s, "/v1/completions", body) for s in servers)
        )
        return {
            server.url: prompt_logprobs(reply, ids, server.url)
            for server, reply in zip(servers, replies, strict=True)
        }

    async def _served_model(self) -> str:
        if self._model is not None:
            return self._model
        if self._model_lock is None:
            self._model_lock = asyncio.Lock()
        async with self._model_lock:
            if self._model is None:
                self._model = await self._pool.served_model()
        return self._model

    # --- weight sync -------------------------------------------------------------------------

    def sync_weights(self, policy: Any, *, version: int | None = None) -> float:
        """Load ``policy``'s weights into every server: a LoRA policy's adapters merged in,
        or its adapters alone with ``lora_sync="adapters"`` (:meth:`syncs_adapters`).

        Requests in flight go on through the reload: their later tokens are sampled with the
        new weights (each token's log-prob is still the one it was sampled with).

        Args:
            policy: A Hugging Face causal LM of the served architecture, or a peft model,
                held whole by this process (several training processes sync through
                :class:`~agile_llmenvs.training.generation.ServerWeightSync`).
            version: The version the servers hold after; ``None``: one more than now.

        Returns:
            The seconds it took.

        Raises:
            GenerationServerError: No server could load them (it names the first); the
                version is left as it was. Servers that fail while others load them are
                retired (:meth:`load_weights_from`).
        """
        return self._sync.sync(policy, version=version)

    def syncs_adapters(self, policy: Any) -> bool:
        """Whether a sync of ``policy`` sends its adapters only (a LoRA policy, and
        ``lora_sync="adapters"``)."""
        return self._sync.syncs_adapters(policy)

    def weights_folder(self, version: int) -> Path:
        """The folder a sync of ``version`` is written to (in ``weights_dir``)."""
        return self._sync.weights_folder(version)

    def load_weights_from(self, folder: str | os.PathLike[str], *, version: int) -> tuple[str, ...]:
        """Have every server reload its weights from ``folder`` (written by
        :func:`~agile_llmenvs.weights.write_weights`, by one process or by each of several),
        then hold ``version``; the previous sync's folder is removed on a thread
        (a model's cached pages take a while to unlink; :meth:`close` waits for it).

        A server that fails the reload while others take it would serve the old weights
        under the new version, so it is retired: it gets no more requests (and no more
        syncs), and the run goes on with the others.

        Returns:
            The URLs of the servers retired by this sync (usually none).

        Raises:
            GenerationServerError: No server could load them (it names the first); the
                version is left as it was.
        """
        return self._sync.load_weights_from(folder, version=version)

    def load_adapters_from(
        self, folder: str | os.PathLike[str], *, version: int
    ) -> tuple[str, ...]:
        """Have every server load the LoRA adapters in ``folder`` (peft's layout:
        :func:`~agile_llmenvs.weights.write_adapters`) in place as
        :data:`~agile_llmenvs.backends.vllm_server.SERVED_ADAPTER`, then hold ``version``; requests
        then name that adapter. A failing server is retired, and the previous folder removed,
        as by :meth:`load_weights_from`.

        The first time, each server is asked whether it can (``GET /server_info``): started
        with ``--enable-lora``, a ``--max-lora-rank`` of at least the adapters' rank, and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``.

        Returns:
            The URLs of the servers retired by this sync (usually none).

        Raises:
            GenerationServerError: A server cannot serve these adapters (it names the
                server, what it lacks and how to fix it), or no server could load them.
        """
        return self._sync.load_adapters_from(folder, version=version)

    def retire(self, urls: Sequence[str]) -> None:
        """Send no more requests or syncs to the servers at ``urls`` (another training
        process's sync found them failing); at least one server must be left.

        Raises:
            ValueError: ``urls`` names every server left.
        """
        self._pool.retire(urls)

    def set_version(self, version: int, *, adapters: bool = False) -> None:
        """Record that the servers hold ``version`` (another training process synced them),
        as the adapters :data:`~agile_llmenvs.backends.vllm_server.SERVED_ADAPTER` when ``adapters``
        (requests then name it)."""
        self._sync.set_version(version, adapters=adapters)

    def stream_weights(self, policy: Any, *, version: int, send: bool = True) -> None:
        """Stream ``policy``'s whole weights (LoRA adapters merged in) to every server over
        gloo, a layer at a time (``weight_transfer="gloo"``), then hold ``version``. Every
        training process of a sharded policy calls it together (each tensor is gathered
        whole, a collective); only the one with ``send`` (rank 0) talks to the servers.

        Raises:
            GenerationServerError: A server failed the sync (the version is left as it was);
                the next sync starts a fresh group.
        """
        self._sync.stream_weights(policy, version=version, send=send)

    def close(self) -> None:
        """Close the HTTP session, and remove the weights folder if this backend made it."""
        self._sync.close()
        self._pool.close()


def _load_tokenizer(tokenizer: Any) -> Any:
    if not isinstance(tokenizer, str | os.PathLike):
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
