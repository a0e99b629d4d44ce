"""OpenEnvServer: host text envs behind OpenEnv's ``/ws`` protocol, in a background thread."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from types import TracebackType

from websockets.asyncio.server import serve

from agile_llmenvs._loops import new_event_loop
from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.transport.env_pool import EnvPool
from agile_llmenvs.transport.http import routing_connection
from agile_llmenvs.transport.routes import ServerMode, server_mode
from agile_llmenvs.transport.served import DEFAULT_MAX_SESSIONS, EnvLike, ServedEnv
from agile_llmenvs.transport.sessions import SessionHost
from agile_llmenvs.transport.settings import ServerSettings

__all__ = ["DEFAULT_MAX_SESSIONS", "OpenEnvServer", "ServedEnv", "ServerSettings"]

logger = logging.getLogger(__name__)


class OpenEnvServer:
    """Serve envs as OpenEnv's ``create_app`` does, in a background daemon thread.

    Pass ``env`` to share one env (one session at a time), or ``make_env`` (+
    ``max_concurrent_envs``) for a fresh env per ``/ws`` session; or, in place of ``env`` and
    the other six keywords that say what is served, one :class:`ServedEnv`. Plain text envs
    are wrapped
    in :class:`OpenEnvWrapper` (their steps take the text fast path); any OpenEnv
    ``Environment`` is served as it is, its actions validated against its own action class.

    Routes, with ``create_app``'s paths and bodies: ``/ws`` sessions (``reset``, ``step``,
    ``state``, ``close`` and ``mcp`` messages), ``GET /health``, ``/metadata``, ``/schema``,
    ``/state``, ``POST /reset``, ``/step``, ``/mcp``, a WebSocket at ``/mcp`` (bare JSON-RPC on
    an MCP session of its own); and our ``GET /sessions``.

    Args:
        env: A single shared local env. Exactly one of ``env`` / ``make_env``. Or a
            :class:`ServedEnv` holding what is served.
        make_env: Zero-argument factory building a fresh env per session.
        host: Interface to bind (default loopback).
        port: TCP port; 0 lets the OS pick one.
        env_name: Name in the env's metadata; defaults to its class name.
        max_concurrent_envs: Max live sessions (with ``make_env``; default
            :data:`DEFAULT_MAX_SESSIONS`; None: unlimited). Set it to at least
            ``batch_size * group_size`` (+1 for an eval env) for GRPO.
        advertise_host: Host clients should dial when it differs from the bound interface.
        token: Shared secret clients must present (OpenEnv itself has no authentication);
            an empty one is refused.
        settings: Timeouts, keep-alive and message limits.
        action_cls: The env's action class, as ``create_app`` takes it. Default: the env's
            ``step`` annotation (``ACTION_CLS`` if it sets one), else OpenEnv's ``Action``.
        observation_cls: The env's observation class (default: ``step``'s return
            annotation), published in ``/schema``.
        state_cls: The env's state class (default: the ``state`` property's annotation).
        mode: OpenEnv's server mode: ``"simulation"`` serves every route; ``"production"``
            drops the simulation controls ``POST /reset``, ``/step`` and ``GET /state`` (404,
            as OpenEnv's ``register_routes(app, mode="production")``) and keeps the rest,
            ``/ws`` sessions included, and serves OpenEnv's ``/harness`` WebSocket for an
            OpenEnv ``HarnessEnvironment``. None reads ``OPENENV_MODE`` (default
            ``"simulation"``), as ``create_app`` does.

    Raises:
        ValueError: both or neither of ``env``/``make_env``, ``max_concurrent_envs > 1``
            with a shared ``env``, an empty ``token``, or a ``mode`` that is neither
            ``"simulation"`` nor ``"production"``.
        TypeError: a given class is not OpenEnv's ``Action`` / ``Observation`` / ``State``.
    """

    def __init__(
        self,
        env: EnvLike | ServedEnv | None = None,
        *,
        make_env: Callable[[], EnvLike] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        env_name: str | None = None,
        max_concurrent_envs: int | None = DEFAULT_MAX_SESSIONS,
        advertise_host: str | None = None,
        token: str | None = None,
        settings: ServerSettings | None = None,
        action_cls: type | None = None,
        observation_cls: type | None = None,
        state_cls: type | None = None,
        mode: ServerMode | str | None = None,
    ) -> None:
        checked_mode = server_mode(mode)
        settings = settings or ServerSettings()
        served = ServedEnv.of(
            env,
            make_env=make_env,
            env_name=env_name,
            max_concurrent_envs=max_concurrent_envs,
            token=token,
            action_cls=action_cls,
            observation_cls=observation_cls,
            state_cls=state_cls,
        )
        self.host_sessions = build_session_host(served, settings, owner="OpenEnvServer")
        self.host_sessions.routes.mode = checked_mode
        self.settings = settings
        self._socket = _bind(host, port)
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        self.advertise_host = advertise_host
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"openenv-server-{self.port}", daemon=True
        )
        self._thread.start()
        if not self._started.wait(30.0):
            raise AgileLLMEnvsError(f"env server on {self.host}:{self.port} did not start")

    @property
    def url(self) -> str:
        """Base URL clients dial (``http://host:port``); sessions live at ``/ws``."""
        host = self.advertise_host or self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def serving(self) -> bool:
        """Whether the serving thread is up (False once closed, or if serving failed)."""
        return self._thread.is_alive()

    @property
    def unhealthy(self) -> str | None:
        """Why the server can no longer build envs reliably (its hung env calls used up the
        threads it replaces), or None while it can; ``/health`` answers 503 with it."""
        return self.host_sessions.pool.env_calls.threads.exhausted

    @property
    def active_sessions(self) -> int:
        """Sessions open right now."""
        return self.host_sessions.pool.active_sessions

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving: open sessions are closed (code 1001) and the thread joined.

        Idempotent.
        """
        if self._thread.is_alive() and self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)
        self._socket.close()
        self.host_sessions.pool.env_calls.close()

    def __enter__(self) -> OpenEnvServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self) -> None:
        try:
            with asyncio.Runner(loop_factory=new_event_loop) as runner:
                runner.run(self._serve())
        except BaseException:  # not the env's (sessions absorb those): the server's own
            logger.exception("the env server on %s:%d stopped serving", self.host, self.port)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        settings = self.settings
        async with serve(
            self.host_sessions.handle,
            sock=self._socket,
            process_request=self.host_sessions.process_request,
            compression=None,
            ping_interval=settings.ws_ping_interval_s,
            ping_timeout=settings.ws_ping_timeout_s,
            max_size=4 * settings.max_message_bytes,
            close_timeout=2.0,
            create_connection=routing_connection(
                self.host_sessions.answer_http,
                settings.max_message_bytes,
                self.host_sessions.gate,
            ),
        ):
            self._started.set()
            await self._stop.wait()
            await self.host_sessions.pool.close_all()


def build_session_host(
    served: ServedEnv, settings: ServerSettings, *, owner: str = "OpenEnvServer"
) -> SessionHost:
    """The :class:`SessionHost` serving ``served``, as :class:`OpenEnvServer` (and
    :func:`~agile_llmenvs.transport.asgi.create_asgi_app`) serve it; ``owner`` names the
    caller in errors. Raises as :class:`OpenEnvServer` documents."""
    checked = served.checked(owner)
    return SessionHost(EnvPool.serving(checked, settings), token=checked.token)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise AgileLLMEnvsError(f"cannot bind the env server to {host}:{port}: {exc}") from exc
    sock.listen(2048)
    return sock
