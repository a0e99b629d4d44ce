"""Turn-level credit (``training.credit``): Monte-Carlo state values from branched
continuations, the per-turn advantages and their per-token weights, all derived by hand on
:class:`branch_envs.DoorEnv` with a scripted policy.

The policy answers a context by the latest of ``cell`` / ``hall`` / ``door`` it shows, the
k-th time it sees that exact context (ids) taking ``SCRIPTS[where][k % len]``. A group of two
plays one task, slot 0 first:

* episode 0: ``a`` (the key), ``b`` (+0.5), ``z`` (+1.0): rewards (0, 0.5, 1.0), return 1.5;
* episode 1: ``x``, ``b`` (+0.5), ``z`` (no key, 0): rewards (0, 0.5, 0), return 0.5.

Two continuations from each state. From episode 0's ``s_1`` (after ``a``, at the hall, seen
once already) the policy says ``y`` then ``b``: returns 0 + 1.0 and 0.5 + 1.0, so
``V = 1.25``; from its ``s_2`` (at the door) ``z`` twice: ``V = 1.0``. Episode 1: ``s_1``
gives 0 + 0 and 0.5 + 0, ``V = 0.25``; ``s_2`` gives 0, ``V = 0``. ``V(s_0)`` is the group's
mean return, 1.0.
"""

from __future__ import annotations

import logging
import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from branch_envs import DoorEnv, SerialDoorEnv, UnforkableDoorEnv, door_manifest
from pydantic import ValidationError
from training.launch import TWO_PROCESSES, accelerate_launch

from agile_llmenvs.core import RolloutBatch
from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.llm_envs import RolloutCollector, RolloutHarness
from agile_llmenvs.training import train_grpo
from agile_llmenvs.training.credit import (
    AnchorSettings,
    BranchTextEnv,
    CreditSettings,
    StateValues,
    anchor_key,
    anchor_turn_advantages,
    batch_turn_advantages,
    collector_checkpoints,
    estimate_values,
    mc_turn_advantages,
    turn_values,
    within_budget,
)
from agile_llmenvs.training.credit.tree import Branch, branch_samples
from agile_llmenvs.training.grpo import build_policy_batch
from agile_llmenvs.training.objective import group_advantages, group_rewards, reward_scale
from agile_llmenvs.training.run import read_metrics
from agile_llmenvs.transport.client import InProcessEnvClient

SCRIPTS = {"cell": ["a", "x"], "hall": ["b", "y", "b"], "door": ["z"]}
#: The sampler's log-prob of every token, by where the policy is (``entropy:N`` reads them).
LOGPS = {"cell": -0.1, "hall": -2.0, "door": -0.5}

VALUES = {0: {1: 1.25, 2: 1.0}, 1: {1: 0.25, 2: 0.0}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def scripted(tokenizer: Any) -> Any:
    seen: Counter[tuple[int, ...]] = Counter()

    def generate(contexts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        out = []
        for context in contexts:
            text = tokenizer.decode(context)
            where = max(SCRIPTS, key=text.rfind)
            script = SCRIPTS[where]
            action = script[seen[tuple(context)] % len(script)]
            seen[tuple(context)] += 1
            ids = [*tokenizer.encode(action, add_special_tokens=False), tokenizer.eos_token_id]
            out.append((ids, [LOGPS[where]] * len(ids)))
        return out

    return generate


def play(
    tokenizer: Any, env_cls: type = DoorEnv, **settings: Any
) -> tuple[RolloutBatch, StateValues, str | None, dict[int, str]]:
    """One group of two on ``env_cls``, then two continuations from each state chosen."""

    def factory() -> RolloutHarness:
        return RolloutHarness.local(env_cls(), tokenizer, max_turns=3)

    collector = RolloutCollector(factory, batch_size=1, group_size=2, base_seed=0)
    checkpoints = collector_checkpoints(collector, CreditSettings(rollouts=2, **settings))
    generate = scripted(tokenizer)
    try:
        batch = collector.collect(generate, observe=checkpoints)
        values = estimate_values(checkpoints, batch.trajectories, generate)
        strategy = checkpoints.strategy_name
        refused = dict(checkpoints.refused)
    finally:
        checkpoints.close()
        collector.close()
    return batch, values, strategy, refused


def advantages(batch: RolloutBatch, values: StateValues, scale: str = "none") -> Any:
    rewards_GN = group_rewards([t.reward for t in batch.trajectories], 2)
    advantages_GN, kept_GN = group_advantages(rewards_GN, scale=scale)  # type: ignore[arg-type]
    scale_G1 = reward_scale(rewards_GN, scale=scale)  # type: ignore[arg-type]
    turns = batch_turn_advantages(
        "turn_mc",
        batch.trajectories,
        rewards_GN,
        advantages_GN,
        kept_GN,
        scale_G1,
        values.values,
        normalise=scale != "none",
    )
    return turns, advantages_GN


def test_the_episodes_play_as_scripted(tokenizer: Any) -> None:
    batch, _, _, _ = play(tokenizer)
    assert [t.episode.rewards for t in batch.trajectories] == [(0.0, 0.5, 1.0), (0.0, 0.5, 0.0)]


@pytest.mark.parametrize("branching", ["auto", "direct", "process_fork", "action_replay"])
def test_state_values_equal_the_hand_derived_means(tokenizer: Any, branching: str) -> None:
    _, values, strategy, refused = play(tokenizer, branching=branching)
    assert strategy == ("direct" if branching == "auto" else branching)
    assert refused == {}
    assert values.values == VALUES
    assert values.states == 4
    assert values.failed == 0
    # 8 continuations: from s_1 two turns ("y" or "b", then "z"), from s_2 one ("z")
    size = {c: len(tokenizer.encode(c, add_special_tokens=False)) + 1 for c in "ybz"}
    per_episode = (size["y"] + size["z"]) + (size["b"] + size["z"]) + 2 * size["z"]
    assert values.tokens == 2 * per_episode


def test_turn_advantages_are_reward_plus_next_value_minus_value(tokenizer: Any) -> None:
    batch, values, _, _ = play(tokenizer)
    turns, _ = advantages(batch, values)
    # episode 0: 0 + 1.25 - 1.0, 0.5 + 1.0 - 1.25, 1.0 + 0 - 1.0
    # episode 1: 0 + 0.25 - 1.0, 0.5 + 0.0 - 0.25, 0.0 + 0 - 0.0
    assert turns.per_turn == [[0.25, 0.25, 0.0], [-0.75, 0.25, 0.0]]
    assert turns.fallback_episodes == 0


def test_group_scale_divides_every_turn_by_the_groups_std(tokenizer: Any) -> None:
    batch, values, _, _ = play(tokenizer)
    turns, advantages_GN = advantages(batch, values, scale="group")
    std = (((1.5 - 1.0) ** 2 + (0.5 - 1.0) ** 2) / (2 - 1)) ** 0.5 + 1e-4
    expected = [[0.25 / std, 0.25 / std, 0.0], [-0.75 / std, 0.25 / std, 0.0]]
    for got, want in zip(turns.per_turn, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-12)
    # each episode's turns sum to its GRPO advantage, (R - mean) / std
    assert [sum(t) for t in turns.per_turn] == pytest.approx(advantages_GN.flatten().tolist())


def test_each_sampled_token_is_weighted_by_its_turns_advantage(tokenizer: Any) -> None:
    batch, values, _, _ = play(tokenizer)
    turns, advantages_GN = advantages(batch, values)
    policy = build_policy_batch(
        batch, advantages_GN.flatten().float(), 0, turn_advantages=turns.per_turn
    )
    assert policy.advantages_B.shape == policy.action_mask_BT.shape
    for row, trajectory in enumerate(batch.trajectories):
        sample = trajectory.episode.sample
        expected = [
            turns.per_turn[row][turn] if sampled else 0.0
            for sampled, turn in zip(sample.action_mask, sample.turn_ids, strict=True)
        ]
        width = len(sample.action_mask)
        assert policy.advantages_B[row, :width].tolist() == expected
        assert policy.advantages_B[row, width:].abs().sum() == 0
    assert policy.select(slice(1, 2)).advantages_B.tolist()[0][:width] == expected


def test_first_n_values_only_the_first_states(tokenizer: Any) -> None:
    batch, values, _, _ = play(tokenizer, turns="first:1")
    assert values.values == {0: {1: 1.25}, 1: {1: 0.25}}
    turns, _ = advantages(batch, values)
    # turns 1 and 2 share r_1 + r_2 + 0 - V(s_1): 1.5 - 1.25 and 0.5 - 0.25
    assert turns.per_turn == [[0.25, 0.25, 0.25], [-0.75, 0.25, 0.25]]


def test_entropy_n_values_the_state_after_the_least_likely_turn(tokenizer: Any) -> None:
    # the hall turn's tokens have log-prob -2.0 against the first turn's -0.1: it is branched
    # after, at s_2
    batch, values, _, _ = play(tokenizer, turns="entropy:1")
    assert values.values == {0: {2: 1.0}, 1: {2: 0.0}}
    turns, _ = advantages(batch, values)
    # turns 0 and 1 share r_0 + r_1 + V(s_2) - V(s_0): 0.5 + 1.0 - 1.0 and 0.5 + 0 - 1.0
    assert turns.per_turn == [[0.5, 0.5, 0.0], [-0.5, -0.5, 0.0]]


def test_max_tokens_ends_a_continuation_with_its_rewards_so_far(tokenizer: Any) -> None:
    size = len(tokenizer.encode("y", add_special_tokens=False)) + 1
    _, values, _, _ = play(tokenizer, max_tokens=size)
    # from s_1 each continuation stops after its first turn: "y" pays 0, "b" 0.5
    assert values.values == {0: {1: 0.25, 2: 1.0}, 1: {1: 0.25, 2: 0.0}}


def test_the_step_budget_takes_states_by_rank_and_skips_what_does_not_fit() -> None:
    # (rank, tokens the episode sampled from the state on); 2 continuations a state
    costs = [(0, 5), (1, 3), (0, 4), (1, 2)]
    # rank 0 first: 2*5 = 10, then 2*4 = 8 (18); rank 1: 2*3 = 6 would make 24, skipped,
    # 2*2 = 4 would make 22, skipped at 20 and taken at 22
    assert within_budget(costs, 2, 20) == [True, False, True, False]
    assert within_budget(costs, 2, 22) == [True, False, True, True]
    assert within_budget(costs, 2, 9) == [False, False, True, False]  # 10 does not fit, 8 does
    assert within_budget([(0, 0)], 3, 3) == [True]  # a state counts at least 1 token a rollout


def test_a_step_budget_values_every_episodes_first_state_before_any_second(
    tokenizer: Any,
) -> None:
    size = {c: len(tokenizer.encode(c, add_special_tokens=False)) + 1 for c in "ybz"}
    # both episodes said "b" then "z" after s_1, and "z" after s_2: s_1 is expected to cost
    # 2 * (b + z) a state, s_2 2 * z; the budget holds both s_1 and one s_2 (episode 0's,
    # first in the batch)
    budget = 2 * 2 * (size["b"] + size["z"]) + 2 * size["z"]
    _, values, _, _ = play(tokenizer, step_tokens=budget)
    assert values.values == {0: {1: 1.25, 2: 1.0}, 1: {1: 0.25}}
    assert values.over_budget == 1
    # s_1's continuations say "y" or "b", then "z"; episode 0's s_2's "z" twice
    assert values.tokens == 2 * (size["y"] + size["b"] + 2 * size["z"]) + 2 * size["z"]
    assert values.tokens <= budget or size["y"] > size["b"]


def test_continuations_past_the_step_budget_end_with_their_rewards_so_far(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expected costs of 1 token let every state in under a budget of 8, but the first
    round alone samples more: the continuations from s_1, one turn in, end there ("y" pays
    0, "b" 0.5); those from s_2 ended in that round."""
    monkeypatch.setattr(turn_values, "sampled_from", lambda samples, turn: 1)
    _, values, _, _ = play(tokenizer, step_tokens=8)
    assert values.over_budget == 0
    assert values.values == {0: {1: 0.25, 2: 1.0}, 1: {1: 0.25, 2: 0.0}}


@pytest.mark.parametrize(
    ("env_cls", "branching", "reason"),
    [
        (UnforkableDoorEnv, "auto", "is not forkable"),
        (SerialDoorEnv, "action_replay", "not deterministic given its seed and task"),
    ],
)
def test_an_env_that_cannot_branch_keeps_its_episode_advantage_and_is_counted(
    tokenizer: Any, env_cls: type, branching: str, reason: str
) -> None:
    batch, values, _, refused = play(tokenizer, env_cls, branching=branching)
    assert values.values == {}
    assert sorted(refused) == [0, 1]
    assert all(reason in r for r in refused.values())
    turns, _ = advantages(batch, values)
    # one segment each, GRPO's R - mean: 1.5 - 1.0 and 0.5 - 1.0 on every turn
    assert turns.per_turn == [[0.5] * 3, [-0.5] * 3]
    assert turns.fallback_episodes == 2


def test_mc_advantages_with_no_values_are_grpos() -> None:
    assert mc_turn_advantages([0.0, 0.5, 1.0], {}, baseline=1.0, scale=2.0) == [0.25] * 3


def test_anchor_compares_turns_that_act_from_the_same_observation() -> None:
    # undiscounted returns to go: episode 0 (1, 1, 1), episode 1 (1, 1, 0); the first and
    # last observations are shared, the middle ones are not (alone in their anchor group: 0);
    # centred only (scale_rewards: none)
    groups = [[([0.0, 0.0, 1.0], [(1,), (2,), (3,)]), ([0.0, 1.0, 0.0], [(1,), (5,), (3,)])]]
    got = anchor_turn_advantages(groups, [[0.0, 0.0]], AnchorSettings(gamma=1.0), normalise=False)
    assert got == [[[0.0, 0.0, 0.5], [0.0, 0.0, -0.5]]]
    # discounted by 0.95: the first turns' returns to go are 0.9025 and 0.95 (mean 0.92625)
    got = anchor_turn_advantages(groups, [[0.0, 0.0]], AnchorSettings(gamma=0.95), normalise=False)
    assert got == [[[pytest.approx(-0.02375), 0.0, 0.5], [pytest.approx(0.02375), 0.0, -0.5]]]


def test_anchor_keys_are_the_observation_ids_since_the_last_action(tokenizer: Any) -> None:
    batch, _, _, _ = play(tokenizer)
    rewards_GN = group_rewards([t.reward for t in batch.trajectories], 2)
    advantages_GN, kept_GN = group_advantages(rewards_GN, scale="none")
    scale_G1 = reward_scale(rewards_GN, scale="none")
    turns = batch_turn_advantages(
        "anchor", batch.trajectories, rewards_GN, advantages_GN, kept_GN, scale_G1, normalise=False
    )
    # both episodes see the same prompt, "hall" and "door": each turn's anchor group is the
    # pair. Rewards (0, 0.5, 1.0) and (0, 0.5, 0), returns to go discounted by 0.95:
    # (0.95 x 1.45, 0.5 + 0.95, 1.0) and (0.95 x 0.5, 0.5, 0.0); each pair's mean is midway,
    # so the steps are +-(0.95 x 0.95 / 2, 0.95 / 2, 0.5); episode advantages +-0.5
    steps = [0.95 * 0.95 / 2, 0.95 / 2, 0.5]
    assert turns.per_turn[0] == pytest.approx([0.5 + s for s in steps], abs=1e-12)
    assert turns.per_turn[1] == pytest.approx([-0.5 - s for s in steps], abs=1e-12)
    keys = [[anchor_key(t.episode.samples, k) for k in range(3)] for t in batch.trajectories]
    assert keys[0] == keys[1]
    hall = tokenizer.encode("hall", add_special_tokens=False)
    text = tokenizer.decode(list(keys[0][1]))
    assert "hall" in text
    assert "cell" not in text
    assert all(i in keys[0][1] for i in hall)


def test_grpo_trains_with_turn_mc_and_logs_what_the_credit_cost(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    manifest = door_manifest(tiny_model_dir, tmp_path / "run", credit="turn_mc", credit_rollouts=2)
    result = train_grpo(manifest)
    assert len(result.metrics) == 2
    for row in result.metrics:
        # 4 episodes of 3 turns: states s_1 and s_2 of each valued, 2 continuations each
        assert row["credit_states"] == 8
        assert row["credit_fallback_episodes"] == 0
        assert 0 < row["credit_tokens"] <= 8 * 2 * 2 * 4  # at most 2 turns of 4 tokens
        assert 0 < row["policy_tokens"] <= 4 * 3 * 4
        # the continuations only value states: the episodes' own tokens are all that train
        assert row["trained_tokens"] == row["policy_tokens"]
        assert row["credit_time_s"] > 0
        assert 0 < row["credit_env_time_s"] < row["credit_time_s"]
        assert math.isfinite(row["loss"])


def test_grpo_trains_with_tree_credit_on_the_continuations_too(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    manifest = door_manifest(tiny_model_dir, tmp_path / "run", credit="tree", credit_rollouts=2)
    result = train_grpo(manifest)
    assert len(result.metrics) == 2
    for row in result.metrics:
        assert row["credit_states"] == 8  # as turn_mc: s_1 and s_2 of 4 episodes, 2 each
        assert row["credit_fallback_episodes"] == 0
        assert 0 < row["credit_tokens"] <= 8 * 2 * 2 * 4
        # every token sampled, the episodes' and the continuations', is trained once
        assert row["trained_tokens"] == row["policy_tokens"] + row["credit_tokens"]
        throughput = row["tokens_per_s"] * row["step_time_s"]
        assert round(throughput) == row["trained_tokens"]
        assert math.isfinite(row["loss"])


def test_a_step_budget_that_values_no_state_trains_on_and_counts_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A budget of 1 token has no room for any state (2 continuations of at least 1 token):
    every episode keeps GRPO's advantage, and the run is not refused as one whose env
    cannot branch."""
    manifest = door_manifest(
        tiny_model_dir, tmp_path / "run", credit="turn_mc", credit_rollouts=2, credit_step_tokens=1
    )
    result = train_grpo(manifest)
    assert len(result.metrics) == 2
    for row in result.metrics:
        # 4 episodes of 3 turns, s_1 and s_2 of each chosen: 8 states, none valued
        assert (row["credit_states"], row["credit_over_budget"]) == (0, 8)
        assert (row["credit_tokens"], row["credit_fallback_episodes"]) == (0, 4)


def test_a_run_whose_env_cannot_branch_is_refused_after_its_first_step(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every episode falling back would be episode credit at turn_mc's cost: the run stops
    after the first step with multi-turn episodes, saying why and what to set."""
    out = tmp_path / "run"
    manifest = door_manifest(tiny_model_dir, out, "UnforkableDoorEnv", credit="turn_mc")
    with (
        caplog.at_level(logging.WARNING, logger="agile_llmenvs.training.grpo"),
        pytest.raises(AgileLLMEnvsError) as raised,
    ):
        train_grpo(manifest)
    message = str(raised.value)
    assert message.startswith(
        "training.credit: turn_mc valued no state at step 1: all 4 of its multi-turn episodes "
        "fell back to episode credit (BranchError: 'UnforkableDoorEnv' is not forkable"
    )
    assert message.endswith(
        "Set training.credit_branching (now 'auto') to one that can branch this env "
        "(docs/branching.md: `action_replay` for an env deterministic given its seed and task, "
        "`process_fork` for one whose episodes live in its own memory), or use `credit: "
        "anchor` (no branching) or `credit: episode`"
    )
    rows = read_metrics(out / "metrics.csv")  # the step it saw is recorded
    assert [float(row["credit_fallback_episodes"]) for row in rows] == [4.0]
    warnings = [r.getMessage() for r in caplog.records if "cannot branch" in r.getMessage()]
    assert len(warnings) == 1
    assert "credit_fallback_episodes" in warnings[0]


@pytest.mark.parametrize("branching", ["auto", "process_fork", "action_replay"])
def test_an_env_from_a_python_file_branches_under_every_strategy(
    tiny_model_dir: Path, tmp_path: Path, branching: str
) -> None:
    """The env the own-env guide teaches: a class in a file next to the manifest, loaded
    under a private module name. ProcessFork's zygote loads the same file before unpickling
    it (it used to fail to import the name, and every episode fell back)."""
    source = Path(__file__).parents[1] / "branch_envs.py"
    env_file = tmp_path / "my_door.py"  # a file outside the tests' import path
    env_file.write_text(source.read_text())  # ForkedDoorEnv: auto branches by ProcessFork
    manifest = door_manifest(
        tiny_model_dir,
        tmp_path / "run",
        credit="turn_mc",
        credit_rollouts=2,
        credit_branching=branching,
    )
    data = manifest.model_dump(mode="json", exclude_unset=True)
    data["env"]["entrypoint"] = f"{env_file}:ForkedDoorEnv"
    result = train_grpo(type(manifest).model_validate(data))
    assert [row["credit_fallback_episodes"] for row in result.metrics] == [0.0, 0.0]
    assert [row["credit_states"] for row in result.metrics] == [8.0, 8.0]


def test_a_killed_zygote_is_replaced_and_the_run_goes_on(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of ProcessFork's zygote while step 1's states wait to be valued: its holders
    are processes of their own and still branch; releasing them no longer asks the dead
    zygote to reap (the run used to end with a BranchError there); step 2 starts a new one."""
    import os
    import signal

    from agile_llmenvs.training.grpo import loop

    real = loop.estimate_values
    killed: list[int] = []

    def kill_first(checkpoints: Any, *args: Any, **kwargs: Any) -> Any:
        if not killed:
            zygote = checkpoints._strategy._zygote
            os.kill(zygote.pid, signal.SIGKILL)
            zygote.process.wait()
            killed.append(zygote.pid)
        return real(checkpoints, *args, **kwargs)

    monkeypatch.setattr(loop, "estimate_values", kill_first)
    manifest = door_manifest(
        tiny_model_dir, tmp_path / "run", "ForkedDoorEnv", credit="turn_mc", credit_rollouts=2
    )
    result = train_grpo(manifest)
    assert len(killed) == 1
    assert [row["credit_states"] for row in result.metrics] == [8.0, 8.0]
    assert [row["credit_fallback_episodes"] for row in result.metrics] == [0.0, 0.0]


def test_grpo_trains_with_anchor_credit_at_no_extra_cost(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    result = train_grpo(door_manifest(tiny_model_dir, tmp_path / "run", credit="anchor"))
    assert [row["credit_tokens"] for row in result.metrics] == [0.0, 0.0]
    assert all(math.isfinite(row["loss"]) for row in result.metrics)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"credit": "turn_mc", "dynamic_sampling": True}, "dynamic_sampling"),
        ({"credit": "tree", "dynamic_sampling": True}, "'tree' values the states"),
        ({"credit": "tree", "credit_gamma": 0.9}, "credit_gamma: is `anchor`'s"),
        ({"credit": "turn_mc", "credit_turns": "some"}, "credit_turns"),
        ({"credit": "turn_mc", "credit_rollouts": 0}, "credit_rollouts"),
        ({"credit": "turn_mc", "credit_gamma": 0.9}, "credit_gamma: is `anchor`'s"),
        ({"credit_omega": 0.5}, "credit_omega: is `anchor`'s, and credit is 'episode'"),
        ({"credit": "anchor", "credit_gamma": 1.5}, "credit_gamma"),
    ],
)
def test_credit_settings_that_cannot_work_are_refused_naming_the_field(
    tiny_model_dir: Path, tmp_path: Path, settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        door_manifest(tiny_model_dir, tmp_path, **settings)


@pytest.mark.parametrize(
    ("tokenizer_name", "case"),
    [("tiny", None), ("mistral_v1", "llama2"), ("mistral_v3", "qwen3"), ("mistral_v3", "llama31")],
)
def test_a_continuation_taking_the_same_actions_rebuilds_the_episodes_ids(
    tiny_model_dir: Path, tokenizer_name: str, case: str | None
) -> None:
    """The continuation's harness goes on from a copy of the episode at the state: taking
    the episode's own actions again, it ends with the episode's ids, mask and turn ids."""
    from real_tokenizers import load_mistral_tokenizer
    from template_corpus import get_case, with_template
    from transformers import AutoTokenizer

    if case is None:
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    else:
        tok = with_template(lambda: load_mistral_tokenizer(tokenizer_name), get_case(case))
    actions = {"cell": "a", "hall": "b", "door": "z"}

    def generate(contexts: list[list[int]]) -> list[list[int]]:
        texts = [tok.decode(c) for c in contexts]
        chosen = [actions[max(actions, key=text.rfind)] for text in texts]
        return [[*tok.encode(a, add_special_tokens=False), tok.eos_token_id] for a in chosen]

    collector = RolloutCollector(
        lambda: RolloutHarness.local(DoorEnv(), tok, max_turns=3), batch_size=1, group_size=2
    )
    checkpoints = collector_checkpoints(collector, CreditSettings(rollouts=1))
    try:
        batch = collector.collect(generate, observe=checkpoints)
        episode = batch.trajectories[0].episode
        for point in checkpoints.points[0]:
            ((env, state),) = [point.held.branch()]
            harness = point.harness.branch(
                point.snapshot, InProcessEnvClient(BranchTextEnv(env, state))
            )
            while not harness.done:
                harness.step(generate([harness.context_ids])[0])
            continued = harness.get_episode_data()
            assert continued.rewards == episode.rewards == (0.0, 0.5, 1.0)
            assert continued.samples == episode.samples  # ids, masks, turn ids, log-probs
            # tree trains it as a branch: the same ids, its own turns sampled, the prefix not
            rows = branch_samples(Branch(0, point.turn, continued), 1.0)
            own = [
                (
                    sample,
                    [
                        m and k >= point.turn
                        for m, k in zip(sample.action_mask, sample.turn_ids, strict=True)
                    ],
                )
                for sample in episode.samples
            ]
            own = [(sample, mask) for sample, mask in own if any(mask)]
            assert [row.token_ids for row, _ in rows] == [s.token_ids for s, _ in own]
            assert [list(row.action_mask) for row, _ in rows] == [mask for _, mask in own]
        assert [p.turn for p in checkpoints.points[0]] == [1, 2]
    finally:
        checkpoints.close()
        collector.close()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
@pytest.mark.parametrize(
    ("credit", "fsdp"),
    [("turn_mc", False), ("turn_mc", True), ("tree", True)],
    ids=["turn_mc-data_parallel", "turn_mc-fsdp", "tree-fsdp"],
)
def test_turn_credit_on_two_processes_values_each_ranks_states(
    tiny_model_dir: Path, tmp_path: Path, credit: str, fsdp: bool
) -> None:
    """Each rank branches its own episodes (its continuations' generate calls paired with the
    other rank's under FSDP); the credit counts are summed over the ranks. Under ``tree``
    every token the continuations sampled trains too, on the rank that branched them."""
    out = tmp_path / "run"
    manifest = door_manifest(
        tiny_model_dir, out, credit=credit, credit_rollouts=2, batch_size=4, fsdp=fsdp
    )
    data = manifest.model_dump(mode="json", exclude_unset=True)
    data["env"]["entrypoint"] = f"{Path(__file__).parents[1] / 'branch_envs.py'}:DoorEnv"
    path = tmp_path / "door.yaml"
    path.write_text(yaml.safe_dump(data))
    done = accelerate_launch(TWO_PROCESSES, "-m", "agile_llmenvs", "train", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(out / "metrics.csv")
    # 4 groups of 2 over 2 ranks: 8 episodes of 3 turns, s_1 and s_2 of each valued
    assert [float(row["credit_states"]) for row in rows] == [16.0, 16.0]
    assert [float(row["credit_fallback_episodes"]) for row in rows] == [0.0, 0.0]
    for row in rows:
        policy, extra = float(row["policy_tokens"]), float(row["credit_tokens"])
        assert extra > 0
        trained = policy + extra if credit == "tree" else policy
        assert float(row["trained_tokens"]) == trained


KILLED_DURING_CREDIT = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from branch_envs import door_manifest
from agile_llmenvs.training import train_grpo
from agile_llmenvs.training.grpo import loop

def held(checkpoints, *args, **kwargs):
    Path(sys.argv[3]).write_text(str(checkpoints._strategy._zygote.pid))
    time.sleep(600)  # killed here, the states' holders alive

loop.estimate_values = held
manifest = door_manifest(
    Path(sys.argv[2]), Path(sys.argv[3]).parent / "run", "ForkedDoorEnv", credit="turn_mc",
    credit_rollouts=2,
)
train_grpo(manifest)
"""


def _marked_processes(marker: str) -> list[int]:
    """The live processes whose environment holds ``marker`` (zombies are not alive)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_trainer_killed_during_a_credit_step_leaves_no_process_behind(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """kill -9 of the trainer while ProcessFork holds a step's states: the zygote and every
    holder see their sockets close and exit; nothing is left running."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import uuid

    marker = f"AGILE_LLMENVS_TEST_MARK={uuid.uuid4().hex}"
    ready = tmp_path / "zygote.pid"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1], "HF_HUB_OFFLINE": "1"}
    tests = str(Path(__file__).resolve().parents[1])
    trainer = subprocess.Popen(
        [sys.executable, "-c", KILLED_DURING_CREDIT, tests, str(tiny_model_dir), str(ready)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 240
        while not ready.exists() and trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists(), trainer.stderr.read().decode()[-3000:] if trainer.stderr else ""
        helpers = [p for p in _marked_processes(marker) if p != trainer.pid]
        assert int(ready.read_text()) in helpers  # the zygote, and the holders it forked
        assert len(helpers) >= 2
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(30)
        deadline = time.monotonic() + 15
        while _marked_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _marked_processes(marker) == []
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for pid in _marked_processes(marker):
            os.kill(pid, signal.SIGKILL)
