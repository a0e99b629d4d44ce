"""Loading the policy to train: the model and its tokenizer, LoRA adapters, the sharding or
``accelerate``'s wrapping, the optimizer and schedule; and the frozen reference it is measured
against."""

from __future__ import annotations

import copy
import functools
import random
from dataclasses import dataclass
from typing import Any, Literal

import torch

from agile_llmenvs._quiet import quiet_transformers
from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.specs import LoRASpec, ModelSpec
from agile_llmenvs.training.policy.learner import Learner
from agile_llmenvs.training.policy.lora import AdaptersOffReference, apply_lora
from agile_llmenvs.training.policy.optim import (
    OptimizerSettings,
    check_master_weights,
    make_optimizer,
    make_scheduler,
)
from agile_llmenvs.training.policy.sharding import frozen_sharded_copy, is_sharded, shard_policy
from agile_llmenvs.training.policy.threads import set_cpu_threads
from agile_llmenvs.weights import is_lora

__all__ = [
    "PolicySettings",
    "autocast_forward",
    "ddp_settings",
    "load_policy",
    "model_dir",
    "prepare_policy",
    "reference_model",
    "seed_everything",
    "vision_processor",
]


def model_dir(spec: ModelSpec) -> str:
    """The policy's directory: ``spec.path``, else the built-in model (built if missing)."""
    from agile_llmenvs.backends.hf import check_model_dir
    from agile_llmenvs.tiny_model import ensure_tiny_model
    from agile_llmenvs.tiny_vlm import ensure_tiny_vlm

    if spec.path:
        return str(check_model_dir(spec.path, field="model.path"))
    return str(ensure_tiny_vlm() if spec.builtin == "tiny_vlm" else ensure_tiny_model())


def load_policy(spec: ModelSpec) -> tuple[Any, Any]:
    """Load the model (``spec.path``, else the built-in model) and its tokenizer; a
    vision-language model loads as one (``AutoModelForImageTextToText``)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from agile_llmenvs.tiny_vlm import is_vision_model

    with quiet_transformers():  # no "Writing model shards" (a first build), "Loading weights"
        path = model_dir(spec)
        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path or path)
        auto_class = AutoModelForImageTextToText if is_vision_model(path) else AutoModelForCausalLM
        model = auto_class.from_pretrained(
            path, dtype=getattr(torch, spec.dtype), use_kernels=spec.hub_kernels
        )
    return model, tokenizer


def vision_processor(spec: ModelSpec) -> Any:
    """The processor of a vision-language policy (None for a text model)."""
    from agile_llmenvs.tiny_vlm import is_vision_model, load_processor

    path = model_dir(spec)
    return load_processor(path) if is_vision_model(path) else None


def ddp_settings() -> Any:
    """``accelerate``'s DDP settings for the policy: no broadcast of buffers in the forward.

    DDP's first forward broadcasts the module's buffers (rotary frequencies, the same on
    every process), a collective; a process with no rows to learn from runs no forward, so
    the others would wait for it forever.
    """
    from accelerate import DistributedDataParallelKwargs

    return DistributedDataParallelKwargs(broadcast_buffers=False)


@dataclass(frozen=True)
class PolicySettings:
    """What loads the policy and how it learns: the manifest's ``model`` and ``seed``, and the
    ``training`` fields of the same names.

    Attributes:
        model: The model (and tokenizer) to load.
        seed: Seeds Python's and torch's generators before the model loads.
        lora: Train these adapters instead of every weight (``None``: every weight).
        fsdp: Shard the policy over the processes with FSDP2.
        mixed_precision: accelerate's compute precision (the weights stay fp32).
        gradient_checkpointing: Recompute the decoder's activations in the backward pass.
        cpu_threads: torch's intra-op threads on CPU (``None``: chosen by the model's size).
        optimizer: AdamW, its schedule and the gradient clip.
    """

    model: ModelSpec
    seed: int
    lora: LoRASpec | None
    fsdp: bool
    mixed_precision: Literal["no", "bf16", "fp16"]
    gradient_checkpointing: bool
    cpu_threads: int | None
    optimizer: OptimizerSettings


def prepare_policy(settings: PolicySettings) -> tuple[Learner, Any]:
    """Seed, load the policy (with LoRA adapters when ``settings.lora``) and its tokenizer,
    prepare it on ``accelerate`` with AdamW over its trainable parameters and the schedule, and
    set torch's CPU threads for it (:func:`~agile_llmenvs.training.policy.threads.set_cpu_threads`).

    With ``settings.fsdp`` the policy (a LoRA one included) is sharded by
    :func:`~agile_llmenvs.training.policy.sharding.shard_policy` rather than wrapped by
    ``accelerate``; the optimizer holds the shards of its trainable parameters only.

    Returns:
        ``(learner, tokenizer)``; ``learner.accelerator.unwrap_model(learner.model)`` is the
        plain model (for generation, or :func:`reference_model`).

    Raises:
        OptionalDependencyError: ``settings.lora`` without ``peft`` installed.
        AgileLLMEnvsError: a trainable parameter is not fp32, or ``fp16`` without a GPU.
    """
    from accelerate import Accelerator

    if settings.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise AgileLLMEnvsError(
            "training.mixed_precision: fp16 needs a GPU; use bf16 (or no) on CPU"
        )
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=settings.mixed_precision,
        kwargs_handlers=[ddp_settings()],
    )
    seed_everything(settings.seed)
    model, tokenizer = load_policy(settings.model)
    if settings.lora is not None:
        model = apply_lora(model, settings.lora)
    check_master_weights(model)
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optim = settings.optimizer
    if settings.fsdp:  # sharded by us, so not wrapped (in DDP) by accelerate
        model = shard_policy(model, accelerator.device)
        autocast_forward(model, accelerator)
        optimizer = make_optimizer(
            model, learning_rate=optim.learning_rate, weight_decay=optim.weight_decay
        )
        optimizer = accelerator.prepare(optimizer)
    else:
        optimizer = make_optimizer(
            model, learning_rate=optim.learning_rate, weight_decay=optim.weight_decay
        )
        model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = make_scheduler(
        optimizer, optim.schedule, warmup_steps=optim.warmup_steps, total_steps=optim.total_steps
    )
    set_cpu_threads(accelerator.unwrap_model(model), settings.cpu_threads, accelerator.device)
    return Learner(accelerator, model, optimizer, scheduler, optim.max_grad_norm), tokenizer


def autocast_forward(model: Any, accelerator: Any) -> None:
    """Run ``model``'s forward under ``accelerator``'s autocast, as ``accelerate`` does for
    the models it prepares: a policy sharded by us then computes in the same precision
    whoever calls it (generation, scoring, the update). A no-op without mixed precision."""
    if accelerator.mixed_precision == "no":
        return
    forward = model.forward

    @functools.wraps(forward)
    def autocast(*args: Any, **kwargs: Any) -> Any:
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = autocast


def reference_model(policy: Any, device: Any) -> Any:
    """The fixed reference a KL or DPO term measures the policy against: the policy as it
    starts (call it before any update).

    A LoRA policy's is its own base model with the adapters switched off (no copy, sharded or
    not); a sharded policy's is a frozen copy sharded the same way, filled from the policy's
    shards (:func:`~agile_llmenvs.training.policy.sharding.frozen_sharded_copy`: no process holds an
    unsharded copy); any other's is a frozen copy on ``device``. A copy is in eval mode with
    no gradients. Under FSDP every process must run as many of the reference's forwards:
    GRPO and DPO pair them (see :mod:`~agile_llmenvs.training.grpo.update` and
    :class:`~agile_llmenvs.training.supervised.dpo.DPOObjective`).
    """
    if is_lora(policy):
        return AdaptersOffReference(policy)
    if is_sharded(policy):
        return frozen_sharded_copy(policy, device)
    reference = copy.deepcopy(policy).to(device).eval()
    reference.requires_grad_(False)
    return reference


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's global generators."""
    random.seed(seed)
    torch.manual_seed(seed)
