"""A run's settings: the manifest's ``training`` section read once, at the top of the run, into
one frozen :class:`RunSettings`, every number derived from it derived there (as CleanRL's
``ppo.py`` computes ``batch_size`` and ``num_iterations`` right below its ``Args``, never
again). Each room of training is handed its part: the policy its :class:`PolicySettings`, the
learning step its :class:`UpdateSettings`, ``turn_mc`` and ``tree`` their
:class:`~agile_llmenvs.training.credit.CreditSettings`, the held-out evaluation its
:class:`HeldOutSettings`, and so on.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agile_llmenvs.backends.types import SamplingParams, TokenDistribution
from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.specs import LLMEnvSpec, RunManifest, TrainingSpec
from agile_llmenvs.specs.generation import VLLMGenerationSpec, VLLMServerSpec
from agile_llmenvs.training.credit import AnchorSettings, CreditSettings
from agile_llmenvs.training.objective import LossType, ScaleRewards
from agile_llmenvs.training.policy import OptimizerSettings, PolicySettings
from agile_llmenvs.training.run.trackers import tensorboard_setting

__all__ = [
    "FailureLimits",
    "GenerationSettings",
    "HeldOutSettings",
    "LoggingSettings",
    "RunSettings",
    "UpdateSettings",
]

_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class UpdateSettings:
    """What shapes a GRPO update (the manifest's ``training`` fields of the same names).

    Attributes:
        loss_type: How per-token losses are averaged.
        clip_eps: The ratio is clipped to ``1 +- clip_eps``.
        beta: The k3 KL coefficient (0: no reference).
        distribution: The sampler's distribution (temperature, repetition penalty,
            truncation), the one every sampled token is scored under.
        max_completion_tokens: ``dr_grpo``'s constant; ``None`` in a run's settings when the
            manifest leaves it to the env's turn budget (:meth:`with_completion_budget`).
        micro_batch_size: Rows per forward/backward (``None``: a mini-batch at once).
        num_iterations: Passes over the batch.
        mini_batches: Optimizer steps per pass.
        chunk_tokens: Scored positions whose logits are held at once.
    """

    loss_type: LossType = "dapo"
    clip_eps: float = 0.2
    beta: float = 0.0
    distribution: TokenDistribution = field(default_factory=TokenDistribution)
    max_completion_tokens: int | None = 1
    micro_batch_size: int | None = None
    num_iterations: int = 1
    mini_batches: int = 1
    chunk_tokens: int = 256

    def with_completion_budget(self, tokens: int) -> UpdateSettings:
        """These settings, ``max_completion_tokens`` set to ``tokens`` where it is unset: a
        run's setup gives the env's turn budget times ``max_new_tokens`` once the env is built."""
        if self.max_completion_tokens is not None:
            return self
        return dataclasses.replace(self, max_completion_tokens=tokens)


@dataclass(frozen=True)
class GenerationSettings:
    """What samples a GRPO run's rollouts.

    Attributes:
        backend: ``hf`` (the policy itself), ``vllm`` (an engine in each process) or
            ``vllm_server`` (running ``vllm serve`` processes).
        vllm: The engine's settings (the manifest's, else the defaults).
        server: The servers of ``vllm_server`` (``None`` for the other backends).
        max_staleness: Policy versions a trained sample may lag the trainer by.
        sync_check: When a weight sync is checked (``auto``, ``every``, ``off``).
        sync_check_tolerance: The check's tolerance (``None``: by the policy's dtype).
    """

    backend: Literal["hf", "vllm", "vllm_server"]
    vllm: VLLMGenerationSpec
    server: VLLMServerSpec | None
    max_staleness: int
    sync_check: Literal["auto", "every", "off"] = "auto"
    sync_check_tolerance: float | None = None


@dataclass(frozen=True)
class HeldOutSettings:
    """GRPO's greedy evaluation on held-out tasks, and the eval config a run ends with.

    Attributes:
        every: Steps between evaluations (0: none during training).
        tasks: Held-out tasks per evaluation (and in the eval config of an entrypoint env).
        success_reward: An episode succeeds when its reward reaches it.
        params: Greedy sampling within the run's per-turn token budget.
    """

    every: int
    tasks: int
    success_reward: float
    params: SamplingParams


@dataclass(frozen=True)
class FailureLimits:
    """When env failures stop a GRPO run (:class:`~agile_llmenvs.training.run.EnvFailures`).

    Attributes:
        max_fraction: A step with a larger share of failed episodes is failing.
        max_steps: Failing steps in a row that stop the run.
    """

    max_fraction: float
    max_steps: int


@dataclass(frozen=True)
class LoggingSettings:
    """What a run shows and records each step besides its checkpoints.

    Attributes:
        every: Steps between progress updates.
        tensorboard: TensorBoard scalars: required (``True``, also when ``report_to`` names
            it), off (``False``) or when installed (``None``).
        report_to: The experiment trackers each row also goes to.
        run_name: The trackers' run name (``None``: the manifest's ``name``, else the folder's).
        rollouts_every: GRPO: steps between logged episodes (0: none).
        rollouts_count: GRPO: episodes logged per logged step.
    """

    every: int
    tensorboard: bool | None
    report_to: tuple[str, ...]
    run_name: str | None
    rollouts_every: int
    rollouts_count: int


@dataclass(frozen=True)
class RunSettings:
    """One run's settings, read once from its manifest (:meth:`of`).

    Attributes:
        manifest: The manifest as the run runs it, ``training.output_dir`` its folder made
            absolute: what it stores in its folder and what a resume is compared with.
        algorithm: ``grpo``, ``sft`` or ``dpo``.
        env: The env spec (an LLM env: the manifest pairs every algorithm with one).
        seed: The run's seed.
        output_dir: The run's folder, as given (``runs/<name>`` when the manifest sets none).
        max_steps: Steps of the whole run.
        save_every: Steps between checkpoints (0: only at the end).
        keep_checkpoints: Complete checkpoints kept (``None``: all).
        batch_size: Rows (SFT, DPO) or groups (GRPO) per step.
        micro_batch_size: Rows per forward/backward (``None``: all at once).
        chunk_tokens: Scored positions whose logits are held at once.
        beta: The manifest's ``beta``: DPO's temperature (GRPO's KL coefficient is in
            ``update``).
        max_model_len: The manifest's context length (``None``: the model's own, which GRPO
            reads from the policy once it is loaded).
        policy: What loads the policy and how it learns (``optimizer.total_steps``: GRPO's
            ``max_steps x num_iterations x mini_batches``, else ``max_steps``).
        logging: What each step shows and records.
        group_size: GRPO: episodes per task.
        sampling: GRPO: how rollouts are sampled, the one distribution every backend samples
            and the trainer scores.
        update: GRPO: the learning step's settings.
        scale_rewards: GRPO: what group-relative advantages are divided by.
        dynamic_sampling: GRPO: refill groups with equal rewards from new tasks.
        credit: GRPO: how an episode's advantage is shared among its turns.
        continuations: ``credit: turn_mc`` and ``tree``'s settings: the continuations
            branched from the batch's states (``None`` for the other modes).
        anchor: ``credit: anchor``'s settings (``None`` for the other modes).
        generation: GRPO: what samples the rollouts.
        held_out: GRPO's held-out evaluation.
        failures: GRPO: when env failures stop the run.
    """

    manifest: RunManifest
    algorithm: Literal["grpo", "dpo", "sft"]
    env: LLMEnvSpec
    seed: int
    output_dir: Path
    max_steps: int
    save_every: int
    keep_checkpoints: int | None
    batch_size: int
    micro_batch_size: int | None
    chunk_tokens: int
    beta: float | None
    max_model_len: int | None
    policy: PolicySettings
    logging: LoggingSettings
    group_size: int
    sampling: SamplingParams
    update: UpdateSettings
    scale_rewards: ScaleRewards
    dynamic_sampling: bool
    credit: Literal["episode", "turn_mc", "anchor", "tree"]
    continuations: CreditSettings | None
    anchor: AnchorSettings | None
    generation: GenerationSettings
    held_out: HeldOutSettings
    failures: FailureLimits

    @classmethod
    def of(cls, manifest: RunManifest) -> RunSettings:
        """Read ``manifest``'s ``training`` section, once.

        Raises:
            AgileLLMEnvsError: the manifest has no ``training`` section.
        """
        if manifest.training is None:
            raise AgileLLMEnvsError("the manifest has no `training` section: add one to train")
        config = manifest.training
        env = manifest.env
        assert isinstance(env, LLMEnvSpec)  # the manifest's validator pairs algorithms with it
        output_dir = _output_dir(manifest, config)
        pinned = config.model_copy(update={"output_dir": str(output_dir.resolve())})
        sampling = _sampling(config)
        return cls(
            manifest=manifest.model_copy(update={"training": pinned}),
            algorithm=config.algorithm,
            env=env,
            seed=manifest.seed,
            output_dir=output_dir,
            max_steps=config.max_steps,
            save_every=config.save_every,
            keep_checkpoints=config.keep_checkpoints,
            batch_size=config.batch_size,
            micro_batch_size=config.micro_batch_size,
            chunk_tokens=config.logps_chunk_tokens,
            beta=config.beta,
            max_model_len=manifest.model.max_model_len,
            policy=_policy(manifest, config),
            logging=_logging(config),
            group_size=config.group_size,
            sampling=sampling,
            update=_update(config, sampling),
            scale_rewards=config.scale_rewards,
            dynamic_sampling=config.dynamic_sampling,
            credit=config.credit,
            continuations=_continuations(config),
            anchor=(
                AnchorSettings(config.credit_gamma, config.credit_omega)
                if config.credit == "anchor"
                else None
            ),
            generation=GenerationSettings(
                config.generation_backend,
                config.vllm or VLLMGenerationSpec(),
                config.vllm_server,
                config.max_staleness,
                config.sync_check,
                config.sync_check_tolerance,
            ),
            held_out=HeldOutSettings(
                config.eval_every,
                config.eval_tasks,
                config.eval_success_reward,
                SamplingParams(max_tokens=config.max_new_tokens, temperature=0.0),
            ),
            failures=FailureLimits(config.max_failed_fraction, config.max_failed_steps),
        )


def _output_dir(manifest: RunManifest, config: TrainingSpec) -> Path:
    """The run's folder: ``training.output_dir``, else ``runs/<name>`` (``runs/<algorithm>``
    without a name) in the working directory."""
    if config.output_dir is not None:
        return Path(config.output_dir)
    name = _UNSAFE_NAME.sub("-", manifest.name or "").strip(".-")
    return Path("runs") / (name or config.algorithm)


def _policy(manifest: RunManifest, config: TrainingSpec) -> PolicySettings:
    """The policy's part; its schedule decays over every optimizer step of the run."""
    total_steps = config.max_steps
    if config.algorithm == "grpo":  # each step: num_iterations passes of mini_batches steps
        total_steps *= config.num_iterations * config.mini_batches
    optimizer = OptimizerSettings(
        learning_rate=config.learning_rate,
        weight_decay=config.weight_decay,
        schedule=config.lr_scheduler,
        warmup_steps=config.warmup_steps,
        total_steps=total_steps,
        max_grad_norm=config.max_grad_norm,
    )
    return PolicySettings(
        model=manifest.model,
        seed=manifest.seed,
        lora=config.lora,
        fsdp=config.fsdp,
        mixed_precision=config.mixed_precision,
        gradient_checkpointing=config.gradient_checkpointing,
        cpu_threads=config.cpu_threads,
        optimizer=optimizer,
    )


def _logging(config: TrainingSpec) -> LoggingSettings:
    """What each step shows and records; ``report_to: [tensorboard]`` requires TensorBoard."""
    return LoggingSettings(
        every=config.log_every,
        tensorboard=tensorboard_setting(config),
        report_to=tuple(config.report_to),
        run_name=config.run_name,
        rollouts_every=config.log_rollouts_every,
        rollouts_count=config.log_rollouts_count,
    )


def _sampling(config: TrainingSpec) -> SamplingParams:
    """How rollouts are sampled: the ``training`` fields of the same names."""
    return SamplingParams(
        max_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        min_p=config.min_p,
        repetition_penalty=config.repetition_penalty,
        truncated_logprobs=config.truncated_logprobs,
    )


def _update(config: TrainingSpec, sampling: SamplingParams) -> UpdateSettings:
    """GRPO's learning step; its tokens are scored under the distribution ``sampling`` samples."""
    return UpdateSettings(
        loss_type=config.loss_type,
        clip_eps=config.clip_eps,
        beta=config.beta or 0.0,
        distribution=TokenDistribution.of(sampling),
        max_completion_tokens=config.max_completion_tokens,
        micro_batch_size=config.micro_batch_size,
        num_iterations=config.num_iterations,
        mini_batches=config.mini_batches,
        chunk_tokens=config.logps_chunk_tokens,
    )


def _continuations(config: TrainingSpec) -> CreditSettings | None:
    """The ``credit_*`` fields, for ``credit: turn_mc`` and ``tree`` alone."""
    if config.credit not in ("turn_mc", "tree"):
        return None
    return CreditSettings(
        config.credit_rollouts,
        config.credit_turns,
        config.credit_max_tokens,
        config.credit_branching,
        config.credit_step_tokens,
    )
