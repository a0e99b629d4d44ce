"""Monte-Carlo rollouts from saved terminal states: the runner's multi-instance path.

A scripted policy behind a real OpenAI-compatible HTTP server: the second command it sends
copies the draft into place, the third submits.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes import ChatAPIServer, api_server, server

from agile_llmenvs.adapters.terminal import TaskFolder, TerminalEnvironment, terminal_restore
from agile_llmenvs.backends import APIConfig, OpenAIBackend, RetryPolicy
from agile_llmenvs.core import Action
from agile_llmenvs.evaluation import TrajectoryRunner
from agile_llmenvs.evaluation.results import StopReason

__all__ = ["api_server", "server"]

COPY = "```bash\ncp draft.txt greeting.txt\n```"


def scripted(messages: list[dict[str, Any]]) -> str:
    return COPY if sum(m["role"] == "assistant" for m in messages) == 1 else "submit"


@pytest.fixture
def policy(server: ChatAPIServer) -> Iterator[OpenAIBackend]:
    server.reply = scripted
    config = APIConfig(retry=RetryPolicy(max_retries=1, initial_backoff_s=0.01))
    backend = OpenAIBackend("m", base_url=server.openai_url, api_key="k", config=config)
    yield backend
    backend.close()


def test_rollouts_from_a_saved_state_each_get_a_restored_instance(
    policy: OpenAIBackend, tasks_dir: Path, work_root: Path, live_processes
) -> None:
    def env_factory() -> TerminalEnvironment:
        return TerminalEnvironment(TaskFolder(tasks_dir, work_root=work_root))

    with env_factory() as env:
        state, _ = env.reset(options={"row_index": 1})
        saved = env.step(state, Action.from_text("echo 'Hello, agent!' > draft.txt")).next_state
        runner = TrajectoryRunner(env, policy, env_factory=env_factory, restore_fn=terminal_restore)

        rollouts = runner.run_batch_from_states([saved] * 3, batch_size=2)
        assert [t.total_reward for t in rollouts.trajectories] == [1.0, 1.0, 1.0]
        assert {t.stop_reason for t in rollouts.trajectories} == {StopReason.TERMINATED}
        assert [[turn.action.text for turn in t.turns] for t in rollouts.trajectories] == [
            [COPY, "submit"]
        ] * 3

        bad = Action.from_text("cp draft.txt elsewhere.txt")
        q_values = runner.run_batch_from_state_actions([saved] * 2, [Action.from_text(COPY), bad])
        assert [t.total_reward for t in q_values.trajectories] == [1.0, 0.0]

        assert len(live_processes()) == 1  # every rollout instance closed; the saved one lives
    assert live_processes() == []
