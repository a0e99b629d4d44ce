"""FSDP2 for the policy: ``fully_shard`` on every decoder layer, then on the whole model.

Applied by the trainer itself (``training.fsdp: true``), so it works wherever
``torch.distributed`` runs: NCCL on GPUs, and gloo on CPUs, where ``accelerate``'s own FSDP
plugin does not turn on. A model ``accelerate``'s plugin already sharded is used as it is.
Each layer's weights are gathered for its forward and backward only; the root holds the
embeddings, the final norm and the output layer (where the scored-token log-probs need them).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_sharded", "shard_policy"]


def is_sharded(model: Any) -> bool:
    """Whether ``model`` is an FSDP2 module (``fully_shard`` was applied to it)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_policy(model: Any, device: torch.device) -> Any:
    """Shard ``model`` over every process of the default process group, in place.

    Raises:
        TypeError: the model has no list of decoder layers to shard one by one.
    """
    from torch.distributed.fsdp import fully_shard

    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise TypeError(
            f"{type(model).__name__} has no decoder `layers` to shard: FSDP here supports "
            "Hugging Face decoder-only models (Llama, Qwen2, Mistral, Gemma, ...)"
        )
    model.to(device)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model
