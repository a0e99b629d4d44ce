"""Monte-Carlo values of mid-episode states, for GRPO's ``credit: turn_mc``.

While the collector plays a batch, :class:`TurnCheckpoints` checkpoints each episode at its
turn boundaries with a branching strategy (Direct for an env declaring ``pure_step = True``,
ProcessFork for any in-process env, ActionReplay for a deterministic one: see
:mod:`~agile_llmenvs.branching`), together with a copy of the harness's episode there. After
the batch, :func:`estimate_values` continues ``credit_rollouts`` times from every state kept,
all of them in lock-step with the current policy (one generate call per round for every
continuation of the batch: the trainer's sampler, or with ``vllm_server`` the servers, called
by the producer of rounds), and each state's value is the mean return of its continuations.

An episode whose env cannot branch (a served env, an env that is not a ``TextEnv``, a
checkpoint the strategy refused) keeps its episode advantage and is counted.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from agile_llmenvs.branching.checkpoint import BranchStrategy, Checkpoint, HeldCheckpoint
from agile_llmenvs.branching.direct import DirectStrategy
from agile_llmenvs.branching.fork import ProcessForkStrategy
from agile_llmenvs.branching.replay import ActionReplayStrategy
from agile_llmenvs.core import StepTuple, StopReason, TextEnv, TokenSample, Trajectory
from agile_llmenvs.core.images import ImagePrompt
from agile_llmenvs.core.text_env import adopt_episode, from_text_env
from agile_llmenvs.core.types import Action, Environment, State
from agile_llmenvs.errors import EnvStateError
from agile_llmenvs.llm_envs.episode_state import EpisodeState
from agile_llmenvs.llm_envs.harness import RolloutHarness
from agile_llmenvs.training.credit.tree import Branch
from agile_llmenvs.transport.client import InProcessEnvClient
from agile_llmenvs.transport.wrapper import OpenEnvWrapper, accepted_reset_kwargs

__all__ = [
    "BranchTextEnv",
    "CreditSettings",
    "StateValues",
    "TurnCheckpoints",
    "collector_checkpoints",
    "estimate_values",
    "sampled_from",
    "within_budget",
]

logger = logging.getLogger(__name__)

Generate = Callable[[list[Any]], Sequence[Any]]
"""The continuations' policy: a context per live continuation -> its sampled ids, ``(ids,
logps)``, or an exception (that continuation's request failed: it alone fails)."""


@dataclass(frozen=True)
class CreditSettings:
    """``turn_mc``'s settings, the manifest's ``credit_*`` fields (a run's part of
    :class:`~agile_llmenvs.training.run.RunSettings`).

    Attributes:
        rollouts: Continuations per branched state (``credit_rollouts``).
        turns: Which boundaries are valued: ``all``, ``first:N`` or ``entropy:N``.
        max_tokens: Tokens one continuation may sample (None: no cap).
        branching: ``auto``, ``direct``, ``process_fork`` or ``action_replay``.
        step_tokens: Tokens the continuations of one step (on this process) may sample
            (``credit_step_tokens``; None: no budget): see :func:`within_budget`.
    """

    rollouts: int = 4
    turns: str = "all"
    max_tokens: int | None = None
    branching: str = "auto"
    step_tokens: int | None = None

    @property
    def limit(self) -> int | None:
        """N of ``first:N`` / ``entropy:N`` (None for ``all``)."""
        return None if self.turns == "all" else int(self.turns.split(":")[1])

    def checkpoints_at(self, turn: int) -> bool:
        """Whether the state before ``turn`` (>= 1) is checkpointed while the batch plays:
        every one for ``all`` and ``entropy:N`` (chosen after the episode), turns 1..N for
        ``first:N``."""
        return turn >= 1 and (not self.turns.startswith("first:") or turn <= (self.limit or 0))

    def chosen(self, samples: Sequence[TokenSample], turns: int) -> set[int]:
        """The boundaries ``t`` (``0 < t < turns``) valued for an episode: all of them, the
        first N, or, for ``entropy:N``, the states after the N turns (of the first
        ``turns - 1``) whose sampled tokens had the highest mean surprisal ``-log p``, the
        sampler's estimate of the policy's entropy there."""
        boundaries = set(range(1, turns))
        if self.turns == "all" or self.turns.startswith("first:"):
            return {t for t in boundaries if self.checkpoints_at(t)}
        surprisal = turn_surprisal(samples, turns)
        ranked = sorted(range(turns - 1), key=lambda t: (-surprisal[t], t))
        return {t + 1 for t in ranked[: self.limit]}


def sampled_from(samples: Sequence[TokenSample], turn: int) -> int:
    """Tokens an episode sampled in its turns ``turn`` and later: what a continuation from
    the state before ``turn`` is expected to sample."""
    return sum(
        sampled and t >= turn
        for sample in samples
        for sampled, t in zip(sample.action_mask, sample.turn_ids, strict=True)
    )


def within_budget(costs: Sequence[tuple[int, int]], rollouts: int, budget: int) -> list[bool]:
    """Which candidate states a step's token budget values.

    Args:
        costs: Per candidate state, in the batch's order: ``(rank, cost)``, its rank among its
            episode's chosen states (0 for the first) and the tokens its episode sampled from
            it on (:func:`sampled_from`; at least 1 is counted).
        rollouts: Continuations a state takes.
        budget: The tokens the step's continuations may sample.

    Returns:
        Per candidate, whether it is valued: states are taken by rank, then in the batch's
        order (every episode's first state before any episode's second), each while its
        ``rollouts`` continuations' expected tokens still fit; one that does not fit is
        skipped and the next ones are tried.
    """
    keep = [False] * len(costs)
    spent = 0
    for index in sorted(range(len(costs)), key=lambda i: (costs[i][0], i)):
        need = rollouts * max(costs[index][1], 1)
        if spent + need <= budget:
            keep[index] = True
            spent += need
    return keep


def turn_surprisal(samples: Sequence[TokenSample], turns: int) -> list[float]:
    """Each turn's mean ``-log p`` of its sampled tokens over the episode's samples (0 where
    the sampler gave none)."""
    totals, counts = [0.0] * turns, [0] * turns
    for sample in samples:
        logps = iter(sample.sampling_logps)
        for sampled, turn in zip(sample.action_mask, sample.turn_ids, strict=True):
            if not sampled:
                continue
            value = next(logps, math.nan)
            if 0 <= turn < turns and math.isfinite(value):
                totals[turn] -= value
                counts[turn] += 1
    return [total / count if count else 0.0 for total, count in zip(totals, counts, strict=True)]


@dataclass
class _Point:
    """A checkpointed state: the harness's episode there, and the strategy's hold on it."""

    turn: int
    snapshot: EpisodeState
    held: HeldCheckpoint
    harness: RolloutHarness  # the slot's: continuations share its settings and framing


class TurnCheckpoints:
    """The collector's observer: checkpoints every live episode at each boundary.

    One serves a whole run: :meth:`release` frees a batch's checkpoints after its values are
    estimated, :meth:`close` the strategy too (ProcessFork's zygote process).

    Args:
        settings: What to checkpoint and how to branch.
        text_env_factory: Builds a fresh instance of the batch's env (ActionReplay and Direct
            branches are built from it).

    Attributes:
        points: By slot: the batch's checkpointed states, in turn order.
        refused: By slot: why the slot's episode could not be checkpointed.
    """

    def __init__(self, settings: CreditSettings, text_env_factory: Callable[[], TextEnv]) -> None:
        self.settings, self.text_env_factory = settings, text_env_factory
        self.points: dict[int, list[_Point]] = {}
        self.refused: dict[int, str] = {}
        self._strategy: BranchStrategy | None = None
        self._episodes = 0

    def __call__(self, harnesses: dict[int, RolloutHarness]) -> None:
        for slot, harness in harnesses.items():
            turn = harness.turns_played
            if slot in self.refused or not self.settings.checkpoints_at(turn):
                continue
            try:
                self._hold(slot, harness, turn)
            except Exception as exc:  # this episode cannot branch: it keeps its own advantage
                self.refused[slot] = f"{type(exc).__name__}: {exc}"

    def _hold(self, slot: int, harness: RolloutHarness, turn: int) -> None:
        env = _text_env(harness)
        snapshot = harness.snapshot()
        self._episodes += 1
        state = _state_of(snapshot, env, self._episodes)
        actions = tuple(Action.from_text(turn.action) for turn in snapshot.texts)
        reset_options = {**state.task, "seed": state.seed}
        checkpoint = Checkpoint(f"{slot}:{turn}", state, actions, reset_options)
        strategy = self._strategy_for(env)
        if isinstance(strategy, ProcessForkStrategy):
            held: HeldCheckpoint = strategy.hold(checkpoint, adopt_episode(env, state))
        else:
            held = strategy.hold(checkpoint)
        self.points.setdefault(slot, []).append(_Point(turn, snapshot, held, harness))

    def _strategy_for(self, env: TextEnv) -> BranchStrategy:
        if self._strategy is None:
            self._strategy = _strategy(self.settings.branching, env, self.text_env_factory)
        return self._strategy

    @property
    def strategy_name(self) -> str | None:
        """The strategy in use (None before the first checkpoint)."""
        return None if self._strategy is None else self._strategy.name

    def release(self) -> None:
        """Free the batch's checkpoints and their branches (the next batch starts afresh)."""
        points, self.points = self.points, {}
        self.refused = {}
        for held in points.values():
            for point in held:
                point.held.release()

    def close(self) -> None:
        """:meth:`release`, and free the strategy's own processes."""
        self.release()
        if self._strategy is not None:
            self._strategy.close()
            self._strategy = None


def _strategy(name: str, env: TextEnv, factory: Callable[[], TextEnv]) -> BranchStrategy:
    """The strategy ``name`` picks for the batch's env (``auto``: Direct for an env declaring
    ``pure_step = True``, else ProcessFork)."""
    if name == "auto":
        name = "direct" if getattr(env, "pure_step", False) else "process_fork"
    label = type(env).__name__
    if name == "direct":
        return DirectStrategy(from_text_env(factory, name=label, pure_step=True))
    if name == "action_replay":
        return ActionReplayStrategy(lambda: from_text_env(factory, name=label))
    forkable = _LiveEnvSpec(label, bool(getattr(env, "forkable", True)))
    return ProcessForkStrategy(
        cast(Environment, forkable), lambda: from_text_env(factory, name=label)
    )


@dataclass(frozen=True)
class _LiveEnvSpec:
    """Stands for the batch's envs where ProcessFork checks its spec (each checkpoint ships
    its own live env)."""

    name: str
    forkable: bool

    @property
    def spec(self) -> Any:
        from agile_llmenvs.core.types import EnvironmentSpec

        return EnvironmentSpec(name=self.name, forkable=self.forkable)


def _text_env(harness: RolloutHarness) -> TextEnv:
    """The text env a harness plays in this process.

    Raises:
        EnvStateError: the harness plays a served env or an OpenEnv ``Environment``.
    """
    client = harness.client
    env = getattr(client, "env", None) if isinstance(client, InProcessEnvClient) else None
    if not isinstance(env, OpenEnvWrapper):
        raise EnvStateError(
            f"{type(client).__name__} plays an env that cannot be branched here: turn_mc "
            "branches text envs built in this process (an `entrypoint` env)"
        )
    return env.inner


def _state_of(snapshot: EpisodeState, env: TextEnv, episode_id: int) -> State:
    """The snapshot's point of the episode as a :class:`State`: the observations as user
    turns and the actions the env read as assistant turns."""
    messages: list[dict[str, Any]] = []
    for turn in snapshot.texts:
        messages += [
            {"role": "user", "content": turn.prompt},
            {"role": "assistant", "content": turn.action},
        ]
    messages.append({"role": "user", "content": snapshot.prompt_text})
    kwargs = dict(snapshot.reset_kwargs)
    seed = kwargs.pop("seed", None)
    return State(
        observation=snapshot.prompt_text,
        messages=tuple(messages),
        step_count=len(snapshot.texts),
        task=accepted_reset_kwargs(env, kwargs),
        episode_id=episode_id,
        seed=seed,
    )


class BranchTextEnv:
    """A branch's ``(env, state)`` (from a strategy's checkpoint) as a text env that goes on
    from the state: what a continuation's harness plays on."""

    def __init__(self, env: Environment, state: State) -> None:
        self.env, self.state = env, state

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        raise EnvStateError("a branch starts mid-episode; it is never reset")

    def step(self, action: str) -> StepTuple:
        result = self.env.step(self.state, Action.from_text(action))
        self.state = result.next_state
        return (
            result.next_state.observation,
            result.reward,
            result.terminated,
            result.truncated,
            dict(result.info),
        )

    def close(self) -> None:
        """Nothing: the checkpoint's release closes its branches."""


@dataclass
class _Continuation:
    slot: int
    turn: int
    harness: RolloutHarness
    tokens: int = 0
    failure: str | None = None  # its generation request failed


@dataclass
class StateValues:
    """What :func:`estimate_values` measured.

    Attributes:
        values: By slot: ``V(s_t)`` of each state valued, by ``t``.
        tokens: Tokens the continuations sampled.
        seconds: Wall time of the continuations (generation and env).
        gen_seconds: The part spent generating.
        failed: Continuations whose env or generation request failed (left out of the
            means).
        refused: By slot: why its episode could not be branched (it keeps its episode
            advantage).
        branches: ``tree``: the continuations whose env did not fail, as training paths.
        over_budget: States chosen but not valued: ``credit_step_tokens`` had no room for
            them.
        policy_version: Generated by servers: the policy version they held before the first
            continuation's request (versions only rise); None when the trainer's own policy
            generated them.
    """

    values: dict[int, dict[int, float]] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    branches: list[Branch] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    gen_seconds: float = 0.0
    failed: int = 0
    over_budget: int = 0
    policy_version: int | None = None

    @property
    def env_seconds(self) -> float:
        """The part not spent generating: branching, the continuations' env steps, the
        harness."""
        return max(self.seconds - self.gen_seconds, 0.0)

    @property
    def states(self) -> int:
        """States valued."""
        return sum(len(v) for v in self.values.values())


def estimate_values(
    checkpoints: TurnCheckpoints,
    trajectories: Sequence[Trajectory],
    generate: Generate,
    *,
    keep_branches: bool = False,
) -> StateValues:
    """Value the chosen states of each trajectory by ``rollouts`` continuations each
    (``keep_branches``: and keep the continuations as :class:`Branch` paths, for ``tree``).

    Each trajectory's states are its slot's checkpoints. A state's continuations run from a copy of
    the harness's episode there on a branch of its env; every continuation of the batch
    generates in one call per round. A continuation ends as an episode does, or once it has
    sampled ``max_tokens`` (its return is then the rewards so far). With ``step_tokens``, the
    states valued are those :func:`within_budget` takes, and should the continuations sample
    more than their episodes did, the ones still playing end (as at ``max_tokens``) before
    the first round that would start past the budget.
    """
    settings = checkpoints.settings
    start = time.perf_counter()
    result = StateValues()
    candidates: list[tuple[int, _Point]] = []
    costs: list[tuple[int, int]] = []
    for trajectory in trajectories:
        points = checkpoints.points.get(trajectory.slot, [])
        episode = trajectory.episode
        if not points or trajectory.failed:
            continue
        chosen = settings.chosen(episode.samples, episode.num_turns)
        for rank, point in enumerate(p for p in points if p.turn in chosen):
            candidates.append((trajectory.slot, point))
            if settings.step_tokens is not None:  # what the budget weighs
                costs.append((rank, sampled_from(episode.samples, point.turn)))
    if settings.step_tokens is not None:
        keep = within_budget(costs, settings.rollouts, settings.step_tokens)
        result.over_budget = keep.count(False)
        candidates = [c for c, kept in zip(candidates, keep, strict=True) if kept]
    continuations: list[_Continuation] = []
    for slot, point in candidates:
        try:
            branches = [point.held.branch() for _ in range(settings.rollouts)]
        except Exception as exc:  # a replay that missed the state: the state is not valued
            checkpoints.refused.setdefault(slot, f"{type(exc).__name__}: {exc}")
            continue
        action_field = getattr(point.harness.client, "action_field", "message")
        for env, state in branches:
            client = InProcessEnvClient(BranchTextEnv(env, state), action_field=action_field)
            harness = point.harness.branch(point.snapshot, client)
            continuations.append(_Continuation(slot, point.turn, harness))
    _play(continuations, generate, settings.max_tokens, result, settings.step_tokens)
    returns: dict[tuple[int, int], list[float]] = {}
    for c in continuations:
        data = c.harness.get_episode_data()
        if c.failure is not None or data.stop_reason is StopReason.ENV_ERROR:
            result.failed += 1
            continue
        returns.setdefault((c.slot, c.turn), []).append(sum(data.rewards[c.turn :]))
        if keep_branches:
            result.branches.append(Branch(c.slot, c.turn, data))
    for (slot, turn), values in returns.items():
        result.values.setdefault(slot, {})[turn] = sum(values) / len(values)
    result.refused = dict(checkpoints.refused)
    result.seconds = time.perf_counter() - start
    return result


def _play(
    continuations: list[_Continuation],
    generate: Generate,
    max_tokens: int | None,
    result: StateValues,
    budget: int | None = None,
) -> None:
    """Play every continuation to its end, one generate call per round for all (none once
    ``budget`` tokens are spent: the ones still playing end there)."""
    live = list(continuations)
    while live:
        if budget is not None and result.tokens >= budget:
            for c in live:
                c.harness.abort(f"credit_step_tokens={budget} reached")
            return
        contexts = [_context(c.harness) for c in live]
        gen_start = time.perf_counter()
        outputs = generate(contexts)
        result.gen_seconds += time.perf_counter() - gen_start
        for c, output in zip(live, outputs, strict=True):
            if isinstance(output, BaseException):
                c.failure = f"{type(output).__name__}: {output}"
                c.harness.abort(c.failure)
                continue
            ids, logps = output if isinstance(output, tuple) else (output, None)
            c.tokens += len(ids)
            result.tokens += len(ids)
            c.harness.step(ids, logps)
            if not c.harness.done and max_tokens is not None and c.tokens >= max_tokens:
                c.harness.abort(f"credit_max_tokens={max_tokens} reached")
        live = [c for c in live if not c.harness.done]


def _context(harness: RolloutHarness) -> Any:
    images = harness.context_images
    ids = harness.context_ids
    return ids if images is None else ImagePrompt(ids, images)


def collector_checkpoints(collector: Any, settings: CreditSettings) -> TurnCheckpoints:
    """A :class:`TurnCheckpoints` for ``collector``'s batch: fresh envs come from its env
    factory (a harness's env, the harness left unused)."""

    def text_env() -> TextEnv:
        return _text_env(collector.env_factory(**collector.env_config))

    return TurnCheckpoints(settings, text_env)
