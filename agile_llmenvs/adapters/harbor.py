"""Harbor (terminal-bench) tasks as terminal environments, each episode in a container.

``HarborAdapter().get_environment("terminal-bench@2.0", max_steps=30)`` gives a
:class:`~agile_llmenvs.adapters.terminal.TerminalEnvironment` whose sandboxes are Harbor
container environments: the same actions, budgets, states and restore as the local terminal
env. :func:`harbor_restore` is the one replay routine the terminal env uses; a plain loop of
``env.step`` would spend the continuation's time budget on the replay.

The ``harbor`` package is imported only when an environment is built. It needs Python 3.12 or
newer and a container engine (Docker, or a cloud sandbox Harbor supports). Neither is on the
machines this library is tested on, so this module's container path is written against
Harbor's documented API (``EnvironmentFactory.create_environment``, ``BaseEnvironment.exec``,
``Verifier.verify``) but not exercised here; its replay logic is the terminal env's, which is.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import tempfile
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from agile_llmenvs.adapters.terminal import (
    CommandResult,
    SupportsReplay,
    TerminalConfig,
    TerminalEnvironment,
    Verdict,
    restore_by_replay,
    validate_replay_consistency,
)
from agile_llmenvs.core.types import State
from agile_llmenvs.errors import EnvBuildError, OptionalDependencyError

__all__ = ["HarborAdapter", "HarborSandbox", "harbor_restore", "validate_replay_consistency"]

_T = TypeVar("_T")
_EXEC_GRACE_S = 10.0  # beyond the command's own timeout, for the container round trip


def harbor_restore(env: SupportsReplay, state: State) -> State:
    """Restore a Harbor ``state`` on a fresh ``env`` by replay: the runners' ``restore_fn``.

    Checks the task name at the state's index (index drift across dataset versions), replays
    the state's commands with the time budget off, aborts on a continuation prompt, and
    re-anchors the budget before the continuation; see
    :func:`~agile_llmenvs.adapters.terminal.restore_by_replay`.
    """
    return restore_by_replay(env, state)


@dataclass(frozen=True)
class _HarborAPI:
    environment_factory: Any
    environment_type: Any
    task_class: Any
    trial_paths_class: Any
    verifier_class: Any


def _import_harbor() -> _HarborAPI:
    try:
        from harbor.environments.factory import EnvironmentFactory
        from harbor.models.environment_type import EnvironmentType
        from harbor.models.task.task import Task
        from harbor.models.trial.paths import TrialPaths
        from harbor.verifier.verifier import Verifier
    except ImportError as exc:
        raise OptionalDependencyError(
            "harbor",
            feature=(
                "Harbor tasks (harbor needs Python >= 3.12 and a container engine such as Docker)"
            ),
        ) from exc
    return _HarborAPI(EnvironmentFactory, EnvironmentType, Task, TrialPaths, Verifier)


class HarborAdapter:
    """Builds terminal environments from Harbor datasets.

    Args:
        environment_type: Harbor's environment type (``"docker"``, ``"daytona"``, ``"e2b"``,
            ...), the container runtime each episode starts.
        trials_dir: Where each episode's trial directory (logs, verifier output) is made;
            the system's temporary directory by default. Each is deleted with its episode.
    """

    def __init__(
        self, *, environment_type: str = "docker", trials_dir: str | Path | None = None
    ) -> None:
        self.environment_type = environment_type
        self.trials_dir = None if trials_dir is None else Path(trials_dir)
        self._tasks: dict[str, tuple[Any, ...]] = {}

    def get_environment(
        self,
        name: str = "terminal-bench@2.0",
        *,
        max_steps: int = 30,
        config: TerminalConfig | None = None,
        dataset_path: str | Path | None = None,
    ) -> TerminalEnvironment:
        """A terminal environment over a Harbor dataset's tasks, sorted by name.

        The task list is loaded once per dataset and adapter, so the environments an
        ``env_factory`` makes from one adapter share task indices.

        Args:
            name: The registry dataset, ``"name@version"`` (``"terminal-bench@2.0"``).
            max_steps: Steps per episode (overrides ``config.max_steps``).
            config: Time and output limits; defaults to ``TerminalConfig()``.
            dataset_path: A local folder of Harbor task folders, read instead of the registry.

        Raises:
            OptionalDependencyError: ``harbor`` is not installed.
            EnvBuildError: The dataset has no task, or the container engine is missing.
        """
        api = _import_harbor()
        self._check_engine()
        key = str(dataset_path) if dataset_path is not None else name
        if key not in self._tasks:
            self._tasks[key] = _load_tasks(api, name, dataset_path)
        source = HarborTaskSource(api, self._tasks[key], self)
        config = replace(config or TerminalConfig(), max_steps=max_steps)
        return TerminalEnvironment(source, config, name=f"harbor:{name}")

    def _check_engine(self) -> None:
        if self.environment_type == "docker" and shutil.which("docker") is None:
            raise EnvBuildError(
                "Harbor's 'docker' environments need a container engine, and no 'docker' "
                "command is on PATH; install and start Docker, or pass "
                "HarborAdapter(environment_type=...) for a cloud sandbox Harbor supports"
            )


def _load_tasks(api: _HarborAPI, name: str, dataset_path: str | Path | None) -> tuple[Any, ...]:
    if dataset_path is not None:
        root = Path(dataset_path)
        folders = sorted(p for p in root.iterdir() if (p / "task.toml").is_file())
        tasks = [api.task_class(task_dir=folder) for folder in folders]
    else:
        from harbor.registry.client.factory import RegistryClientFactory
        from harbor.tasks.client import TaskClient

        dataset, _, version = name.partition("@")
        spec = RegistryClientFactory.create().get_dataset_spec(dataset, version or None)
        ids = [task.to_source_task_id() for task in spec.tasks]
        tasks = [api.task_class(task_dir=d) for d in TaskClient().download_tasks(task_ids=ids)]
    if not tasks:
        where = f"dataset_path {str(dataset_path)!r}" if dataset_path else f"dataset {name!r}"
        raise EnvBuildError(f"{where} holds no Harbor task (folders with task.toml)")
    return tuple(sorted(tasks, key=lambda task: task.name))


class HarborTaskSource:
    """Harbor tasks as a :class:`~agile_llmenvs.adapters.terminal.TaskSource`."""

    def __init__(self, api: _HarborAPI, tasks: tuple[Any, ...], adapter: HarborAdapter) -> None:
        self._api, self._tasks, self._adapter = api, tasks, adapter

    @property
    def task_names(self) -> tuple[str, ...]:
        """The tasks' names, sorted."""
        return tuple(task.name for task in self._tasks)

    def instruction(self, task_index: int) -> str:
        """The task's ``instruction.md``."""
        return str(self._tasks[task_index].instruction).strip()

    def open(self, task_index: int, seed: int | None) -> HarborSandbox:
        """Start a container for the task (``seed`` is unused: Harbor tasks are fixed)."""
        return HarborSandbox(self._api, self._tasks[task_index], self._adapter)


class HarborSandbox:
    """One episode's Harbor container, driven from its own event loop.

    Harbor's environment API is asynchronous; each sandbox runs its calls on a private loop,
    so sandboxes of one batch can be driven from different threads.
    """

    def __init__(self, api: _HarborAPI, task: Any, adapter: HarborAdapter) -> None:
        self._api, self._task = api, task
        self._loop = asyncio.new_event_loop()
        self._trial_dir = Path(
            tempfile.mkdtemp(prefix="agile-llmenvs-harbor-", dir=adapter.trials_dir)
        )
        self._environment: Any = None
        try:
            self._trial_paths = api.trial_paths_class(trial_dir=self._trial_dir)
            self._trial_paths.mkdir()
            self._environment = api.environment_factory.create_environment(
                type=api.environment_type(adapter.environment_type),
                environment_dir=task.paths.environment_dir,
                environment_name=task.name,
                session_id=f"{task.name}-{uuid.uuid4().hex[:8]}",
                trial_paths=self._trial_paths,
                task_env_config=task.config.environment,
            )
            self._call(self._environment.start(force_build=False))
        except Exception as exc:
            self.close()
            raise EnvBuildError(
                f"Harbor could not start the container of task {task.name!r}: "
                f"{type(exc).__name__}: {exc}; is the container engine running?"
            ) from exc

    def run(self, command: str, timeout_s: float) -> CommandResult:
        """Run ``command`` with Harbor's ``exec`` (each command in a fresh shell: files
        persist between commands, the working directory and variables do not)."""
        started = time.monotonic()
        timeout_sec = max(1, math.ceil(min(timeout_s, 1e6)))
        try:
            result = self._call(
                self._environment.exec(command, timeout_sec=timeout_sec),
                timeout_s=timeout_sec + _EXEC_GRACE_S,
            )
        except TimeoutError:
            return CommandResult("", None, time.monotonic() - started, timed_out=True)
        output = (result.stdout or "") + (result.stderr or "")
        return CommandResult(output, result.return_code, time.monotonic() - started)

    def verify(self) -> Verdict:
        """Run the task's tests with Harbor's ``Verifier``; the reward is its ``"reward"``."""
        verifier = self._api.verifier_class(
            task=self._task, trial_paths=self._trial_paths, environment=self._environment
        )
        rewards = dict(self._call(verifier.verify()).rewards or {})
        reward = rewards.get("reward", next(iter(rewards.values()), 0.0))
        return Verdict(float(reward), json.dumps(rewards))

    def close(self) -> None:
        """Stop and delete the container and the trial directory."""
        try:
            if self._environment is not None:
                self._call(self._environment.stop(delete=True))
        finally:
            self._environment = None
            self._loop.close()
            shutil.rmtree(self._trial_dir, ignore_errors=True)

    def _call(self, coroutine: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        return self._loop.run_until_complete(asyncio.wait_for(coroutine, timeout_s))
