"""Generation from running ``vllm serve`` processes: token ids in, token ids out, over HTTP.

Each request is one ``POST /v1/completions`` with the prompt as token ids; the sampled ids
come back as ``"token_id:N"`` strings with their log-probs (``logprobs: 0`` and
``return_tokens_as_token_ids``), so nothing is decoded and re-encoded. Requests are spread
over several servers, and a server that fails is left out for a while, so only the requests
it held fail.

HTTP goes through ``aiohttp`` (the ``vllm_server`` extra, also in ``api``), on the one event
loop thread remote env sessions use (:data:`~agile_llmenvs.transport.session_loop.SESSION_LOOP`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from agile_llmenvs.backends.local import LocalChatBackend, chat_completion
from agile_llmenvs.backends.types import Completion, FinishReason, Generation, SamplingParams
from agile_llmenvs.backends.vllm import _SEED_STRIDE
from agile_llmenvs.errors import (
    GenerationServerError,
    GenerationTimeoutError,
    OptionalDependencyError,
)

if TYPE_CHECKING:
    import aiohttp

    from agile_llmenvs.transport.session_loop import SessionLoop

__all__ = ["SERVED_ADAPTER", "LoRASync", "Routing", "VLLMServerBackend", "WeightTransfer"]

logger = logging.getLogger(__name__)

Routing = Literal["least_loaded", "round_robin"]
WeightTransfer = Literal["files", "gloo"]
LoRASync = Literal["adapters", "merged"]
#: The name the servers load a LoRA policy's adapters under (requests name it as their model).
SERVED_ADAPTER = "policy"

_T = TypeVar("_T")
_TOKEN_ID = "token_id:"
_DOWN_FOR_S = 5.0  # how long a failed server gets no requests before it is tried again


@dataclass
class _Server:
    """One server's routing state (touched on the session loop only)."""

    url: str
    in_flight: int = 0
    down_until: float = 0.0
    max_lora_rank: int | None = None  # once an adapters sync has asked the server

    def up(self, now: float) -> bool:
        return now >= self.down_until


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
    ``weights_dir`` (one per training process: :mod:`~agile_llmenvs.training.weight_files`),
    and each server reloads it, tensor by tensor, through ``POST /collective_rpc`` calling the
    worker extension :class:`~agile_llmenvs.training.vllm_engine.WeightSyncWorker`'s
    ``load_policy_weights_from`` (vLLM's in-place ``reload_weights``), then
    ``POST /reset_prefix_cache``. vLLM's own ``/update_weights`` needs a weight-transfer
    engine, and the ones vLLM 0.32 ships (NCCL, CUDA IPC, ...) need a GPU; the file works on
    any device and with servers on other machines that share the filesystem. With
    ``weight_transfer="gloo"`` the weights stream instead, a layer at a time, through those
    routes and vLLM's layerwise reload, over a gloo group of this process and the servers
    (:mod:`~agile_llmenvs.training.gloo_weights`; start the servers with
    ``--weight-transfer-config '{"backend": "agile_gloo"}'``, as
    ``VLLMServerProcess(weight_transfer="gloo")`` does). Nothing touches a disk, but one
    failing server fails the whole sync (the group is shared), and no server is retired.

    With ``lora_sync="adapters"`` a LoRA (``peft``) policy sends its adapters only (peft's
    layout), which each server loads in place as the adapter :data:`SERVED_ADAPTER`
    (``POST /v1/load_lora_adapter``); from then on requests name that adapter as their
    model, so the servers generate with base + adapters (:meth:`load_adapters_from`).

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
    ) -> None:
        try:
            import aiohttp
        except ImportError as exc:
            raise OptionalDependencyError(
                "aiohttp", extra="vllm_server", feature="VLLMServerBackend"
            ) from exc
        self._aiohttp = aiohttp
        self._servers = [_Server(url) for url in _check_urls(urls)]
        self._retired: tuple[str, ...] = ()
        if routing not in ("least_loaded", "round_robin"):
            raise ValueError(f"routing must be 'least_loaded' or 'round_robin', got {routing!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if lora_sync not in ("adapters", "merged"):
            raise ValueError(f"lora_sync must be 'adapters' or 'merged', got {lora_sync!r}")
        self.lora_sync: LoRASync = lora_sync
        self._adapter: str | None = None  # what requests name once the servers hold adapters
        self.routing: Routing = routing
        self.timeout_s = float(timeout_s)
        self._tokenizer = _load_tokenizer(tokenizer)
        self._model = model
        self._own_weights_dir = weights_dir is None
        self._weights_dir = Path(weights_dir) if weights_dir is not None else None
        self._weights_folder: Path | None = None
        if weight_transfer not in ("files", "gloo"):
            raise ValueError(f"weight_transfer must be 'files' or 'gloo', got {weight_transfer!r}")
        self.weight_transfer: WeightTransfer = weight_transfer
        self.transfer_host = transfer_host
        self._sender: Any = None  # the gloo sender, made on the first streamed sync
        self._version = 0
        self._next = 0  # where the round robin (and least_loaded's ties) resume
        self._session: aiohttp.ClientSession | None = None
        self._model_lock: asyncio.Lock | None = None

    # --- the TokenBackend / AsyncTokenBackend faces ------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer."""
        return self._tokenizer

    @property
    def version(self) -> int:
        """The policy version the servers hold: 0 at start, set by :meth:`sync_weights`."""
        return self._version

    @property
    def urls(self) -> tuple[str, ...]:
        """The base URLs of the servers that take requests, in the order given."""
        return tuple(s.url for s in self._servers)

    def in_flight(self) -> dict[str, int]:
        """Requests from this backend in flight now, per server URL."""
        return {s.url: s.in_flight for s in self._servers}

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
        return _session_loop().run(self._batch(prompts, params))

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
        return await _gather_errors(requests)

    # --- one request -------------------------------------------------------------------------

    async def _request(
        self, prompt: list[int], params: SamplingParams, seed: int | None
    ) -> Generation:
        session = self._client()
        model = self._adapter or await self._served_model()
        body = _completion_body(model, prompt, params, seed)
        server = self._pick()
        server.in_flight += 1
        try:
            reply = await self._post(session, server, "/v1/completions", body)
        finally:
            server.in_flight -= 1
        return _generation(reply, server.url)

    def _pick(self) -> _Server:
        now = time.monotonic()
        servers = self._servers
        order = servers[self._next :] + servers[: self._next]
        live = [s for s in order if s.up(now)] or order  # all down: try them anyway
        chosen = live[0] if self.routing == "round_robin" else min(live, key=_load)
        self._next = (servers.index(chosen) + 1) % len(servers)
        return chosen

    async def _post(
        self, session: aiohttp.ClientSession, server: _Server, path: str, body: dict[str, Any]
    ) -> Any:
        """POST ``body`` to one server; its JSON reply, or a typed error (and the server
        marked down, unless the request itself was at fault: a 4xx)."""
        url = server.url + path
        try:
            async with session.post(url, json=body) as response:
                if response.status >= 400:
                    detail = (await response.text())[:500]
                    if response.status >= 500:
                        server.down_until = time.monotonic() + _DOWN_FOR_S
                    raise GenerationServerError(
                        f"{url} answered {response.status}: {detail}",
                        url=server.url,
                        status_code=response.status,
                    )
                if response.content_length == 0 or response.content_type != "application/json":
                    return None
                return await response.json()
        except TimeoutError as exc:
            server.down_until = time.monotonic() + _DOWN_FOR_S
            raise GenerationTimeoutError(
                f"{url} did not answer within timeout_s={self.timeout_s:g} s",
                url=server.url,
            ) from exc
        except self._aiohttp.ClientError as exc:
            server.down_until = time.monotonic() + _DOWN_FOR_S
            raise GenerationServerError(
                f"{url} failed: {type(exc).__name__}: {exc} (is the server running?)",
                url=server.url,
            ) from exc

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if loop is not _session_loop().loop:
            raise RuntimeError(
                "VLLMServerBackend.agenerate must be awaited on SESSION_LOOP.loop "
                "(asyncio.run_coroutine_threadsafe(..., SESSION_LOOP.loop)); blocking callers "
                "use generate()"
            )
        if self._session is None or self._session.closed:
            aiohttp = self._aiohttp
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=0),  # vllm batches whatever comes
            )
        return self._session

    async def _served_model(self) -> str:
        if self._model is not None:
            return self._model
        if self._model_lock is None:
            self._model_lock = asyncio.Lock()
        async with self._model_lock:
            if self._model is None:
                self._model = await self._ask_model()
        return self._model

    async def _ask_model(self) -> str:
        session = self._client()
        failures: list[GenerationServerError] = []
        for server in self._servers:
            try:
                async with session.get(server.url + "/v1/models") as response:
                    response.raise_for_status()
                    listing = await response.json()
                return str(listing["data"][0]["id"])
            except (TimeoutError, self._aiohttp.ClientError, KeyError, IndexError) as exc:
                failures.append(
                    GenerationServerError(f"{type(exc).__name__}: {exc}", url=server.url)
                )
        raise GenerationServerError(
            "no server told its model name (GET /v1/models): "
            + "; ".join(f"{e.url}: {e}" for e in failures)
            + "; pass model= to skip the question",
            url=self._servers[0].url,
        )

    # --- weight sync -------------------------------------------------------------------------

    def sync_weights(self, policy: Any, *, version: int | None = None) -> float:
        """Load ``policy``'s weights into every server: a LoRA policy's adapters merged in,
        or its adapters alone with ``lora_sync="adapters"`` (:meth:`syncs_adapters`).

        Requests in flight go on through the reload: their later tokens are sampled with the
        new weights (each token's log-prob is still the one it was sampled with).

        Args:
            policy: A Hugging Face causal LM of the served architecture, or a peft model,
                held whole by this process (several training processes sync through
                :class:`~agile_llmenvs.training.server_sync.ServerWeightSync`).
            version: The version the servers hold after; ``None``: one more than now.

        Returns:
            The seconds it took.

        Raises:
            GenerationServerError: No server could load them (it names the first); the
                version is left as it was. Servers that fail while others load them are
                retired (:meth:`load_weights_from`).
        """
        from agile_llmenvs.training.lora import write_adapters
        from agile_llmenvs.training.weight_files import local_weights, write_weights

        start = time.perf_counter()
        version = self._version + 1 if version is None else version
        if self.weight_transfer == "gloo" and not self.syncs_adapters(policy):
            self.stream_weights(policy, version=version)
            return time.perf_counter() - start
        folder = self.weights_folder(version)
        if self.syncs_adapters(policy):
            self.load_adapters_from(write_adapters(policy, folder), version=version)
        else:
            write_weights(folder, local_weights(policy))
            self.load_weights_from(folder, version=version)
        return time.perf_counter() - start

    def syncs_adapters(self, policy: Any) -> bool:
        """Whether a sync of ``policy`` sends its adapters only (a LoRA policy, and
        ``lora_sync="adapters"``)."""
        from agile_llmenvs.training.lora import is_lora

        return self.lora_sync == "adapters" and is_lora(policy)

    def weights_folder(self, version: int) -> Path:
        """The folder a sync of ``version`` is written to (in ``weights_dir``)."""
        if self._weights_dir is None:
            self._weights_dir = Path(tempfile.mkdtemp(prefix="agile-llmenvs-weights-"))
        return self._weights_dir / f"policy-{os.getpid()}-{id(self):x}-v{version}"

    def load_weights_from(self, folder: str | os.PathLike[str], *, version: int) -> tuple[str, ...]:
        """Have every server reload its weights from ``folder`` (written by
        :func:`~agile_llmenvs.training.weight_files.write_weights`, by one process or by
        each of several), then hold ``version``; the previous sync's folder is removed.

        A server that fails the reload while others take it would serve the old weights
        under the new version, so it is retired: it gets no more requests (and no more
        syncs), and the run goes on with the others.

        Returns:
            The URLs of the servers retired by this sync (usually none).

        Raises:
            GenerationServerError: No server could load them (it names the first); the
                version is left as it was.
        """
        return self._load_everywhere(Path(folder), version, self._reload_on)

    def load_adapters_from(
        self, folder: str | os.PathLike[str], *, version: int
    ) -> tuple[str, ...]:
        """Have every server load the LoRA adapters in ``folder`` (peft's layout:
        :func:`~agile_llmenvs.training.lora.write_adapters`) in place as
        :data:`SERVED_ADAPTER`, then hold ``version``; requests then name that adapter. A
        failing server is retired, and the previous folder removed, as by
        :meth:`load_weights_from`.

        The first time, each server is asked whether it can (``GET /server_info``): started
        with ``--enable-lora``, a ``--max-lora-rank`` of at least the adapters' rank, and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``.

        Returns:
            The URLs of the servers retired by this sync (usually none).

        Raises:
            GenerationServerError: A server cannot serve these adapters (it names the
                server, what it lacks and how to fix it), or no server could load them.
        """
        from agile_llmenvs.training.lora import adapter_rank

        folder = Path(folder)
        _session_loop().run(self._check_lora(adapter_rank(folder)))
        return self._load_everywhere(folder, version, self._load_adapters_on, adapters=True)

    def _load_everywhere(
        self,
        folder: Path,
        version: int,
        load: Callable[[_Server, str], Awaitable[None]],
        *,
        adapters: bool = False,
    ) -> tuple[str, ...]:
        """``load`` the folder on every server; retire those that fail while others take
        it, or raise when none does."""
        results = _session_loop().run(
            _gather_errors([load(server, str(folder)) for server in self._servers])
        )
        failed = [r for r in results if isinstance(r, GenerationServerError)]
        if len(failed) == len(self._servers):
            names = ", ".join(e.url for e in failed)
            raise GenerationServerError(
                f"weight sync failed on {names}: {failed[0]}", url=failed[0].url
            ) from failed[0]
        for error in failed:
            logger.warning(
                "weight sync failed on %s, which now gets no requests: %s", error.url, error
            )
        retired = tuple(e.url for e in failed)
        self.retire(retired)
        if self._weights_folder is not None and self._weights_folder != folder:
            shutil.rmtree(self._weights_folder, ignore_errors=True)
        self._weights_folder = folder
        self.set_version(version, adapters=adapters)
        return retired

    def retire(self, urls: Sequence[str]) -> None:
        """Send no more requests or syncs to the servers at ``urls`` (another training
        process's sync found them failing); at least one server must be left.

        Raises:
            ValueError: ``urls`` names every server left.
        """
        keep = [s for s in self._servers if s.url not in set(urls)]
        if not keep:
            raise ValueError(f"retiring {list(urls)} would leave no server to generate")
        self._servers = keep
        self._retired += tuple(u for u in urls if u not in self._retired)
        self._next %= len(keep)

    @property
    def retired(self) -> tuple[str, ...]:
        """The servers a failed weight sync took out of the rotation, in order."""
        return self._retired

    def set_version(self, version: int, *, adapters: bool = False) -> None:
        """Record that the servers hold ``version`` (another training process synced them),
        as the adapters :data:`SERVED_ADAPTER` when ``adapters`` (requests then name it)."""
        self._version = version
        self._adapter = SERVED_ADAPTER if adapters else None

    async def _reload_on(self, server: _Server, path: str) -> None:
        session = self._client()
        await self._post(
            session,
            server,
            "/collective_rpc",
            {"method": "load_policy_weights_from", "args": [path]},
        )
        await self._post(session, server, "/reset_prefix_cache", {})

    async def _load_adapters_on(self, server: _Server, path: str) -> None:
        session = self._client()
        body = {"lora_name": SERVED_ADAPTER, "lora_path": path, "load_inplace": True}
        await self._post(session, server, "/v1/load_lora_adapter", body)
        # a fresh folder per version, but cached prefixes were computed with the old adapters
        await self._post(session, server, "/reset_prefix_cache", {})

    async def _check_lora(self, rank: int) -> None:
        """Raise if a server cannot serve adapters of ``rank``; a server that does not
        answer is left to the load itself (which retires it)."""
        unchecked = [s for s in self._servers if s.max_lora_rank is None]
        settings = await _gather_errors([self._lora_settings(s) for s in unchecked])
        for server, found in zip(unchecked, settings, strict=True):
            if isinstance(found, GenerationServerError):
                continue
            max_rank, runtime_updates = found
            problem = _lora_problem(max_rank, runtime_updates, rank)
            if problem:
                raise GenerationServerError(
                    f"{server.url} cannot serve this LoRA policy's adapters: {problem}. "
                    f"lora_sync='adapters' (the manifest's training.vllm_server.lora_sync, "
                    "its default) needs servers started with --enable-lora --max-lora-rank R "
                    "(R >= the policy's lora.r) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                    "(VLLMServerProcess(max_lora_rank=R) does both); or set lora_sync: merged "
                    "to send the whole model with the adapters merged in",
                    url=server.url,
                )
            server.max_lora_rank = max_rank

    async def _lora_settings(self, server: _Server) -> tuple[int | None, bool]:
        """The server's ``--max-lora-rank`` (``None``: no LoRA) and whether it loads
        adapters at run time."""
        info = await self._server_info(server)
        try:
            lora = info["vllm_config"].get("lora_config")
            runtime = info["vllm_env"].get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", False)
        except (KeyError, TypeError, AttributeError) as exc:
            raise GenerationServerError(
                f"{server.url}/server_info: {type(exc).__name__}: {exc}", url=server.url
            ) from exc
        return (int(lora["max_lora_rank"]) if lora else None), runtime in (True, "True", "1")

    def stream_weights(self, policy: Any, *, version: int, send: bool = True) -> None:
        """Stream ``policy``'s whole weights (LoRA adapters merged in) to every server over
        gloo, a layer at a time (``weight_transfer="gloo"``), then hold ``version``. Every
        training process of a sharded policy calls it together (each tensor is gathered
        whole, a collective); only the one with ``send`` (rank 0) talks to the servers.

        Raises:
            GenerationServerError: A server failed the sync (the version is left as it was);
                the next sync starts a fresh group.
        """
        from agile_llmenvs.training.gloo_weights import GlooWeightSender, TensorMeta
        from agile_llmenvs.training.weight_files import local_weights, weight_metas

        tensors = local_weights(policy, whole=True)
        if not send:
            for _ in tensors:  # the collectives rank 0's stream gathers with
                pass
            return
        if self._sender is None:
            _session_loop().run(self._check_gloo())
            self._sender = GlooWeightSender(
                _Routes(self), host=self.transfer_host, timeout_s=self.timeout_s
            )
        metas = [TensorMeta(*meta) for meta in weight_metas(policy)]
        try:
            self._sender.send(metas, tensors)
            self._sender.control.call("reset_prefix_cache").result()
        except GenerationServerError:
            raise
        except Exception as exc:  # a gloo error: a server left the group mid-broadcast
            raise GenerationServerError(
                f"weight transfer over gloo failed: {type(exc).__name__}: {exc}",
                url=self._servers[0].url,
            ) from exc
        self.set_version(version)

    async def _check_gloo(self) -> None:
        """Raise unless every server was started with the gloo engine (else the group's
        start would wait ``timeout_s`` for a server that never joins)."""
        for server in self._servers:
            info = await self._server_info(server)
            try:
                config = info["vllm_config"].get("weight_transfer_config") or {}
            except (KeyError, TypeError, AttributeError) as exc:
                raise GenerationServerError(
                    f"{server.url}/server_info: {type(exc).__name__}: {exc}", url=server.url
                ) from exc
            if config.get("backend") != "agile_gloo":
                raise GenerationServerError(
                    f"{server.url} cannot take weights over gloo: it was started with weight "
                    f"transfer backend {config.get('backend')!r}, not 'agile_gloo'. Start it "
                    """with --weight-transfer-config '{"backend": "agile_gloo"}' """
                    "(VLLMServerProcess(weight_transfer='gloo') does), or set "
                    "weight_transfer: files",
                    url=server.url,
                )

    async def _server_info(self, server: _Server) -> dict[str, Any]:
        """The server's settings (``GET /server_info``, vLLM's dev mode) as JSON."""
        url = f"{server.url}/server_info?config_format=json"
        try:
            async with self._client().get(url) as response:
                response.raise_for_status()
                info = await response.json()
        except (TimeoutError, self._aiohttp.ClientError) as exc:
            raise GenerationServerError(
                f"{url}: {type(exc).__name__}: {exc}", url=server.url
            ) from exc
        if not isinstance(info, dict):
            raise GenerationServerError(f"{url}: not a JSON object: {info!r}", url=server.url)
        return info

    async def _call_all(
        self, path: str, body: dict[str, Any] | list[dict[str, Any]] | None
    ) -> None:
        """POST to every server at once; raises the first failure once all have answered."""
        session = self._client()
        bodies = body if isinstance(body, list) else [body or {}] * len(self._servers)
        calls = [
            self._post(session, server, path, each)
            for server, each in zip(self._servers, bodies, strict=True)
        ]
        for result in await _gather_errors(calls):
            if isinstance(result, GenerationServerError):
                raise result

    def close(self) -> None:
        """Close the HTTP session, and remove the weights folder if this backend made it."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._session is not None and not self._session.closed:
            _session_loop().run(self._session.close())
        self._session = None
        if self._own_weights_dir and self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
            self._weights_dir = None
            self._weights_folder = None


class _Routes:
    """The servers' weight-transfer routes for
    :class:`~agile_llmenvs.training.gloo_weights.GlooWeightSender`: each call runs on the
    session loop while the caller's thread goes on (to broadcast)."""

    def __init__(self, backend: VLLMServerBackend) -> None:
        self._backend = backend

    @property
    def num_servers(self) -> int:
        return len(self._backend.urls)

    def call(
        self,
        path: str,
        body: dict[str, Any] | list[dict[str, Any]] | None = None,
        query: dict[str, str] | None = None,
    ) -> concurrent.futures.Future[None]:
        route = "/" + path + ("?" + urllib.parse.urlencode(query) if query else "")
        return asyncio.run_coroutine_threadsafe(
            self._backend._call_all(route, body), _session_loop().loop
        )


def _session_loop() -> SessionLoop:
    # imported here: the transport package is heavy, and most backend users never need it
    from agile_llmenvs.transport.session_loop import SESSION_LOOP

    return SESSION_LOOP


def _lora_problem(max_rank: int | None, runtime_updates: bool, rank: int) -> str:
    """What keeps a server from loading adapters of ``rank`` (empty: nothing)."""
    if max_rank is None:
        return "it was started without LoRA (no --enable-lora)"
    if max_rank < rank:
        return f"its --max-lora-rank is {max_rank}, below the policy's lora.r of {rank}"
    if not runtime_updates:
        return "VLLM_ALLOW_RUNTIME_LORA_UPDATING is not set in its environment"
    return ""


def _load(server: _Server) -> int:
    return server.in_flight


def _check_urls(urls: str | Sequence[str]) -> list[str]:
    listed = [urls] if isinstance(urls, str) else list(urls)
    if not listed:
        raise ValueError("urls must name at least one server, got an empty list")
    for url in listed:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"urls: {url!r} is not an http(s) URL; give each server as http://host:port"
            )
    return [url.rstrip("/") for url in listed]


def _load_tokenizer(tokenizer: Any) -> Any:
    if not isinstance(tokenizer, str | os.PathLike):
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)


def _completion_body(
    model: str, prompt: list[int], params: SamplingParams, seed: int | None
) -> dict[str, Any]:
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


def _generation(reply: Any, url: str) -> Generation:
    """A :class:`Generation` from a ``/v1/completions`` reply."""
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
    reason: FinishReason = "stop" if choice.get("finish_reason") == "stop" else "length"
    return Generation(ids, values, text, reason)


def _token_id(token: str) -> int:
    if not token.startswith(_TOKEN_ID):
        raise ValueError(f"token {token!r} is not 'token_id:N'")
    return int(token[len(_TOKEN_ID) :])


async def _gather_errors(
    calls: Sequence[Awaitable[_T]],
) -> list[_T | GenerationServerError]:
    """Await all ``calls`` at once; a ``GenerationServerError`` is returned in its place,
    anything else raised."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, GenerationServerError):
            raise result
    return list(results)  # type: ignore[arg-type]
