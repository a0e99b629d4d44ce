"""Setting a GRPO run up: the policy, the reference, the generation path and the collector.

:func:`setup_run` loads what :func:`~agile_llmenvs.training.grpo.train_grpo` holds between
steps (a :class:`GRPORun`): the policy and its optimizer, a frozen reference when ``beta > 0``,
what generates (transformers on the policy, an in-process vLLM engine, or ``vllm serve``
processes fed by :class:`~agile_llmenvs.training.generation.server_rollouts.ServerRollouts`), the
collector, and the checkpoint's state when resuming.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

from agile_llmenvs._run_files import WEIGHTS_SYNC_DIR
from agile_llmenvs.backends.hf import HFBackend
from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.llm_envs.collector import RolloutCollector, TurnSignal
from agile_llmenvs.training.credit import TurnCheckpoints, anchor_signal
from agile_llmenvs.training.generation import (
    PolicyVLLMEngine,
    Sampler,
    ServerRollouts,
    ServerWeightSync,
    server_backend,
)
from agile_llmenvs.training.generation.sync_check import SETUP_PROBE, SyncCheck, default_tolerance
from agile_llmenvs.training.grpo.envs import RolloutEnvs
from agile_llmenvs.training.grpo.held_out import HeldOutEval
from agile_llmenvs.training.policy import (
    GenerationSync,
    Learner,
    is_sharded,
    prepare_policy,
    reference_model,
    vision_processor,
)
from agile_llmenvs.training.run import RunSettings, UpdateSettings, load_checkpoint
from agile_llmenvs.weights import require_syncable

__all__ = ["GRPORun", "setup_run", "step_seed", "turn_signal"]


@dataclass
class GRPORun:
    """What a GRPO run holds between steps (set up once by :func:`setup_run`)."""

    learner: Learner
    tokenizer: Any
    reference: Any
    collector: RolloutCollector
    sampler: Sampler
    update: UpdateSettings
    start_step: int
    engine: PolicyVLLMEngine | None = None
    server: ServerRollouts | None = None
    held_out: HeldOutEval | None = None
    processor: Any = None  # a vision-language policy's, saved with its checkpoints
    # turn_mc: why episodes could not be branched, one reason per kind (each said once), and
    # whether any state has been valued in this run yet
    credit_refusals: dict[str, str] = field(default_factory=dict)
    credit_valued: bool = False
    checkpoints: TurnCheckpoints | None = None  # turn_mc's, made at the first collection
    sync_check: SyncCheck | None = None  # with an engine or servers, unless turned off
    setup_probe: list[int] = field(default_factory=list)  # the sync check's first probe

    @property
    def accelerator(self) -> Any:
        """The run's ``accelerate.Accelerator``."""
        return self.learner.accelerator

    @property
    def model(self) -> Any:
        """The prepared policy."""
        return self.learner.model

    @cached_property
    def policy(self) -> Any:
        """The policy without its DDP or FSDP wrapper, found once (each
        ``accelerator.unwrap_model`` asks the import system whether DeepSpeed is installed)."""
        return self.accelerator.unwrap_model(self.learner.model)

    def sampler_logps(self, ids: Sequence[int]) -> dict[str, list[float]]:
        """This process's samplers' log-probs of ``ids``, by name: its engine's, or (on the
        main process) every server's."""
        if self.engine is not None:
            name = f"process {self.accelerator.process_index}'s vLLM engine"
            return {name: self.engine.backend.prompt_logprobs(ids)}
        if self.server is not None and self.accelerator.is_main_process:
            return self.server.backend.prompt_logprobs(ids)
        return {}

    def rank_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint after step ``step`` keeps of this process: where its collector
        is in the task sequence (with servers, where the producer that plays ahead would be)."""
        if self.server is not None:
            return {"collector": self.server.resume_state(step)}
        return {"collector": self.collector.state_dict()}

    def close(self) -> None:
        """Release the producer and its servers' connections, the env slots, the env hosts
        behind them (if any), and the vLLM engine."""
        if self.checkpoints is not None:  # turn_mc's; a run with servers has none
            self.checkpoints.close()
        _close(self.server, self.collector, self.held_out, self.engine)


def _close(
    server: ServerRollouts | None,
    collector: RolloutCollector | None,
    held_out: HeldOutEval | None,
    engine: PolicyVLLMEngine | None,
) -> None:
    """Close what a run set up, in that order (what is ``None`` was not set up)."""
    if server is not None:
        server.close()
        server.backend.close()
    if collector is not None:
        collector.close()
        close = getattr(collector.env_factory, "close", None)  # Ray env hosts have one
        if callable(close):
            close()
    if held_out is not None:
        held_out.close()
    if engine is not None:
        engine.close()


def step_seed(seed: int, step: int, rank: int) -> int:
    """The sampling seed of a step's rollouts: it follows the step, so a resumed run samples
    what the whole run would."""
    return (seed * 1_000_003 + step) * 4096 + rank * 64


def setup_run(settings: RunSettings, resume: bool) -> GRPORun:
    """Load the policy (and a reference when ``beta > 0``), the optimizer, the vLLM engine
    when asked for, and the collector; then the checkpoint when resuming."""
    learner, tokenizer = prepare_policy(settings.policy)
    accelerator = learner.accelerator
    policy = accelerator.unwrap_model(learner.model)
    if settings.generation.backend != "hf":  # refused before an engine or server starts
        require_syncable(policy, adapters_only=_syncs_adapters(settings))
    reference = reference_model(policy, accelerator.device) if settings.update.beta else None
    text_config = policy.config.get_text_config()
    max_model_len = settings.max_model_len or text_config.max_position_embeddings
    engine = _engine(settings, max_model_len, accelerator)
    # an engine per process generates alone; generate on a sharded policy pairs the processes
    sampler = Sampler(
        engine.backend if engine else HFBackend.from_model(policy, tokenizer),
        settings.sampling,
        sync=GenerationSync(accelerator.device) if is_sharded(policy) and not engine else None,
    )
    collector = server = None
    try:
        processor = vision_processor(settings.policy.model)
        envs = RolloutEnvs(
            settings.env,
            tokenizer,
            processor,
            max_model_len,
            settings.sampling.max_tokens,
            settings.seed,
        )
        collector, max_turns = _make_collector(settings, envs, accelerator)
        start_step = 0
        if resume:
            start_step, rank_state = load_checkpoint(settings.output_dir, learner)
            collector.load_state_dict(rank_state["collector"])
        if engine is not None:
            engine.load_weights(policy)  # the checkpoint's, or the adapters merged in
        if settings.generation.backend == "vllm_server":
            rows = int(policy.get_input_embeddings().num_embeddings)
            server = _server_rollouts(
                settings, tokenizer, collector, start_step, accelerator, vocab_size=rows
            )
            server.sync(policy, version=start_step)  # the checkpoint's, or the adapters merged in
        held_out = HeldOutEval.build(settings.held_out, envs, accelerator)
        run = GRPORun(
            learner,
            tokenizer,
            reference,
            collector,
            sampler,
            # dr_grpo's constant, unset: every token the env's turns may sample
            settings.update.with_completion_budget(settings.sampling.max_tokens * max_turns),
            start_step,
            engine,
            server,
            held_out=held_out,
            processor=processor,
            sync_check=_sync_check(settings, policy, accelerator),
            setup_probe=list(tokenizer(SETUP_PROBE)["input_ids"]),
        )
        if run.sync_check is not None:  # the setup sync is always checked
            run.sync_check(
                policy, run.setup_probe, run.sampler_logps, when="the setup sync", budgeted=False
            )
    except BaseException:
        _close(server, collector, None, engine)
        raise
    return run


def _sync_check(settings: RunSettings, policy: Any, accelerator: Any) -> SyncCheck | None:
    """The run's weight-sync check (``None`` for ``hf``, which syncs nothing, or ``off``)."""
    generation = settings.generation
    if generation.backend == "hf" or generation.sync_check == "off":
        return None
    tolerance = generation.sync_check_tolerance
    return SyncCheck(
        generation.sync_check,
        tolerance if tolerance is not None else default_tolerance(policy.dtype),
        distributed=accelerator.num_processes > 1,
    )


def _syncs_adapters(settings: RunSettings) -> bool:
    """Whether the run's weight syncs send a LoRA policy's adapters alone."""
    server = settings.generation.server
    return (
        settings.generation.backend == "vllm_server"
        and server is not None
        and server.lora_sync == "adapters"
    )


def _engine(settings: RunSettings, max_model_len: int, accelerator: Any) -> PolicyVLLMEngine | None:
    """This process's vLLM engine (``generation_backend: vllm``; ``None`` otherwise)."""
    if settings.generation.backend != "vllm":
        return None
    return PolicyVLLMEngine(
        settings.manifest,
        settings.generation.vllm,
        max_model_len=max_model_len,
        rank=accelerator.process_index,
        num_processes=accelerator.num_processes,
        device=accelerator.device,
        weights_dir=settings.output_dir / WEIGHTS_SYNC_DIR,
    )


def _server_rollouts(
    settings: RunSettings,
    tokenizer: Any,
    collector: RolloutCollector,
    start_step: int,
    accelerator: Any,
    *,
    vocab_size: int,
) -> ServerRollouts:
    """This process's producer of rounds from the manifest's servers (``generation_backend:
    vllm_server``); it starts with the first weight sync. Every training process sends its
    own share of the requests, and all of them take part in each weight sync."""
    generation = settings.generation
    assert generation.server is not None  # the training spec's validator asks for it
    backend = server_backend(generation.server, tokenizer, settings.output_dir, vocab_size)
    seed, rank = settings.seed, accelerator.process_index
    try:
        return ServerRollouts(
            backend,
            collector,
            settings.sampling,
            lambda step: step_seed(seed, step, rank=rank),
            max_staleness=generation.max_staleness,
            sync_every=generation.server.sync_every,
            start_step=start_step,
            max_steps=settings.max_steps,
            dynamic_sampling=settings.dynamic_sampling,
            turn_signal=turn_signal(settings),
            credit=settings.continuations,
            keep_branches=settings.credit == "tree",
            push_weights=ServerWeightSync(backend, rank=rank, world_size=accelerator.num_processes),
        )
    except BaseException:
        backend.close()
        raise


def _make_collector(
    settings: RunSettings, envs: RolloutEnvs, accelerator: Any
) -> tuple[RolloutCollector, int]:
    """This rank's collector over the run's rollout env, and the env's turn budget."""
    from agile_llmenvs.envs.rollout import building

    if envs.processor is not None and settings.generation.backend != "hf":
        raise AgileLLMEnvsError(
            f"training.generation_backend {settings.generation.backend!r} generates from ids "
            "alone, but the policy is a vision-language model: use generation_backend: hf"
        )
    with building(settings.env):  # an env's constructor may raise anything: a wrong key, say
        env_factory, max_turns = envs.factory()
    collector = RolloutCollector(
        env_factory,
        settings.batch_size,
        settings.group_size,
        base_seed=settings.seed,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        adaptive_task_sampling=settings.env.adaptive_task_sampling,
    )
    try:
        with building(settings.env):
            collector.check_env()  # the first env now: a mistake fails the setup, not step 1
    except BaseException:
        collector.close()
        raise
    return collector, max_turns


def turn_signal(settings: RunSettings) -> TurnSignal | None:
    """What keeps a group of equal rewards under ``dynamic_sampling``: with ``credit:
    anchor``, turns that share an observation and differ in their returns to go (the group
    carries per-turn signal); None otherwise."""
    if settings.anchor is None or not settings.dynamic_sampling:
        return None
    return partial(anchor_signal, gamma=settings.anchor.gamma)
