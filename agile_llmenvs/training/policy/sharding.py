"""FSDP2 for the policy: ``fully_shard`` on every decoder layer, then on the whole model.

Applied by the trainer itself (``training.fsdp: true``), so it works wherever
``torch.distributed`` runs: NCCL on GPUs, and gloo on CPUs, where ``accelerate``'s own FSDP
plugin does not turn on. A model ``accelerate``'s plugin already sharded is used as it is.
Each layer's weights are gathered for its forward and backward only; the root holds the
embeddings, the final norm and the output layer (where the scored-token log-probs need them).
A LoRA (``peft``) policy is sharded the same way, its base model's decoder layers with their
adapters in them.

Every gather is a collective, so every process must run as many forward passes of a sharded
model: :func:`idle_forward` lets a process with fewer rows keep up, after
:func:`max_over_processes` has agreed how many passes every process runs (before the first
one: a count taken after would meet the others' gathers).
:func:`frozen_sharded_copy` is a sharded policy's frozen reference, sharded the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from agile_llmenvs.weights import is_lora

__all__ = [
    "GenerationSync",
    "any_process",
    "frozen_sharded_copy",
    "idle_forward",
    "is_sharded",
    "max_over_processes",
    "shard_policy",
]


def is_sharded(model: Any) -> bool:
    """Whether ``model`` is an FSDP2 module (``fully_shard`` was applied to it), or a LoRA
    (``peft``) model whose base model is one."""
    from torch.distributed.fsdp import FSDPModule

    base = model.get_base_model() if is_lora(model) else model
    return isinstance(base, FSDPModule)


def shard_policy(model: Any, device: torch.device) -> Any:
    """Shard ``model`` over every process of the default process group, in place: each
    decoder layer, then the root.

    A LoRA (``peft``) policy's root is its base model, adapters in its layers: ``generate``
    calls the base model's forward, not the wrapper's, and the root's gathers run before it.

    Raises:
        TypeError: the model has no list of decoder layers to shard one by one.
    """
    from torch.distributed.fsdp import fully_shard

    layers = _decoder_layers(model)
    model.to(device)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model.get_base_model() if is_lora(model) else model)
    return model


def frozen_sharded_copy(model: Any, device: torch.device) -> Any:
    """A frozen copy of the sharded ``model``, sharded the same way, in eval mode.

    The copy is built on the meta device, sharded (each decoder layer, then the root), and
    filled from ``model``'s own shards, so no process ever holds it unsharded. Unlike the
    policy's, its root is resharded after each forward: with no backward to follow, its
    gathered embeddings and output layer would stay in memory otherwise.

    Raises:
        TypeError: ``model`` has no decoder layers, or its rebuild from its config does not
            have its parameters.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    # fully_shard swaps the class for an FSDP subclass of it: build the model's own class
    model_class: Any = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        reference = model_class._from_config(model.config)
    dtypes = {name: param.dtype for name, param in model.named_parameters()}
    if set(dtypes) != {name for name, _ in reference.named_parameters()}:
        raise TypeError(
            f"{model_class.__name__} built from its config has other parameters than the "
            "policy's, so its frozen reference cannot be sharded like it"
        )
    for name, param in reference.named_parameters():
        param.data = param.data.to(dtypes[name])
    for layer in _decoder_layers(reference):
        fully_shard(layer)
    fully_shard(reference, reshard_after_forward=True)
    reference.to_empty(device=device)
    reference.load_state_dict(model.state_dict())  # shard to shard: no communication
    with torch.no_grad():  # buffers (rotary frequencies) are not sharded, nor all saved
        for name, buffer in model.named_buffers():
            reference.get_buffer(name).copy_(buffer)
    reference.requires_grad_(False)
    return reference.eval()


def idle_forward(model: Any, device: torch.device) -> torch.Tensor:
    """A zero through the whole of ``model`` (a forward on one 2-token row): a process with
    no rows left still joins the others' gathers (and, backpropagated, their reductions).

    The first pass of a model probes its post-head transform, as the first scored pass of
    the others does (:func:`~agile_llmenvs.training.objective.logprobs.probe_once`)."""
    from agile_llmenvs.training.objective import probe_once

    probe_once(model, device)
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    return model(input_ids=ids, logits_to_keep=1).logits.sum() * 0.0


def max_over_processes(value: int, device: torch.device) -> int:
    """The largest ``value`` of any process (every process must call it)."""
    tensor = torch.tensor([value], device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return int(tensor.item())


def _decoder_layers(model: Any) -> Any:
    """The decoder layers of a Hugging Face model, or of a ``peft`` model's base model."""
    base = model.get_base_model() if is_lora(model) else model
    layers = getattr(base.get_decoder(), "layers", None)
    if layers is None:
        raise TypeError(
            f"{type(base).__name__} has no decoder `layers` to shard: FSDP here supports "
            "Hugging Face decoder-only models (Llama, Qwen2, Mistral, Gemma, ...)"
        )
    return layers


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
