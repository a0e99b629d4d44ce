"""Tiny verifiers 0.4 (``verifiers.v1``) envs for the v1 adapter's tests, built from the
real package: one taskset of sums (this module is its taskset id: it exports exactly one
``Taskset``), played single-turn (the ``null`` harness), multi-turn (an ``Env`` whose
``run`` holds an interaction and sends a user turn), and with a tool (the ``bash``
harness's ``bash`` tool, run on this machine)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf

__all__ = ["SumsTaskset"]

TASKSET_ID = "verifiers_v1_envs"
SYSTEM_PROMPT = "Reply with the number only."
SUMS = [(2, 3), (4, 4), (7, 6), (9, 1)]
LOCAL: dict[str, Any] = {"type": "subprocess"}  # the default runtime is Prime's sandboxes
CANCELLED: list[int] = []


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def exact_answer(self, trace: vf.Trace) -> float:
        """1.0 when the last assistant message is the answer, else 0.0."""
        replies = [m for m in trace.messages if m.role == "assistant"]
        return float(bool(replies) and (replies[-1].content or "").strip() == self.data.answer)

    @vf.metric
    async def used_the_tool(self, trace: vf.Trace) -> float:
        return float(any(m.role == "tool" for m in trace.messages))


class SumsTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self) -> Iterator[SumTask]:
        for a, b in SUMS:
            data = SumData(
                prompt=f"What is {a} + {b}?", system_prompt=SYSTEM_PROMPT, answer=str(a + b)
            )
            yield SumTask(data)


def _taskset() -> vf.TasksetConfig:
    return vf.TasksetConfig(id=TASKSET_ID)


def load_single_turn() -> vf.Env:
    """A plain taskset's env: one agent on the tool-less ``null`` chat harness."""
    agent = vf.AgentConfig(harness={"id": "null"}, runtime=LOCAL, max_turns=1)
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=_taskset(), agent=agent))


class HintEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"}, runtime=LOCAL, max_turns=2)
    hint: str = "Check again: what is the sum?"
    delay_s: float = 0.0


class HintEnv(vf.Env[HintEnvConfig]):
    """The first reply is answered with a hint (a user turn), the second one is scored."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            first = await chat.turn()
            if first.terminated:
                return
            if self.config.delay_s:
                try:
                    await asyncio.sleep(self.config.delay_s)
                finally:
                    CANCELLED.append(int(task.data.idx or 0))
            await chat.turn(self.config.hint)


def load_multi_turn(delay_s: float = 0.0) -> vf.Env:
    return HintEnv(HintEnvConfig(taskset=_taskset(), delay_s=delay_s))


def load_tool() -> vf.Env:
    """The ``bash`` harness: its chat program offers a ``bash`` tool that runs commands in
    the rollout's subprocess runtime (a scratch folder on this machine)."""
    harness: dict[str, Any] = {"id": "bash", "edit": False, "compaction": None}
    agent = vf.AgentConfig(harness=harness, runtime=LOCAL, max_turns=3)
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=_taskset(), agent=agent))


def load_on_prime() -> vf.Env:
    """The agent's default runtime: Prime's remote sandboxes (not driven here)."""
    agent = vf.AgentConfig(harness={"id": "null"})
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=_taskset(), agent=agent))


def load_user_sim() -> vf.Env:
    """verifiers' ``user-sim`` env: a simulated user (an agent of its own) and the assistant."""
    from verifiers.v1.envs.user_sim.env import UserSimEnv, UserSimEnvConfig

    local = {"runtime": LOCAL, "harness": {"id": "null"}}
    config = UserSimEnvConfig(
        taskset=_taskset(), assistant=vf.AgentConfig(**local), user=vf.AgentConfig(**local)
    )
    return UserSimEnv(config)
