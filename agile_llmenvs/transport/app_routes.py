"""The env's routes added to a FastAPI (or Starlette) app of one's own, as OpenEnv's
``HTTPEnvServer(...).register_routes(app, mode=...)`` adds OpenEnv's.

:func:`register_routes` builds :func:`~agile_llmenvs.transport.asgi.create_asgi_app`'s app and
adds a route per path it serves to ``app.router`` (``/health``, ``/metadata``, ``/schema``,
``/sessions``, ``POST /mcp``, the ``/ws`` and ``/mcp`` WebSockets, in simulation mode
``POST /reset``, ``/step`` and ``GET /state``, and in production mode the ``/harness``
WebSocket, which the app refuses (403, as for no route) unless the env is an OpenEnv
``HarnessEnvironment``), each handing its requests to that app. The
user's own routes, middleware and ``/docs`` stay theirs: ``app.routes`` lists ours beside
them, where mounting the app at ``/`` would hide them all behind one mount.
"""

from __future__ import annotations

from typing import Any

from agile_llmenvs.transport.asgi import AsgiApp, create_asgi_app
from agile_llmenvs.transport.harness_route import HARNESS_PATH
from agile_llmenvs.transport.served import EnvLike

__all__ = ["register_routes"]

#: Every mode's HTTP routes, and the simulation mode's controls (OpenEnv's split).
_ALWAYS = (
    ("/health", "GET"),
    ("/metadata", "GET"),
    ("/schema", "GET"),
    ("/sessions", "GET"),
    ("/mcp", "POST"),
)
_SIMULATION = (("/reset", "POST"), ("/step", "POST"), ("/state", "GET"))
_WEBSOCKETS = ("/ws", "/mcp")


def register_routes(app: Any, env: EnvLike | None = None, **arguments: Any) -> AsgiApp:
    """Add the env server's routes to ``app`` and return the ASGI app that answers them.

    Args:
        app: A ``FastAPI`` or ``Starlette`` application (anything with a Starlette
            ``router``).
        env: As :func:`~agile_llmenvs.transport.create_asgi_app`'s ``env``.
        **arguments: :func:`~agile_llmenvs.transport.create_asgi_app`'s keywords
            (``make_env``, ``token``, ``mode``, ``max_concurrent_envs``, ``settings``, ...).

    On a FastAPI app the env threads and HTTP-made MCP sessions are closed at the app's
    shutdown; on a plain Starlette app call the returned app's ``close()`` in its lifespan.

    Raises:
        ValueError, TypeError: as :func:`~agile_llmenvs.transport.create_asgi_app` raises.
        ImportError: ``starlette`` is not installed.
    """
    from starlette.routing import Route, WebSocketRoute

    served = create_asgi_app(env, **arguments)
    routes = _ALWAYS + (_SIMULATION if served.host.routes.mode == "simulation" else ())
    for path, method in routes:
        app.router.routes.append(Route(path, served, methods=[method]))
    production = served.host.routes.mode == "production"
    for path in _WEBSOCKETS + ((HARNESS_PATH,) if production else ()):
        app.router.routes.append(WebSocketRoute(path, served))
    on_shutdown = getattr(app.router, "on_shutdown", None)
    if isinstance(on_shutdown, list):
        on_shutdown.append(served.close)
    return served
