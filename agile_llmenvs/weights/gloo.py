"""Weight syncs to ``vllm serve`` processes over a gloo group: vLLM's weight-transfer routes
with a transport that works on a CPU.

vLLM's own weight-transfer engines (``vllm.distributed.weight_transfer``: NCCL, CUDA IPC,
sparse NCCL, NCCL M2N, sharded RDT) all need a GPU. This one keeps their protocol and moves
the tensors with a gloo broadcast instead: the trainer (rank 0) hosts a ``TCPStore``, and
each server's worker (ranks 1 to N, :mod:`~agile_llmenvs.weights.vllm_gloo_engine`) joins
the group when the trainer calls ``POST /init_weight_transfer_engine``. A sync is
``/pause`` (requests in flight wait: between the start and the finish of a reload the
model's layers are not there), ``/start_weight_update``, then for each layer one
``/update_weights`` naming its tensors while rank 0 broadcasts them, ``/finish_weight_update``
and ``/resume``. The weights stream a tensor at a time: nothing is written to disk, and no
process holds a second copy of the model (a tensor of a policy sharded by FSDP2 is gathered
whole when its turn comes, by every training process together).

This module needs only torch; the servers start with
``--weight-transfer-config '{"backend": "agile_gloo"}'``
(:class:`~agile_llmenvs.backends.vllm_launch.VLLMServerProcess` ``weight_transfer=``).
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "ENGINE_NAME",
    "ControlPlane",
    "GlooGroup",
    "GlooWeightSender",
    "TensorMeta",
    "layer_groups",
    "open_group",
]

#: The name the servers' ``--weight-transfer-config`` gives the worker-side engine.
ENGINE_NAME = "agile_gloo"
_STORE_PREFIX = "agile-llmenvs-weights"


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver allocates before a tensor's broadcast."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


class GlooGroup:
    """A gloo group of its own (not torch's default group, which a trainer's FSDP holds):
    rank 0 sends, every other rank receives."""

    def __init__(self, backend: Any, store: Any, rank: int) -> None:
        self._backend, self._store, self.rank = backend, store, rank

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Send ``tensor`` (rank 0) or fill it with rank 0's (the others); blocks until done."""
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = 0
        self._backend.broadcast([tensor], options).wait()
        return tensor

    def close(self) -> None:
        self._backend = None
        self._store = None


def open_group(
    host: str, port: int, *, rank: int, world_size: int, timeout_s: float = 300.0
) -> GlooGroup:
    """Join (rank 0: host) the group at ``host:port``; blocks until every rank has joined."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(
        host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    prefixed = PrefixStore(_STORE_PREFIX, store)
    backend = ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return GlooGroup(backend, store, rank)


def layer_groups(metas: Iterable[TensorMeta]) -> Iterator[list[TensorMeta]]:
    """``metas`` in runs that share their outermost numbered module (``model.layers.3.``);
    an unnumbered tensor (embeddings, the final norm) is a run of its own."""
    run: list[TensorMeta] = []
    key: str | None = None
    for meta in metas:
        parts = meta.name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        this = ".".join(parts[: index + 1]) if index is not None else meta.name
        if run and this != key:
            yield run
            run = []
        run.append(meta)
        key = this
    if run:
        yield run


class ControlPlane(Protocol):
    """The servers' weight-transfer routes, called on every server at once: the call returns
    at once, and its future is done when every server has answered (it raises the first
    failure). A list ``body`` gives each server its own, in server order."""

    def call(
        self,
        path: str,
        body: dict[str, Any] | list[dict[str, Any]] | None = None,
        query: dict[str, str] | None = None,
    ) -> Future[None]: ...

    @property
    def num_servers(self) -> int: ...


class GlooWeightSender:
    """Rank 0's end of the transfer: opens the group with the servers on first use and
    streams a policy's tensors to all of them at once, a layer per ``/update_weights``.

    Args:
        control: The servers' routes.
        host: The address the servers reach this process at (it hosts the group's store).
        timeout_s: Most seconds one collective (and the group's start) may take.
    """

    def __init__(
        self, control: ControlPlane, *, host: str = "127.0.0.1", timeout_s: float = 300.0
    ) -> None:
        self.control, self.host, self.timeout_s = control, host, timeout_s
        self._group: GlooGroup | None = None

    def send(
        self, metas: Sequence[TensorMeta], tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> None:
        """Reload every server's weights from ``tensors`` (whole, in ``metas``' order); the
        servers' requests in flight wait (``/pause?mode=keep``) and then go on.

        Raises:
            Exception: What the first failing server call raised; the group is closed, and
                the next :meth:`send` starts a fresh one (the iterator is drained first, so
                every training process leaves its collectives together).
        """
        try:
            group = self._open()
            self.control.call("pause", query={"mode": "keep"}).result()
            try:
                self.control.call("start_weight_update").result()
                for run in layer_groups(metas):
                    pending = self.control.call(
                        "update_weights", {"update_info": _update_info(run)}
                    )
                    for meta in run:
                        name, tensor = next(tensors)
                        _check(meta, name, tensor)
                        group.broadcast(tensor.detach().to("cpu").contiguous())
                    pending.result()
                self.control.call("finish_weight_update").result()
            finally:
                self.control.call("resume").result()
        except Exception:
            self.close()
            for _ in tensors:  # the other training processes gather the rest in step
                pass
            raise

    def close(self) -> None:
        """Leave the group (the servers keep their end until the next start replaces it)."""
        if self._group is not None:
            self._group.close()
            self._group = None

    def _open(self) -> GlooGroup:
        if self._group is not None:
            return self._group
        port = _free_port(self.host)
        servers = self.control.num_servers
        world_size = 1 + servers  # one worker per server (a server's own world of 1)
        init_info = {
            "master_address": self.host,
            "master_port": port,
            "world_size": world_size,
            "timeout_s": self.timeout_s,
        }
        # every server blocks in its init until all ranks have joined, this one included
        init = self.control.call(
            "init_weight_transfer_engine",
            [{"init_info": {**init_info, "rank_offset": 1 + i}} for i in range(servers)],
        )
        try:
            group = open_group(
                self.host, port, rank=0, world_size=world_size, timeout_s=self.timeout_s
            )
        finally:
            init.result()
        self._group = group
        return group


def _update_info(run: Sequence[TensorMeta]) -> dict[str, Any]:
    return {
        "names": [m.name for m in run],
        "dtype_names": [m.dtype_name for m in run],
        "shapes": [list(m.shape) for m in run],
    }


def _check(meta: TensorMeta, name: str, tensor: torch.Tensor) -> None:
    if name != meta.name or tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape:
        raise ValueError(
            f"the policy's weights changed during the sync: expected {meta.name} "
            f"{meta.dtype} {meta.shape}, got {name} {tensor.dtype} {tuple(tensor.shape)}"
        )


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
