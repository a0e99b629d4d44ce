"""Playing TRL's episodes: a lock-step turn loop over harnesses, and the trainer's current model
as the policy that loop calls."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from agile_llmenvs.errors import EnvBuildError, OptionalDependencyError
from agile_llmenvs.llm_envs.collector import Generate
from agile_llmenvs.llm_envs.episode import EpisodeData
from agile_llmenvs.llm_envs.harness import RolloutHarness
from agile_llmenvs.llm_envs.tasks import Task
from agile_llmenvs.llm_envs.trajectory import failed_episode

__all__ = ["check_sampling", "first_prompt", "play_episodes", "trainer_policy"]


def play_episodes(
    harnesses: Sequence[RolloutHarness], tasks: Sequence[Task], generate: Generate
) -> list[EpisodeData]:
    """Play one episode of ``tasks[i]`` on ``harnesses[i]``, lock-step: one ``generate`` call
    per turn for every live episode. An env that raises fails only its episode (a value).

    Env calls run one after another on this thread, and no timeout bounds them as the
    collector's ``io_timeout_s`` does (the collector deals its own tasks, not TRL's).
    """
    outcomes: dict[int, EpisodeData] = {}
    for index, (harness, task) in enumerate(zip(harnesses, tasks, strict=True)):
        try:
            harness.reset(**task.reset_kwargs())
        except Exception as exc:
            outcomes[index] = failed_episode(f"{type(exc).__name__}: {exc}")
    while live := [i for i, h in enumerate(harnesses) if i not in outcomes and not h.done]:
        outputs = generate([harnesses[i].context_ids for i in live])
        for index, output in zip(live, outputs, strict=True):
            ids, logps = output if isinstance(output, tuple) else (output, None)
            try:
                harnesses[index].step(ids, logps)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                harnesses[index].abort(reason)
                outcomes[index] = failed_episode(reason)
    return [outcomes.get(i) or h.get_episode_data() for i, h in enumerate(harnesses)]


def first_prompt(harness: RolloutHarness, task: Task) -> list[int]:
    """The ids of ``task``'s first prompt.

    Raises:
        EnvBuildError: the env failed to reset to the task.
    """
    try:
        return harness.reset(**task.reset_kwargs())
    except Exception as exc:
        raise EnvBuildError(
            f"the env failed to reset to {task} while TRLEnv read its tasks' prompts: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


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
    from agile_llmenvs.training.sampling import Sampler

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
            "use_vllm=True: TRLEnv generates with the trainer's own model (HFBackend); "
            "set use_vllm=False"
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
