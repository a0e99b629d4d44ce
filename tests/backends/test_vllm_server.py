"""VLLMServerBackend: token in / token out from running ``vllm serve`` processes.

Most tests run against real servers (``vllm_server`` marker; they skip without an
interpreter that has vllm-cpu, see tests/vllm_servers.py); the engine-equality test also
needs vllm in this process (the ``vllm`` marker: it runs in the vllm venv). The routing and
URL checks at the top need no server: they talk to small aiohttp fakes of
``/v1/completions``.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import digit_messages
from serving import wait_until

from agile_llmenvs.backends import HFBackend, SamplingParams, VLLMServerBackend
from agile_llmenvs.backends.types import Generation
from agile_llmenvs.backends.vllm_launch import VLLMServerProcess, free_port
from agile_llmenvs.backends.vllm_server import servers
from agile_llmenvs.errors import GenerationServerError, GenerationTimeoutError

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


# --- fakes of /v1/completions, for the tests that need no vLLM -----------------------------


class FakeServer:
    """An aiohttp app in a thread of its own that answers ``/v1/completions`` with the
    prompt's first id, after ``delay_s``; it records the prompts it got."""

    def __init__(self, delay_s: float = 0.0, answer: str = "right") -> None:
        # "right", "garbage" JSON, "html", or "hang" (weight syncs are never answered)
        self.delay_s, self.answer = delay_s, answer
        self.prompts: list[list[int]] = []
        self.bodies: list[dict[str, Any]] = []
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.prompts.append(body["prompt"])
        await asyncio.sleep(self.delay_s)
        if self.answer != "right":
            return self._wrong()
        first = body["prompt"][0]
        return web.json_response(
            {
                "choices": [
                    {
                        "text": "x",
                        "finish_reason": "length",
                        "logprobs": {"tokens": [f"token_id:{first}"], "token_logprobs": [-0.5]},
                    }
                ]
            }
        )

    def _wrong(self) -> web.Response:
        if self.answer == "garbage":
            return web.Response(text='{"choices": [tru', content_type="application/json")
        return web.Response(text="<html>Welcome</html>", content_type="text/html")

    async def _rpc(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        if self.answer == "hang":  # until the server closes
            self._hung = asyncio.Event()
            await self._hung.wait()
        if self.answer != "right":
            return self._wrong()
        return web.json_response({"results": [None]})

    async def _empty(self, request: web.Request) -> web.Response:
        return web.Response()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/collective_rpc", self._rpc)
        app.router.add_post("/reset_prefix_cache", self._empty)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        hung = getattr(self, "_hung", None)
        if hung is not None:
            self._loop.call_soon_threadsafe(hung.set)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def fakes() -> Iterator[Callable[..., FakeServer]]:
    made: list[FakeServer] = []

    def make(delay_s: float = 0.0, answer: str = "right") -> FakeServer:
        made.append(FakeServer(delay_s, answer))
        return made[-1]

    yield make
    for fake in made:
        fake.close()


def fake_backend(urls: list[str], **kwargs: Any) -> VLLMServerBackend:
    return VLLMServerBackend(urls, tokenizer=object(), model="fake", **kwargs)


def in_background(call: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    ("urls", "message"),
    [([], "urls must name at least one server"), (["localhost:8000"], "urls: 'localhost:8000'")],
)
def test_bad_urls_name_the_field(urls: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fake_backend(urls)


def test_bad_routing_and_timeout_are_refused() -> None:
    with pytest.raises(ValueError, match="routing must be"):
        fake_backend(["http://127.0.0.1:1"], routing="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        fake_backend(["http://127.0.0.1:1"], timeout_s=0)


def test_least_loaded_sends_to_the_idle_server(fakes: Callable[..., FakeServer]) -> None:
    slow, fast = fakes(delay_s=1.0), fakes()
    backend = fake_backend([slow.url, fast.url])
    held = in_background(lambda: backend.generate([[7]], GREEDY))  # first in turn: slow
    wait_until(lambda: backend.in_flight()[slow.url] == 1)
    for prompt in ([8], [9]):  # slow is busy: both go to fast, one after the other
        assert backend.generate([prompt], GREEDY)[0].token_ids == (prompt[0],)
    held.join(10)
    assert (slow.prompts, fast.prompts) == ([[7]], [[8], [9]])
    backend.close()


def test_round_robin_takes_turns(fakes: Callable[..., FakeServer]) -> None:
    slow, fast = fakes(delay_s=1.0), fakes()
    backend = fake_backend([slow.url, fast.url], routing="round_robin")
    held = in_background(lambda: backend.generate([[7]], GREEDY))
    wait_until(lambda: backend.in_flight()[slow.url] == 1)
    backend.generate([[8]], GREEDY)
    backend.generate([[9]], GREEDY)  # slow's turn again, busy or not
    held.join(10)
    assert (sorted(slow.prompts), fast.prompts) == ([[7], [9]], [[8]])
    backend.close()


def test_batch_seeds_and_request_body(fakes: Callable[..., FakeServer]) -> None:
    fake = fakes()
    backend = fake_backend([fake.url])
    params = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, stop=("\n",), seed=3)
    generations = backend.generate([[1], [2], [3]], params)
    assert [g.token_ids for g in generations] == [(1,), (2,), (3,)]
    assert [g.logprobs for g in generations] == [(-0.5,)] * 3
    by_prompt = {body["prompt"][0]: body for body in fake.bodies}
    assert [by_prompt[i]["seed"] for i in (1, 2, 3)] == [3 << 16, (3 << 16) + 1, (3 << 16) + 2]
    body = by_prompt[1]
    assert body["top_k"] == -1
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (5, 0.7, 0.9)
    assert (body["logprobs"], body["return_tokens_as_token_ids"], body["stop"]) == (0, True, ["\n"])
    backend.generate([[4]], SamplingParams(max_tokens=2))
    assert "seed" not in fake.bodies[-1]
    backend.close()


def test_refused_connection_names_the_url(fakes: Callable[..., FakeServer]) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    live = fakes()
    backend = fake_backend([closed, live.url], routing="round_robin")
    results = backend.generate_results([[1], [2]], GREEDY)
    assert isinstance(results[0], GenerationServerError)
    assert results[0].url == closed
    assert "is the server running?" in str(results[0])
    assert isinstance(results[1], Generation)
    # the closed server is now down: the next requests all go to the live one
    assert [g.token_ids for g in backend.generate([[3], [4], [5]], GREEDY)] == [(3,), (4,), (5,)]
    assert sorted(live.prompts) == [[2], [3], [4], [5]]
    with pytest.raises(GenerationServerError) as raised:
        fake_backend([closed]).generate([[1]], GREEDY)
    assert raised.value.url == closed
    backend.close()


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        ("garbage", "answered Expecting value: line 1 column 14 (char 13)"),
        ("html", "answered a 'text/html' body, not JSON: '<html>Welcome</html>'"),
    ],
)
def test_a_server_answering_no_json_fails_only_its_requests_and_is_down(
    fakes: Callable[..., FakeServer], answer: str, said: str
) -> None:
    wrong, right = fakes(answer=answer), fakes()
    backend = fake_backend([wrong.url, right.url], routing="round_robin")
    results = backend.generate_results([[1], [2]], GREEDY)
    assert isinstance(results[0], GenerationServerError)
    assert results[0].url == wrong.url
    assert str(results[0]) == (
        f"{wrong.url}/v1/completions {said} (is it a vLLM server, and is it well?)"
    )
    assert isinstance(results[1], Generation)
    # down, as a failed server: the next requests all go to the other
    assert [g.token_ids for g in backend.generate([[3], [4]], GREEDY)] == [(3,), (4,)]
    assert sorted(right.prompts) == [[2], [3], [4]]
    backend.close()


def test_token_ids_outside_the_vocabulary_fail_the_request(
    fakes: Callable[..., FakeServer],
) -> None:
    fake = fakes()  # it answers each prompt's first id as the completion
    backend = fake_backend([fake.url], vocab_size=500)
    results = backend.generate_results([[10**9], [-3], [499]], GREEDY)
    assert [str(r) for r in results[:2]] == [
        f"{fake.url} sent token id 1000000000, outside the vocabulary (0 to 499): is it "
        "serving this model?",
        f"{fake.url} sent token id -3, outside the vocabulary (0 to 499): is it serving this "
        "model?",
    ]
    assert isinstance(results[2], Generation)
    unbounded = fake_backend([fake.url])  # without a size, a negative id is still refused
    assert isinstance(unbounded.generate_results([[-3]], GREEDY)[0], GenerationServerError)
    assert unbounded.generate([[10**6]], GREEDY)[0].token_ids == (10**6,)
    backend.close()
    unbounded.close()


def test_an_html_200_from_collective_rpc_fails_the_sync_there(
    fakes: Callable[..., FakeServer], tmp_path: Path
) -> None:
    """A reload answered by a page (a proxy's, say) is no reload: that server is retired
    as one that failed the sync; alone, it fails the sync and the version stays."""
    page, right = fakes(answer="html"), fakes()
    backend = fake_backend([page.url, right.url])
    assert backend.load_weights_from(tmp_path, version=1) == (page.url,)
    assert (backend.version, backend.urls) == (1, (right.url,))
    backend.close()
    alone = fake_backend([fakes(answer="html").url])
    with pytest.raises(GenerationServerError, match="not JSON"):
        alone.load_weights_from(tmp_path, version=1)
    assert alone.version == 0
    alone.close()


def test_each_sync_removes_the_previous_folder_and_close_waits_for_it(
    fakes: Callable[..., FakeServer], tmp_path: Path
) -> None:
    """The folder a server loaded before is removed once it has loaded the next (on a
    thread: the sync does not wait for the unlinking); the folder just loaded stays until the
    next sync; ``close`` returns with the removal done."""
    backend = fake_backend([fakes().url])
    folders = [tmp_path / f"v{v}" for v in (1, 2, 3)]
    for version, folder in enumerate(folders, start=1):
        folder.mkdir()
        (folder / "rank-00000-of-00001.safetensors").write_bytes(b"x" * 1024)
        backend.load_weights_from(folder, version=version)
        if version == 2:  # the sync itself may return before v1 is gone, never before v2 loaded
            assert folders[1].exists()
    backend.close()
    assert [f.exists() for f in folders] == [False, False, True]


def test_a_sync_to_a_server_that_never_answers_ends_within_timeout_s(
    fakes: Callable[..., FakeServer], tmp_path: Path
) -> None:
    """A reload that hangs is a failed one, after ``timeout_s``: beside a server that takes
    it, the silent one is retired; alone, the sync fails naming it, the version kept."""
    silent, right = fakes(answer="hang"), fakes()
    backend = fake_backend([silent.url, right.url], timeout_s=1.0)
    start = time.monotonic()
    assert backend.load_weights_from(tmp_path, version=1) == (silent.url,)
    assert time.monotonic() - start < 3.0
    assert (backend.version, backend.urls) == (1, (right.url,))
    backend.close()
    alone = fake_backend([fakes(answer="hang").url], timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(GenerationServerError) as raised:
        alone.load_weights_from(tmp_path, version=1)
    assert time.monotonic() - start < 3.0
    assert raised.value.url == alone.urls[0]
    assert "did not answer within timeout_s=1 s" in str(raised.value)
    assert alone.version == 0
    alone.close()


def test_agenerate_elsewhere_than_the_session_loop_is_refused(
    fakes: Callable[..., FakeServer],
) -> None:
    backend = fake_backend([fakes().url])
    with pytest.raises(RuntimeError, match="SESSION_LOOP"):
        asyncio.run(backend.agenerate([1], GREEDY))


def test_agenerate_on_the_session_loop(fakes: Callable[..., FakeServer]) -> None:
    from agile_llmenvs.transport.session_loop import SESSION_LOOP

    backend = fake_backend([fakes().url])
    future = asyncio.run_coroutine_threadsafe(backend.agenerate([5], GREEDY), SESSION_LOOP.loop)
    assert future.result(10).token_ids == (5,)
    assert backend.version == 0
    backend.close()


# --- against real servers --------------------------------------------------------------------


def prompts_of(backend: VLLMServerBackend, n: int) -> list[list[int]]:
    return [backend.encode_chat(m) for m in digit_messages(*range(n))]


@pytest.fixture
def backend(vllm_server: VLLMServerProcess, vllm_model_dir: Path) -> Iterator[VLLMServerBackend]:
    served = VLLMServerBackend(vllm_server.url, tokenizer=vllm_model_dir)
    yield served
    served.close()


@pytest.mark.vllm_server
def test_greedy_ids_match_transformers(backend: VLLMServerBackend, vllm_model_dir: Path) -> None:
    prompts = prompts_of(backend, 4)
    ours = backend.generate(prompts, GREEDY)
    reference = HFBackend(vllm_model_dir).generate(prompts, GREEDY)
    for got, want in zip(ours, reference, strict=True):
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert got.text == want.text
        assert got.finish_reason == want.finish_reason == "length"


@pytest.mark.vllm_server
def test_many_long_seeded_prompts_at_once(backend: VLLMServerBackend) -> None:
    """64 seeded prompts of ~400 tokens arrive together: more than one engine step's token
    budget. With chunked prefill vllm-cpu split one over steps and its engine died (a CPU
    sampler cannot rewind); the launcher turns it off, so every request is answered."""
    prompts = [
        backend.encode_chat([{"role": "user", "content": f"count {i}: " + "1 2 3 " * 60}])
        for i in range(64)
    ]
    assert all(350 < len(p) < 500 for p in prompts)
    generations = backend.generate(prompts, SamplingParams(max_tokens=4, seed=3))
    assert all(1 <= len(g.token_ids) <= 4 for g in generations)
    assert backend.generate(prompts[:1], GREEDY)[0].token_ids  # the engine is still up


@pytest.mark.vllm
@pytest.mark.vllm_server
def test_ids_and_logprobs_match_the_in_process_engine(
    backend: VLLMServerBackend, vllm_model_dir: Path
) -> None:
    pytest.importorskip("vllm")
    import os

    from agile_llmenvs.backends.vllm import VLLMBackend, VLLMConfig

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = VLLMBackend(
        vllm_model_dir, config=VLLMConfig(dtype="float32", max_model_len=512, enforce_eager=True)
    )
    try:
        prompts = prompts_of(backend, 16)
        eos = backend.tokenizer.convert_tokens_to_ids("<|im_end|>")
        for params in (
            SamplingParams(max_tokens=48, temperature=1.0, seed=6),
            SamplingParams(max_tokens=24, temperature=0.8, top_k=50, top_p=0.9, seed=11),
            GREEDY,
        ):
            ours = backend.generate(prompts, params)
            theirs = engine.generate(prompts, params)
            for got, want in zip(ours, theirs, strict=True):
                assert got.token_ids == want.token_ids
                assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
                assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
            if params.seed == 6:  # some sampled the end-of-turn id: kept, as the engine does
                ended = [g for g in ours if g.finish_reason == "stop"]
                assert ended
                assert all(g.token_ids[-1] == eos for g in ended)
    finally:
        engine.close()


def perturbed(model: Any, seed: int, scale: float = 0.05) -> Any:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model


@pytest.mark.vllm_server
def test_sync_weights_serves_the_policy(backend: VLLMServerBackend, vllm_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompts = prompts_of(backend, 4)
    before = backend.generate(prompts, GREEDY)
    original = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    policy = perturbed(copy.deepcopy(original), seed=1)
    try:
        seconds = backend.sync_weights(policy)
        assert 0 < seconds < 30
        assert backend.version == 1
        after = backend.generate(prompts, GREEDY)
        want = HFBackend.from_model(policy, backend.tokenizer).generate(prompts, GREEDY)
        assert [g.token_ids for g in after] == [g.token_ids for g in want]
        assert [g.token_ids for g in after] != [g.token_ids for g in before]
        for got, expected in zip(after, want, strict=True):
            assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    finally:
        backend.sync_weights(original, version=0)  # the shared server serves the model again
    assert backend.version == 0
    assert [g.token_ids for g in backend.generate(prompts, GREEDY)] == [g.token_ids for g in before]


@pytest.mark.vllm_server
def test_sync_weights_merges_lora_adapters(
    backend: VLLMServerBackend, vllm_model_dir: Path
) -> None:
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    lora = get_peft_model(
        copy.deepcopy(original),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # B starts at zero (no change): give the adapters some weight
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    prompts = prompts_of(backend, 4)
    before = backend.generate(prompts, GREEDY)
    try:
        backend.sync_weights(lora)
        after = backend.generate(prompts, GREEDY)
        want = HFBackend.from_model(lora, backend.tokenizer).generate(prompts, GREEDY)
        assert [g.token_ids for g in after] == [g.token_ids for g in want]
        assert [g.token_ids for g in after] != [g.token_ids for g in before]
    finally:
        backend.sync_weights(original, version=0)


@pytest.mark.vllm_server
def test_a_server_that_fails_a_sync_is_retired_and_the_rest_serve(
    vllm_server: VLLMServerProcess, vllm_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import AutoModelForCausalLM

    dead = f"http://127.0.0.1:{free_port()}"
    backend = VLLMServerBackend([dead, vllm_server.url], tokenizer=vllm_model_dir)
    try:
        with caplog.at_level("WARNING", logger="agile_llmenvs.backends.vllm_server"):
            backend.sync_weights(AutoModelForCausalLM.from_pretrained(vllm_model_dir))
        assert backend.version == 1
        assert backend.retired == (dead,)
        assert backend.urls == (vllm_server.url,)
        [record] = caplog.records
        assert record.getMessage().startswith(
            f"weight sync failed on {dead}, which now gets no requests: {dead}/collective_rpc "
            "failed: "
        )
        results = backend.generate_results(prompts_of(backend, 4), GREEDY)
        assert all(isinstance(r, Generation) for r in results)  # none went to the dead one
        assert backend.in_flight() == {vllm_server.url: 0}
    finally:
        backend.close()


@pytest.mark.vllm_server
def test_a_sync_no_server_takes_names_them(vllm_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    backend = VLLMServerBackend(dead, tokenizer=vllm_model_dir, model="m")
    with pytest.raises(GenerationServerError) as raised:
        backend.sync_weights(AutoModelForCausalLM.from_pretrained(vllm_model_dir))
    assert str(raised.value).startswith(f"weight sync failed on {dead[0]}, {dead[1]}: ")
    assert raised.value.url == dead[0]
    assert backend.version == 0
    assert backend.urls == tuple(dead)
    backend.close()


@pytest.mark.vllm_server
def test_timeout_is_typed(vllm_server: VLLMServerProcess, vllm_model_dir: Path) -> None:
    backend = VLLMServerBackend(vllm_server.url, tokenizer=vllm_model_dir, timeout_s=0.05)
    long = SamplingParams(max_tokens=400, temperature=0.0)
    with pytest.raises(GenerationTimeoutError) as raised:
        backend.generate(prompts_of(backend, 1), long)
    assert raised.value.url == vllm_server.url
    backend.close()


@pytest.mark.vllm_server
def test_a_killed_server_fails_only_its_requests(
    vllm_server: VLLMServerProcess,
    vllm_server_factory: Callable[..., VLLMServerProcess],
    vllm_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a failed server is left out for DOWN_FOR_S (5 s); the long batch's survivors can take
    # longer than that on a loaded machine, after which the victim would be tried again
    monkeypatch.setattr(servers, "DOWN_FOR_S", 600.0)
    victim = vllm_server_factory()
    backend = VLLMServerBackend(
        [vllm_server.url, victim.url], tokenizer=vllm_model_dir, routing="round_robin"
    )
    prompts = prompts_of(backend, 6)
    room = vllm_server.max_model_len - max(len(p) for p in prompts)
    long = SamplingParams(max_tokens=room, temperature=0.0)  # greedy never ends early here
    results: list[Generation | GenerationServerError] = []
    batch = in_background(lambda: results.extend(backend.generate_results(prompts, long)))
    wait_until(lambda: backend.in_flight()[victim.url] == 3)
    time.sleep(0.3)
    victim.kill()
    batch.join(120)
    assert len(results) == 6
    for i, result in enumerate(results):
        if i % 2:  # the victim's turns
            assert isinstance(result, GenerationServerError)
            assert result.url == victim.url
        else:
            assert isinstance(result, Generation)
            assert len(result.token_ids) == room
    # the victim is down: the next batch all goes to the live server
    after = backend.generate_results(prompts, GREEDY)
    assert all(isinstance(r, Generation) for r in after)
    with pytest.raises(GenerationServerError) as raised:
        VLLMServerBackend(victim.url, tokenizer=backend.tokenizer, model="m").generate(
            prompts[:1], GREEDY
        )
    assert raised.value.url == victim.url
    backend.close()


@pytest.mark.vllm_server
def test_chat_batch_through_the_server(backend: VLLMServerBackend, vllm_model_dir: Path) -> None:
    conversations = digit_messages(1, 2)
    ours = backend.generate_chat_batch(conversations, GREEDY)
    reference = HFBackend(vllm_model_dir).generate_chat_batch(conversations, GREEDY)
    assert [c.text for c in ours] == [c.text for c in reference]
    assert all(c.generation is not None for c in ours)
