"""resolve_env, spec_to_factory, env_factory and env_packages."""

from __future__ import annotations

import pytest
from echo_envs import EchoEnv

from agile_llmenvs.errors import EnvBuildError, ImportPathError
from agile_llmenvs.llm_envs import RemoteEnvClient, resolve_env, spec_to_factory
from agile_llmenvs.transport.resolve import ensure_env_packages, env_factory


@pytest.mark.parametrize("url", ["http://h:1", "https://h", "ws://h:2/ws", "wss://h"])
def test_a_url_is_already_hosted(url: str) -> None:
    assert resolve_env(url) == (url, None)


def test_an_entrypoint_is_hosted_with_a_fresh_env_per_session() -> None:
    url, server = resolve_env("echo_envs:EchoEnv", {"greeting": "hello"}, max_concurrent_envs=2)
    assert server is not None
    try:
        assert url == server.url
        with RemoteEnvClient(url) as first, RemoteEnvClient(url) as second:
            assert first.reset().prompt == "hello seed=None"
            first.step("a")
            second.reset()
            assert second.step("b").prompt == "1:b"  # its own env: the turn count starts over
    finally:
        server.close()


def test_a_registry_id_goes_through_a_factory() -> None:
    url, server = resolve_env("echo-v0", {"greeting": "hi"}, factory="echo_envs:make")
    assert server is not None
    try:
        with RemoteEnvClient(url) as client:
            assert client.reset().prompt == "hi seed=None"
    finally:
        server.close()


def test_spec_to_factory() -> None:
    assert spec_to_factory("echo_envs:EchoEnv") is EchoEnv
    with pytest.raises(
        ImportPathError,
        match="If 'game:Sudoku-v0-easy' is a registry id rather "
        "than a 'module:Class' path, pass it as the entrypoint with a factory",
    ):
        spec_to_factory("game:Sudoku-v0-easy")
    with pytest.raises(ImportPathError, match="resolves to a int, not a callable"):
        spec_to_factory("echo_envs:SESSION_COUNT")


def test_env_factory_builds_a_fresh_env_per_call() -> None:
    make = env_factory("echo_envs:EchoEnv", {"greeting": "yo"})
    first, second = make(), make()
    assert first is not second
    assert first.greeting == "yo"
    assert isinstance(env_factory("echo-v0", factory="echo_envs:make")(), EchoEnv)


def test_env_packages_already_installed_install_nothing() -> None:
    assert ensure_env_packages({"pip": ["pydantic>=2", "numpy"]}, allow_install=False) == []
    assert ensure_env_packages(None, allow_install=False) == []


def test_missing_env_packages_are_named() -> None:
    with pytest.raises(
        EnvBuildError,
        match=r"env_packages: 'agile-llmenvs-no-such-pkg' not "
        r"installed; install with `pip install agile-llmenvs-no-such-pkg`",
    ):
        ensure_env_packages({"pip": ["agile-llmenvs-no-such-pkg"]}, allow_install=False)
    with pytest.raises(EnvBuildError, match=r"'numpy>=999' not installed"):
        ensure_env_packages({"uv": ["numpy>=999"]}, allow_install=False)
    with pytest.raises(EnvBuildError, match="env_packages: cannot parse 'not a requirement!'"):
        ensure_env_packages({"pip": ["not a requirement!"]}, allow_install=False)


def test_a_failing_install_names_the_package(tmp_path: object) -> None:
    missing = "agile-llmenvs-no-such-pkg @ file:///nonexistent/agile-llmenvs-no-such-pkg"
    with pytest.raises(
        EnvBuildError,
        match=r"env_packages: installing 'agile-llmenvs-no-such-pkg "
        r"@ file:///nonexistent/agile-llmenvs-no-such-pkg' failed \(exit 1\)",
    ):
        ensure_env_packages({"pip": [missing]}, allow_install=True)


def test_resolve_env_checks_env_packages_first() -> None:
    with pytest.raises(EnvBuildError, match="'agile-llmenvs-no-such-pkg' not installed"):
        resolve_env("echo_envs:EchoEnv", env_packages={"pip": ["agile-llmenvs-no-such-pkg"]})
