"""A run's folder: where a run writes, whether a new start may touch it, and what a resume
must match.

A folder *holds a run* when it has ``metrics.csv`` or a ``checkpoint-<step>`` folder. A fresh
start refuses such a folder unless told to overwrite it (then it removes the run's own files
and nothing else). Every run first writes :data:`~agile_llmenvs._run_files.RUN_MARKER` into
its folder: a folder that holds files named like a run's (``wandb/``, ``mlruns/``,
``manifest.yaml``...) without it was not written by a run, and neither a fresh start (which
would write over them) nor an overwrite (which would delete them) touches it. A resume
refuses a folder without a complete checkpoint, and a run whose manifest differs from this
one in anything but :data:`RESUMABLE_CHANGES`. Every run stores the manifest it runs as
``manifest.yaml`` in its folder, with its paths made absolute, so a resume compares the files
both name, and ``agile-llmenvs train runs/x/manifest.yaml --resume`` continues a run with
exactly what it ran.

:func:`plan_run` only reads (every process of a run calls it, before any writes);
:func:`start_run` writes, on the main process. The main process holds the folder's
:class:`RunFolderLock` from :func:`plan_run` until the run ends, so a second run on the folder
(a fresh start, an overwrite or a resume) is refused while the first lives.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from agile_llmenvs._run_files import (
    CHECKPOINT_PREFIX,
    METRICS_FILE,
    PARTIAL_SUFFIX,
    RUN_FILES,
    RUN_LOCK,
    RUN_MANIFEST,
    RUN_MARKER,
    STALE_SUFFIX,
)
from agile_llmenvs.errors import CheckpointError
from agile_llmenvs.specs import RunManifest, load_manifest
from agile_llmenvs.specs.manifest import absolute_paths
from agile_llmenvs.training.run.checkpoint import disk_full_error
from agile_llmenvs.training.run.result import TrainResult
from agile_llmenvs.training.run.settings import RunSettings
from agile_llmenvs.weights import Checkpoint, find_checkpoint

__all__ = [
    "RESUMABLE_CHANGES",
    "RunFolderLock",
    "RunPlan",
    "manifest_differences",
    "plan_run",
    "start_run",
]

logger = logging.getLogger(__name__)

#: The fields a resumed run may change: how long it runs, where and how often it saves and
#: logs, its held-out evaluation (which never touches the training sequence), and settings
#: of memory and speed that leave the update as it is. Anything else changes the data, the
#: shapes or the maths of the run, and must be what the run ran.
RESUMABLE_CHANGES = (
    "name",
    "training.max_steps",
    "training.output_dir",
    "training.save_every",
    "training.keep_checkpoints",
    "training.log_every",
    "training.tensorboard",
    "training.report_to",
    "training.run_name",
    "training.eval_every",
    "training.eval_tasks",
    "training.eval_success_reward",
    "training.micro_batch_size",
    "training.logps_chunk_tokens",
    "training.gradient_checkpointing",
    "training.cpu_threads",
    "training.vllm",
)
_CHECKPOINT_ENTRY = re.compile(
    rf"^{CHECKPOINT_PREFIX}\d+({re.escape(PARTIAL_SUFFIX)}|{re.escape(STALE_SUFFIX)})?$"
)


class RunFolderLock:
    """An exclusive ``flock`` on ``RUN_LOCK`` in a run's folder, held until :meth:`release`.

    The kernel drops the lock when its process dies, however it dies, so a crashed run's
    folder is free again at once (a pid file alone would go stale).
    """

    def __init__(self, output_dir: Path) -> None:
        self.path = output_dir / RUN_LOCK
        self._file: TextIO | None = None

    @classmethod
    def acquire(cls, output_dir: Path) -> RunFolderLock:
        """Lock ``output_dir`` (made if missing) for this process, writing its pid.

        Raises:
            CheckpointError: another process holds the lock; the message names its pid.
        """
        lock = cls(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        file = lock.path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                file.close()
                raise
            file.seek(0)
            holder = file.read().strip() or "unknown"
            file.close()
            raise CheckpointError(
                f"{output_dir} is in use by another run (pid {holder}, which holds "
                f"{lock.path}): wait for that run to end, or give this one another "
                "training.output_dir"
            ) from None
        file.truncate(0)
        file.write(f"{os.getpid()}\n")
        file.flush()
        lock._file = file
        return lock

    def release(self) -> None:
        """Unlock the folder; idempotent (the file stays: removing it would race a taker)."""
        if self._file is not None:
            self._file.close()  # closing the file drops its flock
            self._file = None


@dataclass(frozen=True)
class RunPlan:
    """How a run starts in its folder.

    Attributes:
        output_dir: The run's folder.
        resume_from: The checkpoint a resume continues from (``None``: a fresh start).
        overwrite: A fresh start that first removes the run the folder holds.
        complete: A resume of a run that already reached ``max_steps``: nothing to do.
        lock: The folder's lock, on the main process (:meth:`release` it when the run ends).
        found: A fresh start's view of the folder before it: the names it held (``None``
            when the folder did not exist, and for a resume).
    """

    output_dir: Path
    resume_from: Checkpoint | None = None
    overwrite: bool = False
    complete: bool = False
    lock: RunFolderLock | None = None
    found: frozenset[str] | None = None

    def release(self) -> None:
        """Release the folder's lock, if this process holds it."""
        if self.lock is not None:
            self.lock.release()

    def abandon(self) -> None:
        """After a fresh start failed before its first step: remove what it wrote, so the
        folder is as it was found (the folder too, if the run made it) and a plain re-run
        starts there. A run that finished a step keeps its files; so does a resume; an
        overwrite's removed run stays removed.

        Call it on the main process before :meth:`release`; other processes do nothing.
        """
        if self.lock is None or self.resume_from is not None:
            return
        if _metrics_rows(self.output_dir) or _checkpoints(self.output_dir):
            return  # a step's row, or a checkpoint: the run's record stays
        _remove_run(self.output_dir, keep=frozenset() if self.overwrite else self.found or ())
        if RUN_LOCK not in (self.found or ()):  # unlinked while held: no other run opened it
            (self.output_dir / RUN_LOCK).unlink(missing_ok=True)
        if self.found is None and not any(self.output_dir.iterdir()):
            self.output_dir.rmdir()

    def complete_result(self) -> TrainResult:
        """What a complete run left behind, as a run that ran no step reports it."""
        assert self.resume_from is not None
        return TrainResult(
            self.output_dir,
            self.resume_from.step,
            metrics_path=self.output_dir / METRICS_FILE,
            checkpoint_dir=self.resume_from.directory,
            already_complete=True,
        )


def plan_run(settings: RunSettings, *, resume: bool, overwrite: bool) -> RunPlan:
    """Decide how the run starts, reading the folder only, but for its lock: the main
    process (rank 0) takes the folder's :class:`RunFolderLock` first and holds it in the
    plan; call :meth:`RunPlan.release` when the run ends.

    Raises:
        CheckpointError: another live run holds the folder; a fresh start on a folder that
            holds a run (without ``overwrite``); a resume without a complete checkpoint, or of
            a run whose manifest differs from this one in a field a resume may not change.
        ValueError: both ``resume`` and ``overwrite``.
    """
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other: continue a run, or replace it")
    output_dir = settings.output_dir
    # accelerate's launcher numbers its processes in RANK; only rank 0 writes the folder
    if os.environ.get("RANK", "0") != "0" or (resume and not output_dir.is_dir()):
        return _plan(settings, resume=resume, overwrite=overwrite)
    found = frozenset(e.name for e in output_dir.iterdir()) if output_dir.is_dir() else None
    lock = RunFolderLock.acquire(output_dir)
    try:
        plan = _plan(settings, resume=resume, overwrite=overwrite)
    except BaseException:
        lock.release()
        raise
    if plan.complete:
        lock.release()
        return plan
    return RunPlan(
        plan.output_dir, plan.resume_from, plan.overwrite, plan.complete, lock, found=found
    )


def _plan(settings: RunSettings, *, resume: bool, overwrite: bool) -> RunPlan:
    output_dir = settings.output_dir
    if not resume:
        _check_foreign(output_dir)
        held = _run_marks(output_dir)
        if held and not overwrite:
            raise CheckpointError(
                f"{output_dir} already holds a run ({', '.join(held)}): continue it with "
                f"--resume, or replace it with --overwrite"
            )
        return RunPlan(output_dir, overwrite=overwrite)
    checkpoint = find_checkpoint(output_dir, report=False)
    if checkpoint is None:
        why = (
            "the run there stopped before its first save; start it over with --overwrite"
            if _run_marks(output_dir)
            else "no run has started there; train without --resume to start one"
        )
        raise CheckpointError(f"no complete checkpoint to resume from in {output_dir}: {why}")
    _check_resumable(settings.manifest, output_dir)
    complete = checkpoint.step >= settings.max_steps
    return RunPlan(output_dir, resume_from=checkpoint, complete=complete)


def start_run(plan: RunPlan, manifest: RunManifest, accelerator: Any) -> None:
    """On the main process: remove the run an overwrite replaces, then store the manifest
    this run runs (:attr:`RunSettings.manifest`); every process waits until that is done."""
    if accelerator.is_main_process:
        plan.output_dir.mkdir(parents=True, exist_ok=True)
        if plan.overwrite:
            _remove_run(plan.output_dir)
        (plan.output_dir / RUN_MARKER).write_text(
            "A training run of agile-llmenvs writes this folder (--overwrite deletes its run).\n",
            encoding="utf-8",
        )
        _store_manifest(manifest, plan.output_dir)
    accelerator.wait_for_everyone()


def manifest_differences(ran: RunManifest, new: RunManifest) -> list[tuple[str, Any, Any]]:
    """The fields, dotted (``training.algorithm``), in which ``new`` differs from the manifest
    a run ``ran``, with both values; those in :data:`RESUMABLE_CHANGES` are left out.

    Paths are compared as absolute paths (the files they name), ``training.algorithm`` first.
    """
    before = absolute_paths(ran).model_dump(mode="json")
    after = absolute_paths(new).model_dump(mode="json")
    differences = [d for d in _differences(before, after) if not _may_change(d[0])]
    return sorted(differences, key=lambda difference: difference[0] != "training.algorithm")


def _check_resumable(manifest: RunManifest, output_dir: Path) -> None:
    stored = output_dir / RUN_MANIFEST
    if not stored.exists():
        logger.warning(
            "%s has no %s (a run from before runs stored their manifest): resuming without "
            "checking that this manifest matches the one it ran",
            output_dir,
            RUN_MANIFEST,
        )
        return
    try:
        ran = load_manifest(stored)
    except Exception as exc:  # unreadable, or no longer valid: either way not comparable
        raise CheckpointError(
            f"cannot resume {output_dir}: its {RUN_MANIFEST} does not load ({exc}); start over "
            "with --overwrite"
        ) from exc
    differences = manifest_differences(ran, manifest)
    if differences:
        (field, before, after), *others = differences
        names = [name for name, _, _ in others]
        also = ""
        if names:
            listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
            also = f" ({listed} {'differs' if len(names) == 1 else 'differ'} too)"
        raise CheckpointError(
            f"cannot resume {output_dir}: the run there has {field} {before!r}, this manifest "
            f"{after!r}{also}. Resume it with the manifest it ran, {stored}, or start over "
            f"with --overwrite"
        )


def _may_change(key: str) -> bool:
    return any(key == field or key.startswith(field + ".") for field in RESUMABLE_CHANGES)


def _differences(before: Any, after: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Where two dumps differ, by dotted key: sections both have are compared field by
    field, anything else (a value, a list, a section one of them lacks) whole."""
    if not (isinstance(before, dict) and isinstance(after, dict)):
        return [] if before == after else [(prefix, before, after)]
    found = []
    for key in dict.fromkeys([*before, *after]):
        dotted = f"{prefix}.{key}" if prefix else str(key)
        found += _differences(before.get(key), after.get(key), dotted)
    return found


def _check_foreign(output_dir: Path) -> None:
    """Refuse a folder holding files named like a run's that no run marked as its own.

    Raises:
        CheckpointError: ``output_dir`` has such files and no :data:`RUN_MARKER`.
    """
    if not output_dir.is_dir() or (output_dir / RUN_MARKER).exists():
        return
    named = sorted(
        entry.name
        for entry in output_dir.iterdir()
        if entry.name in RUN_FILES or _CHECKPOINT_ENTRY.match(entry.name)
    )
    if named:
        raise CheckpointError(
            f"{output_dir} holds {', '.join(named)}, named as a run's files, but no run of "
            f"this library marked the folder as its own ({RUN_MARKER}): a run there would "
            "write over them, and --overwrite would delete them. Give training.output_dir "
            "an empty or new folder, or move them out (a run of a version before the marker: "
            "delete its folder yourself, or resume it with --resume)"
        )


def _run_marks(output_dir: Path) -> list[str]:
    """What marks ``output_dir`` as holding a run: its metrics and checkpoint folders."""
    if not output_dir.is_dir():
        return []
    return ([METRICS_FILE] if (output_dir / METRICS_FILE).exists() else []) + _checkpoints(
        output_dir
    )


def _checkpoints(output_dir: Path) -> list[str]:
    """The checkpoint folders in ``output_dir`` (partial and stale ones too), by step."""
    return sorted(
        (entry.name for entry in output_dir.iterdir() if _CHECKPOINT_ENTRY.match(entry.name)),
        key=lambda name: int(re.sub(r"\D", "", name)),
    )


def _metrics_rows(output_dir: Path) -> bool:
    """Whether the run's ``metrics.csv`` holds a step's row (more than its header)."""
    try:
        with (output_dir / METRICS_FILE).open(encoding="utf-8") as file:
            return len(file.readlines(1 << 16)) > 1
    except FileNotFoundError:
        return False


def _remove_run(output_dir: Path, keep: Collection[str] = ()) -> None:
    """Remove what a run writes in ``output_dir`` but the names in ``keep``; any other file
    there stays."""
    for entry in output_dir.iterdir():
        if entry.name in keep or not (
            entry.name in RUN_FILES or _CHECKPOINT_ENTRY.match(entry.name)
        ):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _store_manifest(manifest: RunManifest, output_dir: Path) -> None:
    """Write ``output_dir/manifest.yaml`` whole or not at all (a reader never sees half):
    ``manifest``'s env and model files made absolute, its training section as it is (its
    ``output_dir`` the run's folder, :attr:`RunSettings.manifest`)."""
    pinned = absolute_paths(manifest).model_copy(update={"training": manifest.training})
    data = pinned.model_dump(mode="json", exclude_unset=True)
    partial = output_dir / f".{RUN_MANIFEST}.partial"
    try:
        partial.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    except OSError as exc:
        partial.unlink(missing_ok=True)
        error = disk_full_error(exc, output_dir, f"writing {RUN_MANIFEST}")
        if error is None:
            raise
        raise error from exc
    os.replace(partial, output_dir / RUN_MANIFEST)
