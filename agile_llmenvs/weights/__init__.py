"""A policy's weights outside the trainer: in checkpoint folders, in sync folders and LoRA
adapter folders that generation servers reload, streamed over gloo, and received in a vLLM
worker.

Below the backends and the trainer: :class:`~agile_llmenvs.backends.VLLMServerBackend` and the
training loops both use it, and it imports neither. The names import torch (and vLLM, in a
vLLM worker) on first use, not with the package.

* :mod:`~agile_llmenvs.weights.checkpoints` -- checkpoint folders: published whole, found,
  verified, pruned (no torch).
* :mod:`~agile_llmenvs.weights.files` -- a sync folder: one safetensors file per training
  process, read back a whole tensor at a time.
* :mod:`~agile_llmenvs.weights.adapters` -- a LoRA policy's merged weights, or its adapters in
  peft's layout.
* :mod:`~agile_llmenvs.weights.gloo` -- the trainer's end of a gloo weight stream;
  :mod:`~agile_llmenvs.weights.vllm_gloo_engine` the server's.
* :mod:`~agile_llmenvs.weights.vllm_worker` -- the worker extension vLLM engines and servers
  start with (:data:`WORKER_EXTENSION`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agile_llmenvs._lazy import lazy_attributes

if TYPE_CHECKING:
    from agile_llmenvs.weights.adapters import (
        ADAPTER,
        ADAPTER_CONFIG_FILE,
        ADAPTER_WEIGHTS_FILE,
        adapter_rank,
        is_lora,
        lora_sync_problems,
        merged_weights,
        require_peft,
        require_syncable,
        write_adapters,
    )
    from agile_llmenvs.weights.checkpoints import (
        Checkpoint,
        find_checkpoint,
        prune_checkpoints,
        publish_checkpoint,
    )
    from agile_llmenvs.weights.files import (
        local_weights,
        rank_file,
        read_weights,
        weight_metas,
        write_weights,
    )
    from agile_llmenvs.weights.gloo import (
        ENGINE_NAME,
        ControlPlane,
        GlooGroup,
        GlooWeightSender,
        TensorMeta,
        layer_groups,
        open_group,
    )
    from agile_llmenvs.weights.vllm_reload import reprocess_tied_heads
    from agile_llmenvs.weights.vllm_worker import WeightSyncWorker, register_gloo_engine

__all__ = [
    "ADAPTER",
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "ENGINE_NAME",
    "WORKER_EXTENSION",
    "Checkpoint",
    "ControlPlane",
    "GlooGroup",
    "GlooWeightSender",
    "TensorMeta",
    "WeightSyncWorker",
    "adapter_rank",
    "find_checkpoint",
    "is_lora",
    "layer_groups",
    "local_weights",
    "lora_sync_problems",
    "merged_weights",
    "open_group",
    "prune_checkpoints",
    "publish_checkpoint",
    "rank_file",
    "read_weights",
    "register_gloo_engine",
    "reprocess_tied_heads",
    "require_peft",
    "require_syncable",
    "weight_metas",
    "write_adapters",
    "write_weights",
]

#: The worker extension (``--worker-extension-cls``, ``worker_extension_cls``) every vLLM
#: engine and server a weight sync reaches starts with: :class:`WeightSyncWorker`.
WORKER_EXTENSION = "agile_llmenvs.weights.vllm_worker.WeightSyncWorker"

_SOURCES = {
    **dict.fromkeys(
        [
            "ADAPTER",
            "ADAPTER_CONFIG_FILE",
            "ADAPTER_WEIGHTS_FILE",
            "adapter_rank",
            "is_lora",
            "lora_sync_problems",
            "merged_weights",
            "require_peft",
            "require_syncable",
            "write_adapters",
        ],
        "agile_llmenvs.weights.adapters",
    ),
    **dict.fromkeys(
        ["Checkpoint", "find_checkpoint", "prune_checkpoints", "publish_checkpoint"],
        "agile_llmenvs.weights.checkpoints",
    ),
    **dict.fromkeys(
        ["local_weights", "rank_file", "read_weights", "weight_metas", "write_weights"],
        "agile_llmenvs.weights.files",
    ),
    **dict.fromkeys(
        [
            "ENGINE_NAME",
            "ControlPlane",
            "GlooGroup",
            "GlooWeightSender",
            "TensorMeta",
            "layer_groups",
            "open_group",
        ],
        "agile_llmenvs.weights.gloo",
    ),
    "reprocess_tied_heads": "agile_llmenvs.weights.vllm_reload",
    "WeightSyncWorker": "agile_llmenvs.weights.vllm_worker",
    "register_gloo_engine": "agile_llmenvs.weights.vllm_worker",
}

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _SOURCES)
