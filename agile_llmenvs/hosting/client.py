"""HostedEnvClient: one env session on a pool's env hosts, moving host when its host dies."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from agile_llmenvs.errors import (
    EnvCapacityError,
    EnvConnectionError,
    EnvHostError,
    EnvStateError,
    EnvTimeoutError,
)
from agile_llmenvs.hosting.pool import EnvHostPool, HostLease
from agile_llmenvs.transport.remote import ClientState, RemoteEnvClient
from agile_llmenvs.transport.types import EnvReply

__all__ = ["HostedEnvClient"]

_CONNECT_TIMEOUT_S = 5.0  # a host is known to be up when leased: failing fast finds another


class HostedEnvClient:
    """An env client whose session lives on the least-loaded healthy host of a pool.

    The session (and so the env instance) stays on its host from one episode to the next.
    When the host dies, the open episode fails with :class:`~agile_llmenvs.errors.EnvHostError`
    and the pool is told; the next :meth:`reset` opens a session on a healthy host, waiting
    while the pool has none with room but one is restarting. A reset that finds its idle
    session gone moves on the same way, since no episode was in flight.

    Args:
        pool: The hosts.
        timeout_s: Per-message timeout (None: unbounded).
        action_field: Action field carrying the model's text.
    """

    def __init__(
        self, pool: EnvHostPool, *, timeout_s: float | None = None, action_field: str = "message"
    ) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.action_field = action_field
        self.lease: HostLease | None = None
        self._session: RemoteEnvClient | None = None
        self._closed = False

    @property
    def url(self) -> str:
        """The ``/ws`` URL of the current session ('' before the first reset)."""
        return self._session.url if self._session is not None else ""

    def reset(self, *, seed: int | None = None, **task: Any) -> EnvReply:
        """Start an episode, on a healthy host when the session's host is gone.

        Raises:
            EnvHostError: no host could take the session (every host dead, or none with room
                within the hosts' ready timeout).
            EnvCapacityError: every live host is full.
        """
        if self._closed:
            raise EnvStateError("reset() after close()")
        session = self._session
        if session is not None and session.state_ not in (ClientState.LOST, ClientState.IDLE):
            try:
                return session.reset(seed=seed, **task)
            except EnvTimeoutError:
                raise
            except EnvConnectionError:
                self._report_lost()
        return self._reset_on_new_host(seed, task)

    def step(self, text: str) -> EnvReply:
        """Send the policy's text.

        Raises:
            EnvHostError: the host dropped the session (it died); the episode is over.
        """
        return self._call(lambda session: session.step(text), "step")

    def step_action(self, fields: Mapping[str, Any]) -> EnvReply:
        """Send an action given by its fields (what an ``action_parser`` made of the text)."""
        return self._call(lambda session: session.step_action(fields), "step")

    def call_tool(self, name: str, arguments: dict[str, Any]) -> EnvReply:
        """Call an MCP tool of the env."""
        return self._call(lambda session: session.call_tool(name, arguments), "call_tool")

    def state(self) -> dict[str, Any]:
        """The env's OpenEnv state.

        Raises:
            EnvStateError: no session is open yet (call :meth:`reset` first).
        """
        if self._session is None:
            raise EnvStateError("state() needs an open session; call reset() first")
        return self._call(lambda session: session.state(), "state")

    def close(self) -> None:
        """End the session and give its host lease back; idempotent."""
        self._closed = True
        self._drop()

    def __enter__(self) -> HostedEnvClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _call(self, call: Any, name: str) -> Any:
        session = self._session
        if session is None or self._closed:
            raise EnvStateError(f"{name}() before reset() (or after close())")
        try:
            return call(session)
        except EnvTimeoutError:
            raise
        except EnvConnectionError as exc:
            lease = self.lease
            self._report_lost()
            where = f"env host {lease.index} ({lease.url})" if lease else "the env host"
            raise EnvHostError(
                f"{where} dropped the session during {name!r}; the episode is over and the "
                f"next reset moves to a healthy host ({exc})"
            ) from exc

    def _reset_on_new_host(self, seed: int | None, task: dict[str, Any]) -> EnvReply:
        """Lease a host and reset there; a host that refuses or fails is given back."""
        deadline = time.monotonic() + self.pool.config.ready_timeout_s
        while True:
            self._drop()
            lease = self.lease = self.pool.acquire(max(deadline - time.monotonic(), 0.0))
            self._session = RemoteEnvClient(
                lease.url,
                timeout_s=self.timeout_s,
                connect_timeout_s=_CONNECT_TIMEOUT_S,
                action_field=self.action_field,
                token=self.pool.config.token,
            )
            try:
                return self._session.reset(seed=seed, **task)
            except EnvTimeoutError:
                raise
            except EnvCapacityError:  # the host has not yet seen an old session's close
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            except EnvConnectionError as exc:
                self._report_lost()
                if time.monotonic() > deadline:
                    raise EnvHostError(
                        f"env host {lease.index} ({lease.url}) cannot be reached and no other "
                        f"host took the session in time ({exc})"
                    ) from exc

    def _report_lost(self) -> None:
        if self.lease is not None:
            self.pool.report_lost(self.lease)
        self._drop()

    def _drop(self) -> None:
        session, self._session = self._session, None
        lease, self.lease = self.lease, None
        if session is not None:
            session.close()
        if lease is not None:
            self.pool.release(lease)
