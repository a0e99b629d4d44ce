"""The figures worth a row of ``docs/performance.md``'s table, by benchmark script.

Each script in ``bench/`` prints one JSON object as its last line; :data:`FIGURES` names the
entries of that object the table shows, with their label, unit and target. The training
scripts' figures are in :mod:`agile_llmenvs.bench_figures_training`.
"""

from __future__ import annotations

from agile_llmenvs.bench_figure import Figure, Target, at_least, at_most
from agile_llmenvs.bench_figures_training import TRAINING_FIGURES

__all__ = ["FIGURES", "Figure", "Target"]

_HARNESS = "harness cost per turn over `tokenizer.encode` of the observation, turn"
_HARNESS_RUST = "harness cost per turn over the Rust tokenizer's `encode_batch_fast`, turn"
_API = "256 API requests at `max_concurrency=64`, 100 ms server latency, over the ideal 0.4 s"
_API_BATCH = "256 API requests at `max_concurrency=64`, 100 ms server latency"
_SERVER = "64 episodes x 8 turns (steps 5 ms, 1 in 10 200 ms) on one `vllm serve`"
_CAPACITY = (
    "64 episodes x 8 turns (steps 5 ms, 1 in 10 200 ms) on a server with spare capacity"
    " (`bench/_capacity_server.py`)"
)

FIGURES: dict[str, tuple[Figure, ...]] = {
    "terminal_redteam": (
        Figure(
            "escaped",
            "hostile policies that escaped the terminal env's sandbox",
            unit="",
            target=at_most(0.0),
            detail="of {policies}",
        ),
    ),
    "branching": (
        Figure(
            "fork_500mb_over_10mb",
            "ProcessFork branch cost, a 500 MB env over a 10 MB one",
            target=at_most(2.0),
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
            target=at_most(0.0),
        ),
    ),
    "remote_env": (
        Figure(
            "ours_p50_over_floor",
            "remote env step, p50 latency over a raw `websockets` echo",
            target=at_most(2.0),
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
            target=at_least(2.0),
            detail="{ours.steps_per_s_64} vs {openenv.steps_per_s_64}",
        ),
        Figure(
            "ours_over_floor_steps_per_s_64",
            "steps/s at 64 sessions, ours over the raw `websockets` echo",
            target=at_least(0.6),
            detail="{ours.steps_per_s_64} vs {floor.steps_per_s_64}",
        ),
    ),
    "server_start": (
        Figure(
            "serve_over_create_app",
            "env server start to the first `/health` 200: `agile-llmenvs serve` over uvicorn + "
            "OpenEnv's `create_app`",
            target=at_most(1.2),
            detail="{serve_s} s vs {create_app_s} s",
        ),
        Figure(
            "asgi_over_create_app",
            "same, our ASGI app under uvicorn over `create_app`",
            target=at_most(1.2),
            detail="{asgi_s} s",
        ),
    ),
    "slow_neighbour": (
        Figure(
            "auto_neighbour_max_ms",
            "another session's slowest step while one env call takes 1 s (default "
            "`env_calls=auto`)",
            unit=" ms",
            target=at_most(20.0),
            detail="quiet p50 {auto_quiet_p50_ms} ms",
        ),
        Figure(
            "inline_neighbour_max_ms",
            "same, with the call on the event loop (`env_calls=inline`, reference)",
            unit=" ms",
        ),
    ),
    "harness_turn": (
        Figure("turn_1_over_floor", f"{_HARNESS} 1", target=at_most(1.2)),
        Figure("turn_16_over_floor", f"{_HARNESS} 16", target=at_most(1.2)),
        Figure("turn_64_over_floor", f"{_HARNESS} 64", target=at_most(1.2)),
        Figure("turn_64_over_turn_1", "harness turn 64 over turn 1", target=at_most(1.3)),
        Figure(
            "sentencepiece_turn_1_over_floor",
            f"{_HARNESS} 1, real SentencePiece tokenizer (mistral-common v3)",
            target=at_most(1.2),
            detail="{sentencepiece_turn_1_us} µs vs {sentencepiece_encode_floor_us} µs",
        ),
        Figure(
            "sentencepiece_turn_64_over_floor",
            f"{_HARNESS} 64, real SentencePiece tokenizer (mistral-common v3)",
            target=at_most(1.2),
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
            target=at_most(1.5),
            detail="{collector_turn_us} µs vs {harness_turn_us} µs",
        ),
        Figure(
            "draw_1000000_speedup",
            "adaptive task draw at 1,000,000 rows, speed-up over `torch.multinomial`",
            target=at_least(50.0),
            detail="{draw_1000000_tree_us} µs vs {draw_1000000_multinomial_us} µs",
        ),
        Figure("draw_1000_speedup", "adaptive task draw at 1,000 rows, same measure"),
    ),
    "eval_runner": (
        Figure(
            "runner_throughput_ratio",
            "eval runner throughput over the HF backend's raw batched `generate`",
            target=at_least(0.8),
        ),
        Figure(
            "api_openai_over_sdk",
            f"{_API_BATCH}: `OpenAIBackend` over the `openai` SDK alone (its own `post` under a "
            "bare semaphore), same run",
            target=at_most(1.1),
        ),
        Figure(
            "api_anthropic_over_sdk",
            f"{_API_BATCH}: `AnthropicBackend` over the `anthropic` SDK alone, same run",
            target=at_most(1.1),
        ),
        Figure("api_openai_ratio", f"{_API}: OpenAI (reference)"),
        Figure("api_anthropic_ratio", f"{_API}: Anthropic (reference)"),
        Figure("api.aiohttp_ratio", "same batch, plain `aiohttp` without an SDK (reference)"),
    ),
    "rollout_server": (
        Figure(
            "capacity_speedup",
            f"{_CAPACITY}: episodes/s of continuous rollouts over lock-step",
            target=at_least(1.5),
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
            target=at_least(0.9),
            detail="{continuous_tokens_per_s_best} vs {floor_tokens_per_s_best}",
        ),
    ),
    "slow_clients": (
        Figure(
            "guarded_slowloris_open",
            "our ASGI app under uvicorn with `uvicorn_limits`: connections sending request "
            "headers a byte a second, still open at the end",
            unit="",
            target=at_most(0),
            detail="of {slow} after {hold_s} s; plain uvicorn {asgi.slowloris_open}, "
            "`agile-llmenvs serve` {ours.slowloris_open}",
        ),
        Figure(
            "guarded_slow_body_open",
            "the same, connections sending a body a byte a second",
            unit="",
            target=at_most(0),
            detail="of {slow}; plain uvicorn {asgi.slow_body_open}, `agile-llmenvs serve` "
            "{ours.slow_body_open}",
        ),
        Figure(
            "guarded_flood_open",
            "the same, connections that send nothing",
            unit="",
            target=at_most(0),
            detail="of {idle}; plain uvicorn {asgi.flood_open}, `agile-llmenvs serve` "
            "{ours.flood_open}",
        ),
    ),
    **TRAINING_FIGURES,
}
"""The figures of each script in ``bench/``, by script name without ``.py``."""
