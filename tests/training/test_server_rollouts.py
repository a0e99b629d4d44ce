"""ServerRollouts: when rounds may start (``max_staleness``), in what order, and which groups
are stale; and the manifest's checks of ``generation_backend: vllm_server``.

The producer's collaborators are stand-ins here (a collector that records the served version
each round started at, a backend that counts syncs): the gate is what is tested. The real
servers run in ``test_grpo_server.py``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from pydantic import ValidationError

from agile_llmenvs.backends.types import SamplingParams
from agile_llmenvs.core import EpisodeData, RolloutBatch, StopReason, Trajectory
from agile_llmenvs.llm_envs.tasks import Task
from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training.generation import ServerRollouts


class _Backend:
    def __init__(self) -> None:
        self.version = -1
        self.synced: list[int] = []

    def sync_weights(self, policy: Any, *, version: int) -> None:
        self.synced.append(version)
        self.version = version


class _Collector:
    """Plays a round instantly; every trajectory records the version served at its start."""

    def __init__(self, backend: _Backend, events: list[str]) -> None:
        self.backend, self.events = backend, events
        self.rounds = 0
        self.seeds: list[int | None] = []
        self.played = threading.Semaphore(0)

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def collect_continuous(
        self,
        backend: _Backend,
        params: SamplingParams,
        *,
        dynamic_sampling: bool,
        turn_signal: Any = None,
        observe: Any = None,
    ) -> RolloutBatch:
        self.events.append(f"round{self.rounds}@v{backend.version}")
        self.seeds.append(params.seed)
        self.rounds += 1
        episode = EpisodeData([], [1.0], StopReason.TERMINATED, {})
        version = backend.version
        group = tuple(Trajectory(0, i, Task(0, 0), episode, version) for i in range(2))
        self.played.release()
        return RolloutBatch(group, 2, 0)


def _rollouts(max_staleness: int, sync_every: int = 1, steps: int = 3) -> tuple[Any, ...]:
    events: list[str] = []
    backend = _Backend()
    collector = _Collector(backend, events)
    rollouts = ServerRollouts(
        backend,
        collector,  # type: ignore[arg-type]
        SamplingParams(),
        lambda step: 100 + step,
        max_staleness=max_staleness,
        sync_every=sync_every,
        start_step=0,
        max_steps=steps,
    )
    return rollouts, collector, events


def _train(rollouts: ServerRollouts, collector: _Collector, events: list[str], steps: int) -> None:
    """The trainer's side: take each round, then sync the step's weights. After each sync it
    waits until the producer has played every round the gate lets it, so the order is fixed."""

    def settle(version: int) -> None:
        allowed = min(steps, version + 1 + rollouts.max_staleness)  # rounds startable now
        while collector.rounds < allowed:
            collector.played.acquire()

    rollouts.sync(None, version=0)
    settle(0)
    for step in range(steps):
        rollouts.next_round(step)
        events.append(f"train{step}")
        if rollouts.sync_due(step + 1):
            events.append(f"sync{step + 1}")
            rollouts.sync(None, version=step + 1)
            settle(step + 1)
    rollouts.close()


def test_on_policy_rounds_wait_for_the_previous_steps_weights() -> None:
    rollouts, collector, events = _rollouts(max_staleness=0)
    _train(rollouts, collector, events, 3)
    assert events == [
        "round0@v0",
        "train0",
        "sync1",
        "round1@v1",
        "train1",
        "sync2",
        "round2@v2",
        "train2",
        "sync3",
    ]
    assert collector.seeds == [100, 101, 102]


def test_one_step_off_policy_plays_the_next_round_while_the_trainer_learns() -> None:
    rollouts, collector, events = _rollouts(max_staleness=1)
    _train(rollouts, collector, events, 3)
    # round t + 1 may be played with the weights of step t - 1: one version older
    assert events == [
        "round0@v0",
        "round1@v0",
        "train0",
        "sync1",
        "round2@v1",
        "train1",
        "sync2",
        "train2",
        "sync3",
    ]


def test_stale_groups_are_the_ones_with_a_member_older_than_allowed() -> None:
    rollouts, _, _ = _rollouts(max_staleness=1)
    episode = EpisodeData([], [0.0], StopReason.TERMINATED, {})
    versions = [3, 3, 2, 3, 1, 3, None, 3]  # groups of 2: fresh, fresh, stale, unknown = stale
    batch = RolloutBatch(
        tuple(Trajectory(i // 2, i, Task(0, 0), episode, v) for i, v in enumerate(versions)),
        2,
        0,
    )
    assert rollouts.stale_groups(batch, step=3) == [False, False, True, True]


def test_a_member_that_failed_before_its_first_request_does_not_make_its_group_stale() -> None:
    rollouts, _, _ = _rollouts(max_staleness=0)
    fresh = EpisodeData([], [1.0], StopReason.TERMINATED, {})
    failed = EpisodeData([], [0.0], StopReason.ENV_ERROR, {"error": "reset failed"})
    members = [(fresh, 3), (fresh, 3), (failed, None), (fresh, 3), (fresh, 2), (failed, None)]
    batch = RolloutBatch(
        tuple(Trajectory(i // 3, i, Task(0, 0), e, v) for i, (e, v) in enumerate(members)),
        3,
        0,
    )
    # group 0: two fresh members and a failure with no version: trains on the two; group 1
    # has a member one version old (max_staleness 0): stale
    assert rollouts.stale_groups(batch, step=3) == [False, True]


def test_a_round_that_raises_is_raised_to_the_trainer() -> None:
    rollouts, collector, _ = _rollouts(max_staleness=0)

    def broken(*args: Any, **kwargs: Any) -> RolloutBatch:
        raise RuntimeError("the env factory failed")

    collector.collect_continuous = broken  # type: ignore[method-assign]
    rollouts.sync(None, version=0)
    with pytest.raises(RuntimeError, match="the env factory failed"):
        rollouts.next_round(0)
    rollouts.close()


def test_resume_state_is_the_task_state_before_the_next_steps_round() -> None:
    rollouts, collector, _ = _rollouts(max_staleness=1)
    rollouts.sync(None, version=0)
    rollouts.next_round(0)
    while collector.rounds < 2:  # round 1 was played ahead, at v0
        collector.played.acquire()
    # after one trained step a resumed run must replay round 1: the state from before it
    assert rollouts.resume_state(1) == {"rounds": 1}
    rollouts.close()


def _manifest(**training: Any) -> dict[str, Any]:
    return {
        "env": {
            "env_type": "rollout",
            "dataset_path": "data.jsonl",
            "rubric_file_path": "rubric.py",
            "rubric_name": "r",
        },
        "model": {},
        "training": {"algorithm": "grpo", **training},
    }


@pytest.mark.parametrize(
    ("training", "message"),
    [
        (
            {"generation_backend": "vllm_server"},
            "vllm_server: `generation_backend: vllm_server` needs the servers: "
            "`vllm_server: {urls: [http://127.0.0.1:8000]}`",
        ),
        (
            {"vllm_server": {"urls": ["http://127.0.0.1:8000"]}},
            "vllm_server: server settings need `generation_backend: vllm_server`",
        ),
        (
            {"max_staleness": 1},
            "max_staleness: rollouts overlap learning only with `generation_backend: "
            "vllm_server`; set max_staleness: 0 or use the servers",
        ),
        (
            {"generation_backend": "vllm_server", "vllm_server": {"urls": ["127.0.0.1:8000"]}},
            "urls: '127.0.0.1:8000' is not an http(s) URL: write `http://host:port`",
        ),
        (
            {
                "generation_backend": "vllm_server",
                "vllm_server": {"urls": ["http://h:1"], "sync_every": 3},
                "max_staleness": 1,
            },
            "max_staleness: vllm_server.sync_every: 3 serves weights up to 2 steps "
            "old; set max_staleness >= 2 (or sync_every: 2)",
        ),
    ],
)
def test_server_settings_are_checked(training: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        RunManifest.model_validate(_manifest(**training))
    assert f"Value error, {message} [" in str(info.value)
