"""The parts of env hosts that run without a Ray cluster: configuration, services, ports,
the memory watchdog, and the lazy ray import."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from agile_llmenvs.errors import EnvBuildError
from agile_llmenvs.hosting import HostConfig
from agile_llmenvs.hosting import host as host_module
from agile_llmenvs.hosting.health import HealthPoller, HealthTarget, probe_health
from agile_llmenvs.hosting.host import (
    EnvHost,
    MemoryWatchdog,
    SessionEnvs,
    Watchdog,
    resident_bytes,
)
from agile_llmenvs.hosting.services import start_services, stop_services
from agile_llmenvs.specs import EnvServiceSpec, LLMEnvSpec
from agile_llmenvs.transport.env_threads import EnvThreads

HERE = Path(__file__).resolve().parent


def test_the_hosting_fields_become_actor_options() -> None:
    spec = LLMEnvSpec(
        env_type="rollout",
        entrypoint="pkg.env:MyEnv",
        env_config={"level": 3},
        env_hosts=3,
        env_sessions_per_host=4,
        cpus_per_env_host=1.5,
        env_host_memory_bytes=2**30,
        env_host_memory_limit_bytes=2**31,
        env_host_ready_timeout_s=30,
        env_host_resource="sandbox",
        env_vars={"MODE": "fast"},
        env_port=9000,
        env_session_ports={"vnc": 5900},
    )
    config = HostConfig.from_spec(spec)
    assert (config.num_hosts, config.sessions_per_host, config.ready_timeout_s) == (3, 4, 30.0)
    assert config.actor_options(2) == {
        "num_cpus": 1.5,
        "max_restarts": -1,
        "max_task_retries": 0,
        "runtime_env": {"env_vars": {"MODE": "fast", "AGILE_LLMENVS_ENV_HOST": "2"}},
        "memory": 2**30,
        "resources": {"sandbox": 1},
    }
    assert config.demand() == {"CPU": 1.5, "memory": 2.0**30, "sandbox": 1.0}
    assert [config.port_of(i) for i in range(3)] == [9000, 9001, 9002]
    # host 1, session 2 of 4: the 7th session of the pool
    assert config.session_ports_of(1, 2) == {"vnc": 5906}
    assert config.memory_limit_bytes == 2**31
    assert len(config.token) > 16
    assert HostConfig.from_spec(spec).token != config.token  # a fresh secret per pool


def test_defaults_of_a_spec_with_one_hosting_field() -> None:
    spec = LLMEnvSpec(env_type="rollout", entrypoint="pkg.env:MyEnv", env_vars={"A": "1"})
    config = HostConfig.from_spec(spec)
    assert (config.num_hosts, config.sessions_per_host, config.cpus) == (1, None, 1.0)
    assert config.ready_timeout_s == 120.0
    assert config.port_of(0) == 0  # any free port
    assert config.bind == "loopback"  # bound to 127.0.0.1 unless the manifest says `node`
    assert config.bind_host("10.0.0.7") == "127.0.0.1"
    assert (config.health_poll_interval_s, config.health_poll_timeout_s) == (5.0, 5.0)
    assert config.health_failures_to_replace == 3
    node = LLMEnvSpec(env_type="rollout", entrypoint="pkg.env:MyEnv", env_host_bind="node")
    assert HostConfig.from_spec(node).bind_host("10.0.0.7") == "10.0.0.7"
    assert config.actor_options(0) == {
        "num_cpus": 1.0,
        "max_restarts": -1,
        "max_task_retries": 0,
        "runtime_env": {"env_vars": {"A": "1", "AGILE_LLMENVS_ENV_HOST": "0"}},
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"session_ports": {"vnc": 5900}},
            "env_session_ports: each session gets its own ports (base + host * "
            "env_sessions_per_host + session), so set env_sessions_per_host too",
        ),
        (
            {"services": (EnvServiceSpec(name="db", image="redis:7"),)},
            "env_services[0] (db): env hosts run services as processes and cannot run the "
            "image 'redis:7'; give the service a `command` (drop `image`), or serve it "
            "elsewhere and pass its address in env_vars",
        ),
        (
            {"port": 65535, "num_hosts": 2},
            "env_port: hosts listen on env_port + host index, and 65535 + 1 is past 65535; "
            "pick a lower env_port",
        ),
        (
            {"session_ports": {"vnc": 65530}, "num_hosts": 2, "sessions_per_host": 4},
            "env_session_ports: 'vnc' needs 8 ports from 65530 (one per session of every "
            "host), past 65535; pick a lower base port",
        ),
        (
            {"health_poll_interval_s": 0.0},
            "health_poll_interval_s must be above 0 (or None: no polls), got 0.0",
        ),
        ({"health_poll_timeout_s": -1.0}, "health_poll_timeout_s must be above 0, got -1.0"),
        ({"health_failures_to_replace": 0}, "health_failures_to_replace must be 1 or more, got 0"),
    ],
)
def test_hosting_fields_that_cannot_work_together(fields: dict, message: str) -> None:
    with pytest.raises(EnvBuildError) as caught:
        HostConfig(entrypoint="pkg.env:MyEnv", **fields)
    assert str(caught.value) == message


def test_each_live_session_gets_its_own_ports() -> None:
    config = HostConfig(
        entrypoint="hosting.host_envs:HostEnv",
        num_hosts=2,
        sessions_per_host=3,
        session_ports={"vnc": 5900, "http": 8000},
    )
    sessions = SessionEnvs(config, index=1)
    first, second = sessions(), sessions()
    assert first.inner.session_ports == {"vnc": 5903, "http": 8003}
    assert second.inner.session_ports == {"vnc": 5904, "http": 8004}
    first.close()  # its index is free again: the next session takes it
    assert sessions().inner.session_ports == {"vnc": 5903, "http": 8003}
    assert sessions().inner.session_ports == {"vnc": 5905, "http": 8005}


def test_a_service_starts_ready_and_stops() -> None:
    port = _free_port()
    command = [sys.executable, str(HERE / "host_envs.py"), str(port)]
    services = start_services(
        [EnvServiceSpec(name="echo", command=command, port=port, env_vars={"MODE": "m"})]
    )
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        assert sock.makefile().readline() == "m None\n"
    stop_services(services)
    assert services[0].process.returncode is not None
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0


def test_a_service_that_exits_or_never_listens_fails_with_its_output() -> None:
    exits = EnvServiceSpec(
        name="crash",
        command=[sys.executable, "-c", "print('no config'); raise SystemExit(3)"],
        port=_free_port(),
    )
    with pytest.raises(EnvBuildError) as caught:
        start_services([exits])
    assert str(caught.value) == (
        "env service 'crash' exited with code 3 before it was ready:\nno config"
    )
    port = _free_port()
    silent = EnvServiceSpec(
        name="silent",
        command=[
            sys.executable,
            "-c",
            "print('warming up', flush=True); import time; time.sleep(60)",
        ],
        port=port,
        ready_timeout_s=0.5,
    )
    with pytest.raises(EnvBuildError) as caught:
        start_services([silent])
    assert str(caught.value) == (
        f"env service 'silent' did not listen on port {port} within its "
        "ready_timeout_s=0.5:\nwarming up"
    )
    assert not [c for c in _children() if "time.sleep(60)" in " ".join(c.cmdline())]  # stopped


def test_the_memory_watchdog_counts_children_and_fires_once() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "b = bytearray(64 * 2**20); b[::4096] = b'x' * len(range(0, len(b), 4096)); "
            "print('ready', flush=True); import time; time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        me = psutil.Process()
        own = me.memory_info().rss
        assert resident_bytes(me) - own >= 64 * 2**20
        fired: list[int] = []
        done = threading.Event()

        def exceeded(used: int) -> None:
            fired.append(used)
            done.set()

        watchdog = MemoryWatchdog(own + 32 * 2**20, exceeded, interval_s=0.01)
        assert done.wait(5.0)
        time.sleep(0.05)
        watchdog.stop()
        assert len(fired) == 1
        assert fired[0] >= own + 64 * 2**20
    finally:
        child.kill()
        child.wait()


def test_a_watchdog_fires_once_at_the_first_failure() -> None:
    answers = iter([None, None, "bad", "worse"])
    fired: list[str] = []
    done = threading.Event()
    Watchdog(lambda: next(answers), lambda f: (fired.append(f), done.set()), interval_s=0.01)
    assert done.wait(5.0)
    time.sleep(0.05)
    assert fired == ["bad"]  # then it stops: "worse" is never read


def test_a_host_whose_server_is_unhealthy_exits_for_ray_to_restart_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the host in this process (no Ray actor): its server's thread pool reports hung calls
    # past its bound, as /health's 503 does; the host then exits (here: records why)
    exits: list[str] = []
    done = threading.Event()
    monkeypatch.setattr(host_module, "_exit_unhealthy", lambda r: (exits.append(r), done.set()))
    monkeypatch.setattr(host_module, "HEALTH_CHECK_INTERVAL_S", 0.01)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # host_envs
    host = EnvHost(HostConfig(entrypoint="host_envs:HostEnv"), 0)
    try:
        time.sleep(0.1)
        assert exits == []  # healthy: it stays
        reason = "2 env calls (step, step) outlived env_step_timeout_s"
        monkeypatch.setattr(EnvThreads, "exhausted", property(lambda self: reason))
        assert host.server.unhealthy == reason
        assert done.wait(5.0)
        assert exits == [reason]
    finally:
        host.shutdown()


class _HealthServer(http.server.ThreadingHTTPServer):
    """Answers ``GET /health`` with ``status`` (and a body saying why)."""

    def __init__(self, status: int) -> None:
        answer = status

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = b"{}" if answer == 200 else b'{"status": "unhealthy"}'
                self.send_response(answer)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def test_a_health_probe_names_each_way_a_host_fails() -> None:
    healthy, unhealthy = _HealthServer(200), _HealthServer(503)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    try:
        assert probe_health(healthy.url, 2.0) is None
        assert probe_health(unhealthy.url, 2.0) == (
            'GET /health answered HTTP 503: {"status": "unhealthy"}'
        )
        silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        assert probe_health(silent_url, 0.3) == "GET /health did not answer within 0.3 s"
        assert time.monotonic() - started < 2.0
        refused = probe_health(f"http://127.0.0.1:{closed_port}", 2.0)
        assert refused is not None
        assert refused.startswith("GET /health failed: ")
    finally:
        for server in (healthy, unhealthy):
            server.shutdown()
            server.server_close()
        silent.close()


def test_the_health_poller_reports_a_host_after_its_failures_in_a_row() -> None:
    healthy, unhealthy = _HealthServer(200), _HealthServer(503)
    targets = [HealthTarget(0, 0, healthy.url), HealthTarget(1, 0, unhealthy.url)]
    failing: list[tuple[HealthTarget, str]] = []
    poller = HealthPoller(
        lambda: list(targets),
        lambda target, why: failing.append((target, why)),
        interval_s=3600.0,  # rounds are driven by hand below
        timeout_s=2.0,
        failures_to_replace=2,
    )
    try:
        poller.poll_once()
        assert failing == []  # one failure is not yet two in a row
        poller.poll_once()
        why = "2 health polls failed in a row; the last: GET /health answered HTTP 503: "
        assert failing == [(targets[1], why + '{"status": "unhealthy"}')]
        poller.poll_once()
        assert len(failing) == 1  # the count starts again after a report
        targets[1] = HealthTarget(1, 1, unhealthy.url)  # restarted: a new generation
        poller.poll_once()
        assert len(failing) == 1  # the new generation's first failure
        targets[1] = HealthTarget(1, 1, healthy.url)
        poller.poll_once()  # a good poll clears the count
        targets[1] = HealthTarget(1, 1, unhealthy.url)
        poller.poll_once()
        assert len(failing) == 1
    finally:
        poller.stop()
        for server in (healthy, unhealthy):
            server.shutdown()
            server.server_close()


def test_importing_the_package_and_the_hosting_path_does_not_import_ray() -> None:
    code = (
        "import sys, agile_llmenvs, agile_llmenvs.hosting, agile_llmenvs.envs.rollout; "
        "print('ray' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_without_ray_a_pool_names_the_extra_to_install() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from agile_llmenvs.hosting import EnvHostPool, HostConfig\n"
        "try:\n"
        "    EnvHostPool(HostConfig(entrypoint='a:B'))\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == (
        "OptionalDependencyError The package 'ray' is needed for env hosts but is not "
        'installed; run: pip install "agile-llmenvs[ray]"'
    ), done.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _children() -> list[psutil.Process]:
    return list(psutil.Process().children(recursive=True))
