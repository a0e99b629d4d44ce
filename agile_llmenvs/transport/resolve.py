"""From an env's entrypoint to something a rollout can reach: a factory or a hosted URL.

A manifest's dataset-backed env (rows scored by a rubric) is built by the text-env runtime
(:func:`~agile_llmenvs.llm_envs.from_spec.text_env_factory`).
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.requirements import InvalidRequirement, Requirement

from agile_llmenvs._imports import load_object
from agile_llmenvs.errors import EnvBuildError, ImportPathError
from agile_llmenvs.transport.served import ServedEnv
from agile_llmenvs.transport.server import OpenEnvServer

if TYPE_CHECKING:
    from agile_llmenvs.core.contract import TextEnv

__all__ = [
    "ensure_env_packages",
    "env_config_mismatch",
    "env_factory",
    "load_entrypoint",
    "resolve_env",
    "spec_to_factory",
]

_URL_SCHEMES = ("http://", "https://", "ws://", "wss://")

FACTORY_CHECKS = ("agile_llmenvs.adapters.gem:checked_factory",)
"""What every loaded ``factory:`` callable passes through, in order: an env source's adapter
may put its own build in place of the foreign one (GEM's ``gem.make`` is built by
:func:`agile_llmenvs.adapters.gem.make`, which checks the NLTK corpora and downloads none).
Named as entrypoints, as any factory is: the adapters sit above this layer, and each is
imported only when a factory is loaded."""


def load_entrypoint(path: str, *, field: str = "env.entrypoint") -> Any:
    """The object an entrypoint names: ``module:attr``, or ``path/to/file.py:attr`` (the
    attribute of that Python file, loaded as a gym manifest's ``path`` is).

    A module Python cannot find is imported from the folder of a loaded manifest, then from
    the working directory (:func:`~agile_llmenvs._imports.load_object`); a relative file is
    opened from the working directory (a loaded manifest has already made the files next to
    it absolute).

    Args:
        path: The entrypoint.
        field: The setting that named it, named when its file does not exist.

    Raises:
        ImportPathError: the module, file or attribute does not exist.
    """
    file, sep, attr = path.rpartition(":")
    if sep and file.endswith(".py"):
        if not Path(file).exists():
            looked = "" if Path(file).is_absolute() else f"{Path(file).resolve()}; "
            raise ImportPathError(
                f"{field}: {file!r} does not exist (looked for {looked}a relative path in a "
                "manifest is looked up next to the manifest, then in the working directory)"
            )
        return load_object(attr, file=file)
    return load_object(path)


def spec_to_factory(spec: str) -> Callable[..., TextEnv]:
    """Resolve a constructor path, ``module:attr`` or ``path/to/file.py:attr``, to the callable
    that builds the env.

    Registry ids (``game:GuessTheNumber-v0-easy``, ``CartPole-v1``) are not constructors:
    pass those as the entrypoint of a separate ``factory`` (see :func:`env_factory`).

    Raises:
        ImportPathError: the path does not resolve to a callable.
    """
    try:
        target = load_entrypoint(spec)
    except ImportPathError as exc:
        text = str(exc)
        if _is_file_target(spec):  # a file is no registry id
            raise
        raise ImportPathError(
            f"{text}{' ' if text.endswith(('.', '?')) else '. '}If {spec!r} is a registry "
            "id rather than a 'module:Class' path, pass it as the entrypoint with a factory that "
            "builds it, e.g. factory='gem:make'"
        ) from exc
    if not callable(target):
        raise ImportPathError(f"{spec!r} resolves to a {type(target).__name__}, not a callable")
    return target


def env_factory(
    entrypoint: str, env_config: Mapping[str, Any] | None = None, *, factory: str | None = None
) -> Callable[[], TextEnv]:
    """A zero-argument callable building a fresh env per call.

    With ``factory``, the env is ``factory(entrypoint, **env_config)`` (a registry id handed
    to, say, ``gem:make``); without, ``entrypoint`` is a ``module:Class`` path called with
    ``**env_config``. Either path may name a Python file instead: ``path/to/envs.py:MyEnv``.

    Raises:
        ImportPathError: the entrypoint or factory does not resolve.

    The callable raises :class:`EnvBuildError` naming ``env.env_config`` when the env's
    constructor does not take the keyword arguments ``env_config`` holds (a key it does not
    take, or one it needs that is missing); anything else the constructor raises is its own.
    """
    kwargs = dict(env_config or {})
    if factory is not None:
        make = load_entrypoint(factory, field="env.factory")
        for check in FACTORY_CHECKS:
            make = load_object(check)(make)
        if not callable(make):
            raise ImportPathError(f"factory {factory!r} is not callable")
        return lambda: make(entrypoint, **kwargs)
    constructor = spec_to_factory(entrypoint)

    def build() -> TextEnv:
        try:
            return constructor(**kwargs)
        except TypeError as exc:
            mismatch = env_config_mismatch(constructor, kwargs)
            if mismatch is None:  # raised inside the constructor: its own error
                raise
            raise EnvBuildError(mismatch) from exc

    return build


def env_config_mismatch(constructor: Callable[..., Any], kwargs: Mapping[str, Any]) -> str | None:
    """Why ``constructor(**kwargs)`` cannot be called, as a message naming ``env.env_config``;
    None when it can (or its signature cannot be read)."""
    try:
        signature = inspect.signature(constructor)
    except (TypeError, ValueError):  # a builtin without one
        return None
    try:
        signature.bind(**kwargs)
    except TypeError:
        pass
    else:
        return None
    takes = [
        name
        for name, parameter in signature.parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    ]
    name = getattr(constructor, "__qualname__", repr(constructor))
    listed = ", ".join(takes) if takes else "none"
    unknown = [key for key in kwargs if key not in takes]
    if unknown:
        close = difflib.get_close_matches(unknown[0], takes, n=1)
        fix = f"did you mean {close[0]!r}?" if close else "remove it, or fix its spelling"
        return (
            f"env.env_config: {unknown[0]!r} is not a keyword argument of {name} (it takes: "
            f"{listed}); {fix}"
        )
    needed = [
        key
        for key, parameter in signature.parameters.items()
        if parameter.default is parameter.empty
        and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        and key not in kwargs
    ]
    if needed:
        return (
            f"env.env_config: {name} needs the keyword argument {needed[0]!r}, which env_config "
            "does not set; add it"
        )
    return None


def _is_file_target(path: str) -> bool:
    file, sep, _ = path.rpartition(":")
    return bool(sep) and file.endswith(".py")


def resolve_env(
    spec: str,
    env_config: Mapping[str, Any] | None = None,
    *,
    factory: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    max_concurrent_envs: int | None = None,
    advertise_host: str | None = None,
    env_packages: Mapping[str, Sequence[str]] | None = None,
    allow_install: bool = False,
    token: str | None = None,
) -> tuple[str, OpenEnvServer | None]:
    """Resolve an env spec to a ``(url, server)`` a rollout can reach.

    A URL is already hosted: ``(url, None)``. Anything else is built and hosted on a local
    :class:`OpenEnvServer`, a fresh env per ``/ws`` session, at most
    ``max_concurrent_envs`` at once (unset: one at a time). For GRPO set it to at least
    ``batch_size * group_size`` (+1 for a lazily built eval env).

    Args:
        spec: A URL, a ``module:Class`` (or ``file.py:Class``) entrypoint, or a registry id
            used with ``factory``.
        env_config: Keyword arguments for the env.
        factory: ``module:attr`` callable receiving ``spec`` (e.g. ``gem:make``).
        host: Interface the server binds.
        port: Port the server binds (0: any free port).
        max_concurrent_envs: Sessions served at once.
        advertise_host: Host clients should dial, when not ``host``.
        env_packages: Requirements the env needs (``{"pip": [...]}`` or ``{"uv": [...]}``).
        allow_install: Install missing ``env_packages`` (otherwise a missing one is an error).
        token: Shared secret clients must present.
    """
    if spec.startswith(_URL_SCHEMES):
        return spec, None
    ensure_env_packages(env_packages, allow_install=allow_install)
    make_env = env_factory(spec, env_config, factory=factory)
    served = ServedEnv(
        make_env=make_env, env_name=spec, max_concurrent_envs=max_concurrent_envs or 1, token=token
    )
    server = OpenEnvServer(served, host=host, port=port, advertise_host=advertise_host)
    return server.url, server


def ensure_env_packages(
    env_packages: Mapping[str, Sequence[str]] | None, *, allow_install: bool
) -> list[str]:
    """Make sure the env's declared requirements are installed; returns what was installed.

    Raises:
        EnvBuildError: a requirement is missing and ``allow_install`` is False, cannot be
            parsed, or fails to install; the message names the package.
    """
    missing: list[tuple[str, str]] = []
    for installer, requirements in (env_packages or {}).items():
        missing += [(installer, r) for r in requirements if not _satisfied(r)]
    if not missing:
        return []
    names = [requirement for _, requirement in missing]
    if not allow_install:
        raise EnvBuildError(
            f"env_packages: {', '.join(map(repr, names))} not installed; install with "
            f"`pip install {' '.join(names)}`, or let the first build install them "
            "(allow_install=True)"
        )
    for installer in dict.fromkeys(installer for installer, _ in missing):
        batch = [r for i, r in missing if i == installer]
        _install(installer, batch)
    return names


def _satisfied(requirement: str) -> bool:
    try:
        parsed = Requirement(requirement)
    except InvalidRequirement as exc:
        raise EnvBuildError(f"env_packages: cannot parse {requirement!r}: {exc}") from exc
    try:
        version = importlib.metadata.version(parsed.name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return parsed.specifier.contains(version, prereleases=True)


def _install(installer: str, requirements: list[str]) -> None:
    if installer == "uv" and shutil.which("uv") is not None:
        command = ["uv", "pip", "install", "--python", sys.executable, *requirements]
    else:
        command = [sys.executable, "-m", "pip", "install", *requirements]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise EnvBuildError(
            f"env_packages: installing {', '.join(map(repr, requirements))} failed "
            f"(exit {done.returncode}):\n{tail}"
        )
    importlib.invalidate_caches()
