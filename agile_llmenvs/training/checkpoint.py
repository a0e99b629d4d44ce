"""Checkpoints a run resumes from: weights (or LoRA adapters), optimizer, step, RNG, data state."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from agile_llmenvs.errors import CheckpointError
from agile_llmenvs.training.lora import is_lora

__all__ = ["CHECKPOINT_DIR", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_DIR = "checkpoint"
_RNG_FILE = "rng_rank{rank}.pt"
_WEIGHTS_FILE = "model.safetensors"
_ADAPTER_FILE = "adapter_model.safetensors"


def save_checkpoint(
    output_dir: Path,
    *,
    step: int,
    accelerator: Any,
    model: Any,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any,
    rank_state: Mapping[str, Any],
    scheduler: Any = None,
) -> Path:
    """Save the model (Hugging Face layout; a LoRA policy's adapters only, peft's layout),
    optimizer, learning-rate schedule, step and every rank's RNG and data state.

    ``rank_state`` is this rank's own (its collector or dataset position); each rank writes
    its file, the main process the shared ones.
    """
    directory = output_dir / CHECKPOINT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    state = {"rng": _rng_state(), **rank_state}
    torch.save(state, directory / _RNG_FILE.format(rank=accelerator.process_index))
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(directory / "model")
        tokenizer.save_pretrained(directory / "model")
        trainer = {"step": step, "optimizer": optimizer.state_dict()}
        if scheduler is not None:
            trainer["scheduler"] = scheduler.state_dict()
        torch.save(trainer, directory / "trainer.pt")
    accelerator.wait_for_everyone()
    return directory


def load_checkpoint(
    output_dir: Path,
    *,
    accelerator: Any,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
) -> tuple[int, dict[str, Any]]:
    """Restore what :func:`save_checkpoint` wrote; returns the step and this rank's state.

    Raises:
        CheckpointError: there is no checkpoint, none for this rank, or one of full weights
            for a LoRA run (or of adapters for a full one).
    """
    directory = output_dir / CHECKPOINT_DIR
    rank_file = directory / _RNG_FILE.format(rank=accelerator.process_index)
    if not (directory / "trainer.pt").exists() or not rank_file.exists():
        raise CheckpointError(
            f"no checkpoint to resume from in {directory} for rank {accelerator.process_index}: "
            "run without --resume first, with the same number of processes"
        )
    _load_weights(directory / "model", accelerator.unwrap_model(model))
    trainer = torch.load(directory / "trainer.pt", weights_only=False)
    optimizer.load_state_dict(trainer["optimizer"])
    if scheduler is not None and "scheduler" in trainer:
        scheduler.load_state_dict(trainer["scheduler"])
    state = torch.load(rank_file, weights_only=False)
    _set_rng_state(state.pop("rng"))
    return int(trainer["step"]), state


def _load_weights(directory: Path, policy: Any) -> None:
    from safetensors.torch import load_file

    lora = is_lora(policy)
    file = directory / (_ADAPTER_FILE if lora else _WEIGHTS_FILE)
    if not file.exists():
        saved, wanted = (
            ("full weights", "LoRA adapters") if lora else ("LoRA adapters", "every weight")
        )
        raise CheckpointError(
            f"the checkpoint in {directory} holds {saved}, but this run trains {wanted}: "
            f"resume with the `training.lora` setting it was saved with"
        )
    weights = load_file(str(file))
    if lora:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(policy, weights)
    else:
        # tied weights (lm_head = embed_tokens) are saved once, hence not strict
        policy.load_state_dict(weights, strict=False)


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
