"""EnvHostPool: Ray actors each serving the entrypoint env, and the leases sessions hold on them.

The driver side of env hosts. It starts the hosts and waits for them, hands sessions the
least-loaded healthy host, and when a session reports its host lost, asks Ray for the host
again in the background: a restarted host (a new incarnation, at a new URL) takes sessions
again, a host whose restarts are spent is dropped. It also polls each ready host's ``/health``
from outside, and replaces a host that fails ``health_failures_to_replace`` polls in a row.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import Any

from agile_llmenvs.errors import (
    EnvBuildError,
    EnvCapacityError,
    EnvHostError,
    EnvStateError,
    OptionalDependencyError,
)
from agile_llmenvs.hosting.config import HostConfig
from agile_llmenvs.hosting.health import HealthPoller, HealthTarget
from agile_llmenvs.hosting.host import EnvHost, HostInfo
from agile_llmenvs.hosting.local_ray import init_ray

__all__ = ["EnvHostPool", "HostLease", "HostState", "HostStatus"]

logger = logging.getLogger(__name__)


class HostState(Enum):
    """Lifecycle of one host, as the pool sees it."""

    STARTING = "starting"
    READY = "ready"
    RECOVERING = "recovering"  # a session lost it; asking Ray for it again
    DEAD = "dead"  # its restarts are spent, or it did not come back in time


@dataclass(frozen=True)
class HostLease:
    """One session's claim on a host; a lease from before a restart no longer counts."""

    index: int
    url: str
    generation: int


@dataclass(frozen=True)
class HostStatus:
    """A snapshot of one host.

    Attributes:
        index: The host's index in its pool.
        state: Its lifecycle state.
        sessions: Sessions it serves now.
        info: Its address and identity (None: not started yet).
        reason: Why it is dead, or why it was last replaced.
        replacements: Times the pool killed it for failing its ``/health`` polls.
    """

    index: int
    state: HostState
    sessions: int
    info: HostInfo | None
    reason: str = ""
    replacements: int = 0


_COMING = (HostState.STARTING, HostState.RECOVERING)


@dataclass
class _Host:
    index: int
    actor: Any
    state: HostState = HostState.STARTING
    info: HostInfo | None = None
    sessions: int = 0
    generation: int = 0
    reason: str = ""
    replacements: int = 0


class EnvHostPool:
    """``config.num_hosts`` Ray actors, each an :class:`EnvHost`, started and awaited.

    Uses the Ray runtime this process is connected to (``ray.init(address=...)`` before);
    when there is none it connects to ``address``, or to the cluster Ray finds
    (``RAY_ADDRESS``, or one ``ray start`` left on this machine), or starts a local
    single-node cluster that listens on loopback only. :meth:`close` kills the actors.

    Once the hosts are ready, a daemon thread polls each ready host's ``GET /health`` every
    ``config.health_poll_interval_s``; a host that fails ``config.health_failures_to_replace``
    polls in a row is killed and Ray starts a new one (:attr:`replacements` counts them, and
    each is logged with the host and why).

    Args:
        config: What each host serves, and its resources.
        address: Ray address to connect to when Ray is not initialized yet (None: the
            cluster Ray finds, or a new local one).

    Raises:
        OptionalDependencyError: ray is not installed.
        EnvBuildError: a host failed to start, or was not ready within
            ``config.ready_timeout_s`` (the message names it).
    """

    def __init__(self, config: HostConfig, *, address: str | None = None) -> None:
        ray = ray_module()
        init_ray(ray, address)
        self.config = config
        self.closed = False
        self._cond = threading.Condition()
        actor_class = ray.remote(EnvHost)
        self._hosts = [
            _Host(i, actor_class.options(**config.actor_options(i)).remote(config, i))
            for i in range(config.num_hosts)
        ]
        self._poller: HealthPoller | None = None
        try:
            self._await_ready()
        except BaseException:
            self.close()
            raise
        if config.health_poll_interval_s is not None:
            self._poller = HealthPoller(
                self._health_targets,
                self._replace_failing,
                interval_s=config.health_poll_interval_s,
                timeout_s=config.health_poll_timeout_s,
                failures_to_replace=config.health_failures_to_replace,
            )

    @property
    def max_turns(self) -> int | None:
        """The turn budget the env declares (from the first host's probe)."""
        info = self._hosts[0].info
        return info.max_turns if info is not None else None

    @property
    def replacements(self) -> int:
        """Hosts the pool killed (and Ray started anew) for failing their ``/health`` polls."""
        with self._cond:
            return sum(h.replacements for h in self._hosts)

    def status(self) -> list[HostStatus]:
        """Every host's state, live sessions and address."""
        with self._cond:
            return [
                HostStatus(h.index, h.state, h.sessions, h.info, h.reason, h.replacements)
                for h in self._hosts
            ]

    def actor(self, index: int) -> Any:
        """The Ray actor handle of host ``index`` (to inspect it, or kill it in a drill)."""
        return self._hosts[index].actor

    # -- leases ------------------------------------------------------------------------------

    def acquire(self, timeout_s: float | None = None) -> HostLease:
        """Claim a session on the least-loaded ready host (lowest index on ties).

        Waits while a host with room is starting or recovering.

        Args:
            timeout_s: Longest wait (default: the hosts' ready timeout).

        Raises:
            EnvCapacityError: every live host is full, and none is coming back.
            EnvHostError: every host is dead, or no host had room within ``timeout_s``.
            EnvStateError: the pool is closed.
        """
        wait_s = self.config.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        limit = self.config.sessions_per_host
        with self._cond:
            while True:
                if self.closed:
                    raise EnvStateError("the env host pool is closed")
                free = [
                    h
                    for h in self._hosts
                    if h.state is HostState.READY and (limit is None or h.sessions < limit)
                ]
                if free:
                    host = min(free, key=lambda h: (h.sessions, h.index))
                    host.sessions += 1
                    assert host.info is not None
                    return HostLease(host.index, host.info.url, host.generation)
                if not any(h.state in _COMING for h in self._hosts):
                    raise self._no_room_error()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EnvHostError(
                        f"no env host had a free session within {wait_s} s ({self._summary()})"
                    )
                self._cond.wait(remaining)

    def release(self, lease: HostLease) -> None:
        """Give a lease back (a lease from before its host restarted counts for nothing)."""
        with self._cond:
            host = self._hosts[lease.index]
            if lease.generation == host.generation and host.sessions > 0:
                host.sessions -= 1
                self._cond.notify_all()

    def report_lost(self, lease: HostLease) -> None:
        """A session lost its host: stop placing sessions there until Ray answers for it."""
        with self._cond:
            host = self._hosts[lease.index]
            if self.closed or host.state is not HostState.READY:
                return
            if lease.generation != host.generation:
                return  # the host already came back since this lease was taken
            host.state = HostState.RECOVERING
        threading.Thread(
            target=self._recover, args=(host,), name=f"env-host-{host.index}-recover", daemon=True
        ).start()

    def close(self) -> None:
        """Stop every host (its services too) and kill its actor; idempotent."""
        with self._cond:
            if self.closed:
                return
            self.closed = True
            self._cond.notify_all()
        if self._poller is not None:
            self._poller.stop()
        ray = ray_module()
        # a ready host stops its server and services; one still starting is just killed
        # (its services die with its process)
        stopping = [h.actor.shutdown.remote() for h in self._hosts if h.state is HostState.READY]
        if stopping:
            with contextlib.suppress(Exception):
                ray.wait(stopping, num_returns=len(stopping), timeout=5.0)
        for host in self._hosts:
            with contextlib.suppress(Exception):
                ray.kill(host.actor, no_restart=True)

    def __enter__(self) -> EnvHostPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- startup and recovery ----------------------------------------------------------------

    def _await_ready(self) -> None:
        ray = ray_module()
        deadline = time.monotonic() + self.config.ready_timeout_s
        pending = {host.actor.info.remote(): host for host in self._hosts}
        while pending:
            remaining = deadline - time.monotonic()
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(remaining, 0.0))
            if not done:
                raise self._not_ready_error(sorted(h.index for h in pending.values()))
            host = pending.pop(done[0])
            try:
                host.info = ray.get(done[0])
            except ray.exceptions.RayError as exc:
                raise EnvBuildError(
                    f"env host {host.index} of {len(self._hosts)} failed to start: {_cause(exc)}"
                ) from exc
            unreachable = self._unreachable(host.info)
            if unreachable:
                raise EnvBuildError(
                    f"env_host_bind: env host {host.index} of {len(self._hosts)} {unreachable}"
                )
            host.state = HostState.READY

    def _health_targets(self) -> list[HealthTarget]:
        with self._cond:
            return [
                HealthTarget(h.index, h.generation, h.info.url)
                for h in self._hosts
                if h.state is HostState.READY and h.info is not None and not self.closed
            ]

    def _replace_failing(self, target: HealthTarget, failure: str) -> None:
        """Kill a host that failed its health polls; Ray starts it anew, as after a crash."""
        with self._cond:
            host = self._hosts[target.index]
            if self.closed or host.state is not HostState.READY:
                return
            if host.generation != target.generation or host.info is None:
                return  # it came back since it was polled
            host.state, host.reason = HostState.RECOVERING, failure
            host.replacements += 1
            stale = host.info.incarnation
        logger.warning(
            "env host %d (%s) is replaced: %s; killing it so that Ray starts a new one",
            target.index,
            target.url,
            failure,
        )
        with contextlib.suppress(Exception):
            ray_module().kill(host.actor, no_restart=False)
        threading.Thread(
            target=self._recover,
            args=(host, stale),
            name=f"env-host-{host.index}-replace",
            daemon=True,
        ).start()

    def _recover(self, host: _Host, stale: str | None = None) -> None:
        """Ask Ray for the host until it answers, is dead, or the ready timeout passes.

        Args:
            host: The host to ask for.
            stale: The incarnation the pool killed: while it still answers, the host has
                not been restarted yet.
        """
        ray = ray_module()
        errors = ray.exceptions
        deadline = time.monotonic() + self.config.ready_timeout_s
        died = 0
        while not self.closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._mark_dead(host, "it did not come back within env_host_ready_timeout_s")
                with contextlib.suppress(Exception):
                    ray.kill(host.actor, no_restart=True)
                return
            try:
                info = ray.get(host.actor.info.remote(), timeout=min(remaining, 1.0))
            except errors.ActorUnavailableError:  # restarting
                time.sleep(0.1)
            except errors.GetTimeoutError:
                continue
            except errors.RayError as exc:
                died += 1  # a call in flight when the process died says so too: ask again
                if died >= 2:
                    self._mark_dead(host, _cause(exc))
                    return
                time.sleep(0.1)
            else:
                if info.incarnation == stale:
                    time.sleep(0.1)
                    continue
                unreachable = self._unreachable(info)
                if unreachable:
                    self._mark_dead(host, f"after its restart it {unreachable}")
                    with contextlib.suppress(Exception):
                        ray.kill(host.actor, no_restart=True)
                else:
                    self._mark_ready(host, info)
                return

    def _unreachable(self, info: HostInfo) -> str:
        """Why this process cannot reach a host bound to loopback on another node ("": it
        can)."""
        if self.config.bind != "loopback":
            return ""
        here = str(ray_module().util.get_node_ip_address())
        if info.node_ip == here:
            return ""
        return (
            f"runs on the node at {info.node_ip} and binds loopback, so only processes on that "
            f"node reach it, and this one runs on {here}; set env_host_bind: node to serve "
            "sessions across nodes (they still need the pool's token), or place the hosts on "
            "this node (env_host_resource)"
        )

    def _mark_ready(self, host: _Host, info: HostInfo) -> None:
        with self._cond:
            if host.info is None or info.incarnation != host.info.incarnation:
                host.generation += 1  # a restart: the old sessions died with the old process
                host.sessions = 0
            host.info, host.state = info, HostState.READY
            self._cond.notify_all()

    def _mark_dead(self, host: _Host, reason: str) -> None:
        with self._cond:
            host.state, host.reason = HostState.DEAD, reason
            self._cond.notify_all()

    # -- messages ----------------------------------------------------------------------------

    def _summary(self) -> str:
        limit = self.config.sessions_per_host
        parts = []
        for h in self._hosts:
            load = f"{h.sessions}/{limit}" if limit is not None else str(h.sessions)
            detail = f": {h.reason}" if h.reason and h.state is HostState.DEAD else ""
            parts.append(f"host {h.index} {h.state.value}, {load} sessions{detail}")
        return "; ".join(parts)

    def _no_room_error(self) -> Exception:
        if all(h.state is HostState.DEAD for h in self._hosts):
            return EnvHostError(f"every env host is dead ({self._summary()})")
        return EnvCapacityError(
            f"every live env host serves its env_sessions_per_host="
            f"{self.config.sessions_per_host} sessions ({self._summary()}); raise "
            "env_sessions_per_host or env_hosts so that they cover the rollout slots "
            "(batch_size x group_size per rank)"
        )

    def _not_ready_error(self, slow: list[int]) -> EnvBuildError:
        total = len(self._hosts)
        named = (
            f"env host {slow[0]} of {total} was"
            if len(slow) == 1
            else f"env hosts {', '.join(map(str, slow))} of {total} were"
        )
        return EnvBuildError(
            f"env_host_ready_timeout_s: {named} not ready within "
            f"{self.config.ready_timeout_s} s. A host is ready once Ray has placed it (each "
            f"needs {self.config.demand()}; `ray status` shows what the cluster has free), its "
            "env_services listen and it has built one env; give the cluster room, or raise "
            "env_host_ready_timeout_s"
        )


def ray_module() -> ModuleType:
    """The ``ray`` package, imported on first use.

    Raises:
        OptionalDependencyError: ray is not installed.
    """
    try:
        import ray
    except ImportError as exc:
        raise OptionalDependencyError("ray", extra="ray", feature="env hosts") from exc
    return ray


def _cause(exc: BaseException) -> str:
    """The last line of a Ray error: the original exception of a failed actor, if any."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__
