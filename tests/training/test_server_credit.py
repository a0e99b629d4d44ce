"""Turn-level credit on the servers' path: the continuous collector checkpoints episodes as
they play and :class:`ServerRollouts` plays the continuations on the servers before it hands
the round over.

The servers here are a scripted stand-in speaking the backend's faces (``agenerate`` for the
episodes, ``generate_results`` for the continuations): the values are derived by hand as in
``test_turn_credit.py``, on the same :class:`branch_envs.DoorEnv`. Member 0 of the group takes
the key (``a``, chosen by its first request's seed), member 1 does not (``x``); at the hall the
k-th request for one exact context says ``b``, ``y``, ``b``, ...; at the door ``z``.

* episode 0 (slot 0): ``a``, ``b`` (+0.5), ``z`` (+1.0); from its ``s_1`` the continuations say
  ``y`` then ``b`` (the episode asked first): returns 0 + 1.0 and 0.5 + 1.0, ``V = 1.25``; from
  ``s_2`` ``z`` twice: ``V = 1.0``;
* episode 1 (slot 1): ``x``, ``b``, ``z`` (no key): ``V(s_1) = (0 + 0.5) / 2 = 0.25``,
  ``V(s_2) = 0``.

Real ``vllm serve`` runs of every credit mode on the corridor are in ``test_grpo_server.py``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from branch_envs import DoorEnv

from agile_llmenvs.backends.types import SamplingParams
from agile_llmenvs.core import Generation, RolloutBatch, StopReason, Trajectory
from agile_llmenvs.core.episode import EpisodeData
from agile_llmenvs.errors import GenerationServerError
from agile_llmenvs.llm_envs import RolloutCollector, RolloutHarness
from agile_llmenvs.llm_envs.continuous import request_seed
from agile_llmenvs.llm_envs.tasks import Task
from agile_llmenvs.training.credit import CreditSettings, StateValues
from agile_llmenvs.training.credit.tree import Branch
from agile_llmenvs.training.generation import Round, ServerRollouts

SEED = 7  # the round's sampling seed
VALUES = {0: {1: 1.25, 2: 1.0}, 1: {1: 0.25, 2: 0.0}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class ScriptedServers:
    """The servers' faces the producer uses, answering as the module docstring says.

    ``fail_first`` continuation requests (in the order of the first continuation call)
    fail with :class:`GenerationServerError`, as a server that went down would.
    """

    def __init__(self, tokenizer: Any, *, version: int = 3, fail_first: int = 0) -> None:
        self.tokenizer, self.version, self.fail_first = tokenizer, version, fail_first
        self.seen: Counter[tuple[int, ...]] = Counter()
        self.continuation_calls: list[tuple[int, int | None]] = []  # (prompts, seed)

    def _answer(self, context: list[int], seed: int | None) -> Generation:
        text = self.tokenizer.decode(context)
        where = max(("cell", "hall", "door"), key=text.rfind)
        if where == "cell":  # member 0 (episode 0 of the round) takes the key
            action = "a" if seed == request_seed(SEED, 0, 0) else "x"
        elif where == "hall":
            action = ["b", "y"][self.seen[tuple(context)] % 2]
        else:
            action = "z"
        self.seen[tuple(context)] += 1
        ids = (
            *self.tokenizer.encode(action, add_special_tokens=False),
            self.tokenizer.eos_token_id,
        )
        return Generation(ids, (-0.5,) * len(ids), action, "stop")

    async def agenerate(self, prompt: list[int], params: SamplingParams) -> Generation:
        return self._answer(list(prompt), params.seed)

    def generate_results(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> list[Generation | GenerationServerError]:
        first = not self.continuation_calls
        self.continuation_calls.append((len(prompts), params.seed))
        return [
            GenerationServerError("the server is down", url="http://127.0.0.1:1")
            if first and i < self.fail_first
            else self._answer(list(p), params.seed)
            for i, p in enumerate(prompts)
        ]

    def sync_weights(self, policy: Any, *, version: int) -> None:
        self.version = version


def play_round(
    tokenizer: Any, servers: ScriptedServers, *, branching: str = "auto", tree: bool = False
) -> Round:
    """The first round of a run of one group of two on DoorEnv, two continuations a state."""

    def factory() -> RolloutHarness:
        return RolloutHarness.local(DoorEnv(), tokenizer, max_turns=3)

    collector = RolloutCollector(factory, batch_size=1, group_size=2, base_seed=0)
    rollouts = ServerRollouts(
        servers,
        collector,
        SamplingParams(max_tokens=4),
        lambda step: SEED,
        max_staleness=0,
        sync_every=1,
        start_step=0,
        max_steps=1,
        credit=CreditSettings(rollouts=2, branching=branching),
        keep_branches=tree,
    )
    try:
        rollouts.sync(None, version=servers.version)
        played, _ = rollouts.next_round(0)
    finally:
        rollouts.close()
        collector.close()
    return played


@pytest.mark.parametrize("branching", ["direct", "process_fork", "action_replay"])
def test_a_rounds_states_are_valued_on_the_servers_by_hand(tokenizer: Any, branching: str) -> None:
    servers = ScriptedServers(tokenizer)
    played = play_round(tokenizer, servers, branching=branching)
    rewards = [t.episode.rewards for t in played.batch.trajectories]
    assert rewards == [(0.0, 0.5, 1.0), (0.0, 0.5, 0.0)]
    assert [t.slot for t in played.batch.trajectories] == [0, 1]
    values = played.values
    assert values is not None
    assert values.values == VALUES
    assert (values.states, values.failed, values.refused) == (4, 0, {})
    assert values.branches == []  # turn_mc: values only
    # 8 continuations: from s_1 two turns ("y" or "b", then "z"), from s_2 one ("z")
    size = {c: len(tokenizer.encode(c, add_special_tokens=False)) + 1 for c in "ybz"}
    per_episode = (size["y"] + size["z"]) + (size["b"] + size["z"]) + 2 * size["z"]
    assert values.tokens == 2 * per_episode
    assert values.policy_version == 3  # the version served when the continuations began
    # two calls: all 8 first turns, then the 4 from s_1 at the door; seeded apart from the
    # episodes' own requests (episode numbers start at 0) and from each other
    assert servers.continuation_calls == [
        (8, request_seed(SEED, -1, 0)),
        (4, request_seed(SEED, -1, 1)),
    ]


def test_tree_keeps_the_continuations_from_the_servers_as_branches(tokenizer: Any) -> None:
    played = play_round(tokenizer, ScriptedServers(tokenizer), tree=True)
    values = played.values
    assert values is not None
    assert values.values == VALUES
    got = sorted((b.slot, b.turn, b.episode.rewards) for b in values.branches)
    assert got == [
        (0, 1, (0.0, 0.0, 1.0)),  # y, z
        (0, 1, (0.0, 0.5, 1.0)),  # b, z
        (0, 2, (0.0, 0.5, 1.0)),
        (0, 2, (0.0, 0.5, 1.0)),
        (1, 1, (0.0, 0.0, 0.0)),
        (1, 1, (0.0, 0.5, 0.0)),
        (1, 2, (0.0, 0.5, 0.0)),
        (1, 2, (0.0, 0.5, 0.0)),
    ]
    # each branch's sampled tokens carry the servers' log-probs (the behaviour policy's)
    for branch in values.branches:
        for sample in branch.episode.samples:
            assert set(sample.sampling_logps) == {-0.5}


def test_a_failed_continuation_request_fails_that_continuation_alone(tokenizer: Any) -> None:
    # the first request of the first call is episode 0's first continuation from s_1: it
    # fails, so its sibling (which now gets the script's first hall answer after the
    # episode's, "y") alone values s_1: 0 + 1.0
    played = play_round(tokenizer, ScriptedServers(tokenizer, fail_first=1))
    values = played.values
    assert values is not None
    assert values.failed == 1
    assert values.values == {0: {1: 1.0, 2: 1.0}, 1: {1: 0.25, 2: 0.0}}


def test_a_group_valued_by_an_older_version_than_allowed_is_stale() -> None:
    class Servers:
        version = 5

    rollouts = ServerRollouts(
        Servers(),
        None,  # type: ignore[arg-type]
        SamplingParams(),
        lambda step: 0,
        max_staleness=1,
        sync_every=1,
        start_step=0,
        max_steps=1,
    )
    episode = EpisodeData([], [0.0, 1.0], StopReason.TERMINATED, {})
    trajectories = tuple(
        Trajectory(g, g * 2 + m, Task(g, 0), episode, 5) for g in (0, 1) for m in (0, 1)
    )
    batch = RolloutBatch(trajectories, 2, 0)
    # group 0's slot 1 was valued, group 1's slot 2 has a branch; both by version 3
    old = StateValues(values={1: {1: 0.5}}, branches=[Branch(2, 1, episode)], policy_version=3)
    # at step 5 with max_staleness 1, version 4 is the oldest allowed
    assert rollouts.stale_groups(batch, 5) == [False, False]
    assert rollouts.stale_groups(batch, 5, old) == [True, True]
    assert rollouts.stale_groups(batch, 4, old) == [False, False]  # 3 is allowed at step 4
    only_values = StateValues(values={1: {1: 0.5}}, policy_version=3)
    assert rollouts.stale_groups(batch, 5, only_values) == [True, False]
