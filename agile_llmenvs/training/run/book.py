"""The record every training loop keeps of its run, written once for GRPO, SFT and DPO.

:func:`in_run_folder` plans the run in its folder (:func:`~agile_llmenvs.training.run.folder.
plan_run`) and trains there unless the run is complete already; a fresh start that fails
before its first step leaves the folder as it found it. While the loop runs, a
:class:`RunBook` keeps the rest: it starts the folder, writes each step's metrics row and
progress line, hears SIGINT / SIGTERM, saves the checkpoints (every ``save_every`` steps, and
the last) and ends with the plot and the :class:`~agile_llmenvs.training.run.TrainResult`.
A loop reads::

    with RunBook.start(settings, plan, learner, tokenizer, rank_state, ...) as book:
        for step in book.steps():
            book.record(train_one_step(step), shown={"loss": ...})
            if book.stop_requested():
                break
            book.save_if_due()
    return book.result(book.save(), panels=("loss",))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from agile_llmenvs._run_files import METRICS_FILE, METRICS_PLOT
from agile_llmenvs.training.policy import Learner
from agile_llmenvs.training.run.checkpoint import save_checkpoint
from agile_llmenvs.training.run.folder import RunPlan, plan_run, start_run
from agile_llmenvs.training.run.interrupt import StopRequest
from agile_llmenvs.training.run.metrics import MetricsWriter, plot_metrics
from agile_llmenvs.training.run.progress import Progress
from agile_llmenvs.training.run.result import TrainResult
from agile_llmenvs.training.run.settings import RunSettings
from agile_llmenvs.training.run.trackers import open_trackers

__all__ = ["RankState", "RunBook", "in_run_folder"]

#: This process's own state at a step (its collector's or dataset's position), saved with it.
RankState = Callable[[int], Mapping[str, Any]]


def in_run_folder(
    settings: RunSettings,
    *,
    resume: bool,
    overwrite: bool,
    train: Callable[[RunPlan], TrainResult],
) -> TrainResult:
    """Plan the run in its folder and ``train`` there, unless a resume finds it complete.

    Raises:
        CheckpointError: see :func:`~agile_llmenvs.training.run.folder.plan_run`.
    """
    plan = plan_run(settings, resume=resume, overwrite=overwrite)
    try:
        if plan.complete:
            return plan.complete_result()
        return train(plan)
    except BaseException:
        plan.abandon()  # a run that never finished a step leaves the folder as it was
        raise
    finally:
        plan.release()


class RunBook:
    """One run's record in its folder; made by :meth:`start`, used as a context (in which
    SIGINT and SIGTERM ask the loop to stop after its step, and out of which the metrics file
    and the progress line are closed).

    Attributes:
        step: Steps done, counting those before a resume.
        resume_step: The step a resumed run continued from (``None``: a fresh start).
        history: This process's metric rows, one per step run now.
    """

    def __init__(
        self,
        settings: RunSettings,
        learner: Learner,
        tokenizer: Any,
        rank_state: RankState,
        *,
        start_step: int,
        resume_step: int | None,
        writer: MetricsWriter | None,
    ) -> None:
        self.settings, self.learner, self.tokenizer = settings, learner, tokenizer
        self.rank_state = rank_state
        self.start_step = self.step = start_step
        self.resume_step, self.writer = resume_step, writer
        self.history: list[dict[str, float]] = []
        self.main = learner.accelerator.is_main_process
        self.progress = Progress(
            settings.algorithm, start=start_step, total=settings.max_steps, enabled=self.main
        )
        self.stop = StopRequest()

    @classmethod
    def start(
        cls,
        settings: RunSettings,
        plan: RunPlan,
        learner: Learner,
        tokenizer: Any,
        rank_state: RankState,
        *,
        metric_keys: Sequence[str],
        start_step: int,
    ) -> RunBook:
        """Start the run in the folder ``plan`` holds (an overwrite's old run removed, the
        manifest stored), then open its metrics file and trackers on the main process.

        Args:
            tokenizer: Saved beside the weights (a vision-language policy's processor).
            rank_state: What each checkpoint saves of this process's own state.
            metric_keys: The columns of ``metrics.csv``.
            start_step: Steps done before this run (a resume's checkpoint step).
        """
        start_run(plan, settings.manifest, learner.accelerator)
        resume_step = start_step if plan.resume_from is not None else None
        writer = None
        if learner.accelerator.is_main_process:
            logging, output_dir = settings.logging, settings.output_dir
            trackers = open_trackers(
                logging.report_to,
                output_dir,
                run_name=logging.run_name,
                resume=resume_step is not None,
            )
            writer = MetricsWriter(
                output_dir / METRICS_FILE,
                metric_keys,
                resume_step=resume_step,
                tensorboard=logging.tensorboard,
                trackers=trackers,
            )
        return cls(
            settings,
            learner,
            tokenizer,
            rank_state,
            start_step=start_step,
            resume_step=resume_step,
            writer=writer,
        )

    def __enter__(self) -> RunBook:
        self.stop.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self.progress.close()
            if self.writer is not None:
                self.writer.close()
        finally:
            self.stop.__exit__(exc_type, exc, traceback)

    def steps(self) -> range:
        """The 0-based indices of the steps left to run."""
        return range(self.start_step, self.settings.max_steps)

    def record(self, row: dict[str, float], shown: Mapping[str, float | str]) -> None:
        """Keep the row of the step just done: in :attr:`history`, the metrics file and,
        every ``log_every`` steps, the progress line, which shows ``shown``."""
        self.step += 1
        self.history.append(row)
        if self.writer is not None:
            self.writer.write(row)
        if self.step % self.settings.logging.every == 0:
            self.progress.show(**shown)
        self.progress.advance()

    def stop_requested(self) -> bool:
        """Whether a signal asked the run to stop after this step (every process agrees)."""
        return self.stop.requested(self.learner.accelerator)

    def save_if_due(self) -> None:
        """Save a checkpoint every ``save_every`` steps, but at the last step, whose save
        follows the loop (:meth:`save`)."""
        every = self.settings.save_every
        if every and self.step % every == 0 and self.step != self.settings.max_steps:
            self.save()

    def save(self) -> Path:
        """Save a checkpoint of the steps done; returns its folder."""
        return save_checkpoint(
            self.settings.output_dir,
            self.learner,
            step=self.step,
            tokenizer=self.tokenizer,
            rank_state=self.rank_state(self.step),
            keep=self.settings.keep_checkpoints,
        )

    def result(self, checkpoint_dir: Path, panels: tuple[str, ...]) -> TrainResult:
        """Plot ``panels`` of the metrics (on the main process) and sum the run up."""
        output_dir = self.settings.output_dir
        if self.main:
            plot_metrics(output_dir / METRICS_FILE, output_dir / METRICS_PLOT, panels)
        stopped_by = self.stop.signal_name if self.step < self.settings.max_steps else None
        return TrainResult(
            output_dir,
            self.step,
            self.history,
            output_dir / METRICS_FILE,
            checkpoint_dir,
            stopped_by,
        )
