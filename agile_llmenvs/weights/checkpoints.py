"""Checkpoint folders on disk: how one is published whole, how a complete one is told from a
broken one, and which is the newest.

A save writes ``checkpoint-<step>.partial/`` completely, then :func:`publish_checkpoint`
flushes every file to disk, writes ``manifest.json`` (each file with its size) last, and only
then renames the folder to ``checkpoint-<step>/``. A kill at any moment leaves the previous
checkpoint intact and at worst a ``.partial`` folder, which :func:`find_checkpoint` reports
and ignores, as it does a published folder whose files no longer match its manifest.

Nothing here imports torch: the trainer saves and loads the state
(:mod:`agile_llmenvs.training.run.checkpoint`); the eval command only finds the model a run
saved.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agile_llmenvs._run_files import (
    CHECKPOINT_MANIFEST,
    CHECKPOINT_NAME,
    CHECKPOINT_PREFIX,
    PARTIAL_SUFFIX,
    STALE_SUFFIX,
)

__all__ = ["Checkpoint", "find_checkpoint", "prune_checkpoints", "publish_checkpoint"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint folder.

    Attributes:
        directory: ``output_dir/checkpoint-<step>``.
        step: Optimizer steps of the loop done when it was saved.
        world_size: Processes that saved it (each wrote its own rank file).
    """

    directory: Path
    step: int
    world_size: int


def find_checkpoint(output_dir: Path, *, report: bool = True) -> Checkpoint | None:
    """The newest complete checkpoint in ``output_dir`` (``None`` when there is none).

    Partial folders (a save that was cut short) and published folders whose files do not
    match their manifest are skipped, each logged as a warning when ``report``.
    """
    if not output_dir.is_dir():
        return None
    for partial in sorted(output_dir.glob(f"{CHECKPOINT_PREFIX}*{PARTIAL_SUFFIX}")):
        if report:
            logger.warning("ignoring %s: a checkpoint save that did not finish", partial)
    for step, directory in _published(output_dir):
        if directory.is_symlink():  # not written by a run: never resumed from nor removed
            if report:
                logger.warning(
                    "ignoring %s: a symbolic link (to %s), not a checkpoint this run wrote",
                    directory,
                    os.readlink(directory),
                )
            continue
        manifest, problem = _read_verified(directory)
        if manifest is not None:
            return Checkpoint(directory, step, int(manifest["world_size"]))
        if report:
            logger.warning("ignoring %s: %s", directory, problem)
    return None


def publish_checkpoint(partial: Path, final: Path, *, step: int, world_size: int) -> None:
    """Flush every file of ``partial``, write its manifest last, and rename the folder to
    ``final`` (replacing a ``final`` already there: the same step saved again)."""
    files = _files(partial)
    for name in files:
        _fsync(partial / name)
    manifest = {"step": step, "world_size": world_size, "files": files}
    (partial / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    _fsync(partial / CHECKPOINT_MANIFEST)
    if final.is_symlink():  # a link someone put there: replaced, what it points at kept
        final.unlink()
    if final.exists():  # the same step saved again (a resumed run that was already done)
        stale = final.with_name(final.name + STALE_SUFFIX)
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        partial.rename(final)
        shutil.rmtree(stale)
    else:
        partial.rename(final)
    directory_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)


def prune_checkpoints(output_dir: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints (a symbolic link named as a
    checkpoint is no checkpoint of the run's: neither kept nor removed)."""
    complete = [
        d
        for _, d in _published(output_dir)
        if not d.is_symlink() and _read_verified(d)[0] is not None
    ]
    for directory in complete[keep:]:
        shutil.rmtree(directory)


def _fsync(path: Path) -> None:
    with path.open("rb") as file:
        os.fsync(file.fileno())


def _files(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` (but the manifest), with its size."""
    return {
        str(path.relative_to(directory)): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != CHECKPOINT_MANIFEST
    }


def _published(output_dir: Path) -> list[tuple[int, Path]]:
    """The ``checkpoint-<step>`` folders, newest first (complete or not)."""
    found = []
    for directory in output_dir.iterdir():
        match = CHECKPOINT_NAME.match(directory.name)
        if match and directory.is_dir():
            found.append((int(match.group(1)), directory))
    return sorted(found, reverse=True)


def _read_verified(directory: Path) -> tuple[dict[str, Any] | None, str]:
    """``directory``'s manifest when every file it lists is there at its size, else why not."""
    path = directory / CHECKPOINT_MANIFEST
    if not path.exists():
        return None, "it has no manifest.json (a save that did not finish)"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        recorded = manifest["files"]
    except (ValueError, KeyError) as exc:
        return None, f"its manifest.json is unreadable ({exc})"
    actual = _files(directory)
    for name, size in recorded.items():
        if name not in actual:
            return None, f"{name} is missing"
        if actual[name] != size:
            return None, f"{name} has {actual[name]} bytes, {size} when saved"
    return manifest, ""
