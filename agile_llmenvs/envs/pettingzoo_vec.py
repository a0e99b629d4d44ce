"""Vectorised PettingZoo parallel environments: many sub-envs behind one batched interface.

:class:`AsyncPettingZooVecEnv` runs each sub-env in its own subprocess (pipes);
:class:`SyncPettingZooVecEnv` runs them in-process with the same API (debugging, reference).
All sub-envs must share ``possible_agents`` and per-agent spaces. With ``n = num_envs``:

* observations: agent -> batch built with gymnasium's ``create_empty_array``/``concatenate``
  (``(n, *shape)`` for ``Box``; nested for ``Dict``/``Tuple``). An agent not alive in sub-env
  ``i`` gets zeros there.
* rewards / terminations / truncations: agent -> ``(n,)`` array of ``float32`` / ``bool`` /
  ``bool``. A non-alive agent gets ``0`` / ``True`` / ``False``; its actions are not passed on.
* infos: agent -> ``list`` of ``n`` info dicts (empty for non-alive agents).

Same-step auto-reset: when no agent of sub-env ``i`` is alive after a step (all terminated or
truncated, or ``env.agents`` empty), it is reset at once. The step returns the *reset*
observation with the final step's rewards and flags; ``infos[agent][i]`` is the reset info plus
``"_autoreset": True`` for every possible agent and, for agents that acted in the final step,
``"final_observation"`` and ``"final_info"``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any, Self, cast

import cloudpickle
import numpy as np
from gymnasium.spaces import Space
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate
from pettingzoo import ParallelEnv

from agile_llmenvs.errors import AgileLLMEnvsError, EnvBuildError

__all__ = [
    "AUTORESET_KEY",
    "FINAL_INFO_KEY",
    "FINAL_OBS_KEY",
    "AsyncPettingZooVecEnv",
    "SyncPettingZooVecEnv",
    "VecEnvStateError",
    "VecEnvWorkerError",
]

AUTORESET_KEY = "_autoreset"
FINAL_OBS_KEY = "final_observation"
FINAL_INFO_KEY = "final_info"
_ERROR_CLOSE_GRACE_S = 5.0  # after a failure, workers get this long to exit before SIGTERM

EnvFn = Callable[[], ParallelEnv]
_Spaces = tuple[list[str], dict[str, tuple[Space[Any], Space[Any]]]]
_StepOut = tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]


class VecEnvWorkerError(AgileLLMEnvsError, RuntimeError):
    """A sub-env raised (or its worker died) during reset/step; the vector env is now closed.

    Attributes:
        index: Index of the failing sub-env.
        traceback_text: The original traceback (or a description of the failure).
    """

    def __init__(self, index: int, traceback_text: str) -> None:
        super().__init__(
            f"sub-env {index} failed; the vector env has been closed. "
            f"Original error:\n{traceback_text}"
        )
        self.index = index
        self.traceback_text = traceback_text


class VecEnvStateError(AgileLLMEnvsError, RuntimeError):
    """A method was called in the wrong state (after close, or out of step_async/wait order)."""


def _close_quietly(env: ParallelEnv) -> None:
    with contextlib.suppress(Exception):
        env.close()


def _describe(env: ParallelEnv) -> _Spaces:
    """Read the agent list and per-agent spaces of a built sub-env."""
    agents = list(env.possible_agents)
    return agents, {a: (env.observation_space(a), env.action_space(a)) for a in agents}


def _step_sub_env(env: ParallelEnv, actions: Mapping[str, Any]) -> _StepOut:
    """Step one sub-env with the actions of its live agents, auto-resetting when it is over.

    This is the single implementation of stepping used by the worker loop and the sync env.
    """
    live = set(env.agents)
    obs, rewards, terms, truncs, infos = env.step({a: v for a, v in actions.items() if a in live})
    infos = {a: dict(i) for a, i in infos.items()}
    if not all(terms.get(a, False) or truncs.get(a, False) for a in env.agents):
        return obs, rewards, terms, truncs, infos
    final_obs, final_infos = obs, infos
    obs, reset_infos = env.reset()
    infos = {}
    for agent in env.possible_agents:
        info = {**reset_infos.get(agent, {}), AUTORESET_KEY: True}
        if agent in final_obs:
            info[FINAL_OBS_KEY] = final_obs[agent]
            info[FINAL_INFO_KEY] = final_infos.get(agent, {})
        infos[agent] = info
    return obs, rewards, terms, truncs, infos


def _infos(per_env: Sequence[Mapping[str, Any]], agent: str) -> list[dict[str, Any]]:
    return [dict(i.get(agent, {})) for i in per_env]


def _execute(env: ParallelEnv, command: str, data: Any) -> Any:
    """Run one command (``"reset"`` or ``"step"``) on a sub-env and return its raw result."""
    if command == "reset":
        seed, options = data
        return env.reset(seed=seed, options=options)
    if command == "step":
        return _step_sub_env(env, data)
    raise ValueError(f"unknown command {command!r}")


def _worker(env_fn_bytes: bytes, conn: Connection, parent: Connection | None) -> None:
    """Subprocess main loop: build the env, report its spaces, then serve commands."""
    if parent is not None:  # fork start method: drop the inherited parent end
        parent.close()
    env: ParallelEnv | None = None
    try:
        env = cloudpickle.loads(env_fn_bytes)()
        conn.send((True, _describe(env)))
        while True:
            command, data = conn.recv()
            if command == "close":
                break
            try:
                conn.send((True, _execute(env, command, data)))
            except Exception:
                conn.send((False, traceback.format_exc()))
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass
    except Exception:  # build or describe failed
        conn.send((False, traceback.format_exc()))
    finally:
        if env is not None:
            _close_quietly(env)
        conn.close()


class _PettingZooVecEnvBase:
    """Spaces, argument checks and batching shared by the sync and async vector envs."""

    num_envs: int
    possible_agents: list[str]

    def _init_spaces(self, described: Sequence[_Spaces]) -> None:
        self.num_envs = len(described)
        self.possible_agents, spaces = described[0]
        for i, other in enumerate(described[1:], start=1):
            if other != described[0]:
                raise EnvBuildError(
                    f"sub-env {i} has agents/spaces {other} but sub-env 0 has {described[0]}; "
                    "all sub-envs of a vector env must match"
                )
        self._single_obs = {a: s[0] for a, s in spaces.items()}
        self._single_act = {a: s[1] for a, s in spaces.items()}
        self._batch_obs = {a: batch_space(s, self.num_envs) for a, s in self._single_obs.items()}
        self._batch_act = {a: batch_space(s, self.num_envs) for a, s in self._single_act.items()}
        self._zero_obs = {
            a: next(iter(iterate(batch_space(s, 1), create_empty_array(s, 1, fn=np.zeros))))
            for a, s in self._single_obs.items()
        }
        self._waiting = False
        self._closed = False

    @property
    def agents(self) -> list[str]:
        """All agents of the sub-envs (the same list as ``possible_agents``)."""
        return list(self.possible_agents)

    def single_observation_space(self, agent: str) -> Space[Any]:
        """The observation space of ``agent`` in one sub-env."""
        return self._single_obs[agent]

    def single_action_space(self, agent: str) -> Space[Any]:
        """The action space of ``agent`` in one sub-env."""
        return self._single_act[agent]

    def observation_space(self, agent: str) -> Space[Any]:
        """The batched observation space of ``agent`` (``batch_space`` over ``num_envs``)."""
        return self._batch_obs[agent]

    def action_space(self, agent: str) -> Space[Any]:
        """The batched action space of ``agent`` (``batch_space`` over ``num_envs``)."""
        return self._batch_act[agent]

    def _check_open(self, *, waiting: bool) -> None:
        if self._closed:
            raise VecEnvStateError("the vector env is closed")
        if self._waiting != waiting:
            need = "a step_async call to be pending" if waiting else "no pending step_async call"
            raise VecEnvStateError(f"this call needs {need}; call step_async then step_wait")

    def _seeds(self, seed: int | list[int] | None) -> list[int | None]:
        if seed is None:
            return [None] * self.num_envs
        if isinstance(seed, int | np.integer):
            return [int(seed) + i for i in range(self.num_envs)]
        if len(seed) != self.num_envs:
            raise ValueError(f"got {len(seed)} seeds for {self.num_envs} sub-envs; pass one each")
        return list(seed)

    def _split_actions(self, actions: Mapping[str, Any]) -> list[dict[str, Any]]:
        per_env: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        for agent, batched in actions.items():
            if agent not in self._batch_act:
                raise ValueError(f"unknown agent {agent!r}; expected one of {self.possible_agents}")
            items = list(iterate(self._batch_act[agent], batched))
            if len(items) != self.num_envs:
                raise ValueError(
                    f"actions[{agent!r}] has {len(items)} entries; expected num_envs="
                    f"{self.num_envs} (one per sub-env along the first axis)"
                )
            for env_actions, item in zip(per_env, items, strict=True):
                env_actions[agent] = item
        return per_env

    def _stack(self, per_env: Sequence[Mapping[str, Any]], agent: str) -> Any:
        space = self._single_obs[agent]
        items = [d[agent] if agent in d else self._zero_obs[agent] for d in per_env]
        out: Any = create_empty_array(space, self.num_envs, fn=np.zeros)
        return concatenate(space, items, out)

    def _batch_step(self, results: Sequence[_StepOut]) -> _StepOut:
        obs, rewards, terms, truncs, infos = (list(part) for part in zip(*results, strict=True))
        agents = self.possible_agents
        return (
            {a: self._stack(obs, a) for a in agents},
            {a: np.array([r.get(a, 0.0) for r in rewards], dtype=np.float32) for a in agents},
            {a: np.array([bool(t.get(a, True)) for t in terms], dtype=bool) for a in agents},
            {a: np.array([bool(t.get(a, False)) for t in truncs], dtype=bool) for a in agents},
            {a: _infos(infos, a) for a in agents},
        )

    def reset(
        self, seed: int | list[int] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Reset every sub-env.

        Args:
            seed: ``None``; an int ``s`` (sub-env ``i`` is seeded with ``s + i``); or one seed
                per sub-env.
            options: Passed unchanged to every sub-env's ``reset``.

        Returns:
            ``(observations, infos)``: agent -> batched observation, agent -> list of info dicts.
        """
        self._check_open(waiting=False)
        self._send_all("reset", [(s, options) for s in self._seeds(seed)])
        obs, infos = zip(*self._recv_all(None), strict=True)
        agents = self.possible_agents
        return {a: self._stack(obs, a) for a in agents}, {a: _infos(infos, a) for a in agents}

    def step(self, actions: Mapping[str, Any]) -> _StepOut:
        """Step every sub-env; see the module docstring for the layout and auto-reset.

        Args:
            actions: agent -> batched actions with ``num_envs`` entries along the first axis.

        Returns:
            ``(observations, rewards, terminations, truncations, infos)``.
        """
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Mapping[str, Any]) -> None:
        """Start a step with ``actions`` (see :meth:`step`); collect it with :meth:`step_wait`."""
        self._check_open(waiting=False)
        self._send_all("step", self._split_actions(actions))
        self._waiting = True

    def step_wait(self, timeout: float | None = None) -> _StepOut:
        """Wait for the step started by :meth:`step_async` and return its batched result.

        Args:
            timeout: Seconds to wait for all sub-envs (``None``: no limit; ignored by the sync
                env). On timeout a :class:`VecEnvWorkerError` is raised and the env closed.
        """
        self._check_open(waiting=True)
        self._waiting = False
        return self._batch_step(self._recv_all(timeout))

    def _send_all(self, command: str, payloads: Sequence[Any]) -> None:
        raise NotImplementedError

    def _recv_all(self, timeout: float | None) -> list[Any]:
        raise NotImplementedError

    def close(self, timeout: float | None = None) -> None:
        """Close every sub-env; calling it again does nothing."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close(timeout=0.0)
        except Exception:
            pass


class SyncPettingZooVecEnv(_PettingZooVecEnvBase):
    """Runs the sub-envs one after another in this process (same API as the async env).

    Args:
        env_fns: One callable per sub-env, each returning a ``pettingzoo.ParallelEnv``.

    Raises:
        EnvBuildError: A sub-env could not be built or lacks ``possible_agents``/spaces, or the
            sub-envs disagree on agents/spaces.
    """

    def __init__(self, env_fns: Sequence[EnvFn]) -> None:
        self._closed = True
        if not env_fns:
            raise EnvBuildError("env_fns is empty; pass at least one env constructor")
        self.envs: list[ParallelEnv] = []
        self._pending: list[Any] = []
        described: list[_Spaces] = []
        try:
            for i, fn in enumerate(env_fns):
                try:
                    self.envs.append(fn())
                    described.append(_describe(self.envs[-1]))
                except Exception as exc:
                    tb = traceback.format_exc()
                    raise EnvBuildError(f"sub-env {i} failed to build:\n{tb}") from exc
            self._init_spaces(described)
        except EnvBuildError:
            for env in self.envs:
                _close_quietly(env)
            raise

    def _send_all(self, command: str, payloads: Sequence[Any]) -> None:
        self._pending = [(command, p) for p in payloads]

    def _recv_all(self, timeout: float | None) -> list[Any]:
        pending, self._pending = self._pending, []
        results = []
        for i, (env, (command, data)) in enumerate(zip(self.envs, pending, strict=True)):
            try:
                results.append(_execute(env, command, data))
            except Exception as exc:
                self.close()
                raise VecEnvWorkerError(i, traceback.format_exc()) from exc
        return results

    def close(self, timeout: float | None = None) -> None:
        """Close every sub-env; idempotent. ``timeout`` is accepted for API parity."""
        if self._closed:
            return
        self._closed = True
        for env in self.envs:
            _close_quietly(env)


class AsyncPettingZooVecEnv(_PettingZooVecEnvBase):
    """Runs each sub-env in its own subprocess, communicating over pipes.

    Args:
        env_fns: One callable per sub-env, each returning a ``pettingzoo.ParallelEnv``. They are
            pickled with cloudpickle, so lambdas and locally defined classes work.
        context: multiprocessing start method; default ``"forkserver"`` where available, else
            ``"spawn"``.

    Raises:
        EnvBuildError: A sub-env could not be built or lacks ``possible_agents``/spaces, or the
            sub-envs disagree on agents/spaces. The workers are shut down first.
    """

    def __init__(self, env_fns: Sequence[EnvFn], *, context: str | None = None) -> None:
        self._closed = True
        if not env_fns:
            raise EnvBuildError("env_fns is empty; pass at least one env constructor")
        if context is None:
            context = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        ctx = cast(Any, mp.get_context(context))  # typeshed: BaseContext lacks .Process
        self._conns: list[Connection] = []
        self.processes: list[mp.process.BaseProcess] = []
        for i, fn in enumerate(env_fns):
            parent, child = ctx.Pipe()
            inherit = parent if context == "fork" else None
            proc = ctx.Process(
                target=_worker,
                args=(cloudpickle.dumps(fn), child, inherit),
                name=f"PettingZooVecEnvWorker-{i}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self.processes.append(proc)
        self._closed = False
        self._waiting = False
        try:
            self._init_spaces(self._recv_all(None))
        except VecEnvWorkerError as exc:
            raise EnvBuildError(
                f"sub-env {exc.index} failed to build:\n{exc.traceback_text}"
            ) from exc
        except BaseException:
            self.close()
            raise

    def _send_all(self, command: str, payloads: Sequence[Any]) -> None:
        for i, (conn, data) in enumerate(zip(self._conns, payloads, strict=True)):
            try:
                conn.send((command, data))
            except (OSError, ValueError) as exc:
                self.close(timeout=_ERROR_CLOSE_GRACE_S)
                raise VecEnvWorkerError(i, f"worker pipe is broken ({exc!r})") from exc

    def _recv_all(self, timeout: float | None) -> list[Any]:
        """Collect one reply from every worker; on any failure close and raise the first one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results: list[Any] = []
        error: tuple[int, str] | None = None
        for i, conn in enumerate(self._conns):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                if not conn.poll(left):
                    error = error or (i, f"no reply within timeout={timeout}s")
                    break
                ok, payload = conn.recv()
            except (EOFError, OSError):
                self.processes[i].join(1.0)
                code = self.processes[i].exitcode
                ok, payload = False, f"worker process died (exit code {code})"
            results.append(payload)
            if not ok and error is None:
                error = (i, payload)
        if error is not None:
            self.close(timeout=0.0 if deadline is not None else _ERROR_CLOSE_GRACE_S)
            raise VecEnvWorkerError(*error)
        return results

    def close(self, timeout: float | None = None) -> None:
        """Shut the workers down; idempotent.

        Args:
            timeout: Seconds to wait for a pending step and for workers to exit before they are
                terminated (``None``: wait without limit).
        """
        if self._closed:
            return
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        for conn, proc in zip(self._conns, self.processes, strict=True):
            try:
                if self._waiting and proc.is_alive() and conn.poll(left()):
                    conn.recv()  # drain the pending step reply
                conn.send(("close", None))
            except (OSError, EOFError, ValueError):
                pass
        self._waiting = False
        for proc in self.processes:
            proc.join(left())
            if proc.is_alive():
                proc.terminate()
                proc.join()
        for conn in self._conns:
            conn.close()
