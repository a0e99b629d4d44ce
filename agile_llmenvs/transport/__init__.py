"""The env wire: OpenEnv types, the wrapper, the server and the in-process and remote clients."""

from __future__ import annotations

from agile_llmenvs.transport.app_routes import register_routes
from agile_llmenvs.transport.asgi import create_asgi_app
from agile_llmenvs.transport.client import EnvClientProtocol, InProcessEnvClient
from agile_llmenvs.transport.remote import ClientState, RemoteEnvClient
from agile_llmenvs.transport.served import ServedEnv
from agile_llmenvs.transport.server import OpenEnvServer
from agile_llmenvs.transport.settings import ServerSettings
from agile_llmenvs.transport.types import EnvReply, TextAction, TextObservation, TextState
from agile_llmenvs.transport.wrapper import OpenEnvWrapper

__all__ = [
    "ClientState",
    "EnvClientProtocol",
    "EnvReply",
    "InProcessEnvClient",
    "OpenEnvServer",
    "OpenEnvWrapper",
    "RemoteEnvClient",
    "ServedEnv",
    "ServerSettings",
    "TextAction",
    "TextObservation",
    "TextState",
    "create_asgi_app",
    "register_routes",
]
