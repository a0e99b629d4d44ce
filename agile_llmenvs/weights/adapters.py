"""LoRA adapters as a generation engine takes them: a ``peft`` policy's weights with its
adapters merged in, or the adapters alone in peft's layout (what vLLM loads as an adapter).

The trainer's side of LoRA (putting adapters on the policy, its base model as the reference)
is :mod:`agile_llmenvs.training.policy.lora`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from agile_llmenvs.errors import LoRASyncError, OptionalDependencyError

__all__ = [
    "ADAPTER",
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "adapted_layers",
    "adapter_rank",
    "check_mergeable",
    "is_lora",
    "lora_sync_problems",
    "merged_weights",
    "require_peft",
    "require_syncable",
    "write_adapters",
]

#: The adapter's name in the peft model (peft's default).
ADAPTER = "default"
#: The files of peft's layout (``PeftModel.save_pretrained``), as vLLM loads an adapter.
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def require_peft() -> Any:
    """The ``peft`` module.

    Raises:
        OptionalDependencyError: ``peft`` is not installed (the ``train`` extra).
    """
    try:
        import peft
    except ImportError as exc:
        raise OptionalDependencyError(
            "peft", extra="train", feature="LoRA training (training.lora)"
        ) from exc
    return peft


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a ``peft`` model (without importing peft when it is not)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def adapted_layers(base: Any) -> dict[str, Any]:
    """The layers of a peft model's base model (``model.get_base_model()``) that carry the
    adapter, keyed by the name of the weight they adapt (``"model.embed_tokens.weight"``)."""
    from peft.tuners.lora import LoraLayer

    return {
        f"{name}.weight": module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer)
        and (ADAPTER in module.lora_A or ADAPTER in module.lora_embedding_A)
    }


def check_mergeable(layer: Any) -> None:
    """Refuse an adapted layer whose adapter a weight sync cannot merge exactly.

    Raises:
        NotImplementedError: Not a plain LoRA adapter on a linear layer or an embedding
            (DoRA, ``fan_in_fan_out``, convolutions, attention modules, target parameters).
    """
    from peft.tuners.lora import Embedding, Linear

    if not isinstance(layer, Linear | Embedding):
        raise NotImplementedError(
            f"{type(layer).__name__}: a weight sync merges LoRA adapters on linear layers "
            "and embeddings only"
        )
    if getattr(layer, "fan_in_fan_out", False) or layer.use_dora.get(ADAPTER):
        raise NotImplementedError(
            f"{type(layer).__name__}: merging fan_in_fan_out or DoRA adapters for a weight "
            "sync is not supported; train plain LoRA adapters on Linear layers"
        )


def lora_sync_problems(model: Any, *, adapters_only: bool = False) -> list[str]:
    """Why a weight sync could not hand ``model``'s adapters to a vLLM sampler exactly: one
    line per adapted module that names it and says what to do (empty: every one reaches it).

    A sampler holds one matrix per weight, so a model whose output layer shares the input
    embedding's matrix (``tie_word_embeddings``) cannot take an adapter on either: peft adds
    it on one side of the shared matrix only. An adapters-only sync (``lora_sync: adapters``)
    sends linear layers' adapters; vLLM would drop an embedding's or the output layer's.

    Args:
        model: A peft model (anything else has no problems).
        adapters_only: The sync sends the adapters alone, not merged weights.
    """
    if not is_lora(model):
        return []
    base = model.get_base_model()
    inputs, outputs = base.get_input_embeddings(), base.get_output_embeddings()
    tied = outputs is not None and _base_weight(outputs) is _base_weight(inputs)
    problems = []
    for name, layer in adapted_layers(base).items():
        module = name.removesuffix(".weight")
        ends = layer is inputs or layer is outputs
        try:
            check_mergeable(layer)
        except NotImplementedError as exc:
            problems.append(f"{module}: {exc}; leave it out of training.lora.target_modules")
            continue
        if ends and tied:
            problems.append(
                f"{module}: the model ties its output layer to its input embedding "
                "(tie_word_embeddings), and an adapter on either changes only one side of the "
                "matrix the sampler holds once; leave it out of training.lora.target_modules, "
                "or untie the model (save it with tie_word_embeddings: false and lm_head "
                "copied from embed_tokens)"
            )
        elif ends and adapters_only:
            problems.append(
                f"{module}: an adapters-only sync sends linear layers' adapters, not an "
                "embedding's or the output layer's; set training.vllm_server.lora_sync: "
                "merged (the weights go with the adapters merged in), or leave it out of "
                "training.lora.target_modules"
            )
    return problems


def require_syncable(model: Any, *, adapters_only: bool = False) -> None:
    """Refuse a policy whose adapters a weight sync would send wrong
    (:func:`lora_sync_problems`); a plain model, or adapters that all reach the sampler
    exactly, pass.

    Raises:
        LoRASyncError: Naming every module that cannot be sent, with what to do.
    """
    problems = lora_sync_problems(model, adapters_only=adapters_only)
    if problems:
        lines = "".join(f"\n  - {problem}" for problem in problems)
        raise LoRASyncError(
            "this LoRA policy's adapters cannot reach the vLLM sampler exactly, so it would "
            f"generate from another policy than the one trained:{lines}"
        )


def _base_weight(module: Any) -> Any:
    """The weight under any adapter of ``module``."""
    return getattr(module, "base_layer", module).weight


def merged_weights(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights under the base model's own names, adapters merged in
    (``W + scale * B A``; an embedding's ``W + scale * (B A)^T``) without touching the
    model; a plain model's parameters as they are.
    """
    if not is_lora(model):
        return {name: param.detach() for name, param in model.named_parameters()}
    base = model.get_base_model()
    weights = {
        name.replace(".base_layer.", "."): param.detach()
        for name, param in base.named_parameters()
        if ".lora_" not in name
    }
    with torch.no_grad():
        for name, layer in adapted_layers(base).items():
            check_mergeable(layer)
            weight = layer.get_base_layer().weight
            weights[name] = weight + layer.get_delta_weight(ADAPTER).to(weight.dtype)
    return weights


def write_adapters(model: Any, folder: Path, *, main: bool = True) -> Path:
    """Write the adapters of ``model`` (a peft model) into ``folder`` in peft's layout
    (:data:`ADAPTER_WEIGHTS_FILE` and :data:`ADAPTER_CONFIG_FILE`), and return ``folder``.

    Under FSDP2 every process must call it, in step: each adapter tensor is gathered whole
    (a collective; adapters are small), and only the ``main`` process writes.
    """
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    peft = require_peft()
    require_syncable(model, adapters_only=True)
    gathered: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if ".lora_" not in name or f".{ADAPTER}." not in name:
            continue
        tensor = param.detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if main:
            gathered[name] = tensor.cpu().contiguous()
    if main:
        # peft's own renaming: the adapter's name leaves the keys, as save_pretrained writes
        tensors = peft.get_peft_model_state_dict(model, state_dict=gathered, adapter_name=ADAPTER)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        model.peft_config[ADAPTER].save_pretrained(str(folder))
    return folder


def adapter_rank(folder: Path) -> int:
    """The largest adapter rank of the adapters in ``folder`` (its ``r`` and any
    ``rank_pattern``), as a server checks it against its ``--max-lora-rank``."""
    config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
    return max([int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())])
