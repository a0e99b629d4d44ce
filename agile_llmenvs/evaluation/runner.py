"""The lock-step trajectory runner: one backend call per step for every live trajectory.

``run_batch`` resets one episode per task, then repeats: build the messages of every live
trajectory, generate all their completions in a single backend call, step each trajectory's
episode with its completion, and drop those that finished. As trajectories end the batch
shrinks, and short ones never wait on long ones beyond the step they are in.

Images an env sends in ``info["images"]`` are shown in the user message they came with (see
:mod:`~agile_llmenvs.evaluation.images`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agile_llmenvs.backends.types import Backend, Completion, Message, SamplingParams
from agile_llmenvs.core.types import Action, Environment, State
from agile_llmenvs.errors import EvaluationError
from agile_llmenvs.evaluation.images import shown_images
from agile_llmenvs.evaluation.instances import run_from_states
from agile_llmenvs.evaluation.lockstep import (
    ProgressCallback,
    ProgressCounter,
    Rollout,
    chunked,
    run_lockstep,
)
from agile_llmenvs.evaluation.results import BatchResult, StopReason, Trajectory, Turn
from agile_llmenvs.llm_envs.image_framing import with_images
from agile_llmenvs.transport.images import IMAGES_FIELD, ImageObservationError, image_values

__all__ = ["RunnerConfig", "TrajectoryRunner"]


@dataclass(frozen=True)
class RunnerConfig:
    """How a runner frames and bounds episodes.

    Attributes:
        system_prompt: A system message put before every conversation.
        max_steps: Most steps per trajectory (further capped by the env's ``max_turns``).
        seed: When set, task ``i`` is reset with seed ``seed + i``.
        success_threshold: Total reward at which a trajectory counts as solved, for envs
            whose final ``info`` has no ``"success"``.
    """

    system_prompt: str | None = None
    max_steps: int = 10
    seed: int | None = None
    success_threshold: float = 1.0

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")


class TrajectoryRunner:
    """Runs batches of trajectories of one environment in lock-step.

    Args:
        environment: The environment; a non-pure one must run several episodes at once
            (``from_text_env`` given a factory does).
        backend: Generates the completions.
        sampling_params: How to sample; defaults to ``SamplingParams()``.
        config: System prompt, step budget, seeding and the success threshold.
        env_factory: Makes fresh, independent environments. With ``restore_fn``, rollouts
            from states of a non-pure env each get their own instance (see
            :meth:`run_batch_from_states`); ignored for a pure-step env.
        restore_fn: ``restore_fn(fresh_env, state) -> state``: brings a fresh instance to
            ``state`` (by replay, say: :func:`~agile_llmenvs.core.replay.replay_restore`)
            and returns the restored state, which is then stepped on that instance.
    """

    def __init__(
        self,
        environment: Environment,
        backend: Backend,
        sampling_params: SamplingParams | None = None,
        *,
        config: RunnerConfig | None = None,
        env_factory: Callable[[], Environment] | None = None,
        restore_fn: Callable[[Environment, State], Any] | None = None,
    ) -> None:
        self.environment = environment
        self.backend = backend
        self.sampling_params = sampling_params or SamplingParams()
        self.config = config or RunnerConfig()
        self.env_factory = env_factory
        self.restore_fn = restore_fn

    @property
    def max_steps(self) -> int:
        """The step budget: the config's, capped by the env's own ``max_turns``."""
        env_turns = self.environment.spec.max_turns
        return min(self.config.max_steps, env_turns) if env_turns else self.config.max_steps

    def run_batch(
        self,
        task_indices: Sequence[int],
        batch_size: int | None = None,
        progress_callback: ProgressCallback | None = None,
    ) -> BatchResult:
        """Run one trajectory per task, all in lock-step (or ``batch_size`` at a time).

        Args:
            task_indices: The tasks (dataset rows) to run, in the order results come back.
            batch_size: Run at most this many trajectories at once: tasks are processed in
                chunks of this size, one after another. ``None`` runs them all together.
            progress_callback: ``callback(completed, total)`` after each trajectory ends.

        Returns:
            The trajectories, in the order of ``task_indices``.

        Raises:
            EvaluationError: ``batch_size`` is below 1.
            BackendError: The backend refused a request outright (a bad key or model).
        """
        indices = list(task_indices)
        results = []
        progress = ProgressCounter(len(indices), progress_callback)
        for chunk in chunked(indices, batch_size):
            rollouts = [self.start(i) for i in chunk]
            run_lockstep(rollouts, self.backend, self.sampling_params, progress)
            results.append(self.collect(rollouts))
        return BatchResult.concat(results, self.environment.spec.name)

    def run_batch_from_states(
        self,
        states: Sequence[State],
        batch_size: int | None = None,
        progress_callback: ProgressCallback | None = None,
    ) -> BatchResult:
        """Continue one trajectory from each state, in lock-step (Monte-Carlo rollouts).

        A pure-step env runs every rollout on the runner's environment (a state may appear
        any number of times). A non-pure env with ``env_factory`` and ``restore_fn`` gives
        each rollout a fresh instance restored to its state (in parallel threads), steps the
        instances in parallel threads with one backend call per step for all, and closes
        every instance when the chunk ends, also on error. A non-pure env without them can
        only continue distinct live episodes, each once.

        Args:
            states: The states to continue from; results come back in this order.
            batch_size: At most this many rollouts (and, on the multi-instance path, live
                env instances) at once; more states run in consecutive chunks.
            progress_callback: ``callback(completed, total)`` after each trajectory ends.

        Returns:
            One trajectory per state: its turns and reward are the continuation's only; its
            messages hold the whole conversation. The step budget counts the steps taken
            before the state.

        Raises:
            EvaluationError: ``batch_size`` is below 1, ``env_factory`` is given without
                ``restore_fn``, or a non-pure env without them is given the same episode twice.
        """
        return run_from_states(self, states, None, batch_size, progress_callback)

    def run_batch_from_state_actions(
        self,
        states: Sequence[State],
        actions: Sequence[Action],
        batch_size: int | None = None,
        progress_callback: ProgressCallback | None = None,
    ) -> BatchResult:
        """Like :meth:`run_batch_from_states`, with each rollout's first step forced.

        Rollout ``i`` takes ``actions[i]`` in ``states[i]`` and then follows the backend,
        so the mean total reward over rollouts of one ``(state, action)`` pair estimates its
        Q-value.

        Raises:
            EvaluationError: ``states`` and ``actions`` differ in length, or as for
                :meth:`run_batch_from_states`.
        """
        if len(actions) != len(states):
            raise EvaluationError(
                f"run_batch_from_state_actions needs one action per state; got "
                f"{len(states)} states and {len(actions)} actions"
            )
        return run_from_states(self, states, actions, batch_size, progress_callback)

    # The per-trajectory steps, also driven by run_multi_evaluation's shared loop.

    def start(self, task_index: int) -> Rollout:
        """Reset an episode for ``task_index``; an env error ends it at once, as a value, as
        do images the policy cannot see.

        Raises:
            EvaluationError: the env sent images and the backend takes none (see
                :func:`~agile_llmenvs.evaluation.images.shown_images`).
        """
        rollout = Rollout(self, task_index)
        seed = None if self.config.seed is None else self.config.seed + task_index
        try:
            rollout.state, rollout.last_info = self.environment.reset(
                seed=seed, options={"row_index": task_index}
            )
        except Exception as exc:
            rollout.stop_reason, rollout.error = StopReason.ENV_ERROR, _describe(exc)
            return rollout
        self._show(rollout, 0, image_values(rollout.last_info.pop(IMAGES_FIELD, None)))
        return rollout

    def messages(self, rollout: Rollout) -> list[Message]:
        """The conversation to generate the next action of ``rollout`` from (a message that
        shows images holds them as image parts before its text)."""
        assert rollout.state is not None
        system = self.config.system_prompt
        head: list[Message] = [{"role": "system", "content": system}] if system else []
        shown = rollout.images
        return head + [
            {**message, "content": with_images(message["content"], shown[i])}
            if i in shown
            else message
            for i, message in enumerate(rollout.state.messages)
        ]

    def advance(self, rollout: Rollout, completion: Completion) -> None:
        """Step ``rollout``'s episode with ``completion``, ending it when it is done."""
        assert rollout.state is not None
        if completion.finish_reason == "error":
            self._end(rollout, StopReason.BACKEND_ERROR, completion.error or "backend error")
            return
        self.act(rollout, Action.from_completion(completion))

    def act(self, rollout: Rollout, action: Action) -> None:
        """Step ``rollout``'s episode with ``action``, ending it when it is done.

        Raises:
            EvaluationError: as :meth:`start`, for the images of the next observation.
        """
        assert rollout.state is not None
        try:
            result = rollout.environment.step(rollout.state, action)
        except Exception as exc:
            self._end(rollout, StopReason.ENV_ERROR, _describe(exc))
            return
        info = dict(result.info)
        # they go to the policy, with the observation
        images = image_values(info.pop(IMAGES_FIELD, None))
        rollout.state, rollout.last_info = result.next_state, dict(info)
        rollout.turns.append(Turn(action, result.next_state.observation, result.reward, info))
        if result.terminated:
            rollout.stop_reason = StopReason.TERMINATED
        elif result.truncated:
            rollout.stop_reason = StopReason.TRUNCATED
        elif rollout.base_steps + len(rollout.turns) >= self.max_steps:
            self._end(rollout, StopReason.MAX_STEPS)
        else:
            self._show(rollout, len(result.next_state.messages) - 1, images)

    def collect(self, rollouts: Sequence[Rollout]) -> BatchResult:
        """The finished ``rollouts`` as a :class:`BatchResult`."""
        return BatchResult(tuple(self.trajectory(r) for r in rollouts), self.environment.spec.name)

    def trajectory(self, rollout: Rollout) -> Trajectory:
        """The finished ``rollout`` as a :class:`Trajectory`."""
        assert rollout.stop_reason is not None
        total = sum(turn.reward for turn in rollout.turns)
        if "success" in rollout.last_info and rollout.stop_reason in _CLEAN_ENDS:
            success = bool(rollout.last_info["success"])
        else:
            success = rollout.stop_reason in _CLEAN_ENDS and total >= self.config.success_threshold
        messages = self.messages(rollout) if rollout.state is not None else []
        return Trajectory(
            task_index=rollout.task_index,
            env_name=self.environment.spec.name,
            turns=tuple(rollout.turns),
            messages=tuple(messages),
            total_reward=total,
            success=success,
            stop_reason=rollout.stop_reason,
            error=rollout.error,
        )

    def _show(self, rollout: Rollout, index: int, images: list[Any]) -> None:
        """Show ``images`` in message ``index`` of ``rollout``'s conversation; images the
        policy cannot see fail the episode (or, for a backend that takes none, the run)."""
        if not images:
            return
        try:
            rollout.images[index] = tuple(shown_images(self.backend, images))
        except ImageObservationError as exc:
            self._end(rollout, StopReason.ENV_ERROR, _describe(exc))

    def _end(self, rollout: Rollout, reason: StopReason, error: str | None = None) -> None:
        rollout.stop_reason, rollout.error = reason, error
        if rollout.state is not None:
            rollout.environment.release(rollout.state)


_CLEAN_ENDS = (StopReason.TERMINATED, StopReason.TRUNCATED, StopReason.MAX_STEPS)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
