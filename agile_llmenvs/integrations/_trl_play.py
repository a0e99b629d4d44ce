"""Playing TRL's episodes: the rollout's harnesses and the threads their env calls run on, and
the trainer's current model as the policy the turn loop calls."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, wait
from contextlib import contextmanager, suppress
from functools import partial
from typing import Any

from agile_llmenvs.core import EpisodeData, failed_episode
from agile_llmenvs.errors import EnvBuildError, EnvStateError, OptionalDependencyError
from agile_llmenvs.llm_envs.collector import Generate
from agile_llmenvs.llm_envs.harness import RolloutHarness
from agile_llmenvs.llm_envs.image_framing import content_text
from agile_llmenvs.llm_envs.tasks import Task

__all__ = ["EnvSlots", "Messages", "check_sampling", "first_prompt", "trainer_policy"]

Messages = list[dict[str, str]]
"""A conversation as TRL's conversational format holds it: ``{"role", "content"}`` dicts."""


class EnvSlots:
    """The rollout's harnesses (kept between rollouts) and the lock-step turn loop over them.

    Every env call of a round (the resets, then each turn's steps) runs on its own thread, so
    the envs of a round wait together, as the rollout collector's do. A call that raises
    fails only its episode; one that outlives ``io_timeout_s`` fails only its episode too,
    and its harness is dropped (closed at once, which may free a remote call) and replaced by
    a fresh one on the slot's next use. The threads are daemons, so an env that never returns
    holds up neither the rollout nor the interpreter's exit.

    The rollout collector is not reused for this: it deals its own tasks from its assigner
    and resets all its slots at once, while a TRL wave plays the tasks TRL's prompts name, on
    as many slots as the wave needs.

    Args:
        factory: Builds one harness.
        io_timeout_s: Longest an env call may take (None: unbounded).
    """

    def __init__(
        self, factory: Callable[[], RolloutHarness], *, io_timeout_s: float | None
    ) -> None:
        self.factory = factory
        self.io_timeout_s = io_timeout_s
        self._harnesses: list[RolloutHarness | None] = []

    def play(self, tasks: Sequence[Task], generate: Generate) -> list[EpisodeData]:
        """Play one episode of ``tasks[i]`` on slot ``i``, lock-step: one ``generate`` call per
        turn for every live episode. A failed episode is a value (``StopReason.ENV_ERROR``,
        its error in ``info["error"]``), never an exception."""
        self._harnesses += [None] * (len(tasks) - len(self._harnesses))
        # built here, on the calling thread: a timed-out call must not leave a slot half-built
        harnesses = [self._slot(i) for i in range(len(tasks))]
        failures: dict[int, str] = {}
        resets = {i: partial(_reset, harnesses[i], task) for i, task in enumerate(tasks)}
        self._run(resets, failures)
        while live := [i for i, h in enumerate(harnesses) if i not in failures and not h.done]:
            outputs = generate([harnesses[i].context_ids for i in live])
            calls: dict[int, Callable[[], Any]] = {}
            for index, output in zip(live, outputs, strict=True):
                ids, logps = output if isinstance(output, tuple) else (output, None)
                calls[index] = partial(harnesses[index].step, ids, logps)
            self._run(calls, failures)
        return [
            failed_episode(failures[i]) if i in failures else h.get_episode_data()
            for i, h in enumerate(harnesses)
        ]

    def _slot(self, index: int) -> RolloutHarness:
        """Slot ``index``'s harness, built on first use."""
        harness = self._harnesses[index]
        if harness is None:
            harness = self._harnesses[index] = self.factory()
        return harness

    def _run(self, calls: Mapping[int, Callable[[], Any]], failures: dict[int, str]) -> None:
        """Run each slot's call on a thread of its own and wait for all of them together;
        a call that raises or outlives ``io_timeout_s`` records its slot's failure."""
        futures = {index: _start(call) for index, call in calls.items()}
        done, _ = wait(futures.values(), timeout=self.io_timeout_s)
        for index, future in futures.items():
            if future not in done:
                failures[index] = f"the env call exceeded io_timeout_s={self.io_timeout_s}"
                hung, self._harnesses[index] = self._harnesses[index], None
                if hung is not None:
                    _start(partial(_close_quietly, hung))
            elif (error := future.exception()) is not None:
                failures[index] = f"{type(error).__name__}: {error}"

    def close(self) -> None:
        """Close every harness."""
        harnesses, self._harnesses = self._harnesses, []
        for harness in harnesses:
            if harness is not None:
                _close_quietly(harness)


def _start(call: Callable[[], Any]) -> Future[Any]:
    """Run ``call`` on a new daemon thread; its outcome lands in the returned future."""
    future: Future[Any] = Future()

    def settle() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(call())
        except BaseException as exc:  # the env's failure is the episode's, not the thread's
            future.set_exception(exc)

    threading.Thread(target=settle, name="trl-env-call", daemon=True).start()
    return future


def _reset(harness: RolloutHarness, task: Task) -> list[int]:
    return harness.reset(**task.reset_kwargs())


def _close_quietly(harness: RolloutHarness) -> None:
    with suppress(Exception):
        harness.close()


def first_prompt(harness: RolloutHarness, task: Task) -> Messages:
    """``task``'s first prompt as the conversation the harness renders into its ids (text
    only: the images an env shows stay with the harness).

    Raises:
        EnvBuildError: the env failed to reset to the task.
    """
    try:
        ids = harness.reset(**task.reset_kwargs())
    except Exception as exc:
        raise EnvBuildError(
            f"the env failed to reset to {task} while TRLEnv read its tasks' prompts: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    try:
        messages = harness.snapshot().messages
    except EnvStateError:  # the prompt alone ended the episode (over a prompt limit)
        messages = [{"role": "user", "content": harness.tokenizer.decode(ids)}]
    return [{"role": m["role"], "content": content_text(m["content"])} for m in messages]


@contextmanager
def trainer_policy(
    trainer: Any, tokenizer: Any, *, max_tokens: int, seed: int
) -> Iterator[Generate]:
    """The trainer's current model as a policy: an ``HFBackend`` over it, in eval mode for the
    rollout, sampling at the trainer's ``temperature``, ``top_p`` and ``top_k``, seeded with
    ``seed`` plus one per call. The model is unwrapped by TRL's own
    ``unwrap_model_for_generation`` (which gathers DeepSpeed ZeRO-3 weights).

    Raises:
        OptionalDependencyError: trl is not installed.
        ValueError: see :func:`check_sampling`.
    """
    try:
        from trl.models import unwrap_model_for_generation
    except ImportError as exc:
        raise OptionalDependencyError("trl", extra="trl", feature="TRLEnv") from exc
    from agile_llmenvs.backends.hf import HFBackend
    from agile_llmenvs.backends.types import SamplingParams
    from agile_llmenvs.training.generation import Sampler

    check_sampling(trainer)
    args = trainer.args
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(args.temperature),
        top_p=float(args.top_p),
        top_k=int(args.top_k) or None,
        # TRL scores every sampled token under the whole vocabulary's log-softmax
        truncated_logprobs=False,
        seed=seed,
    )
    with unwrap_model_for_generation(
        trainer.model_wrapped,
        trainer.accelerator,
        gather_deepspeed3_params=args.ds3_gather_for_generation,
    ) as model:
        was_training = model.training
        model.eval()
        try:
            yield Sampler(HFBackend.from_model(model, tokenizer), params)
        finally:
            model.train(was_training)


def check_sampling(trainer: Any) -> None:
    """Refuse trainer settings the rollout's sampler would silently ignore.

    Raises:
        ValueError: ``use_vllm``, ``min_p``, ``repetition_penalty`` or ``generation_kwargs``
            is set.
    """
    args = trainer.args
    if getattr(trainer, "use_vllm", False):
        raise ValueError(
            "use_vllm=True: TRLEnv generates with the trainer's own model (HFBackend), not "
            "through TRL's vLLM engine; set use_vllm=False (see docs/trl.md, Limits)"
        )
    ignored = {
        "min_p": args.min_p is not None,
        "repetition_penalty": float(args.repetition_penalty) != 1.0,
        "generation_kwargs": bool(args.generation_kwargs),
    }
    unsupported = [name for name, is_set in ignored.items() if is_set]
    if unsupported:
        raise ValueError(
            f"GRPOConfig sets {unsupported}, which TRLEnv's sampler does not apply; it samples "
            "with temperature, top_p and top_k only"
        )
