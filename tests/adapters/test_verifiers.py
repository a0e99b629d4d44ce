"""Classic verifiers envs (single-turn, multi-turn, tool) built from the real package, played
through the rollout factory and the collector: an oracle policy scores 1.0 and a wrong one
0.0, the rubric's metrics reach ``info``, rows follow ``row_index``, timeouts and resets
cancel the rollout, and no thread is left after close."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agile_llmenvs.envs import make_rollout_env_factory
from agile_llmenvs.llm_envs import RolloutCollector, RolloutHarness, StopReason
from agile_llmenvs.specs import LLMEnvSpec
from agile_llmenvs.transport.client import InProcessEnvClient

pytest.importorskip("verifiers.envs", reason="needs the `verifiers` extra (verifiers 0.3.x)")
from agile_llmenvs.adapters.verifiers import VerifiersEnv, make

ENVS = Path(__file__).resolve().parent / "verifiers_envs.py"
EOS = 2
QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")


@pytest.fixture(scope="module", autouse=True)
def _progress_monitor_started() -> None:
    """One env built and closed first: the first ``Dataset.map`` starts tqdm's monitor thread,
    which lives as long as the process; the tests count the threads an env leaves after it."""
    make(f"{ENVS}:load_single_turn").close()


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def spec(loader: str, **env_config: Any) -> LLMEnvSpec:
    return LLMEnvSpec(
        env_type="rollout",
        entrypoint=f"{ENVS}:{loader}",
        factory="agile_llmenvs.adapters.verifiers:make",
        env_config=env_config,
    )


def scripted(tokenizer: Any, policy: Callable[[str], str], seen: list[str]) -> Any:
    """A collector ``generate`` that plays ``policy`` on each slot's decoded context."""

    def generate(contexts: list[list[int]]) -> list[list[int]]:
        texts = [tokenizer.decode(ids) for ids in contexts]
        seen.extend(texts)
        return [[*tokenizer.encode(policy(t), add_special_tokens=False), EOS] for t in texts]

    return generate


def collect(tokenizer: Any, env_spec: LLMEnvSpec, policy: Callable[[str], str]) -> Any:
    factory, max_turns = make_rollout_env_factory(env_spec, tokenizer)
    seen: list[str] = []
    before = set(threading.enumerate())
    collector = RolloutCollector(factory, batch_size=2, group_size=2, base_seed=3)
    try:
        batch = collector.collect(scripted(tokenizer, policy, seen))
    finally:
        collector.close()
    for thread in set(threading.enumerate()) - before:  # the collector's pool, told to exit
        thread.join(timeout=10)
    assert set(threading.enumerate()) <= before
    return batch, max_turns, seen


def the_sum(context: str) -> int:
    a, b = QUESTION.findall(context)[-1]
    return int(a) + int(b)


def oracle(context: str) -> str:
    return str(the_sum(context))


def tool_oracle(context: str) -> str:
    """Call ``add`` on the question, then answer with what the tool returned."""
    if "</tool_call>" not in context:
        a, b = QUESTION.findall(context)[-1]
        call = {"name": "add", "arguments": {"a": int(a), "b": int(b)}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    return context.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0].strip()


def wrong(context: str) -> str:
    return "0"


@pytest.mark.parametrize(
    ("loader", "policy", "rewards", "max_turns"),
    [
        ("load_single_turn", oracle, (1.0,), 1),
        ("load_multi_turn", oracle, (0.0, 1.0), 2),
        ("load_tool", tool_oracle, (0.0, 1.0), 3),
    ],
)
def test_an_oracle_scores_one_with_the_rubric_metrics_in_info(
    tokenizer: Any,
    loader: str,
    policy: Callable[[str], str],
    rewards: tuple[float, ...],
    max_turns: int,
) -> None:
    batch, budget, seen = collect(tokenizer, spec(loader), policy)
    assert budget == max_turns  # the env's own max_turns
    assert len(batch.trajectories) == 4
    for trajectory in batch.trajectories:
        episode = trajectory.episode
        assert episode.stop_reason is StopReason.TERMINATED
        assert episode.rewards == rewards
        metrics = episode.info["metrics"]
        assert metrics["exact_answer"] == 1.0
        assert metrics["num_turns"] == float(len(rewards))
        assert episode.info["row_index"] == trajectory.task.row_index
    system = "<|im_start|>system\nReply with the number only.<|im_end|>\n<|im_start|>user\n"
    for context in seen:  # the env's system prompt: in the system role, once, not as user text
        assert context.startswith(system)
        assert context.count("Reply with the number only.") == 1
    if loader == "load_tool":
        answered = [c for c in seen if "</tool_call>" in c]
        assert len(answered) == 4
        for context in answered:  # the tool's result in the template's tool role, not as user
            a, b = map(int, QUESTION.findall(context)[-1])
            assert context.endswith(f"<|im_start|>tool\n{a + b}<|im_end|>\n<|im_start|>assistant\n")
        for trajectory in batch.trajectories:
            assert trajectory.episode.info["metrics"]["add_calls"] == 1.0
            assert trajectory.episode.info["metrics"]["used_the_tool"] == 1.0
    else:
        assert all(t.episode.info["metrics"]["reply_length"] > 0 for t in batch.trajectories)


@pytest.mark.parametrize("loader", ["load_single_turn", "load_multi_turn", "load_tool"])
def test_a_wrong_policy_scores_zero(tokenizer: Any, loader: str) -> None:
    batch, _, _ = collect(tokenizer, spec(loader), wrong)
    for trajectory in batch.trajectories:
        assert trajectory.episode.stop_reason is StopReason.TERMINATED
        assert trajectory.episode.rewards[-1] == 0.0
        assert trajectory.episode.info["metrics"]["exact_answer"] == 0.0


def test_the_system_message_goes_in_the_templates_system_role(tokenizer: Any) -> None:
    env = make(f"{ENVS}:load_single_turn")
    _, info = env.reset(row_index=2)
    assert info["system_prompt"] == "Reply with the number only."
    assert [m["role"] for m in info["messages"]] == ["system", "user"]
    harness = RolloutHarness(InProcessEnvClient(env), tokenizer, 1)  # no system_prompt set
    try:
        context = tokenizer.decode(harness.reset(row_index=2))
    finally:
        harness.close()
    assert context == (
        "<|im_start|>system\nReply with the number only.<|im_end|>\n"
        "<|im_start|>user\nWhat is 7 + 6?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_rows_tools_and_tool_messages_direct() -> None:
    before = set(threading.enumerate())
    env = make(f"{ENVS}:load_tool")
    try:
        assert env.dataset_size == 4
        assert [tool["name"] for tool in env.tools] == ["add"]
        assert env.tools[0]["parameters"]["required"] == ["a", "b"]
        prompt, _ = env.reset(row_index=1)
        assert prompt == "What is 4 + 4?"
        call = '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 4}}\n</tool_call>'
        observation, reward, done, _, info = env.step(call)
        assert (observation, reward, done) == ("8", 0.0, False)
        assert info["messages"] == [{"role": "tool", "content": "8", "tool_call_id": "call_0"}]
        malformed = '<tool_call>\n{"name": "add", "arguments": \n</tool_call>'
        _, reward, done, _, info = env.step(malformed)  # plain text: ToolEnv ends, scored
        assert (reward, done) == (0.0, True)
        assert info["stop_condition"] == "no_tools_called"
        with pytest.raises(RuntimeError, match="after the rollout ended"):
            env.step("8")
        with pytest.raises(IndexError):
            env.reset(row_index=4)
    finally:
        env.close()
    assert set(threading.enumerate()) <= before


def test_reset_and_close_cancel_the_rollout_under_way() -> None:
    before = set(threading.enumerate())
    env = make(f"{ENVS}:load_multi_turn")
    env.reset(row_index=0)
    env.step("1")  # the rollout now waits for the second reply
    first = env._episodes.task
    assert first is not None
    assert not first.done()
    env.reset(row_index=3)
    assert first.cancelled()
    assert env.step("10")[:3] == ("Check again: what is the sum?", 0.0, False)
    assert env.step("10")[1:3] == (1.0, True)
    env.reset(row_index=0)
    loop = env._episodes.loop
    env.close()
    env.close()  # idempotent
    assert loop.is_closed()
    assert set(threading.enumerate()) <= before


def test_a_slow_env_times_out_and_its_rollout_is_cancelled() -> None:
    before = set(threading.enumerate())
    env = make(f"{ENVS}:load_slow", call_timeout_s=0.2)
    try:
        env.reset(row_index=1)
        with pytest.raises(TimeoutError, match=r"call_timeout_s=0\.2"):
            env.step("anything")
        envs_module = sys.modules[type(env.env).__module__]
        assert envs_module.CANCELLED[-1] == 1  # the sleeping env_response was cancelled
        assert not asyncio.all_tasks(env._episodes.loop)
        env.reset(row_index=2)  # usable again
    finally:
        env.close()
    assert set(threading.enumerate()) <= before


def test_make_explains_what_it_cannot_build() -> None:
    from agile_llmenvs.errors import EnvBuildError

    with pytest.raises(EnvBuildError, match="not a verifiers Environment"):
        make(f"{ENVS}:exact_answer", completion=[], answer="1")
    with pytest.raises(EnvBuildError, match="split"):
        make(f"{ENVS}:load_single_turn", split="validation")
    assert isinstance(make(f"{ENVS}:load_single_turn", split="train"), VerifiersEnv)


def test_an_env_builds_and_plays_off_the_main_thread() -> None:
    """verifiers installs signal handlers when an env is built: skipped off the main thread
    (an env server's session thread), where Python refuses them."""
    played: list[Any] = []

    def play() -> None:
        env = make(f"{ENVS}:load_single_turn")
        try:
            played.append(env.reset(row_index=0)[0])
            played.append(env.step("5")[1])
        finally:
            env.close()

    worker = threading.Thread(target=play)
    worker.start()
    worker.join(timeout=60)
    assert played == ["What is 2 + 3?", 1.0]
