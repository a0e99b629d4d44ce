"""Weight syncs to ``vllm serve`` processes from every training process of a run.

Each process writes its own file of the sync's folder (its shard of an FSDP-sharded policy,
or, for a policy every process holds whole, nothing but rank 0's copy:
:mod:`~agile_llmenvs.weights.files`), so nothing is gathered and no process holds a
second copy of the model. Once every file is written, rank 0 asks each server to reload the
folder, and every process learns the outcome from rank 0: each then records the new version
(so every process's producer sees the same served version before its next round), or each
raises the same :class:`~agile_llmenvs.errors.GenerationServerError`, so no process is left
waiting in a collective. A LoRA policy synced as adapters (``lora_sync: adapters``) is the
exception to "nothing is gathered": its adapter tensors, small, are gathered to rank 0,
which writes them in peft's layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agile_llmenvs.errors import GenerationServerError
from agile_llmenvs.training.policy import is_sharded
from agile_llmenvs.weights import local_weights, write_adapters, write_weights

__all__ = ["ServerWeightSync", "write_shared_adapters", "write_shared_folder"]


class ServerWeightSync:
    """Loads the policy's weights into the servers of ``backend``; call it on every process.

    Args:
        backend: This process's :class:`~agile_llmenvs.backends.VLLMServerBackend` (each
            process has one; rank 0's reaches the servers for the sync).
        rank: This process.
        world_size: The run's training processes.
    """

    def __init__(self, backend: Any, *, rank: int, world_size: int) -> None:
        self.backend, self.rank, self.world_size = backend, rank, world_size

    def __call__(self, policy: Any, version: int) -> None:
        """Sync ``policy`` (the unwrapped model, sharded or whole) as ``version``.

        A LoRA policy sends its adapters only when the backend's ``lora_sync`` is
        ``"adapters"`` (:func:`write_shared_adapters`). A server that fails the reload while
        others take it is retired on every process
        (:meth:`~agile_llmenvs.backends.VLLMServerBackend.load_weights_from`).

        Raises:
            GenerationServerError: No server could load the weights (on every process).
        """
        if self.world_size == 1:
            self.backend.sync_weights(policy, version=version)
            return
        adapters = self.backend.syncs_adapters(policy)  # the same on every process
        if self.backend.weight_transfer == "gloo" and not adapters:
            self._stream(policy, version)
            return
        proposed = self.backend.weights_folder(version) if self.rank == 0 else None
        if adapters:
            folder = write_shared_adapters(policy, proposed, rank=self.rank)
            load = self.backend.load_adapters_from
        else:
            folder = write_shared_folder(
                policy, proposed, rank=self.rank, world_size=self.world_size
            )
            load = self.backend.load_weights_from
        outcome: dict[str, Any] = {}  # rank 0's: the servers retired, or the failure
        if self.rank == 0:
            try:
                outcome["retired"] = load(folder, version=version)
            except GenerationServerError as exc:
                outcome["failed"] = (str(exc), exc.url)
        outcome = _rank_0_outcome(outcome)
        if self.rank != 0:
            if outcome["retired"]:
                self.backend.retire(outcome["retired"])  # the servers rank 0 found failing
            self.backend.set_version(version, adapters=adapters)

    def _stream(self, policy: Any, version: int) -> None:
        """Rank 0 streams the weights over gloo (``weight_transfer="gloo"``) while every
        process gathers each tensor with it; each then records the version, or raises rank
        0's failure."""
        outcome: dict[str, Any] = {}
        try:
            self.backend.stream_weights(policy, version=version, send=self.rank == 0)
        except GenerationServerError as exc:
            outcome["failed"] = (str(exc), exc.url)
        _rank_0_outcome(outcome)
        if self.rank != 0:
            self.backend.set_version(version)


def _rank_0_outcome(outcome: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's outcome of a sync, on every process; its failure raised on every process."""
    outcome = _from_rank_0(outcome)
    if "failed" in outcome:
        message, url = outcome["failed"]
        raise GenerationServerError(message, url=url)
    return outcome


def write_shared_folder(policy: Any, proposed: Path | None, *, rank: int, world_size: int) -> Path:
    """Write this process's file of a sync folder, and return the folder once every process
    has written its own (call it on every process).

    Args:
        policy: The unwrapped policy, sharded by FSDP2 or held whole by every process.
        proposed: The folder, on rank 0 (the other processes learn it from rank 0).
        rank: This process.
        world_size: The run's training processes.
    """
    folder = Path(_from_rank_0(None if proposed is None else str(proposed)))
    write_weights(
        folder,
        local_weights(policy),
        rank=rank,
        world_size=world_size,
        sharded=is_sharded(policy),
    )
    torch.distributed.barrier()  # every file is in place
    return folder


def write_shared_adapters(policy: Any, proposed: Path | None, *, rank: int) -> Path:
    """Write a LoRA policy's adapters (peft's layout) into a sync folder from rank 0, and
    return the folder once they are written (call it on every process: the adapter tensors
    of an FSDP2-sharded policy are gathered whole, a collective; they are small).

    Args:
        policy: The unwrapped peft policy, sharded by FSDP2 or held whole by every process.
        proposed: The folder, on rank 0 (the other processes learn it from rank 0).
        rank: This process.
    """
    folder = Path(_from_rank_0(None if proposed is None else str(proposed)))
    write_adapters(policy, folder, main=rank == 0)
    torch.distributed.barrier()  # the files are in place
    return folder


def _from_rank_0(value: Any) -> Any:
    """Rank 0's ``value``, on every process."""
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
