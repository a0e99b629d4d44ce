"""ServedEnv: what a server serves, as one value the server entry points take or build."""

from __future__ import annotations

import pytest
from echo_envs import EchoEnv

from agile_llmenvs.transport import (
    OpenEnvServer,
    RemoteEnvClient,
    ServedEnv,
    TextAction,
    create_asgi_app,
)
from agile_llmenvs.transport.served import DEFAULT_MAX_SESSIONS


def test_the_keywords_and_the_value_serve_the_same() -> None:
    by_keywords = ServedEnv.of(None, make_env=EchoEnv, max_concurrent_envs=2, token="s3cret")
    value = ServedEnv(make_env=EchoEnv, max_concurrent_envs=2, token="s3cret")
    assert by_keywords == value
    assert ServedEnv.of(value, make_env=None, max_concurrent_envs=DEFAULT_MAX_SESSIONS) is value
    with OpenEnvServer(value) as server:
        assert server.host_sessions.pool.max_sessions == 2
        assert server.host_sessions.token == "s3cret"
        with RemoteEnvClient(server.url, token="s3cret") as client:
            assert client.reset(seed=3).prompt == "start seed=3"
    app = create_asgi_app(ServedEnv(env=EchoEnv(), env_name="echo"))
    assert (app.host.pool.max_sessions, app.host.pool.env_name) == (1, "echo")
    assert not app.host.pool.owns_envs


def test_settings_given_twice_or_wrongly_are_refused_naming_the_caller() -> None:
    served = ServedEnv(make_env=EchoEnv)
    with pytest.raises(ValueError, match=r"^max_concurrent_envs, token given both in the Served"):
        OpenEnvServer(served, max_concurrent_envs=4, token="x")
    with pytest.raises(ValueError, match=r"^create_asgi_app needs exactly one of `env` or"):
        ServedEnv().checked("create_asgi_app")
    with pytest.raises(ValueError, match=r"^max_concurrent_envs=2 needs `make_env`"):
        ServedEnv(env=EchoEnv(), max_concurrent_envs=2).checked("OpenEnvServer")
    with pytest.raises(ValueError, match=r"^max_concurrent_envs must be >= 1, got 0"):
        ServedEnv(make_env=EchoEnv, max_concurrent_envs=0).checked("OpenEnvServer")
    shared = ServedEnv(env=EchoEnv(), max_concurrent_envs=None).checked("OpenEnvServer")
    assert shared.max_concurrent_envs == 1
    assert ServedEnv(make_env=EchoEnv, action_cls=TextAction).given_types() == {
        "action_cls": TextAction
    }
