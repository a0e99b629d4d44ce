"""Specs of classic environments: gymnasium / PettingZoo, offline datasets, contextual bandits.

Specs are data only: they validate a manifest section and say what to build. Construction
lives in :mod:`agile_llmenvs.envs`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, Field, field_validator, model_validator

from agile_llmenvs.specs._types import SPEC_CONFIG, ImportPath, ObjectPath, Port

__all__ = ["BanditEnvSpec", "EnvServiceSpec", "GymEnvSpec", "OfflineEnvSpec", "fail"]

_VERSIONED = re.compile(r"-v\d+$")
_BARE_ATTR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_MODULE_ATTR = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

WrapperEntry = ObjectPath | tuple[ObjectPath, dict[str, Any]]


def fail(field: str, message: str) -> ValueError:
    """Build the error a cross-field rule raises: the field first, then what to do."""
    return ValueError(f"{field}: {message}")


class GymEnvSpec(BaseModel):
    """A gymnasium or PettingZoo environment, or a custom one from an entrypoint.

    How the single env is built, first match wins:

    * ``entrypoint`` and ``factory``: ``factory(entrypoint, **env_config)`` (e.g. a registry id
      handed to a ``make`` function);
    * ``entrypoint``: the class or callable at ``module:attr`` (or the attribute of the Python
      file at ``path``), called with ``**env_config``;
    * ``factory``: ``factory(env_id, **env_config)``;
    * otherwise ``gymnasium.make(env_id, **env_config)`` (for PettingZoo, ``name`` is the env
      module, e.g. ``pettingzoo.butterfly.pistonball_v6``, and its ``parallel_env`` is called).
    """

    model_config = SPEC_CONFIG

    num_envs: Annotated[int, Field(ge=1, description="Number of copies in the vector env.")] = 32
    version: str | int | None = Field(
        None, description="Version appended to `name` as `-v{version}` (e.g. 1 -> CartPole-v1)."
    )
    env_type: Literal["gym"] = Field("gym", description="Discriminator: a gymnasium-style env.")
    name: str = Field(
        min_length=1, description="Registry id (e.g. `CartPole-v1`) or PettingZoo env module."
    )
    custom: bool = Field(
        False, description="The env is user code built from `entrypoint` or `factory`."
    )
    default_type: str = Field(
        "float32", description="numpy dtype floating-point observations are cast to."
    )
    entrypoint: str | None = Field(
        None,
        min_length=1,
        description="`module:Class` of a custom env, a bare attribute of the file at `path`, "
        "or the id handed to `factory`.",
    )
    factory: ImportPath | None = Field(
        None, description="`module:attr` callable receiving the env id (or `entrypoint`)."
    )
    path: str | None = Field(
        None, min_length=1, description="Python file that `entrypoint`/`factory` live in."
    )
    env_config: dict[str, Any] | str | None = Field(
        None, description="Keyword arguments for the env, or the path of a YAML/JSON file of them."
    )
    env_wrappers: list[WrapperEntry] | None = Field(
        None,
        description="Wrappers applied in order to each env: an import path, or "
        "`[import_path, {kwargs}]`.",
    )
    sync: bool = Field(
        False,
        description="Step the copies in this process (SyncVectorEnv) instead of subprocesses.",
    )

    @field_validator("default_type")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        try:
            dtype = np.dtype(value)
        except TypeError:
            raise ValueError(
                f"expected a numpy dtype name such as 'float32', got {value!r}"
            ) from None
        return dtype.name

    @model_validator(mode="after")
    def _check_sources(self) -> GymEnvSpec:
        if self.version is not None and _VERSIONED.search(self.name):
            raise fail(
                "version",
                f"name {self.name!r} already ends in a version; drop `version` or the suffix",
            )
        if self.custom and self.entrypoint is None and self.factory is None:
            raise fail("custom", "a custom env needs an `entrypoint` or a `factory` to build it")
        if self.path is not None and self.entrypoint is None and self.factory is None:
            raise fail("path", "`path` names the file that `entrypoint` or `factory` live in")
        if self.entrypoint is not None and self.factory is None:
            pattern = _BARE_ATTR if self.path is not None else _MODULE_ATTR
            if not pattern.match(self.entrypoint):
                want = "an attribute name in the file at `path`" if self.path else "'module:attr'"
                raise fail("entrypoint", f"expected {want}, got {self.entrypoint!r}")
        return self

    @property
    def env_id(self) -> str:
        """The registry id: ``name`` with ``-v{version}`` appended when a version is given."""
        return self.name if self.version is None else f"{self.name}-v{self.version}"


class OfflineEnvSpec(GymEnvSpec):
    """A gym environment whose transitions come from a fixed dataset.

    The env itself (for evaluation) is built as for :class:`GymEnvSpec`; the transitions come
    from exactly one of ``dataset_path`` (a local ``.npz``/``.h5`` file) or
    ``minari_dataset_id``.
    """

    env_type: Literal["offline"] = Field(  # type: ignore[assignment]
        "offline", description="Discriminator: an env with an offline dataset."
    )
    minari_dataset_id: str | None = Field(
        None, min_length=1, description="Minari dataset id (local Minari cache unless `remote`)."
    )
    dataset_path: str | None = Field(
        None,
        min_length=1,
        description="Local dataset file: `.npz` or `.h5`/`.hdf5` with observations, actions, "
        "rewards, next_observations and terminals.",
    )
    remote: bool = Field(False, description="Download the Minari dataset if it is not cached.")

    @model_validator(mode="after")
    def _check_dataset(self) -> OfflineEnvSpec:
        if (self.minari_dataset_id is None) == (self.dataset_path is None):
            given = "both" if self.dataset_path else "neither"
            raise fail(
                "dataset_path",
                f"an offline env needs exactly one of `dataset_path` or `minari_dataset_id` "
                f"({given} given)",
            )
        if self.remote and self.minari_dataset_id is None:
            raise fail("remote", "`remote` downloads a Minari dataset; set `minari_dataset_id`")
        return self


class BanditEnvSpec(BaseModel):
    """A tabular dataset wrapped as a contextual-bandit environment.

    ``features`` is a table (CSV, JSON lines or parquet) of one row per context and ``targets``
    a table of one column: the index of the arm that pays 1. Both may instead be handed to
    :func:`~agile_llmenvs.envs.make_bandit_env` in memory.
    """

    model_config = SPEC_CONFIG

    num_envs: Annotated[int, Field(ge=1, description="Number of bandit copies.")] = 1
    version: str | int | None = Field(None, description="Free-form version label of the data.")
    env_type: Literal["bandit"] = Field("bandit", description="Discriminator: a bandit env.")
    name: str = Field("BanditEnv", min_length=1, description="Name shown in logs.")
    features: str | None = Field(None, min_length=1, description="Path of the features table.")
    targets: str | None = Field(None, min_length=1, description="Path of the targets table.")
    entrypoint: ImportPath | None = Field(
        None, description="`module:Class` of a custom bandit env, called with the tables."
    )
    path: str | None = Field(None, min_length=1, description="Python file `entrypoint` lives in.")
    env_config: dict[str, Any] | None = Field(
        None, description="Extra keyword arguments for the bandit env."
    )

    @model_validator(mode="after")
    def _check_tables(self) -> BanditEnvSpec:
        if (self.features is None) != (self.targets is None):
            missing = "targets" if self.targets is None else "features"
            raise fail(missing, "`features` and `targets` are given together (or neither)")
        if self.path is not None and self.entrypoint is None:
            raise fail("path", "`path` names the file that `entrypoint` lives in")
        return self


class EnvServiceSpec(BaseModel):
    """A sidecar service started beside each env host (a database, a sandbox daemon, ...)."""

    model_config = SPEC_CONFIG

    name: str = Field(
        min_length=1,
        pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$",
        description="Service name (lowercase letters, digits and '-'), unique per host.",
    )
    image: str | None = Field(None, min_length=1, description="Container image to run.")
    command: list[str] | None = Field(
        None, min_length=1, description="Command (argv) to run, or to override the image's."
    )
    port: Port | None = Field(None, description="Port the service listens on, if any.")
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="Environment variables of the service."
    )
    ready_timeout_s: float = Field(
        60.0, gt=0.0, description="Seconds to wait for the service to accept connections."
    )

    @model_validator(mode="after")
    def _check_runnable(self) -> EnvServiceSpec:
        if self.image is None and self.command is None:
            raise fail("command", "a service needs a `command` or an `image` to run")
        return self
