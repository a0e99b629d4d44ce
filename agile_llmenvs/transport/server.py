"""OpenEnvServer: host text envs behind OpenEnv's ``/ws`` protocol, in a background thread."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeAlias

from websockets.asyncio.server import serve

from agile_llmenvs._loops import new_event_loop
from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.transport._openenv import Environment
from agile_llmenvs.transport.env_types import EnvTypes, infer_env_types
from agile_llmenvs.transport.http import routing_connection
from agile_llmenvs.transport.routes import ServerMode, server_mode
from agile_llmenvs.transport.sessions import SessionHost
from agile_llmenvs.transport.settings import ServerSettings
from agile_llmenvs.transport.wrapper import OpenEnvWrapper

__all__ = ["DEFAULT_MAX_SESSIONS", "OpenEnvServer", "ServerSettings"]

logger = logging.getLogger(__name__)

#: Sessions a server with ``make_env`` serves at once unless told otherwise.
DEFAULT_MAX_SESSIONS = 256

EnvLike: TypeAlias = Any
"""A :class:`TextEnv` or an OpenEnv ``Environment`` (OpenEnv's classes are untyped)."""


class OpenEnvServer:
    """Serve envs as OpenEnv's ``create_app`` does, in a background daemon thread.

    Pass ``env`` to share one env (one session at a time), or ``make_env`` (+
    ``max_concurrent_envs``) for a fresh env per ``/ws`` session. Plain text envs are wrapped
    in :class:`OpenEnvWrapper` (their steps take the text fast path); any OpenEnv
    ``Environment`` is served as it is, its actions validated against its own action class.

    Routes, with ``create_app``'s paths and bodies: ``/ws`` sessions (``reset``, ``step``,
    ``state``, ``close`` and ``mcp`` messages), ``GET /health``, ``/metadata``, ``/schema``,
    ``/state``, ``POST /reset``, ``/step``, ``/mcp``, a WebSocket at ``/mcp`` (bare JSON-RPC on
    an MCP session of its own); and our ``GET /sessions``.

    Args:
        env: A single shared local env. Exactly one of ``env`` / ``make_env``.
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
            ``/ws`` sessions included. None reads ``OPENENV_MODE`` (default
            ``"simulation"``), as ``create_app`` does.

    Raises:
        ValueError: both or neither of ``env``/``make_env``, ``max_concurrent_envs > 1``
            with a shared ``env``, an empty ``token``, or a ``mode`` that is neither
            ``"simulation"`` nor ``"production"``.
        TypeError: a given class is not OpenEnv's ``Action`` / ``Observation`` / ``State``.
    """

    def __init__(
        self,
        env: EnvLike | None = None,
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
        self.host_sessions = build_session_host(
            env,
            make_env=make_env,
            env_name=env_name,
            max_concurrent_envs=max_concurrent_envs,
            token=token,
            settings=settings,
            action_cls=action_cls,
            observation_cls=observation_cls,
            state_cls=state_cls,
            owner="OpenEnvServer",
        )
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
        return self.host_sessions.env_calls.threads.exhausted

    @property
    def active_sessions(self) -> int:
        """Sessions open right now."""
        return self.host_sessions.active_sessions

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving: open sessions are closed (code 1001) and the thread joined.

        Idempotent.
        """
        if self._thread.is_alive() and self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)
        self._socket.close()
        self.host_sessions.env_calls.close()

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
                self.host_sessions.answer_http, settings.max_message_bytes
            ),
        ):
            self._started.set()
            await self._stop.wait()
            await self.host_sessions.routes.mcp_sessions.close_all()


def build_session_host(
    env: EnvLike | None = None,
    *,
    make_env: Callable[[], EnvLike] | None = None,
    env_name: str | None = None,
    max_concurrent_envs: int | None = DEFAULT_MAX_SESSIONS,
    token: str | None = None,
    settings: ServerSettings,
    action_cls: type | None = None,
    observation_cls: type | None = None,
    state_cls: type | None = None,
    owner: str = "OpenEnvServer",
) -> SessionHost:
    """The :class:`SessionHost` serving ``env`` or ``make_env``, as :class:`OpenEnvServer`
    (and :func:`~agile_llmenvs.transport.asgi.create_asgi_app`) take them; ``owner`` names
    the caller in errors. Raises as :class:`OpenEnvServer` documents."""
    if (env is None) == (make_env is None):
        raise ValueError(f"{owner} needs exactly one of `env` or `make_env`")
    if env is not None and max_concurrent_envs == DEFAULT_MAX_SESSIONS:
        max_concurrent_envs = 1
    if env is not None and max_concurrent_envs not in (None, 1):
        raise ValueError(
            f"max_concurrent_envs={max_concurrent_envs} needs `make_env`: one shared `env` "
            "serves one session at a time"
        )
    if max_concurrent_envs is not None and max_concurrent_envs < 1:
        raise ValueError(f"max_concurrent_envs must be >= 1, got {max_concurrent_envs}")
    given = {
        k: v
        for k, v in (
            ("action_cls", action_cls),
            ("observation_cls", observation_cls),
            ("state_cls", state_cls),
        )
        if v is not None
    }
    shared: Environment | None = None
    if env is not None:
        shared = _as_environment(env, env_name, owns=False)
        build: Callable[[], Environment] = lambda: shared  # noqa: E731
        limit: int | None = 1
        name = env_name or _name_of(env)
    else:
        assert make_env is not None
        build = _Fresh(make_env, env_name)
        limit = max_concurrent_envs
        name = env_name or str(getattr(make_env, "__name__", "env"))
    return SessionHost(
        build,
        env_name=name,
        max_sessions=limit,
        token=token,
        settings=settings,
        owns_envs=env is None,
        types=_known_types(shared if env is not None else None, make_env, given),
        given_types=given,
    )


class _Fresh:
    """A fresh env per session, owned (and closed) by the session."""

    def __init__(self, make_env: Callable[[], EnvLike], env_name: str | None) -> None:
        self.make_env = make_env
        self.env_name = env_name

    def __call__(self) -> Environment:
        return _as_environment(self.make_env(), self.env_name, owns=True)


def _as_environment(env: EnvLike, env_name: str | None, *, owns: bool) -> Environment:
    if isinstance(env, Environment):
        return env
    return OpenEnvWrapper(env, env_name=env_name, owns_inner=owns)


def _known_types(
    shared: Environment | None, make_env: Any, given: dict[str, type]
) -> EnvTypes | None:
    """The wire types when they are known before a session: a shared env's, or those of an
    env class passed as the factory; otherwise None (the first env built tells)."""
    if shared is not None:
        return infer_env_types(shared, **given)
    if isinstance(make_env, type) and issubclass(make_env, Environment):
        return infer_env_types(make_env, **given)
    return None


def _name_of(env: Any) -> str:
    return str(getattr(env, "env_name", None) or type(env).__name__)


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
