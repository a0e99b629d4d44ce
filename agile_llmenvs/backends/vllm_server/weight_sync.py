"""Weight sync for :class:`~agile_llmenvs.backends.VLLMServerBackend`: how a policy's weights
reach the servers, and which version (and adapter) they hold.

With ``weight_transfer="files"`` the weights go to a folder of safetensors files
(:mod:`~agile_llmenvs.weights.files`) that each server reloads through
``POST /collective_rpc``; a server that fails while others take the folder is retired. With
``"gloo"`` they stream over a gloo group (:mod:`~agile_llmenvs.weights.gloo`) through the
servers' weight-transfer routes. With ``lora_sync="adapters"`` a LoRA policy sends its
adapters only, which the servers load as :data:`SERVED_ADAPTER`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from agile_llmenvs.backends.vllm_server.servers import (
    Server,
    ServerPool,
    gather_errors,
    session_loop,
)
from agile_llmenvs.backends.vllm_server.wire import lora_problem, lora_settings, transfer_backend
from agile_llmenvs.errors import GenerationServerError

if TYPE_CHECKING:
    from agile_llmenvs.weights.gloo import GlooWeightSender

__all__ = ["SERVED_ADAPTER", "LoRASync", "WeightSync", "WeightTransfer"]

logger = logging.getLogger(__name__)

WeightTransfer = Literal["files", "gloo"]
LoRASync = Literal["adapters", "merged"]
#: The name the servers load a LoRA policy's adapters under (requests name it as their model).
SERVED_ADAPTER = "policy"


class WeightSync:
    """What the servers of ``pool`` hold, and how a policy's weights reach them (the
    backend's :meth:`~agile_llmenvs.backends.VLLMServerBackend.sync_weights` and the methods
    beside it document each step).

    Args:
        pool: The servers.
        weights_dir: Where sync folders are written (``None``: a temporary folder, removed
            by :meth:`close`).
        lora_sync: ``"merged"`` or ``"adapters"``.
        weight_transfer: ``"files"`` or ``"gloo"``.
        transfer_host: With ``"gloo"``: the address the servers reach this process at.

    Raises:
        ValueError: ``lora_sync`` or ``weight_transfer`` is invalid.
    """

    def __init__(
        self,
        pool: ServerPool,
        *,
        weights_dir: str | os.PathLike[str] | None,
        lora_sync: LoRASync,
        weight_transfer: WeightTransfer,
        transfer_host: str,
    ) -> None:
        if lora_sync not in ("adapters", "merged"):
            raise ValueError(f"lora_sync must be 'adapters' or 'merged', got {lora_sync!r}")
        if weight_transfer not in ("files", "gloo"):
            raise ValueError(f"weight_transfer must be 'files' or 'gloo', got {weight_transfer!r}")
        self._pool = pool
        self.lora_sync: LoRASync = lora_sync
        self.weight_transfer: WeightTransfer = weight_transfer
        self.transfer_host = transfer_host
        self.version = 0
        self.adapter: str | None = None  # what requests name once the servers hold adapters
        self._own_weights_dir = weights_dir is None
        self._weights_dir = Path(weights_dir) if weights_dir is not None else None
        self._weights_folder: Path | None = None
        self._removal: threading.Thread | None = None  # the previous folder, going
        self._sender: GlooWeightSender | None = None  # made on the first streamed sync

    def sync(self, policy: Any, *, version: int | None) -> float:
        """Load ``policy``'s weights into every server; the seconds it took."""
        from agile_llmenvs.weights import local_weights, write_adapters, write_weights

        start = time.perf_counter()
        version = self.version + 1 if version is None else version
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
        from agile_llmenvs.weights import is_lora

        return self.lora_sync == "adapters" and is_lora(policy)

    def weights_folder(self, version: int) -> Path:
        if self._weights_dir is None:
            self._weights_dir = Path(tempfile.mkdtemp(prefix="agile-llmenvs-weights-"))
        return self._weights_dir / f"policy-{os.getpid()}-{id(self):x}-v{version}"

    def set_version(self, version: int, *, adapters: bool = False) -> None:
        self.version = version
        self.adapter = SERVED_ADAPTER if adapters else None

    # --- a folder every server loads ----------------------------------------------------------

    def load_weights_from(self, folder: str | os.PathLike[str], *, version: int) -> tuple[str, ...]:
        return self._load_everywhere(Path(folder), version, self._reload_on)

    def load_adapters_from(
        self, folder: str | os.PathLike[str], *, version: int
    ) -> tuple[str, ...]:
        from agile_llmenvs.weights import adapter_rank

        folder = Path(folder)
        session_loop().run(self._check_lora(adapter_rank(folder)))
        return self._load_everywhere(folder, version, self._load_adapters_on, adapters=True)

    def _load_everywhere(
        self,
        folder: Path,
        version: int,
        load: Callable[[Server, str], Awaitable[None]],
        *,
        adapters: bool = False,
    ) -> tuple[str, ...]:
        """``load`` the folder on every server; retire those that fail while others take
        it, or raise when none does."""
        servers = self._pool.servers
        results = session_loop().run(
            gather_errors([load(server, str(folder)) for server in servers])
        )
        failed = [r for r in results if isinstance(r, GenerationServerError)]
        if len(failed) == len(servers):
            names = ", ".join(e.url for e in failed)
            raise GenerationServerError(
                f"weight sync failed on {names}: {failed[0]}", url=failed[0].url
            ) from failed[0]
        for error in failed:
            logger.warning(
                "weight sync failed on %s, which now gets no requests: %s", error.url, error
            )
        retired = tuple(e.url for e in failed)
        self._pool.retire(retired)
        if self._weights_folder is not None and self._weights_folder != folder:
            self._remove(self._weights_folder)
        self._weights_folder = folder
        self.set_version(version, adapters=adapters)
        return retired

    async def _reload_on(self, server: Server, path: str) -> None:
        body = {"method": "load_policy_weights_from", "args": [path]}
        await self._pool.post(server, "/collective_rpc", body)
        await self._pool.post(server, "/reset_prefix_cache", {})

    async def _load_adapters_on(self, server: Server, path: str) -> None:
        body = {"lora_name": SERVED_ADAPTER, "lora_path": path, "load_inplace": True}
        await self._pool.post(server, "/v1/load_lora_adapter", body)
        # a fresh folder per version, but cached prefixes were computed with the old adapters
        await self._pool.post(server, "/reset_prefix_cache", {})

    async def _check_lora(self, rank: int) -> None:
        """Raise if a server cannot serve adapters of ``rank``; a server that does not
        answer is left to the load itself (which retires it)."""
        unchecked = [s for s in self._pool.servers if s.max_lora_rank is None]
        settings = await gather_errors([self._lora_settings(s) for s in unchecked])
        for server, found in zip(unchecked, settings, strict=True):
            if isinstance(found, GenerationServerError):
                continue
            max_rank, runtime_updates = found
            problem = lora_problem(max_rank, runtime_updates, rank)
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

    async def _lora_settings(self, server: Server) -> tuple[int | None, bool]:
        return lora_settings(await self._pool.server_info(server), server.url)

    # --- a stream over gloo -------------------------------------------------------------------

    def stream_weights(self, policy: Any, *, version: int, send: bool = True) -> None:
        """Stream ``policy``'s whole weights to every server over gloo, then hold
        ``version``; only the process with ``send`` talks to the servers."""
        from agile_llmenvs.weights import GlooWeightSender, TensorMeta, local_weights, weight_metas

        tensors = local_weights(policy, whole=True)
        if not send:
            for _ in tensors:  # the collectives rank 0's stream gathers with
                pass
            return
        if self._sender is None:
            session_loop().run(self._check_gloo())
            self._sender = GlooWeightSender(
                _Routes(self._pool), host=self.transfer_host, timeout_s=self._pool.timeout_s
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
                url=self._pool.servers[0].url,
            ) from exc
        self.set_version(version)

    async def _check_gloo(self) -> None:
        """Raise unless every server was started with the gloo engine (else the group's
        start would wait ``timeout_s`` for a server that never joins)."""
        for server in self._pool.servers:
            backend = transfer_backend(await self._pool.server_info(server), server.url)
            if backend != "agile_gloo":
                raise GenerationServerError(
                    f"{server.url} cannot take weights over gloo: it was started with weight "
                    f"transfer backend {backend!r}, not 'agile_gloo'. Start it "
                    """with --weight-transfer-config '{"backend": "agile_gloo"}' """
                    "(VLLMServerProcess(weight_transfer='gloo') does), or set "
                    "weight_transfer: files",
                    url=server.url,
                )

    def _remove(self, folder: Path) -> None:
        """Remove a sync's folder that no server reads any more, on a thread: unlinking a
        model's worth of cached pages takes a large share of a sync's time (0.3-0.4 s of about
        2 s for 2 GB on 2 CPU cores), which the step waiting on the sync need not pay."""
        self.settle()
        self._removal = threading.Thread(
            target=shutil.rmtree,
            args=(folder,),
            kwargs={"ignore_errors": True},
            name="weights-folder-removal",
            daemon=True,
        )
        self._removal.start()

    def settle(self) -> None:
        """Wait until the previous sync's folder is removed (it goes on a thread)."""
        if self._removal is not None:
            self._removal.join()
            self._removal = None

    def close(self) -> None:
        """Leave the gloo group, wait for the previous sync's folder to be removed, and
        remove the weights folder if this sync made it."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        self.settle()
        if self._own_weights_dir and self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
            self._weights_dir = None
            self._weights_folder = None


class _Routes:
    """The servers' weight-transfer routes for :class:`~agile_llmenvs.weights.GlooWeightSender`
    (its :class:`~agile_llmenvs.weights.ControlPlane`): each call runs on the session loop
    while the caller's thread goes on (to broadcast)."""

    def __init__(self, pool: ServerPool) -> None:
        self._pool = pool

    @property
    def num_servers(self) -> int:
        return len(self._pool.servers)

    def call(
        self,
        path: str,
        body: dict[str, Any] | list[dict[str, Any]] | None = None,
        query: dict[str, str] | None = None,
    ) -> concurrent.futures.Future[None]:
        route = "/" + path + ("?" + urllib.parse.urlencode(query) if query else "")
        return asyncio.run_coroutine_threadsafe(
            self._pool.call_all(route, body), session_loop().loop
        )
