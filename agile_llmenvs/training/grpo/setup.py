"""Setting a GRPO run up: the policy, the reference, the generation path and the collector.

:func:`setup_run` loads what :func:`~agile_llmenvs.training.grpo.train_grpo` holds between
steps (a :class:`GRPORun`): the policy and its optimizer, a frozen reference when ``beta > 0``,
what generates (transformers on the policy, an in-process vLLM engine, or ``vllm serve``
processes fed by :class:`~agile_llmenvs.training.generation.server_rollouts.ServerRollouts`), the
collector, and the checkpoint's state when resuming.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agile_llmenvs._run_files import WEIGHTS_SYNC_DIR
from agile_llmenvs.backends.hf import HFBackend
from agile_llmenvs.backends.types import SamplingParams, TokenDistribution
from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.llm_envs.collector import RolloutCollector
from agile_llmenvs.specs import LLMEnvSpec, RunManifest, TrainingSpec
from agile_llmenvs.specs.manifest import VLLMGenerationSpec
from agile_llmenvs.training.credit import TurnCheckpoints
from agile_llmenvs.training.generation import (
    PolicyVLLMEngine,
    Sampler,
    ServerRollouts,
    ServerWeightSync,
    server_backend,
)
from agile_llmenvs.training.grpo.held_out import HeldOutEval
from agile_llmenvs.training.grpo.update import UpdateSettings
from agile_llmenvs.training.policy import (
    GenerationSync,
    Learner,
    is_sharded,
    prepare_policy,
    reference_model,
    set_cpu_threads,
    vision_processor,
)
from agile_llmenvs.training.run import load_checkpoint

__all__ = ["GRPORun", "setup_run", "step_seed"]


@dataclass
class GRPORun:
    """What a GRPO run holds between steps (set up once by :func:`_setup`)."""

    learner: Learner
    tokenizer: Any
    reference: Any
    collector: RolloutCollector
    sampler: Sampler
    settings: UpdateSettings
    start_step: int
    engine: PolicyVLLMEngine | None = None
    server: ServerRollouts | None = None
    keep_checkpoints: int | None = None
    held_out: HeldOutEval | None = None
    processor: Any = None  # a vision-language policy's, saved with its checkpoints
    credit_refusals: set[str] = field(default_factory=set)  # turn_mc refusals already said
    checkpoints: TurnCheckpoints | None = None  # turn_mc's, made at the first collection

    @property
    def accelerator(self) -> Any:
        """The run's ``accelerate.Accelerator``."""
        return self.learner.accelerator

    @property
    def model(self) -> Any:
        """The prepared policy."""
        return self.learner.model

    def close(self) -> None:
        """Release the producer and its servers' connections, the env slots, the env hosts
        behind them (if any), and the vLLM engine."""
        if self.server is not None:
            self.server.close()
            self.server.backend.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
        self.collector.close()
        _close_factory(self.collector)
        if self.held_out is not None:
            self.held_out.close()
        if self.engine is not None:
            self.engine.close()


def _close_factory(collector: RolloutCollector) -> None:
    """Stop what the run's env factory holds (Ray env hosts have a ``close``)."""
    close = getattr(collector.env_factory, "close", None)
    if callable(close):
        close()


def step_seed(seed: int, step: int, rank: int) -> int:
    """The sampling seed of a step's rollouts: it follows the step, so a resumed run samples
    what the whole run would."""
    return (seed * 1_000_003 + step) * 4096 + rank * 64


def setup_run(
    manifest: RunManifest, config: TrainingSpec, output_dir: Path, resume: bool
) -> GRPORun:
    """Load the policy (and a reference when ``beta > 0``), the optimizer, the vLLM engine
    when asked for, and the collector; then the checkpoint when resuming (``config``: the
    manifest's training section)."""
    total_steps = config.max_steps * config.num_iterations * config.mini_batches
    learner, tokenizer = prepare_policy(manifest, config, total_steps=total_steps)
    accelerator = learner.accelerator
    policy = accelerator.unwrap_model(learner.model)
    set_cpu_threads(policy, config.cpu_threads, accelerator.device)
    reference = reference_model(policy, accelerator.device) if config.beta else None
    text_config = policy.config.get_text_config()
    max_model_len = manifest.model.max_model_len or text_config.max_position_embeddings
    engine = None
    if config.generation_backend == "vllm":
        engine = PolicyVLLMEngine(
            manifest,
            config.vllm or VLLMGenerationSpec(),
            max_model_len=max_model_len,
            rank=accelerator.process_index,
            num_processes=accelerator.num_processes,
            device=accelerator.device,
            weights_dir=output_dir / WEIGHTS_SYNC_DIR,
        )
    params = sampling_params(config)
    # an engine per process generates alone; generate on a sharded policy pairs the processes
    sampler = Sampler(
        engine.backend if engine else HFBackend.from_model(policy, tokenizer),
        params,
        sync=GenerationSync(accelerator.device) if is_sharded(policy) and not engine else None,
    )
    collector = server = None
    try:
        processor = vision_processor(manifest.model)
        collector, max_turns = _make_collector(
            manifest, config, tokenizer, processor, max_model_len, accelerator
        )
        start_step = 0
        if resume:
            start_step, rank_state = load_checkpoint(
                output_dir,
                accelerator=accelerator,
                model=learner.model,
                optimizer=learner.optimizer,
                scheduler=learner.scheduler,
            )
            collector.load_state_dict(rank_state["collector"])
        if engine is not None:
            engine.load_weights(policy)  # the checkpoint's, or the adapters merged in
        if config.generation_backend == "vllm_server":
            server = _server_rollouts(
                config,
                manifest.seed,
                output_dir,
                tokenizer,
                collector,
                params,
                start_step,
                accelerator,
            )
            server.sync(policy, version=start_step)  # the checkpoint's, or the adapters merged in
        held_out = HeldOutEval.build(manifest, tokenizer, max_model_len, accelerator, processor)
    except BaseException:
        if server is not None:
            server.close()
            server.backend.close()
        if collector is not None:
            collector.close()
            _close_factory(collector)
        if engine is not None:
            engine.close()
        raise
    return GRPORun(
        learner,
        tokenizer,
        reference,
        collector,
        sampler,
        _update_settings(config, max_turns),
        start_step,
        engine,
        server,
        keep_checkpoints=config.keep_checkpoints,
        held_out=held_out,
        processor=processor,
    )


def _server_rollouts(
    config: TrainingSpec,
    seed: int,
    output_dir: Path,
    tokenizer: Any,
    collector: RolloutCollector,
    params: SamplingParams,
    start_step: int,
    accelerator: Any,
) -> ServerRollouts:
    """This process's producer of rounds from the manifest's servers (``generation_backend:
    vllm_server``); it starts with the first weight sync. Every training process sends its
    own share of the requests, and all of them take part in each weight sync."""
    spec = config.vllm_server
    assert spec is not None  # the training spec's validator asks for it
    backend = server_backend(spec, tokenizer, output_dir)
    rank = accelerator.process_index
    try:
        return ServerRollouts(
            backend,
            collector,
            params,
            lambda step: step_seed(seed, step, rank=rank),
            max_staleness=config.max_staleness,
            sync_every=spec.sync_every,
            start_step=start_step,
            max_steps=config.max_steps,
            dynamic_sampling=config.dynamic_sampling,
            push_weights=ServerWeightSync(backend, rank=rank, world_size=accelerator.num_processes),
        )
    except BaseException:
        backend.close()
        raise


def sampling_params(config: TrainingSpec) -> SamplingParams:
    """How rollouts are sampled: the manifest's ``training`` fields of the same names, the
    one definition of the distribution every backend samples and the trainer scores."""
    return SamplingParams(
        max_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        min_p=config.min_p,
        repetition_penalty=config.repetition_penalty,
        truncated_logprobs=config.truncated_logprobs,
    )


def _update_settings(config: TrainingSpec, max_turns: int) -> UpdateSettings:
    """The learning step's settings; ``max_turns`` is the env's turn budget, as the rollout
    factory found it (the manifest's, or what the env declares)."""
    return UpdateSettings(
        loss_type=config.loss_type,
        clip_eps=config.clip_eps,
        beta=config.beta or 0.0,
        distribution=TokenDistribution.of(sampling_params(config)),
        max_completion_tokens=config.max_completion_tokens or config.max_new_tokens * max_turns,
        micro_batch_size=config.micro_batch_size,
        num_iterations=config.num_iterations,
        mini_batches=config.mini_batches,
        chunk_tokens=config.logps_chunk_tokens,
    )


def _make_collector(
    manifest: RunManifest,
    config: TrainingSpec,
    tokenizer: Any,
    processor: Any,
    max_model_len: int,
    accelerator: Any,
) -> tuple[RolloutCollector, int]:
    """This rank's collector over the manifest's rollout env, and the env's turn budget
    (``processor``: a vision-language policy's, which the envs' images are shown to)."""
    from agile_llmenvs.envs import make_rollout_env_factory
    from agile_llmenvs.envs.rollout import building

    env_spec = manifest.env
    assert isinstance(env_spec, LLMEnvSpec)  # the manifest validator pairs grpo with rollout
    if processor is not None and config.generation_backend != "hf":
        raise AgileLLMEnvsError(
            f"training.generation_backend {config.generation_backend!r} generates from ids "
            "alone, but the policy is a vision-language model: use generation_backend: hf"
        )
    with building(env_spec):  # an env's constructor may raise anything: a wrong key, say
        env_factory, max_turns = make_rollout_env_factory(
            env_spec,
            tokenizer,
            max_model_len=max_model_len,
            max_output_tokens=config.max_new_tokens,
            seed=manifest.seed,
            vision_processor=processor,
        )
    collector = RolloutCollector(
        env_factory,
        config.batch_size,
        config.group_size,
        base_seed=manifest.seed,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        adaptive_task_sampling=env_spec.adaptive_task_sampling,
    )
    try:
        with building(env_spec):
            collector.check_env()  # the first env now: a mistake fails the setup, not step 1
    except BaseException:
        collector.close()
        raise
    return collector, max_turns
