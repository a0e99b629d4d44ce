"""verifiers 0.4 envs (``verifiers.v1``: single-turn on the ``null`` harness, multi-turn with
a user turn, the ``bash`` harness's tool) built from the real package, played through the
rollout factory and the collector with the manifest's one factory
(``agile_llmenvs.adapters.verifiers:make``): an oracle policy scores 1.0 and a wrong one 0.0,
the task's rewards and metrics reach ``info``, tasks follow ``row_index``, timeouts and
resets cancel the episode, and no thread is left after close."""

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
from agile_llmenvs.errors import EnvBuildError
from agile_llmenvs.llm_envs import RolloutCollector, RolloutHarness, StopReason
from agile_llmenvs.specs import LLMEnvSpec
from agile_llmenvs.transport.client import InProcessEnvClient

# verifiers 0.3 ships a different verifiers.v1 preview: only 0.4's is driven
pytest.importorskip("verifiers", minversion="0.4", reason="needs verifiers 0.4 (`verifiers-v1`)")
pytest.importorskip("verifiers.v1", reason="needs the `verifiers-v1` extra (verifiers 0.4)")
# a taskset id is an importable module name: the helper module's folder goes on the path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import verifiers_v1_envs as envs

from agile_llmenvs.adapters.verifiers import make
from agile_llmenvs.adapters.verifiers_v1 import VerifiersV1Env

EOS = 2
QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")
SYSTEM = "Reply with the number only."
BASH_SYSTEM = (
    "You are a coding agent. You have access to a bash tool for running shell commands."
    f"\n\n{SYSTEM}"
)


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def spec(loader: str, **env_config: Any) -> LLMEnvSpec:
    return LLMEnvSpec(
        env_type="rollout",
        entrypoint=f"verifiers_v1_envs:{loader}",
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


def oracle(context: str) -> str:
    a, b = QUESTION.findall(context)[-1]
    return str(int(a) + int(b))


def tool_oracle(context: str) -> str:
    """Have ``bash`` add the question's numbers, then answer with what the tool printed."""
    if "</tool_call>" not in context:
        a, b = QUESTION.findall(context)[-1]
        call = {"name": "bash", "arguments": {"command": f"echo $(({a} + {b}))"}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    # the tool's output: the last tool turn (the tiny model's template has a tool role)
    return context.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0].strip()


def wrong(context: str) -> str:
    return "0"


@pytest.mark.parametrize(
    ("loader", "policy", "rewards", "max_turns", "system", "stop", "used_the_tool"),
    [
        ("load_single_turn", oracle, (1.0,), 1, SYSTEM, "agent_completed", 0.0),
        ("load_multi_turn", oracle, (0.0, 1.0), 2, SYSTEM, "user_closed", 0.0),
        ("load_tool", tool_oracle, (0.0, 1.0), 3, BASH_SYSTEM, "agent_completed", 1.0),
    ],
)
def test_an_oracle_scores_one_with_the_rewards_and_metrics_in_info(
    tokenizer: Any,
    loader: str,
    policy: Callable[[str], str],
    rewards: tuple[float, ...],
    max_turns: int,
    system: str,
    stop: str,
    used_the_tool: float,
) -> None:
    batch, budget, seen = collect(tokenizer, spec(loader), policy)
    assert budget == max_turns  # the env's agent's own max_turns
    assert len(batch.trajectories) == 4
    for trajectory in batch.trajectories:
        episode = trajectory.episode
        assert episode.stop_reason is StopReason.TERMINATED
        assert episode.rewards == rewards
        info = episode.info
        assert info["rewards"] == {"exact_answer": 1.0}
        assert info["metrics"] == {"used_the_tool": used_the_tool}
        assert info["stop_condition"] == stop
        assert info["num_turns"] == len(rewards)
        assert "errors" not in info
        assert info["row_index"] == trajectory.task.row_index
    assert len(seen) == 4 * len(rewards)
    head = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
    for context in seen:  # the harness's system prompt: in the system role, once
        assert context.startswith(head)
        assert context.count(SYSTEM) == 1
    if loader == "load_tool":
        answered = [c for c in seen if "</tool_call>" in c]
        assert len(answered) == 4
        for context in answered:  # bash's output in the template's tool role, not as user
            a, b = map(int, QUESTION.findall(context)[-1])
            tail = f"<|im_start|>tool\n{a + b}\n<|im_end|>\n<|im_start|>assistant\n"
            assert context.endswith(tail)


@pytest.mark.parametrize("loader", ["load_single_turn", "load_multi_turn", "load_tool"])
def test_a_wrong_policy_scores_zero(tokenizer: Any, loader: str) -> None:
    batch, _, _ = collect(tokenizer, spec(loader), wrong)
    for trajectory in batch.trajectories:
        assert trajectory.episode.stop_reason is StopReason.TERMINATED
        assert trajectory.episode.rewards[-1] == 0.0
        assert trajectory.episode.info["rewards"] == {"exact_answer": 0.0}


def test_the_system_message_goes_in_the_templates_system_role(tokenizer: Any) -> None:
    env = make("verifiers_v1_envs:load_single_turn")
    assert isinstance(env, VerifiersV1Env)
    _, info = env.reset(row_index=2)
    assert info["system_prompt"] == SYSTEM
    assert info["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 7 + 6?"},
    ]
    harness = RolloutHarness(InProcessEnvClient(env), tokenizer, 1)  # no system_prompt set
    try:
        context = tokenizer.decode(harness.reset(row_index=2))
    finally:
        harness.close()
    assert context == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 7 + 6?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tasks_tools_and_tool_messages_direct() -> None:
    before = set(threading.enumerate())
    env = make("verifiers_v1_envs:load_tool")
    try:
        assert (env.dataset_size, env.max_turns, env.tools) == (4, 3, [])
        prompt, info = env.reset(row_index=1)
        assert prompt == "What is 4 + 4?"
        assert [tool["name"] for tool in env.tools] == ["bash"]
        assert info["tools"] == env.tools
        assert env.tools[0]["parameters"]["required"] == ["command"]
        command = {"name": "bash", "arguments": {"command": "echo $((4 + 4))"}}
        call = f"<tool_call>\n{json.dumps(command)}\n</tool_call>"
        observation, reward, done, _, info = env.step(call)
        assert (observation, reward, done) == ("8\n", 0.0, False)
        assert info == {
            "row_index": 1,
            "messages": [{"role": "tool", "content": "8\n", "tool_call_id": "call_1"}],
        }
        _, reward, done, _, info = env.step("8")
        assert (reward, done) == (1.0, True)
        assert info == {
            "row_index": 1,
            "rewards": {"exact_answer": 1.0},
            "metrics": {"used_the_tool": 1.0},
            "stop_condition": "agent_completed",
            "num_turns": 2,
            "messages": [],
        }
        with pytest.raises(RuntimeError, match="after the episode ended"):
            env.step("8")
        with pytest.raises(IndexError):
            env.reset(row_index=4)
    finally:
        env.close()
    assert set(threading.enumerate()) <= before


def test_reset_and_close_cancel_the_episode_under_way() -> None:
    before = set(threading.enumerate())
    env = make("verifiers_v1_envs:load_multi_turn")
    assert isinstance(env, VerifiersV1Env)
    env.reset(row_index=0)
    assert env.step("1") == (
        "Check again: what is the sum?",
        0.0,
        False,
        False,
        {
            "row_index": 0,
            "messages": [{"role": "user", "content": "Check again: what is the sum?"}],
        },
    )  # the episode now waits for the second reply
    first = env._episodes.task
    assert first is not None
    assert not first.done()
    env.reset(row_index=3)
    assert first.cancelled()
    assert env.step("10")[:3] == ("Check again: what is the sum?", 0.0, False)
    assert env.step("10")[1:3] == (1.0, True)
    env.reset(row_index=0)
    second = env._episodes.task
    assert second is not None
    loop = env._loop
    env.close()
    env.close()  # idempotent
    assert second.cancelled()
    assert loop.is_closed()
    assert set(threading.enumerate()) <= before


def test_a_slow_env_times_out_and_its_episode_is_cancelled() -> None:
    before = set(threading.enumerate())
    env = make("verifiers_v1_envs:load_multi_turn", delay_s=30.0, call_timeout_s=5.0)
    assert isinstance(env, VerifiersV1Env)
    try:
        env.reset(row_index=1)
        with pytest.raises(TimeoutError, match=r"call_timeout_s=5\.0"):
            env.step("anything")  # the env sleeps before its user turn
        assert envs.CANCELLED[-1] == 1  # the sleeping run() was cancelled
        assert env._episode is None
        assert env._episodes.task is None
        assert [t for t in asyncio.all_tasks(env._loop) if t is not env._serving] == []
        assert env.reset(row_index=2)[0] == "What is 7 + 6?"  # usable again
    finally:
        env.close()
    assert set(threading.enumerate()) <= before


def test_make_explains_what_it_cannot_build() -> None:
    with pytest.raises(EnvBuildError, match="module:attr"):
        make("vf-math-python")
    with pytest.raises(EnvBuildError, match=r"not a verifiers\.v1 Env"):
        make("verifiers_v1_envs:SumData", answer="1")
    with pytest.raises(EnvBuildError, match="split"):
        make("verifiers_v1_envs:load_single_turn", split="eval")
    with pytest.raises(EnvBuildError, match="remote runtime"):
        make("verifiers_v1_envs:load_on_prime")
    with pytest.raises(EnvBuildError, match=r"2 agents \(assistant, user\)"):
        make("verifiers_v1_envs:load_user_sim")


def test_an_env_builds_and_plays_off_the_main_thread() -> None:
    """An env server plays each session on a thread of its own."""
    played: list[Any] = []

    def play() -> None:
        env = make("verifiers_v1_envs:load_single_turn")
        try:
            played.append(env.reset(row_index=0)[0])
            played.append(env.step("5")[1])
        finally:
            env.close()

    worker = threading.Thread(target=play)
    worker.start()
    worker.join(timeout=60)
    assert played == ["What is 2 + 3?", 1.0]


def test_another_process_cannot_reach_the_rollouts_interception_server() -> None:
    """The interception server listens on 127.0.0.1, where any user of the machine can
    connect. Each rollout's model and state calls carry a secret of their own (verifiers'
    bearer per rollout): a caller without it gets 401 on every route, the policy is not
    asked, and the episode goes on as if nothing came. (The server runs on the env's loop,
    which runs while the env steps: the callers are answered during the next step.)"""
    import urllib.error
    import urllib.request

    env = make("verifiers_v1_envs:load_multi_turn")
    assert isinstance(env, VerifiersV1Env)
    codes: dict[tuple[str, str, str], int] = {}

    def call(method: str, path: str, body: bytes | None, bearer: str) -> None:
        request = urllib.request.Request(base + path, data=body, method=method)
        request.add_header("Content-Type", "application/json")
        if bearer:
            request.add_header("Authorization", bearer)
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                codes[method, path, bearer] = reply.status
        except urllib.error.HTTPError as refused:
            codes[method, path, bearer] = refused.code

    try:
        question, _ = env.reset(row_index=0)  # the episode waits for the policy's reply
        base = env.env._interception.base_url
        assert base.startswith("http://127.0.0.1:")
        chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        calls = [
            ("POST", "/v1/chat/completions", chat.encode()),
            ("POST", "/chat/completions", chat.encode()),
            ("GET", "/task", None),
            ("GET", "/state", None),
            ("PUT", "/state", b"{}"),
            ("POST", "/tool", b"{}"),
        ]
        callers = [
            threading.Thread(target=call, args=(method, path, body, bearer))
            for bearer in ("", "Bearer not-the-secret")
            for method, path, body in calls
        ]
        for caller in callers:
            caller.start()
        # the policy's first reply plays the episode's first turn, whatever else came
        answer = oracle(question)
        assert env.step(answer)[:3] == ("Check again: what is the sum?", 0.0, False)
        assert env.step(answer)[1:3] == (1.0, True)
        for caller in callers:
            caller.join(60)
        assert len(codes) == len(callers)
        assert set(codes.values()) <= {401, 404}, codes
    finally:
        env.close()
