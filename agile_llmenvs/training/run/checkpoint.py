"""Checkpoints a run resumes from: weights (or LoRA adapters), optimizer, learning-rate
schedule, step, every rank's RNG and data position.

A save is atomic. It writes ``checkpoint-<step>.partial/`` completely, then publishes it
(:func:`~agile_llmenvs.weights.publish_checkpoint`: every file flushed, ``manifest.json``
written last, the folder renamed to ``checkpoint-<step>/``); older checkpoints beyond ``keep``
are pruned after that. A kill at any moment leaves the previous checkpoint intact and at worst
a ``.partial`` folder, which resuming reports and ignores, as it does a published folder whose
files no longer match its manifest (:func:`~agile_llmenvs.weights.find_checkpoint`). A save
the disk has no room for removes its ``.partial`` folder and says so (:func:`disk_full_error`).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from agile_llmenvs._quiet import quiet_transformers
from agile_llmenvs._run_files import (
    CHECKPOINT_MODEL_DIR,
    CHECKPOINT_RANK_FILE,
    CHECKPOINT_TRAINER_FILE,
    CHECKPOINT_WEIGHTS_FILE,
    CHECKPOINT_WEIGHTS_INDEX,
    PARTIAL_SUFFIX,
    checkpoint_name,
)
from agile_llmenvs.errors import CheckpointError
from agile_llmenvs.training.policy import Learner, is_sharded
from agile_llmenvs.weights import (
    ADAPTER_WEIGHTS_FILE,
    find_checkpoint,
    is_lora,
    prune_checkpoints,
    publish_checkpoint,
)

__all__ = ["disk_full_error", "load_checkpoint", "save_checkpoint"]

_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def save_checkpoint(
    output_dir: Path,
    learner: Learner,
    *,
    step: int,
    tokenizer: Any,  # or a vision-language model's processor, which saves its tokenizer too
    rank_state: Mapping[str, Any],
    keep: int | None = None,
) -> Path:
    """Save the learner's model (Hugging Face layout; a LoRA policy's adapters only, peft's
    layout), optimizer and schedule, the step and every rank's RNG and data state, atomically.

    ``rank_state`` is this rank's own (its collector or dataset position); each rank writes
    its file, the main process the shared ones and the manifest.

    Args:
        keep: Complete checkpoints to keep, this one included (``None``: all).

    Returns:
        The published ``checkpoint-<step>`` folder.

    Raises:
        CheckpointError: the disk is full (or over quota); the partial checkpoint is removed,
            the previous complete one left as it was.
    """
    final = output_dir / checkpoint_name(step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    try:
        _save(partial, final, step, learner, tokenizer, rank_state)
    except OSError as exc:
        error = disk_full_error(exc, output_dir, f"saving {final.name}")
        if error is None:
            raise
        shutil.rmtree(partial, ignore_errors=True)
        raise error from exc
    if learner.accelerator.is_main_process and keep is not None:
        prune_checkpoints(output_dir, keep)
    learner.accelerator.wait_for_everyone()
    return final


def disk_full_error(exc: OSError, folder: Path, doing: str) -> CheckpointError | None:
    """The error to raise for ``exc`` if it says the disk under ``folder`` is full or over
    quota (None for any other ``OSError``): it names the folder and the bytes free there."""
    if exc.errno not in _DISK_FULL:
        return None
    try:
        free = f"{shutil.disk_usage(folder).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    why = "the disk is full" if exc.errno == errno.ENOSPC else "the disk quota is used up"
    return CheckpointError(
        f"{doing} in {folder} failed: {why} ({free} there). Free some space (or keep fewer "
        "checkpoints with training.keep_checkpoints), then continue the run with --resume"
    )


def _save(
    partial: Path,
    final: Path,
    step: int,
    learner: Learner,
    tokenizer: Any,
    rank_state: Mapping[str, Any],
) -> None:
    """Write ``partial`` on every rank, then publish it as ``final``."""
    accelerator, model = learner.accelerator, learner.model
    main = accelerator.is_main_process
    accelerator.wait_for_everyone()
    if main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    state = {"rng": _rng_state(), **rank_state}
    _save_synced(state, partial / CHECKPOINT_RANK_FILE.format(rank=accelerator.process_index))
    weights, optimizer_state = _full_state(model, learner.optimizer)
    if main:
        with quiet_transformers():  # no "Writing model shards" bar
            accelerator.unwrap_model(model).save_pretrained(
                partial / CHECKPOINT_MODEL_DIR, state_dict=weights
            )
        tokenizer.save_pretrained(partial / CHECKPOINT_MODEL_DIR)
        trainer: dict[str, Any] = {"step": step, "optimizer": optimizer_state}
        if learner.scheduler is not None:
            trainer["scheduler"] = learner.scheduler.state_dict()
        _save_synced(trainer, partial / CHECKPOINT_TRAINER_FILE)
    accelerator.wait_for_everyone()
    if main:
        publish_checkpoint(partial, final, step=step, world_size=accelerator.num_processes)


def load_checkpoint(output_dir: Path, learner: Learner) -> tuple[int, dict[str, Any]]:
    """Restore the newest complete checkpoint into ``learner`` (its model, optimizer and
    schedule); returns its step and this rank's state.

    Raises:
        CheckpointError: there is no complete checkpoint, it was saved by another number of
            processes, it holds full weights for a LoRA run (or adapters for a full one), or
            its weights do not match the model's (missing or unexpected keys).
    """
    accelerator = learner.accelerator
    checkpoint = find_checkpoint(output_dir)
    if checkpoint is None:
        raise CheckpointError(
            f"no complete checkpoint to resume from in {output_dir}: run without --resume first"
        )
    if checkpoint.world_size != accelerator.num_processes:
        raise CheckpointError(
            f"{checkpoint.directory} was saved by {checkpoint.world_size} process(es), this run "
            f"has {accelerator.num_processes}: resume with the same number of processes"
        )
    model, optimizer, scheduler = learner.model, learner.optimizer, learner.scheduler
    directory = checkpoint.directory
    _load_weights(directory / CHECKPOINT_MODEL_DIR, accelerator.unwrap_model(model))
    trainer = _load_plain(directory / CHECKPOINT_TRAINER_FILE)
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, trainer["optimizer"], options=options)
    else:
        optimizer.load_state_dict(trainer["optimizer"])
    if scheduler is not None and "scheduler" in trainer:
        scheduler.load_state_dict(trainer["scheduler"])
    state = _load_plain(directory / CHECKPOINT_RANK_FILE.format(rank=accelerator.process_index))
    _set_rng_state(state.pop("rng"))
    return int(trainer["step"]), state


def _full_state(model: Any, optimizer: torch.optim.Optimizer) -> tuple[Any, dict[str, Any]]:
    """The weights to save (``None``: the model's own) and the optimizer state.

    An FSDP2 model's weights and optimizer state are gathered whole, on the CPU of the main
    process (every process takes part), so the checkpoint is the one a single process saves.
    """
    if not is_sharded(model):
        return None, optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    return weights, get_optimizer_state_dict(model, optimizer, options=options)


def _save_synced(obj: Any, path: Path) -> None:
    # into a file of ours: torch.save given a path turns a failed write (a full disk) into a
    # RuntimeError that names no cause; through a Python file the OSError comes as it is
    with path.open("wb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())


def _load_plain(path: Path) -> dict[str, Any]:
    """A trainer or rank file: tensors, numbers, strings and containers only, no pickled code."""
    try:
        return dict(torch.load(path, weights_only=True))
    except Exception as exc:  # the unpickler's errors are of several types
        raise CheckpointError(
            f"{path} holds more than tensors and plain values, so it is not loaded: {exc}"
        ) from exc


def _load_weights(directory: Path, policy: Any) -> None:
    from safetensors.torch import load_file

    lora = is_lora(policy)
    file = directory / (ADAPTER_WEIGHTS_FILE if lora else CHECKPOINT_WEIGHTS_FILE)
    index = directory / CHECKPOINT_WEIGHTS_INDEX
    if not file.exists() and not (index.exists() and not lora):
        saved, wanted = (
            ("full weights", "LoRA adapters") if lora else ("LoRA adapters", "every weight")
        )
        raise CheckpointError(
            f"the checkpoint in {directory} holds {saved}, but this run trains {wanted}: "
            f"resume with the `training.lora` setting it was saved with"
        )
    if lora:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(policy, load_file(str(file)))
        return
    weights: dict[str, torch.Tensor] = {}
    shards = [file] if file.exists() else _shards(index)
    for shard in shards:
        weights.update(load_file(str(shard)))
    _check_keys(directory, policy, weights)
    if is_sharded(policy):  # every process loads the whole file into its shards
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(policy, dict[str, Any](weights), options=options)
    else:
        policy.load_state_dict(weights, strict=False)


def _shards(index: Path) -> list[Path]:
    names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    missing = [name for name in names if not (index.parent / name).exists()]
    if missing:
        raise CheckpointError(f"the checkpoint in {index.parent} lacks its shard(s) {missing}")
    return [index.parent / name for name in names]


def _check_keys(directory: Path, policy: Any, weights: Mapping[str, torch.Tensor]) -> None:
    """Refuse weights of another architecture: every key present, none unexpected.

    A tied weight (``lm_head.weight`` sharing ``embed_tokens.weight``) is saved once, so a key
    missing from the file is fine when another key of the same tensor is in it.
    """
    tensors = policy.state_dict(keep_vars=True)
    saved = {id(tensors[k]) for k in weights if k in tensors}  # tied weights: one parameter
    missing = [k for k in tensors if k not in weights and id(tensors[k]) not in saved]
    unexpected = [k for k in weights if k not in tensors]
    if missing or unexpected:
        raise CheckpointError(
            f"the weights in {directory} do not fit this model: missing {_some(missing)}, "
            f"unexpected {_some(unexpected)}. Resume with the model the run was started with"
        )


def _some(keys: list[str]) -> str:
    shown = ", ".join(keys[:4]) or "none"
    return shown + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def _rng_state() -> dict[str, Any]:
    """This process's generators: Python's, torch's CPU one and, on a GPU, its device's."""
    python_state = random.getstate()
    state = {
        "python": [python_state[0], list(python_state[1]), python_state[2]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
