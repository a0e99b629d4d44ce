"""The settings of an env server beyond what it serves and where: timeouts, limits, threads."""

from __future__ import annotations

from dataclasses import dataclass

from agile_llmenvs.transport.calls import CallMode

__all__ = ["ServerSettings"]


@dataclass(frozen=True)
class ServerSettings:
    """Settings of an env server beyond what to serve and where.

    Attributes:
        session_idle_timeout_s: A ``/ws`` session or ``/mcp`` WebSocket that sends nothing
            for this long (counted from its last reply) is closed, its slot freed (None:
            never). Long, so slow generations are safe; half-open peers are found sooner by
            the keep-alive ping.
        ws_ping_interval_s: Seconds between keep-alive pings (None: no pings).
        ws_ping_timeout_s: A peer that does not answer a ping within this is dropped.
        max_message_bytes: Larger frames get a ``MESSAGE_TOO_LARGE`` error reply; frames over
            4x this close the connection (code 1009).
        executor_threads: Threads running sync env calls (None: one per session, up to 256).
        env_calls: Where sync env calls run: ``auto`` (in the thread pool; once an env class
            has shown its calls are fast, its calls of one event-loop iteration go together
            to one worker thread and the loop waits up to ``inline_wait_s`` for them before
            it goes on with other sessions; see :mod:`~agile_llmenvs.transport.calls` and
            :mod:`~agile_llmenvs.transport.fast_lane`), ``thread`` (the loop never waits) or
            ``inline`` (on the event loop itself: one slow call stalls every session and no
            ``env_step_timeout_s`` can stop it).
        inline_wait_s: Most seconds the event loop waits for one batch of env calls in
            ``auto`` mode: the most one session's env call delays the others.
        env_step_timeout_s: Most seconds any env call (the factory, reset, step, state,
            get_metadata, close) may take; a slower one fails with an ``EXECUTION_ERROR``
            reply and its session is closed, its env discarded (None: no bound). A thread
            cannot be stopped from outside: a new one takes the hung call's place, up to
            twice ``executor_threads`` hung calls, past which ``/health`` answers 503.
        first_message_timeout_s: A connection that sends no valid message within this is
            closed (None: never). Envs are built at the first valid message (invalid ones
            are answered with an error), so an idle or garbage-sending connection costs no
            env and holds no slot.
        mcp_session_idle_timeout_s: An MCP session made over HTTP
            (``openenv/session/create``) that no ``/ws`` connection holds and no request has
            used for this long is closed, its slot freed (None: never).
    """

    session_idle_timeout_s: float | None = 1800.0
    ws_ping_interval_s: float | None = 20.0
    ws_ping_timeout_s: float | None = 20.0
    max_message_bytes: int = 8 * 1024 * 1024
    executor_threads: int | None = None
    env_calls: CallMode = "auto"
    inline_wait_s: float = 0.002
    env_step_timeout_s: float | None = 600.0
    first_message_timeout_s: float | None = 30.0
    mcp_session_idle_timeout_s: float | None = 60.0

    def __post_init__(self) -> None:
        for name in (
            "env_step_timeout_s",
            "first_message_timeout_s",
            "session_idle_timeout_s",
            "mcp_session_idle_timeout_s",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if not self.inline_wait_s >= 0:
            raise ValueError(f"inline_wait_s must be >= 0, got {self.inline_wait_s}")
