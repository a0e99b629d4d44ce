"""FSDP2 for the policy: ``fully_shard`` on every decoder layer, then on the whole model.

Applied by the trainer itself (``training.fsdp: true``), so it works wherever
``torch.distributed`` runs: NCCL on GPUs, and gloo on CPUs, where ``accelerate``'s own FSDP
plugin does not turn on. A model ``accelerate``'s plugin already sharded is used as it is.
Each layer's weights are gathered for its forward and backward only; the root holds the
embeddings, the final norm and the output layer (where the scored-token log-probs need them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GenerationSync", "any_process", "is_sharded", "shard_policy"]


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


def any_process(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is true on any process (every process must call it)."""
    value = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(value)
    return bool(value.item() > 0)


class GenerationSync:
    """Keeps the processes' generate calls paired on a sharded policy.

    Each generate call of a sharded model gathers weights with every process, but the
    processes' episodes last different numbers of turns. Every real call is announced
    (:meth:`before_generate`); a process whose episodes are done then joins the others'
    remaining calls with one-token calls of its own (:meth:`drain`) until no process is left.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def before_generate(self) -> None:
        """Announce a real generate call (paired with the others' announcements or drains)."""
        any_process(True, self.device)

    def drain(self, generate_one: Callable[[], object]) -> None:
        """After this process's last real call: join the others' until none is left."""
        while any_process(False, self.device):
            generate_one()
