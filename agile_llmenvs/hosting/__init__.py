"""Env hosts: an entrypoint env served by Ray actors, beyond one machine.

The hosting fields of an :class:`~agile_llmenvs.specs.LLMEnvSpec` (``env_hosts``,
``env_sessions_per_host``, ``cpus_per_env_host``, ...) make
:func:`~agile_llmenvs.envs.make_rollout_env_factory` return a :class:`HostedHarnessFactory`:
each host is a Ray actor running an :class:`~agile_llmenvs.transport.server.OpenEnvServer`,
and sessions spread over the hosts, least-loaded first. ``ray`` is imported only when a pool
starts, so importing this package does not need it.
"""

from __future__ import annotations

from agile_llmenvs.hosting.client import HostedEnvClient
from agile_llmenvs.hosting.config import HOST_INDEX_VAR, HostConfig
from agile_llmenvs.hosting.factory import HostedHarnessFactory
from agile_llmenvs.hosting.host import EnvHost, HostInfo
from agile_llmenvs.hosting.pool import EnvHostPool, HostLease, HostState, HostStatus

__all__ = [
    "HOST_INDEX_VAR",
    "EnvHost",
    "EnvHostPool",
    "HostConfig",
    "HostInfo",
    "HostLease",
    "HostState",
    "HostStatus",
    "HostedEnvClient",
    "HostedHarnessFactory",
]
