"""What every env host of a pool runs, and with which resources: the hosting fields as data."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from agile_llmenvs.errors import EnvBuildError
from agile_llmenvs.specs import EnvServiceSpec, LLMEnvSpec

__all__ = [
    "DEFAULT_HEALTH_FAILURES_TO_REPLACE",
    "DEFAULT_HEALTH_POLL_INTERVAL_S",
    "DEFAULT_HEALTH_POLL_TIMEOUT_S",
    "DEFAULT_READY_TIMEOUT_S",
    "HOST_INDEX_VAR",
    "LOOPBACK",
    "HostConfig",
]

#: Seconds a host may take to start when ``env_host_ready_timeout_s`` is unset.
DEFAULT_READY_TIMEOUT_S = 120.0
#: Seconds between the pool's polls of each host's ``/health``.
DEFAULT_HEALTH_POLL_INTERVAL_S = 5.0
#: Seconds one ``/health`` poll waits for its answer.
DEFAULT_HEALTH_POLL_TIMEOUT_S = 5.0
#: Failed ``/health`` polls in a row after which the pool replaces a host.
DEFAULT_HEALTH_FAILURES_TO_REPLACE = 3
#: Environment variable holding a host's index (0-based) in its pool, set on every host.
HOST_INDEX_VAR = "AGILE_LLMENVS_ENV_HOST"
#: The interface hosts bind under ``env_host_bind: loopback`` (the default).
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class HostConfig:
    """The env every host serves and the resources each one holds.

    Built from an :class:`~agile_llmenvs.specs.LLMEnvSpec` by :meth:`from_spec`; it travels to
    each Ray actor as its constructor argument, so it holds plain data only.

    Attributes:
        entrypoint: The env's ``module:Class`` (or a registry id handed to ``factory``).
        env_config: Keyword arguments of the env.
        factory: ``module:attr`` callable receiving ``entrypoint``, if any.
        env_packages: Requirements each host checks (and may install) before serving.
        allow_install: Install missing ``env_packages`` on the hosts.
        num_hosts: Hosts in the pool.
        sessions_per_host: Concurrent sessions a host serves (None: unlimited).
        cpus: CPUs each host holds for its lifetime.
        memory_bytes: Memory each host reserves (Ray's ``memory`` resource).
        memory_limit_bytes: Resident memory (the host and its children) past which a host
            is stopped and restarted.
        ready_timeout_s: Seconds a host may take to start (or to come back after a restart).
        services: Sidecar processes started on each host before its env server.
        resource: Custom Ray resource each host needs one unit of.
        env_vars: Environment variables of each host process (and its services).
        port: First port of the env servers: host ``i`` listens on ``port + i`` (None: any).
        session_ports: Named base ports; session ``k`` of host ``i`` gets
            ``base + i * sessions_per_host + k`` as its env's ``session_ports`` argument.
        token: Shared secret the hosts require from clients.
        max_restarts: Restarts Ray grants each host after its process dies (-1: unlimited).
        bind: Interface each host's server binds: ``"loopback"`` (127.0.0.1: only its own
            node reaches it) or ``"node"`` (the node's address, reachable across the cluster).
        health_poll_interval_s: Seconds between the pool's ``GET /health`` polls of each ready
            host (None: no polls).
        health_poll_timeout_s: Seconds a poll waits; no answer in time is a failed poll, as
            is any answer but 200.
        health_failures_to_replace: Failed polls in a row after which the pool kills the host
            and Ray starts a new one (a host too stuck to exit by itself: its event loop
            blocked, its process stopped).
    """

    entrypoint: str
    env_config: dict[str, Any] = field(default_factory=dict)
    factory: str | None = None
    env_packages: dict[str, list[str]] | None = None
    allow_install: bool = False
    num_hosts: int = 1
    sessions_per_host: int | None = None
    cpus: float = 1.0
    memory_bytes: int | None = None
    memory_limit_bytes: int | None = None
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    services: tuple[EnvServiceSpec, ...] = ()
    resource: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    port: int | None = None
    session_ports: dict[str, int] = field(default_factory=dict)
    token: str = field(default_factory=lambda: secrets.token_urlsafe(16), repr=False)
    max_restarts: int = -1
    bind: Literal["loopback", "node"] = "loopback"
    health_poll_interval_s: float | None = DEFAULT_HEALTH_POLL_INTERVAL_S
    health_poll_timeout_s: float = DEFAULT_HEALTH_POLL_TIMEOUT_S
    health_failures_to_replace: int = DEFAULT_HEALTH_FAILURES_TO_REPLACE

    def __post_init__(self) -> None:
        self._check_health_polls()
        if self.session_ports and self.sessions_per_host is None:
            raise EnvBuildError(
                "env_session_ports: each session gets its own ports (base + host * "
                "env_sessions_per_host + session), so set env_sessions_per_host too"
            )
        for index, service in enumerate(self.services):
            if service.image is not None:
                raise EnvBuildError(
                    f"env_services[{index}] ({service.name}): env hosts run services as "
                    f"processes and cannot run the image {service.image!r}; give the service "
                    "a `command` (drop `image`), or serve it elsewhere and pass its address "
                    "in env_vars"
                )
        if self.port is not None and self.port + self.num_hosts - 1 > 65535:
            raise EnvBuildError(
                f"env_port: hosts listen on env_port + host index, and {self.port} + "
                f"{self.num_hosts - 1} is past 65535; pick a lower env_port"
            )
        sessions = self.num_hosts * (self.sessions_per_host or 1)
        for name, base in self.session_ports.items():
            if base + sessions - 1 > 65535:
                raise EnvBuildError(
                    f"env_session_ports: {name!r} needs {sessions} ports from {base} (one per "
                    f"session of every host), past 65535; pick a lower base port"
                )

    def _check_health_polls(self) -> None:
        if self.health_poll_interval_s is not None and self.health_poll_interval_s <= 0:
            raise EnvBuildError(
                f"health_poll_interval_s must be above 0 (or None: no polls), got "
                f"{self.health_poll_interval_s}"
            )
        if self.health_poll_timeout_s <= 0:
            raise EnvBuildError(
                f"health_poll_timeout_s must be above 0, got {self.health_poll_timeout_s}"
            )
        if self.health_failures_to_replace < 1:
            raise EnvBuildError(
                f"health_failures_to_replace must be 1 or more, got "
                f"{self.health_failures_to_replace}"
            )

    @classmethod
    def from_spec(cls, spec: LLMEnvSpec, *, allow_install: bool = False) -> HostConfig:
        """The hosting fields of an entrypoint spec as a host configuration.

        Raises:
            EnvBuildError: the spec has no ``entrypoint``, or its hosting fields cannot work
                together (see the class attributes).
        """
        if spec.entrypoint is None:
            raise EnvBuildError(f"{spec.label!r}: env hosts serve an `entrypoint` env; set one")
        return cls(
            entrypoint=spec.entrypoint,
            env_config=dict(spec.env_config or {}),
            factory=spec.factory,
            env_packages=spec.env_packages,
            allow_install=allow_install,
            num_hosts=spec.env_hosts or 1,
            sessions_per_host=spec.env_sessions_per_host,
            cpus=spec.cpus_per_env_host or 1.0,
            memory_bytes=spec.env_host_memory_bytes,
            memory_limit_bytes=spec.env_host_memory_limit_bytes,
            ready_timeout_s=spec.env_host_ready_timeout_s or DEFAULT_READY_TIMEOUT_S,
            services=tuple(spec.env_services),
            resource=spec.env_host_resource,
            env_vars=dict(spec.env_vars),
            port=spec.env_port,
            session_ports=dict(spec.env_session_ports),
            bind=spec.env_host_bind,
        )

    def bind_host(self, node_ip: str) -> str:
        """The interface a host on the node at ``node_ip`` binds."""
        return LOOPBACK if self.bind == "loopback" else node_ip

    def port_of(self, index: int) -> int:
        """The port host ``index`` listens on (0: any free port)."""
        return 0 if self.port is None else self.port + index

    def session_ports_of(self, index: int, session: int) -> dict[str, int]:
        """The named ports of session ``session`` on host ``index``."""
        stride = self.sessions_per_host or 1
        return {name: base + index * stride + session for name, base in self.session_ports.items()}

    def demand(self) -> dict[str, float]:
        """The Ray resources one host holds, for messages."""
        demand: dict[str, float] = {"CPU": self.cpus}
        if self.memory_bytes is not None:
            demand["memory"] = float(self.memory_bytes)
        if self.resource is not None:
            demand[self.resource] = 1.0
        return demand

    def actor_options(self, index: int) -> dict[str, Any]:
        """Ray actor options of host ``index``: resources, restarts and environment."""
        options: dict[str, Any] = {
            "num_cpus": self.cpus,
            "max_restarts": self.max_restarts,
            "max_task_retries": 0,
            "runtime_env": {"env_vars": {**self.env_vars, HOST_INDEX_VAR: str(index)}},
        }
        if self.memory_bytes is not None:
            options["memory"] = self.memory_bytes
        if self.resource is not None:
            options["resources"] = {self.resource: 1}
        return options
