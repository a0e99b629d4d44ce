"""Env hosts on a real local Ray cluster: spreading, readiness, host death, resources."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from agile_llmenvs.envs import make_rollout_env_factory
from agile_llmenvs.errors import EnvAuthError, EnvBuildError, EnvCapacityError, EnvHostError
from agile_llmenvs.hosting import (
    HOST_INDEX_VAR,
    EnvHostPool,
    HostConfig,
    HostedEnvClient,
    HostedHarnessFactory,
    HostState,
)
from agile_llmenvs.llm_envs import RolloutCollector
from agile_llmenvs.specs import LLMEnvSpec
from agile_llmenvs.transport.remote import RemoteEnvClient

ray = pytest.importorskip("ray", reason="needs the `ray` extra")

pytestmark = pytest.mark.ray

HERE = Path(__file__).resolve().parent
EOS = 2
CLUSTER_CPUS = 2.0


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """One local cluster for the module; its workers import the test envs of this folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "disabled")
        path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
        ray.init(
            num_cpus=int(CLUSTER_CPUS),
            resources={"sandbox": 1},
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
        yield
        try:
            assert _wait_for(lambda: ray.available_resources().get("CPU") == CLUSTER_CPUS)
        finally:
            ray.shutdown()


@pytest.fixture(autouse=True)
def no_leaked_hosts(ray_cluster: None) -> Iterator[None]:
    """Every test gives back the CPUs its own hosts held: no actor outlives its pool."""
    before = ray.available_resources().get("CPU")
    yield
    assert _wait_for(lambda: ray.available_resources().get("CPU") == before), (
        f"hosts leaked: {ray.available_resources()}, {before} CPUs were free before"
    )


@pytest.fixture(scope="module")
def two_hosts(ray_cluster: None, tokenizer: Any) -> Iterator[HostedHarnessFactory]:
    """2 hosts x 4 sessions, from the manifest fields, shared by the collector tests."""
    spec = LLMEnvSpec(
        env_type="rollout",
        entrypoint="host_envs:HostEnv",
        env_hosts=2,
        env_sessions_per_host=4,
        cpus_per_env_host=0.5,
        env_host_ready_timeout_s=60,
        request_timeout_s=30,
    )
    factory, max_turns = make_rollout_env_factory(spec, tokenizer)
    assert isinstance(factory, HostedHarnessFactory)
    assert max_turns == 2  # probed on a host
    yield factory
    factory.close()


def says_the_row(tokenizer: Any, before_first: Callable[[], None] | None = None) -> Any:
    """A policy answering each context with its row number; calls ``before_first`` once."""
    pending = [before_first] if before_first else []

    def generate(contexts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        while pending:
            pending.pop()()
        out = []
        for context in contexts:
            row = re.findall(r"[Ss]ay (\d+)\.", tokenizer.decode(context))[-1]
            ids = [*tokenizer.encode(row, add_special_tokens=False), EOS]
            out.append((ids, [-0.5] * len(ids)))
        return out

    return generate


def test_a_collector_over_two_hosts_collects_full_groups(
    two_hosts: HostedHarnessFactory, tokenizer: Any
) -> None:
    collector = RolloutCollector(two_hosts, batch_size=2, group_size=4, base_seed=0)
    batch = collector.collect(says_the_row(tokenizer))
    assert batch.failed == 0
    assert [t.group for t in batch.trajectories] == [0, 0, 0, 0, 1, 1, 1, 1]
    for group in batch.groups():
        assert len({t.task for t in group}) == 1
    assert [t.reward for t in batch.trajectories] == [2.0] * 8  # right on both turns
    served_by = Counter(t.episode.info["host"] for t in batch.trajectories)
    assert served_by == {0: 4, 1: 4}  # least-loaded: the sessions fill both hosts evenly
    assert [s.sessions for s in two_hosts.pool.status()] == [4, 4]
    collector.close()
    assert [s.sessions for s in two_hosts.pool.status()] == [0, 0]


def test_a_killed_host_fails_only_its_episodes_and_the_next_collection_recovers(
    two_hosts: HostedHarnessFactory, tokenizer: Any
) -> None:
    pool = two_hosts.pool
    collector = RolloutCollector(two_hosts, batch_size=2, group_size=4, base_seed=0)
    first = collector.collect(says_the_row(tokenizer))
    assert first.failed == 0
    pids = {t.episode.info["host"]: t.episode.info["pid"] for t in first.trajectories}
    old_pid, old_url = pids[0], pool.status()[0].info.url  # type: ignore[union-attr]

    def kill_host_0() -> None:  # after every reset, before the first step
        ray.kill(pool.actor(0), no_restart=False)
        assert _wait_for(lambda: not _alive(old_pid))

    second = collector.collect(says_the_row(tokenizer, before_first=kill_host_0))
    failed = [t for t in second.trajectories if t.failed]
    assert second.failed == 4
    assert {t.episode.info["host"] for t in failed} == {0}
    assert all(not t.failed for t in second.trajectories if t.episode.info["host"] == 1)
    for trajectory in failed:
        assert trajectory.episode.info["error"].startswith(
            f"EnvHostError: env host 0 ({old_url}) "
            "dropped the session during 'step'; the episode is over and the next reset "
            "moves to a healthy host"
        )
    assert [t.reward for t in second.trajectories if not t.failed] == [2.0] * 4

    third = collector.collect(says_the_row(tokenizer))  # waits for Ray to restart host 0
    assert third.failed == 0
    assert Counter(t.episode.info["host"] for t in third.trajectories) == {0: 4, 1: 4}
    now = {t.episode.info["host"]: t.episode.info["pid"] for t in third.trajectories}
    assert now[0] != old_pid  # a new process
    assert now[1] == pids[1]  # the healthy host kept its sessions
    assert [s.state for s in pool.status()] == [HostState.READY, HostState.READY]
    collector.close()


def test_a_dead_host_sends_new_sessions_to_the_healthy_one(ray_cluster: None) -> None:
    config = HostConfig(entrypoint="host_envs:HostEnv", num_hosts=2, sessions_per_host=2, cpus=0.5)
    with EnvHostPool(config) as pool:
        first, second, third = (HostedEnvClient(pool) for _ in range(3))
        reply = first.reset(row_index=1)
        assert reply.metadata["host"] == 0
        assert second.reset(row_index=2).metadata["host"] == 1
        ray.kill(pool.actor(0), no_restart=True)  # restarts spent
        assert _wait_for(lambda: not _alive(reply.metadata["pid"]))
        with pytest.raises(EnvHostError, match=r"env host 0 \(.*\) dropped the session"):
            first.step("1")
        assert first.reset(row_index=1).metadata["host"] == 1
        assert _wait_for(lambda: pool.status()[0].state is HostState.DEAD)
        status = pool.status()
        assert status[0].reason == "The actor is dead because it was killed by `ray.kill`."
        assert status[1].sessions == 2
        message = (
            "every live env host serves its env_sessions_per_host=2 sessions (host 0 dead, "
            "0/2 sessions: The actor is dead because it was killed by `ray.kill`.; host 1 "
            "ready, 2/2 sessions); raise env_sessions_per_host or env_hosts so that they "
            "cover the rollout slots (batch_size x group_size per rank)"
        )
        with pytest.raises(EnvCapacityError, match=re.escape(message)):
            third.reset()
        for client in (first, second, third):
            client.close()


def test_readiness_timeout_names_the_slow_host(ray_cluster: None, tokenizer: Any) -> None:
    spec = LLMEnvSpec(
        env_type="rollout",
        entrypoint="host_envs:SlowStartEnv",
        env_config={"slow_host": 1, "delay_s": 120},
        env_hosts=2,
        cpus_per_env_host=0.5,
        env_host_ready_timeout_s=8,
    )
    message = (
        "env_host_ready_timeout_s: env host 1 of 2 was not ready within 8.0 s. A host is "
        "ready once Ray has placed it (each needs {'CPU': 0.5}; `ray status` shows what the "
        "cluster has free), its env_services listen and it has built one env; give the "
        "cluster room, or raise env_host_ready_timeout_s"
    )
    with pytest.raises(EnvBuildError, match=re.escape(message)):
        make_rollout_env_factory(spec, tokenizer)


def test_unplaceable_hosts_and_a_broken_env_fail_at_startup(
    ray_cluster: None, tokenizer: Any
) -> None:
    spec = LLMEnvSpec(
        env_type="rollout",
        entrypoint="host_envs:HostEnv",
        env_hosts=2,
        cpus_per_env_host=0.5,
        env_host_resource="gpu-sandbox",  # no node has it
        env_host_ready_timeout_s=1,
    )
    with pytest.raises(
        EnvBuildError,
        match=re.escape(
            "env hosts 0, 1 of 2 were not ready within 1.0 s. A host is ready once Ray has "
            "placed it (each needs {'CPU': 0.5, 'gpu-sandbox': 1.0};"
        ),
    ):
        make_rollout_env_factory(spec, tokenizer)
    broken = LLMEnvSpec(
        env_type="rollout", entrypoint="host_envs:BrokenEnv", env_hosts=1, cpus_per_env_host=0.5
    )
    with pytest.raises(
        EnvBuildError,
        match=re.escape("env host 0 of 1 failed to start: RuntimeError: this env needs a GPU"),
    ):
        make_rollout_env_factory(broken, tokenizer)


def test_an_openenv_env_on_hosts_needs_a_turn_budget_in_the_manifest(
    ray_cluster: None, tokenizer: Any
) -> None:
    fields: dict[str, Any] = {
        "env_type": "rollout",
        "entrypoint": "host_envs:native_env",
        "env_hosts": 1,
        "cpus_per_env_host": 0.5,
        "action_field": "message",
    }
    with pytest.raises(EnvBuildError) as unknown:
        make_rollout_env_factory(LLMEnvSpec(**fields), tokenizer)
    assert str(unknown.value) == (
        "env.max_turns: the env 'host_envs:native_env' on the env hosts does not advertise a "
        "turn budget (its state has no `max_turns`), so an episode's length is unknown; set "
        "`max_turns` in the manifest's env section to the turns an episode may take (e.g. "
        "`max_turns: 3`)"
    )
    factory, max_turns = make_rollout_env_factory(LLMEnvSpec(**fields, max_turns=3), tokenizer)
    try:
        assert max_turns == 3
    finally:
        factory.close()  # type: ignore[attr-defined]


def test_resources_env_vars_services_and_ports_reach_the_host(
    ray_cluster: None, tokenizer: Any
) -> None:
    env_port, service_port = _free_port(), _free_port()
    spec = LLMEnvSpec(
        env_type="rollout",
        entrypoint="host_envs:HostEnv",
        env_config={"report_vars": ["MODE", HOST_INDEX_VAR], "service_port": service_port},
        env_hosts=1,
        env_sessions_per_host=2,
        cpus_per_env_host=0.5,
        env_host_memory_bytes=64 * 2**20,
        env_host_resource="sandbox",
        env_vars={"MODE": "fast"},
        env_port=env_port,
        env_session_ports={"vnc": 5900},
        env_services=[
            {
                "name": "echo",
                "command": [sys.executable, str(HERE / "host_envs.py"), str(service_port)],
                "port": service_port,
                "env_vars": {"SERVICE_NAME": "echo"},
            }
        ],
    )
    factory, _ = make_rollout_env_factory(spec, tokenizer)
    assert isinstance(factory, HostedHarnessFactory)
    try:
        harnesses = [factory() for _ in range(3)]
        infos = []
        for harness in harnesses[:2]:
            harness.reset(row_index=0)
            infos.append(harness.info)
        assert harnesses[0].client.url == f"ws://127.0.0.1:{env_port}/ws"  # loopback
        for info in infos:
            assert info["environ"] == {"MODE": "fast", HOST_INDEX_VAR: "0"}
            assert info["resources"] == {"CPU": 0.5, "memory": 64.0 * 2**20, "sandbox": 1.0}
            assert info["service"] == "fast echo"  # the host's variables, then its own
        assert sorted(i["session_ports"]["vnc"] for i in infos) == [5900, 5901]
        with pytest.raises(EnvCapacityError, match="serves its env_sessions_per_host=2"):
            harnesses[2].reset(row_index=0)
        stranger = RemoteEnvClient(harnesses[0].client.url)  # a process without the token
        with pytest.raises(EnvAuthError, match=r"refused the session \(HTTP 403\)"):
            stranger.reset()
        ray.kill(factory.pool.actor(0), no_restart=True)  # services die with their host
        assert _wait_for(lambda: not _accepts(service_port))
    finally:
        factory.close()


def test_a_host_over_its_memory_limit_is_restarted(ray_cluster: None) -> None:
    config = HostConfig(entrypoint="host_envs:HostEnv", cpus=0.5, memory_limit_bytes=400 * 2**20)
    with EnvHostPool(config) as pool, HostedEnvClient(pool) as client:
        old_pid = client.reset(row_index=3).metadata["pid"]

        def grow_past_the_limit() -> None:
            client.step("grow:500")  # the watchdog ends the host during or after this step
            assert _wait_for(lambda: not _alive(old_pid))
            client.step("3")

        with pytest.raises(EnvHostError, match=r"env host 0 \(.*\) dropped the session"):
            grow_past_the_limit()
        assert not _alive(old_pid)
        new_pid = client.reset(row_index=3).metadata["pid"]  # on the restarted host
        assert new_pid != old_pid
        assert pool.status()[0].state is HostState.READY


def test_a_stopped_host_fails_its_health_polls_and_is_replaced(
    ray_cluster: None, caplog: pytest.LogCaptureFixture
) -> None:
    config = HostConfig(
        entrypoint="host_envs:HostEnv",
        cpus=0.5,
        health_poll_interval_s=0.5,
        health_poll_timeout_s=1.0,
        health_failures_to_replace=3,
    )
    with EnvHostPool(config) as pool, HostedEnvClient(pool, timeout_s=30) as client:
        old_pid = client.reset(row_index=3).metadata["pid"]
        old_url = pool.status()[0].info.url  # type: ignore[union-attr]
        assert pool.replacements == 0
        os.kill(old_pid, signal.SIGSTOP)  # too stuck to run its own watchdog, or to exit
        try:
            assert _wait_for(lambda: pool.replacements == 1, timeout_s=30.0)
            assert _wait_for(lambda: not _alive(old_pid), timeout_s=30.0)
        finally:
            if _alive(old_pid):
                os.kill(old_pid, signal.SIGCONT)
        assert _wait_for(lambda: pool.status()[0].state is HostState.READY, timeout_s=60.0)
        status = pool.status()[0]
        assert status.replacements == 1
        assert status.info is not None
        assert status.info.pid != old_pid
        assert status.reason == (
            "3 health polls failed in a row; the last: GET /health did not answer within 1.0 s"
        )
        replaced = [r.getMessage() for r in caplog.records if "is replaced" in r.getMessage()]
        assert replaced == [
            f"env host 0 ({old_url}) is replaced: {status.reason}; killing it so that Ray "
            "starts a new one"
        ]
        reply = client.reset(row_index=4)  # the next episode, on the new host
        assert reply.metadata["pid"] == status.info.pid
        assert client.step("4").reward == 1.0
        assert pool.replacements == 1  # a healthy host is left alone


@pytest.mark.parametrize("bind", ["loopback", "node"])
def test_hosts_bind_loopback_unless_the_manifest_asks_for_the_node(
    ray_cluster: None, tokenizer: Any, bind: str
) -> None:
    fields = {} if bind == "loopback" else {"env_host_bind": "node"}
    spec = LLMEnvSpec(
        env_type="rollout", entrypoint="host_envs:HostEnv", cpus_per_env_host=0.5, **fields
    )
    factory, _ = make_rollout_env_factory(spec, tokenizer)
    assert isinstance(factory, HostedHarnessFactory)
    try:
        info = factory.pool.status()[0].info
        assert info is not None
        port = int(info.url.rsplit(":", 1)[1])
        address = "127.0.0.1" if bind == "loopback" else info.node_ip
        listening = {
            (conn.laddr.ip, conn.laddr.port)
            for conn in psutil.Process(info.pid).net_connections(kind="inet")
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
        }
        assert listening == {(address, port)}  # never 0.0.0.0
        assert info.url == f"http://{address}:{port}"
        harness = factory()  # and the address it advertises is the one a client dials
        harness.reset(row_index=1)
        assert harness.client.url == f"ws://{address}:{port}/ws"
    finally:
        factory.close()


def test_a_loopback_host_on_another_node_fails_the_build(
    ray_cluster: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.255.0.1")  # the driver's
    config = HostConfig(entrypoint="host_envs:HostEnv", cpus=0.5)
    with pytest.raises(EnvBuildError) as raised:
        EnvHostPool(config)
    node_ip = re.search(r"runs on the node at (\S+) and", str(raised.value))
    assert node_ip is not None
    assert str(raised.value) == (
        f"env_host_bind: env host 0 of 1 runs on the node at {node_ip[1]} and binds loopback, "
        "so only processes on that node reach it, and this one runs on 10.255.0.1; set "
        "env_host_bind: node to serve sessions across nodes (they still need the pool's "
        "token), or place the hosts on this node (env_host_resource)"
    )


def _wait_for(condition: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0
