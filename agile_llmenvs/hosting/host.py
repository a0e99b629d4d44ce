"""EnvHost: the body of one Ray actor, serving the pool's entrypoint env over ``/ws``.

This module runs inside the actor's process; it never imports ray at module level, so it
can also be read, typed and tested without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from agile_llmenvs.errors import EnvBuildError
from agile_llmenvs.hosting.config import HostConfig
from agile_llmenvs.hosting.services import ServiceProcess, start_services, stop_services
from agile_llmenvs.transport._openenv import Environment
from agile_llmenvs.transport.resolve import ensure_env_packages, env_factory
from agile_llmenvs.transport.server import OpenEnvServer
from agile_llmenvs.transport.wrapper import OpenEnvWrapper

__all__ = ["EnvHost", "HostInfo", "MemoryWatchdog", "Watchdog"]

#: Seconds between a host's checks of its own env server's health.
HEALTH_CHECK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class HostInfo:
    """What a started host reports to its pool.

    Attributes:
        index: The host's index in its pool.
        url: Base URL of its env server.
        incarnation: A fresh id per start: a different one means the host was restarted.
        pid: The host's process id.
        node_ip: The address of the node the host runs on.
        max_turns: The turn budget the env declares (None: none).
    """

    index: int
    url: str
    incarnation: str
    pid: int
    node_ip: str
    max_turns: int | None


class EnvHost:
    """One env host: sidecar services, then an :class:`OpenEnvServer` serving a fresh env
    per ``/ws`` session, at most ``sessions_per_host`` at once.

    The server binds loopback (``config.bind == "loopback"``, the default: processes on the
    same node only) or the node's own address (``"node"``), never every interface; its URL
    is the address it binds.

    Before the host reports ready it builds (and closes) one env, so an entrypoint that
    cannot be imported or built fails at startup, on the host, with its own error.

    Args:
        config: What to serve and how.
        index: The host's index in its pool (also in its ``AGILE_LLMENVS_ENV_HOST`` variable).
    """

    def __init__(self, config: HostConfig, index: int) -> None:
        self.config, self.index = config, index
        self.incarnation = uuid.uuid4().hex
        # Ray workers log at INFO: keep one line per session open/close out of the driver's log
        logging.getLogger("websockets").setLevel(logging.WARNING)
        self.services: list[ServiceProcess] = start_services(config.services)
        try:
            ensure_env_packages(config.env_packages, allow_install=config.allow_install)
            self.sessions = SessionEnvs(config, index)
            max_turns = _probe_max_turns(self.sessions)
            node_ip = _node_ip()
            self.server = OpenEnvServer(
                make_env=self.sessions,
                host=config.bind_host(node_ip),  # never every interface
                port=config.port_of(index),
                env_name=config.entrypoint,
                max_concurrent_envs=config.sessions_per_host,
                token=config.token,
            )
        except BaseException:
            stop_services(self.services)
            raise
        self.info_ = HostInfo(
            index, self.server.url, self.incarnation, os.getpid(), node_ip, _int(max_turns)
        )
        self.watchdog: MemoryWatchdog | None = None
        if config.memory_limit_bytes is not None:
            limit = config.memory_limit_bytes
            self.watchdog = MemoryWatchdog(limit, on_exceeded=lambda used: _exit_host(used, limit))
        # a server whose hung env calls used up its threads answers /health with 503: the
        # host exits, so that Ray restarts it as it restarts a host over its memory limit
        server = self.server
        self.health = Watchdog(
            lambda: server.unhealthy,
            _exit_unhealthy,
            interval_s=HEALTH_CHECK_INTERVAL_S,
            name="health-watchdog",
        )

    def info(self) -> HostInfo:
        """The host's address and identity."""
        return self.info_

    def shutdown(self) -> None:
        """Stop serving (open sessions are closed) and stop the services."""
        if self.watchdog is not None:
            self.watchdog.stop()
        self.health.stop()
        self.server.close()
        stop_services(self.services)


class SessionEnvs:
    """Builds each session's env; with ``session_ports``, hands each live session its own.

    Session ``k`` (the lowest index no live session holds) of host ``i`` receives
    ``session_ports={name: base + i * sessions_per_host + k}`` as a keyword argument; the
    index is free again when the session's env is closed.

    Args:
        config: The entrypoint, its ``env_config`` and the session ports.
        index: The host's index in its pool.
    """

    def __init__(self, config: HostConfig, index: int) -> None:
        self.config, self.index = config, index
        self._lock = threading.Lock()
        self._taken: set[int] = set()
        self._build = env_factory(config.entrypoint, config.env_config, factory=config.factory)

    def __call__(self) -> Any:
        """A fresh env for one session."""
        if not self.config.session_ports:
            return self._build()
        with self._lock:
            session = min(set(range(len(self._taken) + 1)) - self._taken)
            self._taken.add(session)
        try:
            ports = self.config.session_ports_of(self.index, session)
            kwargs = {**self.config.env_config, "session_ports": ports}
            env = env_factory(self.config.entrypoint, kwargs, factory=self.config.factory)()
            if isinstance(env, Environment):
                raise EnvBuildError(
                    f"env_session_ports: {self.config.entrypoint!r} builds an OpenEnv "
                    "Environment; session ports are handed to text envs only"
                )
        except BaseException:
            self._release(session)
            raise
        return _PortedEnv(env, lambda: self._release(session))

    def _release(self, session: int) -> None:
        with self._lock:
            self._taken.discard(session)


class _PortedEnv(OpenEnvWrapper):
    """A session's env that gives its session index back when closed."""

    def __init__(self, inner: Any, release: Callable[[], None]) -> None:
        super().__init__(inner, owns_inner=True)
        self._release = release

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._release()


class Watchdog:
    """Calls ``on_failure`` once ``check`` returns something other than None (checked every
    ``interval_s`` on a daemon thread); then it stops.

    Args:
        check: What is wrong now (None: nothing).
        on_failure: Called with what ``check`` returned; a host exits, and Ray restarts it.
        interval_s: Seconds between checks.
        name: The thread's name.
    """

    def __init__(
        self,
        check: Callable[[], Any],
        on_failure: Callable[[Any], None],
        *,
        interval_s: float,
        name: str = "watchdog",
    ) -> None:
        self.check, self.on_failure, self.interval_s = check, on_failure, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching."""
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            failure = self.check()
            if failure is not None:
                self.on_failure(failure)
                return


class MemoryWatchdog(Watchdog):
    """Calls ``on_exceeded`` once the process and its children hold more than ``limit_bytes``
    of resident memory (checked every ``interval_s`` on a daemon thread).

    Args:
        limit_bytes: The resident-memory limit.
        on_exceeded: Called with the measured bytes; a host exits, and Ray restarts it.
        interval_s: Seconds between checks.
    """

    def __init__(
        self, limit_bytes: int, on_exceeded: Callable[[int], None], interval_s: float = 0.2
    ) -> None:
        self.limit_bytes = limit_bytes
        process = psutil.Process()

        def over_limit() -> int | None:
            used = resident_bytes(process)
            return used if used > limit_bytes else None

        super().__init__(over_limit, on_exceeded, interval_s=interval_s, name="memory-watchdog")


def resident_bytes(process: psutil.Process) -> int:
    """Resident memory of ``process`` and all its descendants."""
    total = 0
    for member in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += member.memory_info().rss
    return total


def _probe_max_turns(sessions: SessionEnvs) -> Any:
    """Build one env (so a broken entrypoint fails at startup) and read its turn budget, as
    :func:`~agile_llmenvs.llm_envs.from_spec.env_turn_budget` does (None: an OpenEnv env
    that advertises none, which the rollout factory then reports)."""
    from agile_llmenvs.errors import EnvBuildError
    from agile_llmenvs.llm_envs.from_spec import env_turn_budget

    probe = sessions()
    env = probe.inner if isinstance(probe, _PortedEnv) else probe
    try:
        return env_turn_budget(env, label=type(env).__name__)
    except EnvBuildError:
        return None
    finally:
        close = getattr(probe, "close", None)
        if callable(close):
            close()


def _exit_host(used: int, limit: int) -> None:
    print(
        f"env host: resident memory of {used} bytes is over env_host_memory_limit_bytes="
        f"{limit}; exiting so that Ray restarts this host",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def _exit_unhealthy(reason: str) -> None:
    print(
        f"env host: its env server is unhealthy ({reason}); exiting so that Ray restarts this host",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


def _int(value: Any) -> int | None:
    return int(value) if value else None
