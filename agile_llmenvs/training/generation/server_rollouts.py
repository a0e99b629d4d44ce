"""GRPO rollouts from running ``vllm serve`` processes, generated ahead of the trainer.

A producer thread plays one batch (a *round*) per training step through the collector's
continuous path: every episode asks the servers for its next turn as soon as its env replies.
Round ``t`` is the batch step ``t`` trains on. It starts once the servers hold the weights of
step ``t - max_staleness`` or later, so with ``max_staleness: 0`` each round waits for the
previous step's weights (on-policy, no overlap), and with ``max_staleness: 1`` round ``t + 1``
is generated while the trainer learns on round ``t``.

Policy versions are training steps: after step ``t`` the weights are synced (every
``sync_every`` steps) as version ``t``; each trajectory records the version served when its
first turn was requested (``Trajectory.policy_version``). A group with a member older than
``max_staleness`` versions at the step that would train on it is dropped and counted; the
importance ratio is taken against the servers' own log-probs of each sampled token (the
behaviour policy), so a sample one version old is still weighted correctly.

With ``credit: turn_mc`` or ``tree`` the producer checkpoints every episode at its turn
boundaries while the round plays, then plays the continuations from those states on the
servers too (one request per continuation and turn, all in flight at once) before it hands
the round over: the round carries its states' values and, for ``tree``, its branches. The
continuations sample with the version served when they start, never older than their
episodes'; a group whose values came from a version older than ``max_staleness`` allows is
dropped as a stale member's is.
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from agile_llmenvs.backends.types import SamplingParams
from agile_llmenvs.core import RolloutBatch
from agile_llmenvs.core.images import ImagePrompt
from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.llm_envs.collector import RolloutCollector, TurnSignal
from agile_llmenvs.llm_envs.continuous import request_seed
from agile_llmenvs.specs.manifest import VLLMServerSpec
from agile_llmenvs.training.credit import (
    CreditSettings,
    StateValues,
    TurnCheckpoints,
    collector_checkpoints,
    estimate_values,
)

__all__ = ["Round", "ServerContinuations", "ServerRollouts", "server_backend"]

#: The episode number of continuations' request seeds (episodes are numbered from 0).
_CONTINUATIONS = -1


@dataclass(frozen=True)
class Round:
    """One batch played for one training step.

    Attributes:
        step: The training step (0-based) it is for.
        batch: The groups played.
        values: ``credit: turn_mc`` / ``tree``: its states' values (and ``tree``'s
            branches), from continuations played on the servers; None otherwise.
    """

    step: int
    batch: RolloutBatch
    values: StateValues | None = None


class ServerContinuations:
    """:func:`~agile_llmenvs.training.credit.estimate_values`'s policy on the servers: each
    call (a round of the continuations) sends one request per continuation, all in flight at
    once; a failed request fails its continuation alone.

    Round ``k``'s requests are seeded from ``request_seed(params.seed, -1, k)`` (the
    episodes' own requests use episode numbers from 0), request ``i`` of it as
    :meth:`~agile_llmenvs.backends.VLLMServerBackend.generate` seeds it.

    Attributes:
        version: The version the servers held before the first request.
    """

    def __init__(self, backend: Any, params: SamplingParams) -> None:
        self.backend, self.params = backend, params
        self.version: int = backend.version
        self._rounds = 0

    def __call__(self, contexts: list[Any]) -> list[Any]:
        seed = request_seed(self.params.seed, _CONTINUATIONS, self._rounds)
        self._rounds += 1
        if any(isinstance(c, ImagePrompt) for c in contexts):
            raise AgileLLMEnvsError(
                "vllm_server generates from ids alone but a continuation's prompt shows "
                "images: train image envs with generation_backend: hf"
            )
        results = self.backend.generate_results(
            contexts, dataclasses.replace(self.params, seed=seed)
        )
        return [
            r if isinstance(r, BaseException) else (list(r.token_ids), list(r.logprobs))
            for r in results
        ]


class _Failed:
    """What the producer leaves in the queue when a round raised: the trainer re-raises it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class ServerRollouts:
    """Rounds of continuous rollouts from the servers, produced ahead within ``max_staleness``.

    Args:
        backend: The servers (a :class:`~agile_llmenvs.backends.VLLMServerBackend`).
        collector: Plays each round (``collect_continuous``).
        params: Sampling settings; each round's seed comes from ``round_seed``.
        round_seed: The sampling seed of the round for a step.
        max_staleness: Versions a trained sample may lag the trainer by.
        sync_every: Steps between weight syncs.
        start_step: The first step to produce for (a resumed run's).
        max_steps: The run's last step; no round is played past it.
        dynamic_sampling: Refill groups whose rewards are all equal (see
            :meth:`RolloutCollector.collect`).
        turn_signal: Keeps such a group when its turns carry credit (``credit: anchor``).
        credit: ``credit: turn_mc`` / ``tree``: value each round's states by continuations on
            the servers (see the module docstring); None: no continuations.
        keep_branches: ``tree``: keep the continuations as training paths.
        push_weights: Loads ``(policy, version)`` into the servers; ``None``:
            ``backend.sync_weights`` (one training process). Several processes pass a
            :class:`~agile_llmenvs.training.generation.ServerWeightSync`, which every process
            calls, so each process's producer waits for the same served versions.
    """

    def __init__(
        self,
        backend: Any,
        collector: RolloutCollector,
        params: SamplingParams,
        round_seed: Callable[[int], int],
        *,
        max_staleness: int,
        sync_every: int,
        start_step: int,
        max_steps: int,
        dynamic_sampling: bool = False,
        turn_signal: TurnSignal | None = None,
        credit: CreditSettings | None = None,
        keep_branches: bool = False,
        push_weights: Callable[[Any, int], object] | None = None,
    ) -> None:
        if max_staleness < sync_every - 1:
            raise ValueError(
                f"sync_every={sync_every} serves weights up to {sync_every - 1} steps old: "
                f"max_staleness must be >= {sync_every - 1}, got {max_staleness}"
            )
        self.backend, self.collector, self.params = backend, collector, params
        self.round_seed = round_seed
        self.max_staleness, self.sync_every = max_staleness, sync_every
        self.start_step, self.max_steps = start_step, max_steps
        self.dynamic_sampling, self.turn_signal = dynamic_sampling, turn_signal
        self.credit, self.keep_branches = credit, keep_branches
        self._checkpoints: TurnCheckpoints | None = None  # the producer's, for the whole run
        self._push_weights = push_weights or self._sync_backend
        self._rounds: queue.Queue[Round | _Failed] = queue.Queue()
        self._served = threading.Condition()  # notified at each sync and at close
        self._snapshots: dict[int, dict[str, Any]] = {}  # step -> task state before its round
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="server-rollouts", daemon=True)

    # -- the trainer's side ----------------------------------------------------------------------

    def sync(self, policy: Any, version: int) -> float:
        """Send ``policy``'s weights to every server as ``version``; returns the seconds taken.

        The first call (the weights the run starts from) also starts the producer.
        """
        start = time.perf_counter()
        self._push_weights(policy, version)
        with self._served:
            self._served.notify_all()
        if self._thread.ident is None and not self._stop.is_set():  # not started yet
            self._thread.start()
        return time.perf_counter() - start

    def _sync_backend(self, policy: Any, version: int) -> None:
        self.backend.sync_weights(policy, version=version)

    def sync_due(self, step: int) -> bool:
        """Whether the weights after ``step`` steps go to the servers."""
        return step % self.sync_every == 0

    def next_round(self, step: int) -> tuple[Round, float]:
        """The round for ``step`` (waiting for it) and the seconds spent waiting.

        Raises:
            Exception: whatever the producer's round raised (an env factory failing, say).
        """
        start = time.perf_counter()
        item = self._rounds.get()
        waited = time.perf_counter() - start
        if isinstance(item, _Failed):
            raise item.error
        if item.step != step:  # rounds are produced in order, one per step
            raise AgileLLMEnvsError(f"the round for step {item.step} came for step {step}")
        return item, waited

    def stale_groups(
        self, batch: RolloutBatch, step: int, values: StateValues | None = None
    ) -> list[bool]:
        """Per group: whether a member that trains is older than ``max_staleness`` versions at
        ``step`` (or has no version), or (``values``) its states were valued by continuations
        of an older version. A failed member trains on nothing and is left out: one whose env
        failed before its first request has no version, and used to drop its whole group."""
        oldest_allowed = step - self.max_staleness
        stale_slots: set[int] = set()
        version = values.policy_version if values is not None else None
        if values is not None and version is not None and version < oldest_allowed:
            stale_slots = set(values.values) | {branch.slot for branch in values.branches}
        return [
            any(
                t.policy_version is None
                or t.policy_version < oldest_allowed
                or t.slot in stale_slots
                for t in group
                if not t.failed
            )
            for group in batch.groups()
        ]

    def resume_state(self, trained_steps: int) -> dict[str, Any]:
        """The collector's task state a run resumed after ``trained_steps`` steps starts
        from: before the round of the next step, played ahead or not."""
        with self._served:
            state = self._snapshots.get(trained_steps)
            return copy.deepcopy(state if state is not None else self.collector.state_dict())

    def close(self) -> None:
        """Stop producing (a round in play finishes first, or fails once the servers go),
        then free the credit's checkpoints (ProcessFork's zygote)."""
        self._stop.set()
        with self._served:
            self._served.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=self.backend_timeout_s)
        if self._checkpoints is not None:
            self._checkpoints.close()

    @property
    def backend_timeout_s(self) -> float:
        """How long :meth:`close` waits for a round in play."""
        return float(getattr(self.backend, "timeout_s", 60.0))

    # -- the producer's side ---------------------------------------------------------------------

    def _may_start(self, step: int) -> bool:
        """Whether the round of ``step`` may start: the servers hold the weights of step
        ``step - max_staleness`` or later (or the producer is stopping)."""
        return self._stop.is_set() or self.backend.version >= step - self.max_staleness

    def _produce(self) -> None:
        step = self.start_step
        while step < self.max_steps:
            with self._served:
                self._served.wait_for(partial(self._may_start, step))
                if self._stop.is_set():
                    return
                self._snapshots = {
                    s: v for s, v in self._snapshots.items() if s >= step - self.max_staleness - 1
                }
                self._snapshots[step] = copy.deepcopy(self.collector.state_dict())
            params = dataclasses.replace(self.params, seed=self.round_seed(step))
            try:
                played = self._play(step, params)
            except BaseException as exc:  # the trainer raises it at its next round
                self._rounds.put(_Failed(exc))
                return
            self._rounds.put(played)
            step += 1

    def _play(self, step: int, params: SamplingParams) -> Round:
        """Play the round of ``step``, and with ``credit`` its continuations after it."""
        if self.credit is not None and self._checkpoints is None:
            self._checkpoints = collector_checkpoints(self.collector, self.credit)
        checkpoints = self._checkpoints
        try:
            batch = self.collector.collect_continuous(
                self.backend,
                params,
                dynamic_sampling=self.dynamic_sampling,
                turn_signal=self.turn_signal,
                observe=checkpoints,
            )
            if checkpoints is None:
                return Round(step, batch)
            continuations = ServerContinuations(self.backend, params)
            values = estimate_values(
                checkpoints, batch.trajectories, continuations, keep_branches=self.keep_branches
            )
            values.policy_version = continuations.version
            return Round(step, batch, values)
        finally:
            if checkpoints is not None:
                checkpoints.release()


def server_backend(
    spec: VLLMServerSpec, tokenizer: Any, output_dir: Path, vocab_size: int | None = None
) -> Any:
    """The run's :class:`~agile_llmenvs.backends.VLLMServerBackend` over ``spec``'s servers;
    ``vocab_size``: the policy's embedding rows, the ids a reply may hold."""
    from agile_llmenvs.backends.vllm_server import VLLMServerBackend

    weights_dir = Path(spec.weights_dir) if spec.weights_dir else output_dir / "weights-sync"
    weights_dir.mkdir(parents=True, exist_ok=True)
    return VLLMServerBackend(
        spec.urls,
        tokenizer=tokenizer,
        routing=spec.routing,
        timeout_s=spec.timeout_s,
        weights_dir=weights_dir,
        lora_sync=spec.lora_sync,
        weight_transfer=spec.weight_transfer,
        transfer_host=spec.transfer_host,
        vocab_size=vocab_size,
    )
