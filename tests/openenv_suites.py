"""OpenEnv's own route suites, run against ``create_asgi_app`` and against ``create_app``.

OpenEnv's route tests build apps three ways: ``HTTPEnvServer(...).register_routes(app,
mode=...)`` on a ``FastAPI()`` they made, ``create_fastapi_app(...)`` and ``create_app(...)``
(the last also in the ``uvicorn`` servers of ``tests/envs/test_websockets.py``).
:func:`install` replaces the three in ``openenv.core.env_server.http_server`` so that each
builds *our* app from the same arguments; every test then runs unchanged.

:func:`write_suites` copies the suites (and the two envs ``test_websockets.py`` imports) out of
an OpenEnv checkout or bare git mirror at :data:`OPENENV_COMMIT` into a folder, with a
``conftest.py`` that runs ``async def`` tests (OpenEnv's ``asyncio_mode = "auto"``, without
needing pytest-asyncio) and installs the shim when ``AGILE_OPENENV_TARGET=ours``.
:func:`run_suites` runs them there in a subprocess and returns each test's outcome.

OpenEnv is BSD-3-Clause licensed (Copyright Meta Platforms, Inc. and affiliates); its files are
read from its repository at test time, never copied into this one.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

#: The OpenEnv commit the suites are read at (2026-05-01; its API matches openenv 0.10.0).
OPENENV_COMMIT = "685de411e5f77286b0fd94798d42c4467cf8a1bc"
#: Where to find OpenEnv's repository: ``$OPENENV_REPO`` (a checkout or a bare git dir), else
#: this machine's mirror.
OPENENV_REPO = Path(os.environ.get("OPENENV_REPO", "/work/.mirror/meta-pytorch+OpenEnv/repo"))
SUITES = (
    "tests/core/test_production_mode_routes.py",
    "tests/core/test_mode_selection.py",
    "tests/core/test_simulation_mode_preserves_api.py",
    "tests/core/test_types_and_enums.py",
    "tests/envs/test_websockets.py",
)
#: The envs ``test_websockets.py`` imports and serves.
ENV_FOLDERS = ("envs/echo_env", "envs/connect4_env")
TARGET = "AGILE_OPENENV_TARGET"
TESTS = Path(__file__).resolve().parent

_CONFTEST = f"""\
# Runs OpenEnv's suites against {TARGET}=ours|openenv (tests/openenv_suites.py).
from openenv_suites import pytest_configure, pytest_pyfunc_call  # noqa: F401
"""
_ENVS_INIT = f"""\
# The uvicorn servers test_websockets.py starts import this first: serve our app there too.
import os

if os.environ.get("{TARGET}") == "ours":
    import openenv_suites

    openenv_suites.install()
"""
_INI = """\
[pytest]
markers =
    asyncio: an async test (run by conftest.py)
    integration: OpenEnv's integration tests
    docker: needs Docker
    network: needs the network
"""


# -- the shim --------------------------------------------------------------------------------


def install() -> None:
    """Make OpenEnv's app builders build :func:`create_asgi_app` from the same arguments."""
    from openenv.core.env_server import http_server
    from openenv.core.env_server.types import State

    from agile_llmenvs.transport import create_asgi_app

    def ours(
        env: Any,
        action_cls: Any,
        observation_cls: Any,
        *,
        max_concurrent_envs: int | None,
        concurrency_config: Any,
        env_name: str | None,
        state_cls: Any,
        mode: Any,
    ) -> Any:
        if not callable(env):  # create_app's check and message
            raise TypeError(f"env must be a callable (class or factory function), got {env!r}")
        if concurrency_config is not None:
            max_concurrent_envs = concurrency_config.max_concurrent_envs
        return create_asgi_app(
            make_env=env,
            env_name=env_name,
            max_concurrent_envs=max_concurrent_envs or 1,  # create_app's default
            action_cls=action_cls,
            observation_cls=observation_cls,
            state_cls=state_cls,
            mode=mode,
        )

    def create_fastapi_app(
        env: Any,
        action_cls: Any,
        observation_cls: Any,
        max_concurrent_envs: int | None = None,
        concurrency_config: Any = None,
        env_name: str | None = None,
        state_cls: Any = State,
        *,
        mode: Any = None,
        reset_observation_cls: Any = None,
    ) -> Any:
        return ours(
            env,
            action_cls,
            observation_cls,
            max_concurrent_envs=max_concurrent_envs,
            concurrency_config=concurrency_config,
            env_name=env_name,
            state_cls=state_cls,
            mode=mode,
        )

    def create_app(
        env: Any,
        action_cls: Any,
        observation_cls: Any,
        env_name: str | None = None,
        max_concurrent_envs: int | None = None,
        concurrency_config: Any = None,
        *args: Any,
        state_cls: Any = State,
        mode: Any = None,
        **web_options: Any,
    ) -> Any:
        return create_fastapi_app(
            env,
            action_cls,
            observation_cls,
            max_concurrent_envs,
            concurrency_config,
            env_name,
            state_cls,
            mode=mode,
        )

    def register_routes(self: Any, app: Any, mode: Any = "simulation") -> None:
        # the server object was built (and its arguments checked) by OpenEnv; our routes
        # join the FastAPI app's own, as OpenEnv's do
        from agile_llmenvs.transport import register_routes as ours_on

        ours_on(
            app,
            make_env=self._env_factory,
            action_cls=self.action_cls,
            observation_cls=self.observation_cls,
            max_concurrent_envs=self._max_concurrent_envs or 1,
            env_name=self.env_name,
            state_cls=self.state_cls,
            mode=mode,
        )

    http_server.create_fastapi_app = create_fastapi_app
    http_server.create_app = create_app
    http_server.HTTPEnvServer.register_routes = register_routes


# -- the hooks conftest.py takes -------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(TARGET) == "ours":
        install()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run an ``async def`` test in a fresh event loop (pytest-asyncio's auto mode)."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    asyncio.run(pyfuncitem.obj(**{name: pyfuncitem.funcargs[name] for name in names}))
    return True


# -- writing and running the suites ----------------------------------------------------------


def openenv_files(paths: tuple[str, ...]) -> dict[str, bytes]:
    """``paths`` (files or folders) from :data:`OPENENV_REPO` at :data:`OPENENV_COMMIT`.

    Raises:
        FileNotFoundError: no OpenEnv repository there, or not that commit.
    """
    git = ["git", "--git-dir", str(_git_dir(OPENENV_REPO))]
    listing = subprocess.run(
        [*git, "ls-tree", "-r", "--name-only", OPENENV_COMMIT, "--", *paths],
        capture_output=True,
        text=True,
    )
    names = listing.stdout.split()
    if listing.returncode != 0 or not names:
        raise FileNotFoundError(f"OpenEnv {OPENENV_COMMIT} not in {OPENENV_REPO}")
    return {
        name: subprocess.run(
            [*git, "show", f"{OPENENV_COMMIT}:{name}"], capture_output=True, check=True
        ).stdout
        for name in names
    }


def write_suites(folder: Path) -> None:
    """Write the suites, the two envs, ``conftest.py`` and ``pytest.ini`` into ``folder``."""
    for name, content in openenv_files(SUITES + ENV_FOLDERS).items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    (folder / "conftest.py").write_text(_CONFTEST)
    (folder / "envs" / "__init__.py").write_text(_ENVS_INIT)
    (folder / "pytest.ini").write_text(_INI)


def run_suites(folder: Path, target: str, timeout_s: float = 600) -> dict[str, str]:
    """Run the suites in ``folder`` against ``target`` (``"ours"`` or ``"openenv"``):
    each test's id (``dotted.module.Class::name``) and outcome (passed, failed, error, skipped)."""
    report = folder / f"report-{target}.xml"
    environment = {
        **os.environ,
        TARGET: target,
        "PYTHONPATH": os.pathsep.join([str(folder), str(TESTS)]),
        "ENABLE_WEB_INTERFACE": "false",
    }
    environment.pop("OPENENV_MODE", None)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(folder / "pytest.ini"),
            "--rootdir",
            str(folder),
            f"--junitxml={report}",
            *SUITES,
        ],
        cwd=folder,
        env=environment,
        capture_output=True,
        timeout=timeout_s,
    )
    return junit_outcomes(report)


def junit_outcomes(report: Path) -> dict[str, str]:
    """Each test case of a JUnit XML report (``dotted.module.Class::name``) and its outcome."""
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        outcomes[test_id] = outcome
    return outcomes


def _git_dir(repo: Path) -> Path:
    return repo / ".git" if (repo / ".git").exists() else repo
