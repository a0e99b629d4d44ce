"""The local Ray cluster a pool starts for itself listens on loopback only."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from agile_llmenvs.hosting.local_ray import init_ray

HERE = Path(__file__).resolve().parent

# A fresh process: the pool must start the cluster itself, with ray imported before it (as a
# user's script does). It prints every listening socket of itself and of its descendants (the
# GCS, the raylet, its agents and the workers, the hosts among them).
LISTENERS = textwrap.dedent(
    """
    import json, os, psutil, ray
    from ray._private import ray_constants
    from agile_llmenvs.hosting import EnvHostPool, HostConfig

    with EnvHostPool(HostConfig(entrypoint="host_envs:HostEnv", cpus=0.5)) as pool:
        listeners = []
        for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
            try:
                name = process.name()
                sockets = process.net_connections(kind="inet")
            except psutil.NoSuchProcess:
                continue
            listeners += [
                [name, s.laddr.ip, s.laddr.port] for s in sockets if s.status == psutil.CONN_LISTEN
            ]
        print(json.dumps({
            "node_ip": ray.util.get_node_ip_address(),
            "host_url": pool.status()[0].info.url,
            "listeners": listeners,
            "cluster_flag": ray_constants.ENABLE_RAY_CLUSTER,
            "flag_var": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"),
        }))
    ray.shutdown()
    """
)


@pytest.mark.ray
def test_the_local_cluster_a_pool_starts_listens_on_loopback_only() -> None:
    pytest.importorskip("ray", reason="needs the `ray` extra")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    env["RAY_AUTH_MODE"] = "disabled"
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    done = subprocess.run(
        [sys.executable, "-c", LISTENERS],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    listeners = [tuple(entry) for entry in report["listeners"]]
    names = {name for name, _, _ in listeners}
    assert {"gcs_server", "raylet"} <= names, listeners
    assert any(name.startswith("ray::") for name in names), listeners  # the workers
    exposed = [entry for entry in listeners if not _loopback(entry[1])]
    assert exposed == [], f"listening beyond loopback: {exposed} (all: {listeners})"
    assert report["node_ip"] == "127.0.0.1"
    assert report["host_url"].startswith("http://127.0.0.1:")
    # Ray's switch is set only while the cluster starts, and the environment is left alone
    assert report["cluster_flag"] is True
    assert report["flag_var"] is None


def test_a_cluster_to_connect_to_is_used_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray", reason="needs the `ray` extra")
    from ray._private import ray_constants, services

    calls: list[tuple[str | None, bool]] = []
    fake = _FakeRay(calls, node_ip="10.0.0.5")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    init_ray(fake, None)  # type: ignore[arg-type]
    monkeypatch.delenv("RAY_ADDRESS")
    init_ray(fake, "10.0.0.5:6379")  # type: ignore[arg-type]
    # a cluster `ray start` left on this machine, which ray.init() would find
    monkeypatch.setattr(services, "canonicalize_bootstrap_address", lambda *_: "10.0.0.5:6379")
    init_ray(fake, None)  # type: ignore[arg-type]
    cluster_flag = ray_constants.ENABLE_RAY_CLUSTER
    assert calls == [(None, cluster_flag), ("10.0.0.5:6379", cluster_flag), (None, cluster_flag)]
    fake.initialized = True
    init_ray(fake, "10.0.0.5:6379")  # type: ignore[arg-type]
    assert len(calls) == 3


def test_a_new_cluster_starts_in_local_only_mode_and_warns_if_it_is_not(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("ray", reason="needs the `ray` extra")
    from ray._private import ray_constants, services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "canonicalize_bootstrap_address", lambda *_: None)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    calls: list[tuple[str | None, bool]] = []
    init_ray(_FakeRay(calls, node_ip="127.0.0.1"), None)  # type: ignore[arg-type]
    assert calls == [("local", False)]
    assert ray_constants.ENABLE_RAY_CLUSTER is True
    assert caplog.records == []
    init_ray(_FakeRay(calls, node_ip="192.0.2.7"), None)  # type: ignore[arg-type]
    assert [record.getMessage() for record in caplog.records] == [
        "the local Ray cluster started for the env hosts has the node address 192.0.2.7, so "
        "its GCS, raylet and workers listen on every interface (Ray 0.0-fake); to choose how "
        "Ray listens, start it yourself before the pool (`ray.init(...)`, or `ray start` and "
        "RAY_ADDRESS)"
    ]


class _FakeRay:
    """The few members of ``ray`` that ``init_ray`` uses; records each ``init`` call's
    address, with Ray's cluster flag as the call saw it."""

    __version__ = "0.0-fake"

    def __init__(self, calls: list[tuple[str | None, bool]], *, node_ip: str) -> None:
        self.calls = calls
        self.initialized = False
        self.util = SimpleNamespace(get_node_ip_address=lambda: node_ip)

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, *, address: str | None) -> None:
        from ray._private import ray_constants

        self.calls.append((address, ray_constants.ENABLE_RAY_CLUSTER))


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback
