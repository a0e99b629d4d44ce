"""bench/_capacity_server.py driven by the real ``VLLMServerBackend``: the wire, the sampling
rules (seeds, stop strings, ``max_tokens``) and the latency law.

The server lives in bench/ (a private module of bench/rollout_server.py); bench/ is appended
to ``sys.path``, after everything else, so none of its scripts can shadow a module the tests
import.
"""

from __future__ import annotations

import json
import math
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agile_llmenvs.backends import SamplingParams, VLLMServerBackend
from agile_llmenvs.backends.vllm import _SEED_STRIDE
from agile_llmenvs.errors import GenerationServerError

pytest.importorskip("aiohttp")
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
from _capacity_server import CapacityServerProcess, LatencyLaw

# slow enough that the law shows through a loaded machine's scheduling noise
LAW = LatencyLaw(fixed_s=0.4, per_token_s=0.02, capacity=4)
PROMPTS = [[11, 12, 13], [21, 22], [31], [41, 42, 43, 44]]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[CapacityServerProcess]:
    with CapacityServerProcess(tiny_model_dir, LAW) as started:
        yield started


@pytest.fixture
def backend(server: CapacityServerProcess, tiny_model_dir: Path) -> Iterator[VLLMServerBackend]:
    made = VLLMServerBackend(server.url, tokenizer=tiny_model_dir)  # asks /v1/models
    yield made
    made.close()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        return dict(json.load(reply))


def test_ids_and_logprobs_come_back_as_the_server_sent_them(
    server: CapacityServerProcess, backend: VLLMServerBackend
) -> None:
    params = SamplingParams(max_tokens=6, seed=5)
    generation = backend.generate([PROMPTS[0]], params)[0]
    reply = post(
        server.url,
        {
            "model": str(server.model_dir),
            "prompt": PROMPTS[0],
            "max_tokens": 6,
            "seed": 5 * _SEED_STRIDE,  # request 0 of a batch seeded 5
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    )
    choice = reply["choices"][0]
    assert [f"token_id:{i}" for i in generation.token_ids] == choice["logprobs"]["tokens"]
    assert list(generation.logprobs) == choice["logprobs"]["token_logprobs"]
    tokenizer = backend.tokenizer
    vocabulary = len(tokenizer) - len(tokenizer.all_special_ids)
    assert generation.logprobs == (pytest.approx(-math.log(vocabulary)),) * 6
    assert not set(generation.token_ids) & set(tokenizer.all_special_ids)
    assert reply["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_max_tokens_ends_with_length(backend: VLLMServerBackend) -> None:
    generations = backend.generate(PROMPTS, SamplingParams(max_tokens=5, seed=1))
    for generation in generations:
        assert (len(generation.token_ids), generation.finish_reason) == (5, "length")
        assert generation.text == backend.tokenizer.decode(generation.token_ids)


def test_a_stop_string_cuts_the_text_before_it(backend: VLLMServerBackend) -> None:
    params = SamplingParams(max_tokens=64, stop=("e",), seed=2)  # "e" comes within a few tokens
    for generation in backend.generate(PROMPTS, params):
        full = backend.tokenizer.decode(generation.token_ids)
        assert generation.finish_reason == "stop"
        assert full.startswith(generation.text + "e")
        assert "e" not in generation.text
        # the id that completed the stop string is the last one drawn
        assert "e" not in backend.tokenizer.decode(generation.token_ids[:-1])


def test_equal_seeds_and_prompts_give_equal_ids(backend: VLLMServerBackend) -> None:
    def ids(prompts: list[list[int]], **params: Any) -> list[tuple[int, ...]]:
        sampling = SamplingParams(max_tokens=8, **params)
        return [g.token_ids for g in backend.generate(prompts, sampling)]

    twice = [PROMPTS[0], PROMPTS[0]]  # same prompt, seeds 7 * 65536 + 0 and + 1
    first, second = ids(twice, seed=7)
    assert ids(twice, seed=7) == [first, second]
    assert first != second
    assert ids([PROMPTS[1]], seed=7) != [first]  # another prompt, the same seed
    greedy = ids(twice, temperature=0.0, seed=3)  # greedy: the prompt alone decides
    assert greedy == ids(twice, temperature=0.0)
    assert greedy[0] == greedy[1]


def test_values_it_cannot_honour_are_refused(backend: VLLMServerBackend) -> None:
    with pytest.raises(GenerationServerError, match="top_p") as raised:
        backend.generate([PROMPTS[0]], SamplingParams(max_tokens=2, top_p=0.5))
    assert raised.value.status_code == 400
    with pytest.raises(GenerationServerError, match="maximum context length is 512"):
        backend.generate([[1] * 510], SamplingParams(max_tokens=8))


def test_requests_in_flight_wait_for_capacity_only(backend: VLLMServerBackend) -> None:
    params = SamplingParams(max_tokens=5)  # 0.4 + 5 * 0.02 = 0.5 s a request
    backend.generate([PROMPTS[0]], params)  # the connection pool warm
    start = time.perf_counter()
    backend.generate(PROMPTS, params)  # 4: the capacity, all served at once
    at_capacity = time.perf_counter() - start
    start = time.perf_counter()
    backend.generate(PROMPTS * 2, params)  # 8: the last 4 wait for the first
    beyond = time.perf_counter() - start
    assert 0.5 <= at_capacity < 1.5  # served one after another, 2 s
    assert beyond >= 1.0


def test_a_law_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"capacity >= 1; got 0\.005, 0\.001 and 0$"):
        LatencyLaw(capacity=0)
