"""Evaluation runner overheads against their floors.

* ``runner``: ``TrajectoryRunner.run_batch`` on the tiny HF model over N single-turn tasks,
  against the floor of the backend's own batched ``generate`` on the very same prompt ids
  (pre-tokenised), same sampling. Figure: throughput ratio floor_s / runner_s (target >= 0.8).
* ``api``: 256 chat requests through ``OpenAIBackend`` (and ``AnthropicBackend``) at
  ``max_concurrency=64`` against a local server (its own process) that answers after 100 ms.
  Two floors run in the same rounds, on the same kind of event loop: each official SDK alone
  (its async client and ``post`` under a bare semaphore, the SDK's aiohttp transport: what
  any caller of the SDK pays) and plain ``aiohttp`` (what the transport alone costs). Figure:
  each backend's wall time over its SDK's floor (target <= 1.1); beside it, for reference,
  wall_s over the ideal 256 / 64 x 0.1 s = 0.4 s, and the plain-aiohttp floor's.

Rounds are interleaved; ratios use each side's best round (these shared 2-core machines
drift from minute to minute), medians are reported beside them. Torch runs on one thread,
on both sides, so another process's load does not stall its thread barrier.
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the shared fakes: DigitEnv and the API server

SERVER = """
import sys, time
sys.path.insert(0, {tests!r})
from fakes import ChatAPIServer
server = ChatAPIServer(latency_s={latency}).start()
print(server.port, flush=True)
sys.stdin.read()
"""


def bench_runner(tasks: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    import torch
    from fakes import DigitEnvFactory

    from agile_llmenvs.backends import HFBackend, SamplingParams
    from agile_llmenvs.core import from_text_env
    from agile_llmenvs.evaluation import RunnerConfig, TrajectoryRunner
    from agile_llmenvs.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    backend = HFBackend(model_dir)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)  # every row: all tokens
    env = from_text_env(DigitEnvFactory())
    runner = TrajectoryRunner(env, backend, params, config=RunnerConfig(system_prompt="Digits."))
    prompts = [
        backend.encode_chat(runner.messages(runner.start(i))) for i in range(tasks)
    ]  # the same ids the runner will send
    backend.generate(prompts[:2], params)  # warm-up
    floor, ours = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        backend.generate(prompts, params)
        floor.append(time.perf_counter() - start)
        start = time.perf_counter()
        result = runner.run_batch(range(tasks))
        ours.append(time.perf_counter() - start)
        assert result.num_tasks == tasks
        assert result.num_errors == 0
    return {
        "tasks": tasks,
        "max_tokens": max_tokens,
        "floor_best_s": round(min(floor), 4),
        "runner_best_s": round(min(ours), 4),
        "floor_median_s": round(statistics.median(floor), 4),
        "runner_median_s": round(statistics.median(ours), 4),
        "throughput_ratio": round(min(floor) / min(ours), 3),
    }


def _floor_batch(kind: str, port: int, bodies: list[dict[str, Any]], concurrency: int) -> float:
    """Wall seconds of one batch sent without the backend: ``kind`` is a floor's name."""
    import asyncio

    import aiohttp

    from agile_llmenvs._loops import new_event_loop

    async def batch() -> float:
        semaphore = asyncio.Semaphore(concurrency)
        if kind == "aiohttp":
            session = aiohttp.ClientSession()
            url = f"http://127.0.0.1:{port}/v1/chat/completions"

            async def one(body: dict[str, Any]) -> object:
                async with semaphore, session.post(url, json=body) as response:
                    return await response.json()

            close = session.close
        else:
            import anthropic
            import openai

            sdk: Any = openai if kind == "openai_sdk" else anthropic
            client_cls = sdk.AsyncOpenAI if sdk is openai else sdk.AsyncAnthropic
            base = f"http://127.0.0.1:{port}" + ("/v1" if sdk is openai else "")
            path = "/chat/completions" if sdk is openai else "/v1/messages"
            client = client_cls(
                api_key="x", base_url=base, max_retries=0, http_client=sdk.DefaultAioHttpClient()
            )

            async def one(body: dict[str, Any]) -> object:
                async with semaphore:
                    return await client.post(path, body=body, cast_to=object)

            close = client.close
        await asyncio.gather(*(one(b) for b in bodies[:concurrency]))  # connections opened
        start = time.perf_counter()
        await asyncio.gather(*(one(b) for b in bodies))
        wall = time.perf_counter() - start
        await close()
        return wall

    loop = new_event_loop()
    try:
        return loop.run_until_complete(batch())
    finally:
        loop.close()


def bench_api(requests: int, concurrency: int, latency: float, rounds: int) -> dict[str, Any]:
    from agile_llmenvs.backends import AnthropicBackend, OpenAIBackend, SamplingParams

    code = SERVER.format(tests=str(ROOT / "tests"), latency=latency)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        backends = {
            "openai": OpenAIBackend(
                "m", base_url=f"http://127.0.0.1:{port}/v1", max_concurrency=concurrency
            ),
            "anthropic": AnthropicBackend(
                "m", base_url=f"http://127.0.0.1:{port}", max_concurrency=concurrency
            ),
        }
        batch = [[{"role": "user", "content": f"Say the digit {i % 10}."}] for i in range(requests)]
        params = SamplingParams(max_tokens=4)
        bodies = {
            "openai_sdk": [backends["openai"].request_body(m, None, params) for m in batch],
            "anthropic_sdk": [backends["anthropic"].request_body(m, None, params) for m in batch],
        }
        bodies["aiohttp"] = bodies["openai_sdk"]
        walls: dict[str, list[float]] = {name: [] for name in [*backends, *bodies]}
        for backend in backends.values():
            backend.generate_chat_batch(batch, params)  # warm-up: connections opened
        for _ in range(rounds):
            for name, backend in backends.items():
                start = time.perf_counter()
                completions = backend.generate_chat_batch(batch, params)
                walls[name].append(time.perf_counter() - start)
                assert all(c.finish_reason == "stop" for c in completions)
            for name, floor_bodies in bodies.items():
                walls[name].append(_floor_batch(name, port, floor_bodies, concurrency))
        for backend in backends.values():
            backend.close()
    finally:
        proc.kill()
        proc.wait()
    ideal = requests / concurrency * latency
    out: dict[str, Any] = {"requests": requests, "max_concurrency": concurrency, "ideal_s": ideal}
    for name, times in walls.items():
        out[f"{name}_best_s"] = round(min(times), 4)
        out[f"{name}_median_s"] = round(statistics.median(times), 4)
        out[f"{name}_ratio"] = round(min(times) / ideal, 3)
    for name in backends:
        out[f"{name}_over_sdk"] = round(min(walls[name]) / min(walls[f"{name}_sdk"]), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    runner = bench_runner(args.tasks, args.max_tokens, args.rounds)
    print("runner", json.dumps(runner))
    api = bench_api(256, 64, 0.1, args.rounds)
    print("api", json.dumps(api))
    summary = {
        "bench": "eval_runner",
        "runner_throughput_ratio": runner["throughput_ratio"],
        "runner_target": ">= 0.8",
        "api_openai_over_sdk": api["openai_over_sdk"],
        "api_anthropic_over_sdk": api["anthropic_over_sdk"],
        "api_over_sdk_target": "<= 1.1",
        "api_openai_ratio": api["openai_ratio"],
        "api_anthropic_ratio": api["anthropic_ratio"],
        "api_openai_sdk_ratio": api["openai_sdk_ratio"],
        "api_anthropic_sdk_ratio": api["anthropic_sdk_ratio"],
        "api_aiohttp_ratio": api["aiohttp_ratio"],
        "runner": runner,
        "api": api,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
