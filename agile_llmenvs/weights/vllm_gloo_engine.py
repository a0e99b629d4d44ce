"""The server side of :mod:`~agile_llmenvs.weights.gloo`: a vLLM weight-transfer
engine (``WeightTransferEngine``) that receives a policy's tensors by gloo broadcast, run in
a ``vllm serve`` worker process.

vLLM builds it at model load from ``--weight-transfer-config '{"backend": "agile_gloo"}'``;
:func:`register` enters it in vLLM's engine registry first, when vLLM imports the worker
extension (:mod:`~agile_llmenvs.weights.vllm_worker`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from agile_llmenvs.weights.gloo import ENGINE_NAME, GlooGroup, open_group
from agile_llmenvs.weights.vllm_reload import reprocess_tied_heads

__all__ = ["GlooInitInfo", "GlooUpdateInfo", "GlooWeightTransferEngine", "register"]


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's group is, and this server's first rank in it."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One layer's tensors, in the order rank 0 broadcasts them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must be as long: got {len(self.names)}, "
                f"{len(self.dtype_names)} and {len(self.shapes)}"
            )


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives checkpoint-format tensors over gloo into vLLM's layerwise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group: GlooGroup | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = (
            init_info.rank_offset
            + parallel.data_parallel_index * parallel.world_size
            + parallel.rank
        )
        if self._group is not None:
            self._group.close()
        self._group = open_group(
            init_info.master_address,
            init_info.master_port,
            rank=rank,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on a CPU;
        # a gloo broadcast has finished when it returns
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self._group is None:
            raise RuntimeError(
                f"the {ENGINE_NAME} weight transfer was not initialised: "
                "POST /init_weight_transfer_engine first"
            )
        weights = []
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
            weights.append((name, self._group.broadcast(tensor)))
        self.model.load_weights(weights)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        reprocess_tied_heads(self.model)

    def shutdown(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None


def register() -> None:
    """Enter the engine in vLLM's registry under ``agile_gloo`` (once per process)."""
    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, GlooWeightTransferEngine)
