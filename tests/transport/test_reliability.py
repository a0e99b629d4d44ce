"""Reliability on 127.0.0.1: many sessions, timeouts, a killed server, vanished clients."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from echo_envs import EchoEnv
from serving import ServedProcess

from agile_llmenvs.errors import EnvConnectionError, EnvTimeoutError
from agile_llmenvs.transport import ClientState, OpenEnvServer, RemoteEnvClient, ServerSettings
from agile_llmenvs.transport.session_loop import SESSION_LOOP

SESSIONS, STEPS = 256, 200


@pytest.mark.slow
def test_256_sessions_x_200_steps_every_reply_answers_its_own_request(
    serve_process: Callable[..., ServedProcess],
) -> None:
    served = serve_process("echo_envs:EchoEnv", "--port", "0", "--max-concurrent-envs", "256")

    async def session(index: int) -> tuple[int, int]:
        client = RemoteEnvClient(served.url, timeout_s=60)
        matched = mismatched = 0
        reset = await client.areset(seed=index)
        matched += reset.prompt == f"start seed={index}"
        for step in range(STEPS):
            reply = await client.astep(f"s{index}-{step}")
            if reply.prompt == f"{step + 1}:s{index}-{step}" and reply.reward == step + 1:
                matched += 1
            else:
                mismatched += 1
        await client.aclose()
        return matched, mismatched

    async def everyone() -> list[tuple[int, int]]:
        return await asyncio.gather(*(session(i) for i in range(SESSIONS)))

    results = SESSION_LOOP.run(everyone())
    assert sum(m for m, _ in results) == SESSIONS * (STEPS + 1)
    assert sum(x for _, x in results) == 0


def test_blocking_calls_from_many_threads_stay_paired() -> None:
    with OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=32) as server:

        def episode(index: int) -> list[str]:
            with RemoteEnvClient(server.url, timeout_s=30) as client:
                client.reset()
                return [client.step(f"t{index}-{k}").prompt for k in range(50)]

        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(episode, range(32)))
    assert results == [[f"{k + 1}:t{i}-{k}" for k in range(50)] for i in range(32)]


def test_an_idle_blocking_client_answers_keepalive_pings_and_keeps_its_session() -> None:
    settings = ServerSettings(ws_ping_interval_s=0.1, ws_ping_timeout_s=0.2)
    server = OpenEnvServer(make_env=EchoEnv, settings=settings)
    with server, RemoteEnvClient(server.url, timeout_s=5) as client:
        client.reset()
        assert client.step("a").prompt == "1:a"
        time.sleep(1.0)  # ~10 server pings while the caller makes no call
        assert client.step("b").prompt == "2:b"
        assert server.active_sessions == 1


def test_blocking_calls_run_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(coro: object) -> None:
        raise AssertionError("a blocking call hopped to the session loop")

    monkeypatch.setattr(SESSION_LOOP, "run", refuse)
    with OpenEnvServer(make_env=EchoEnv) as server, RemoteEnvClient(server.url) as client:
        assert client.reset(seed=3).prompt == "start seed=3"
        assert client.step("x").prompt == "1:x"
        assert client.state()["step_count"] == 1


def test_either_api_drives_a_session_the_other_opened() -> None:
    with OpenEnvServer(make_env=EchoEnv) as server:
        blocking_first = RemoteEnvClient(server.url, timeout_s=5)
        blocking_first.reset()
        assert SESSION_LOOP.run(blocking_first.astep("a")).prompt == "1:a"
        assert blocking_first.step("b").prompt == "2:b"
        assert SESSION_LOOP.run(blocking_first.astate())["step_count"] == 2
        SESSION_LOOP.run(blocking_first.aclose())
        assert blocking_first.state_ is ClientState.CLOSED

        async_first = RemoteEnvClient(server.url, timeout_s=5)
        SESSION_LOOP.run(async_first.areset())
        assert async_first.step("a").prompt == "1:a"
        assert SESSION_LOOP.run(async_first.astep("b")).prompt == "2:b"
        assert async_first.state()["step_count"] == 2
        async_first.close()
        assert async_first.state_ is ClientState.CLOSED
        deadline = time.monotonic() + 5
        while server.active_sessions and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.active_sessions == 0


def test_a_late_reply_never_answers_a_later_call() -> None:
    with OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=4) as server:
        client = RemoteEnvClient(server.url, timeout_s=0.2)
        client.reset()
        assert client.step("first").prompt == "1:first"
        start = time.monotonic()
        with pytest.raises(EnvTimeoutError, match=r"no reply to 'step' within 0\.2 s"):
            client.step("sleep:2")
        assert time.monotonic() - start < 1.5  # not the step's 2 s
        with pytest.raises(EnvConnectionError, match="lost mid-episode"):
            client.step("second")  # the episode is over: no stale "2:sleep:2" here
        time.sleep(max(0.0, start + 2.3 - time.monotonic()))  # the late reply is written by now
        assert client.reset().prompt == "start seed=None"
        assert client.step("fresh").prompt == "1:fresh"
        assert client.step("again").prompt == "2:again"
        client.close()


def test_an_interrupted_call_drops_the_session_so_its_reply_is_never_read() -> None:
    # Python's own SIGINT handler, whatever an earlier test of the process left installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupted_calls()
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_calls() -> None:
    with OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=4) as server:
        blocking = RemoteEnvClient(server.url, timeout_s=5)
        blocking.reset()
        stepping = threading.Event()

        def interrupt_the_step() -> None:
            stepping.wait(10)
            time.sleep(0.5)  # inside the step, which lasts 2 s
            os.kill(os.getpid(), signal.SIGINT)

        interrupt = threading.Thread(target=interrupt_the_step, daemon=True)
        interrupt.start()
        stepping.set()
        with pytest.raises(KeyboardInterrupt):
            blocking.step("sleep:2")
        interrupt.join()
        assert blocking.state_ is ClientState.LOST
        time.sleep(2)  # the reply to the interrupted step has been sent by now
        with pytest.raises(EnvConnectionError, match="lost mid-episode"):
            blocking.step("next")
        assert blocking.reset().prompt == "start seed=None"
        assert blocking.step("fresh").prompt == "1:fresh"
        blocking.close()

        asynchronous = RemoteEnvClient(server.url, timeout_s=5)

        async def cancelled_step() -> None:
            await asynchronous.areset()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(asynchronous.astep("sleep:0.6"), 0.2)

        SESSION_LOOP.run(cancelled_step())
        assert asynchronous.state_ is ClientState.LOST
        time.sleep(0.6)
        with pytest.raises(EnvConnectionError, match="lost mid-episode"):
            SESSION_LOOP.run(asynchronous.astep("next"))
        assert SESSION_LOOP.run(asynchronous.areset()).prompt == "start seed=None"
        assert SESSION_LOOP.run(asynchronous.astep("fresh")).prompt == "1:fresh"
        asynchronous.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_killed_server_fails_open_episodes_then_reset_reconnects_to_the_restarted_one(
    serve_process: Callable[..., ServedProcess],
) -> None:
    port = str(_free_port())
    served = serve_process("echo_envs:EchoEnv", "--port", port, "--max-concurrent-envs", "8")
    clients = [RemoteEnvClient(served.url, timeout_s=5, connect_timeout_s=20) for _ in range(4)]
    for client in clients:
        client.reset()
        client.step("before")
    served.kill()
    for client in clients:
        start = time.monotonic()
        with pytest.raises(EnvConnectionError):
            client.step("during")
        assert time.monotonic() - start < 5
        with pytest.raises(EnvConnectionError, match="lost mid-episode"):
            client.step("still during")
    serve_process("echo_envs:EchoEnv", "--port", port, "--max-concurrent-envs", "8")
    for client in clients:
        assert client.reset().prompt == "start seed=None"
        assert client.step("after").prompt == "1:after"
        client.close()


def test_reset_waits_with_backoff_for_a_server_that_comes_up(
    serve_process: Callable[..., ServedProcess],
) -> None:
    port = _free_port()
    client = RemoteEnvClient(f"http://127.0.0.1:{port}", connect_timeout_s=30)
    pool = ThreadPoolExecutor(1)
    pending = pool.submit(client.reset)
    time.sleep(0.5)
    assert not pending.done()
    serve_process("echo_envs:EchoEnv", "--port", str(port))
    assert pending.result(timeout=30).prompt == "start seed=None"
    client.close()
    pool.shutdown()
    unreachable = RemoteEnvClient(f"http://127.0.0.1:{_free_port()}", connect_timeout_s=0.5)
    with pytest.raises(EnvConnectionError, match=r"cannot connect within 0.5 s"):
        unreachable.reset()


def test_a_killed_client_process_frees_its_slot() -> None:
    with OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=1) as server:
        code = (
            "import sys, time; from agile_llmenvs.transport import RemoteEnvClient; "
            f"c = RemoteEnvClient({server.url!r}); c.reset(); print('up', flush=True); "
            "time.sleep(60)"
        )
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "up"
        assert server.active_sessions == 1
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 5
        while server.active_sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.active_sessions == 0
        with RemoteEnvClient(server.url) as client:
            assert client.reset().prompt == "start seed=None"
