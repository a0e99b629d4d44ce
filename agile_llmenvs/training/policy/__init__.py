"""The policy being trained: loading it (and its tokenizer), LoRA adapters, FSDP2 sharding,
AdamW and its schedule, one accumulated optimizer step, the frozen reference, and the CPU
threads its maths runs on."""

from __future__ import annotations

from agile_llmenvs.training.policy.learner import Learner, micro_batch_slices, reduce_sum
from agile_llmenvs.training.policy.loading import (
    PolicySettings,
    autocast_forward,
    ddp_settings,
    load_policy,
    model_dir,
    prepare_policy,
    reference_model,
    seed_everything,
    vision_processor,
)
from agile_llmenvs.training.policy.lora import AdaptersOffReference, apply_lora
from agile_llmenvs.training.policy.optim import (
    OptimizerSettings,
    Schedule,
    check_master_weights,
    lr_factor,
    make_optimizer,
    make_scheduler,
)
from agile_llmenvs.training.policy.sharding import (
    GenerationSync,
    any_process,
    frozen_sharded_copy,
    idle_forward,
    is_sharded,
    max_over_processes,
    shard_policy,
)
from agile_llmenvs.training.policy.threads import (
    SMALL_MODEL_PARAMETERS,
    ThreadChoice,
    choose_cpu_threads,
    set_cpu_threads,
)

__all__ = [
    "SMALL_MODEL_PARAMETERS",
    "AdaptersOffReference",
    "GenerationSync",
    "Learner",
    "OptimizerSettings",
    "PolicySettings",
    "Schedule",
    "ThreadChoice",
    "any_process",
    "apply_lora",
    "autocast_forward",
    "check_master_weights",
    "choose_cpu_threads",
    "ddp_settings",
    "frozen_sharded_copy",
    "idle_forward",
    "is_sharded",
    "load_policy",
    "lr_factor",
    "make_optimizer",
    "make_scheduler",
    "max_over_processes",
    "micro_batch_slices",
    "model_dir",
    "prepare_policy",
    "reduce_sum",
    "reference_model",
    "seed_everything",
    "set_cpu_threads",
    "shard_policy",
    "vision_processor",
]
