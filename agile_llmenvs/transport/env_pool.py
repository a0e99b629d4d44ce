"""EnvPool: the envs an env server builds, under its one capacity.

Every env the server builds holds a slot from its build to its close: a ``/ws`` session's, an
HTTP call's own (``/reset``, ``/step``, ...), and one held between requests for an MCP
session (:class:`HeldEnv`; OpenEnv's ``openenv/session/create``). When every slot is taken,
held envs no connection has used for ``mcp_session_idle_timeout_s`` are ended to make room;
otherwise a new env is refused. The pool also runs the envs' calls (:class:`EnvCalls`) and
knows their wire types. The ``/ws`` sessions (:mod:`~agile_llmenvs.transport.sessions`), the
HTTP routes (:mod:`~agile_llmenvs.transport.routes`) and the MCP sessions
(:mod:`~agile_llmenvs.transport.mcp_sessions`) all take their envs from it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from agile_llmenvs.transport._openenv import Environment
from agile_llmenvs.transport.env_calls import Discard, EnvCalls
from agile_llmenvs.transport.env_types import EnvTypes, infer_env_types
from agile_llmenvs.transport.served import EnvLike, ServedEnv
from agile_llmenvs.transport.settings import ServerSettings
from agile_llmenvs.transport.wrapper import OpenEnvWrapper

__all__ = ["EnvPool", "HeldEnv"]

logger = logging.getLogger(__name__)


@dataclass
class HeldEnv:
    """An env held between requests (an MCP session's), alive until it is ended."""

    env: Any
    stack: AsyncExitStack
    last_used: float = field(default_factory=time.monotonic)
    attached: bool = False
    closing: bool = False


class EnvPool:
    """The envs of one server: building and closing them, their calls, and the capacity.

    Args:
        make_env: Builds the OpenEnv ``Environment`` of one session.
        env_name: Name reported by ``/sessions``.
        max_sessions: Live envs allowed at once (None: unlimited).
        settings: Timeouts and limits.
        owns_envs: Close each session's env when the session ends (False for a shared env).
        types: The env's wire types, when known before any env is built.
        given_types: Classes the server was told (``action_cls`` and the like): they win over
            what an env's annotations say.
    """

    def __init__(
        self,
        make_env: Callable[[], Environment],
        *,
        env_name: str,
        max_sessions: int | None,
        settings: ServerSettings,
        owns_envs: bool = True,
        types: EnvTypes | None = None,
        given_types: dict[str, type] | None = None,
    ) -> None:
        self.make_env = make_env
        self.types = types
        self.given_types = given_types or {}
        self.env_name = env_name
        self.max_sessions = max_sessions
        self.settings = settings
        self.owns_envs = owns_envs
        self.active_sessions = 0
        self.held: dict[str, HeldEnv] = {}
        threads = settings.executor_threads or min(max_sessions or 256, 256)
        self.env_calls = EnvCalls(settings, threads, lambda: self.active_sessions)

    @classmethod
    def serving(cls, served: ServedEnv, settings: ServerSettings) -> EnvPool:
        """The pool of ``served`` (checked: see :meth:`ServedEnv.checked`): its one shared
        env, or a fresh env per session from its factory. Plain text envs are wrapped in
        :class:`OpenEnvWrapper`.

        Raises:
            TypeError: a given class is not OpenEnv's ``Action`` / ``Observation`` / ``State``.
        """
        given = served.given_types()
        if served.env is not None:
            shared = _as_environment(served.env, served.env_name, owns=False)
            return cls(
                lambda: shared,
                env_name=served.env_name or _name_of(served.env),
                max_sessions=1,
                settings=settings,
                owns_envs=False,
                types=infer_env_types(shared, **given),
                given_types=given,
            )
        make_env = served.make_env
        assert make_env is not None  # checked: exactly one of env / make_env
        known = isinstance(make_env, type) and issubclass(make_env, Environment)
        return cls(
            _Fresh(make_env, served.env_name),
            env_name=served.env_name or str(getattr(make_env, "__name__", "env")),
            max_sessions=served.max_concurrent_envs,
            settings=settings,
            types=infer_env_types(make_env, **given) if known else None,
            given_types=given,
        )

    # -- env calls ---------------------------------------------------------------------------

    def types_of(self, env: Environment) -> EnvTypes:
        """The wire types of ``env`` (and, from the first env built, of every session)."""
        if self.types is None:
            self.types = infer_env_types(env, **self.given_types)
        return self.types

    async def build_env(self) -> Environment:
        """A fresh env from the factory, bounded like any env call."""
        env: Environment = await self.env_calls.call_bounded(self.make_env)
        self.types_of(env)
        return env

    async def close_env(self, env: Environment) -> None:
        """Close ``env`` if this pool owns its envs; a failing close is logged, not raised."""
        if self.owns_envs:
            try:
                await self.env_calls.call_bounded(env.close)
            except (Exception, Discard) as exc:
                logger.warning("closing an env failed: %s", exc)

    async def reset(self, env: Environment, kwargs: dict[str, Any]) -> Any:
        """``env.reset(**kwargs)``, the kwargs it cannot take dropped (as OpenEnv does)."""
        return await self.env_calls.call(env, "reset", **_reset_kwargs(env, kwargs))

    async def step(self, env: Environment, action: Any) -> Any:
        """``env.step(action)`` where the call policy runs env calls."""
        return await self.env_calls.call(env, "step", action)

    async def state(self, env: Environment) -> Any:
        """``env.state`` in the thread pool, bounded like any env call."""
        return await self.env_calls.call_bounded(lambda: env.state, "state")

    async def metadata(self, env: Environment) -> Any:
        """``env.get_metadata()`` in the thread pool, bounded like any env call."""
        return await self.env_calls.call_bounded(env.get_metadata, "get_metadata")

    # -- capacity ----------------------------------------------------------------------------

    def full(self) -> bool:
        """Whether every slot holds a live env."""
        return self.max_sessions is not None and self.active_sessions >= self.max_sessions

    async def take_slot(self) -> bool:
        """Take a slot for an env about to be built (idle held envs are ended first when
        there is none); False when the server is at capacity."""
        if self.full():
            await self.reap_idle()
            if self.full():
                return False
        self.active_sessions += 1
        return True

    def free_slot(self) -> None:
        """Give back a slot whose env is closed (or was never built)."""
        self.active_sessions -= 1

    def capacity_message(self) -> str:
        """Why a new session is refused (OpenEnv's words)."""
        return f"Server at capacity ({self.active_sessions}/{self.max_sessions} sessions)"

    # -- envs held between requests ----------------------------------------------------------

    def hold(self, env: Any, stack: AsyncExitStack) -> str:
        """Hold ``env`` (whose slot is taken) until :meth:`end`; returns its new session id.
        ``stack`` is closed before the env when it ends."""
        session_id = str(uuid.uuid4())
        self.held[session_id] = HeldEnv(env, stack)
        return session_id

    def used(self, session_id: str) -> HeldEnv | None:
        """The held env ``session_id`` (marked as used now), or None if there is none."""
        held = self.held.get(session_id)
        if held is not None:
            held.last_used = time.monotonic()
        return held

    def attach(self, session_id: str) -> HeldEnv:
        """Attach a connection to a held env.

        Raises:
            RuntimeError: no such session, or one that has a connection already (OpenEnv's
                messages).
        """
        held = self.held.get(session_id)
        if held is None:
            raise RuntimeError(f"Unknown session_id: {session_id}")
        if held.attached:
            raise RuntimeError(f"Session {session_id} already has an attached WebSocket")
        held.attached = True
        return held

    async def detach(self, session_id: str) -> None:
        """The connection of a held env left; end it if a close waits."""
        held = self.held.get(session_id)
        if held is None:
            return
        held.attached = False
        held.last_used = time.monotonic()
        if held.closing:
            await self.end(session_id)

    async def end(self, session_id: str) -> None:
        """Close a held env (its stack first), and free its slot."""
        held = self.held.pop(session_id, None)
        if held is None:
            return
        try:
            with contextlib.suppress(Exception):
                await held.stack.aclose()
            await self.close_env(held.env)
        finally:
            self.free_slot()

    async def close_all(self) -> None:
        """End every held env (the server is stopping)."""
        for session_id in list(self.held):
            await self.end(session_id)

    async def reap_idle(self) -> None:
        """End held envs no connection has used for ``mcp_session_idle_timeout_s``."""
        idle = self.settings.mcp_session_idle_timeout_s
        if idle is None:
            return
        now = time.monotonic()
        for session_id, held in list(self.held.items()):
            if not held.attached and now - held.last_used > idle:
                await self.end(session_id)


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


def _name_of(env: Any) -> str:
    return str(getattr(env, "env_name", None) or type(env).__name__)


_SIGNATURES: dict[type, inspect.Signature] = {}


def _reset_kwargs(env: Environment, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the reset kwargs ``env`` cannot take, as OpenEnv drops them."""
    cls = type(env)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(env.reset)
    params = _SIGNATURES[cls].parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return data
    return {k: v for k, v in data.items() if k in params}
