"""InProcessEnvClient and RemoteEnvClient: the same env answers the same, in-process or hosted."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from echo_envs import EchoEnv

from agile_llmenvs.errors import EnvExecutionError, EnvProtocolError, EnvStateError
from agile_llmenvs.transport import (
    ClientState,
    EnvReply,
    InProcessEnvClient,
    OpenEnvServer,
    OpenEnvWrapper,
    RemoteEnvClient,
    TextAction,
)


class _TypedWrapper(OpenEnvWrapper):
    """Overrides ``reset`` and ``step`` (as themselves): clients must go the typed way."""

    calls = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> Any:
        type(self).calls += 1
        return super().reset(seed, episode_id, **kw)

    def step(self, action: TextAction, timeout_s: float | None = None, **kw: Any) -> Any:
        type(self).calls += 1
        return super().step(action)


def _episode(client: InProcessEnvClient | RemoteEnvClient) -> list[EnvReply]:
    replies = [client.reset(seed=5, row_index=1)]
    replies += [client.step(text) for text in ("a", "b", "stop")]
    return replies


def test_in_process_and_remote_replies_are_identical() -> None:
    in_process = InProcessEnvClient(EchoEnv())
    with (
        OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=2) as server,
        RemoteEnvClient(server.url) as remote,
    ):
        local_replies, remote_replies = _episode(in_process), _episode(remote)
        assert local_replies == remote_replies
        assert in_process.state() == remote.state()
    assert local_replies[0] == EnvReply(
        observation={
            "prompt": "start seed=5",
            "truncated": False,
            "question": None,
            "answer": None,
        },
        reward=None,
        done=False,
        metadata={"task": {"row_index": 1}, "seed": 5},
    )
    assert [r.prompt for r in local_replies[1:]] == ["1:a", "2:b", "3:stop"]
    assert [r.reward for r in local_replies[1:]] == [1.0, 2.0, 3.0]
    assert [r.done for r in local_replies] == [False, False, False, True]
    assert local_replies[-1].observation["answer"] == "stop"


def test_the_in_process_text_path_answers_as_the_typed_path() -> None:
    """Our wrapper takes text straight to the reply; a subclass that overrides its steps is
    called through the typed models; both give the same replies, truncation included."""
    direct = InProcessEnvClient(EchoEnv())
    typed = InProcessEnvClient(_TypedWrapper(EchoEnv(), owns_inner=True))
    _TypedWrapper.calls = 0
    texts = ["a", "b", "c", "d", "e"]  # the fifth step is truncated
    direct_replies = [direct.reset(seed=2, row_index=0)] + [direct.step(t) for t in texts]
    typed_replies = [typed.reset(seed=2, row_index=0)] + [typed.step(t) for t in texts]
    assert direct_replies == typed_replies
    assert _TypedWrapper.calls == 6
    assert direct_replies[-1].observation["truncated"] is True
    assert direct_replies[1].metadata == {"turn": 1, "scores": [1.5, 2.5]}
    assert direct.reset().prompt == typed.reset().prompt == "start seed=None"
    assert direct.step("stop") == typed.step("stop")
    assert direct.state() == typed.state()


def test_env_errors_surface_as_the_same_type_in_process_and_remote(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = Path(inspect.getfile(EchoEnv))
    monkeypatch.chdir(source.parent)  # files under the working folder are named relative to it
    line = next(
        number
        for number, text in enumerate(source.read_text().splitlines(), 1)
        if 'raise ValueError("the env exploded")' in text
    )
    raised = (
        f"ValueError: the env exploded (raised as ValueError at {source.name}:{line} in step) "
        "[code EXECUTION_ERROR]"
    )
    in_process = InProcessEnvClient(EchoEnv())
    in_process.reset()
    with pytest.raises(EnvExecutionError) as error:
        in_process.step("boom")
    assert str(error.value) == f"in-process env: {raised}"
    assert in_process.step("after").prompt == "1:after"  # the env stays usable
    with OpenEnvServer(make_env=EchoEnv) as server, RemoteEnvClient(server.url) as remote:
        remote.reset()
        with pytest.raises(EnvExecutionError) as error:
            remote.step("boom")
        assert str(error.value).endswith(f"/ws: {raised}")
        assert remote.step("after").prompt == "1:after"


def test_a_wrong_action_field_is_a_protocol_error_in_process_and_remote() -> None:
    client = InProcessEnvClient(EchoEnv(), action_field="msg")
    client.reset()
    with pytest.raises(EnvProtocolError, match="msg\n  Extra inputs are not permitted"):
        client.step("x")
    with (
        OpenEnvServer(make_env=EchoEnv) as server,
        RemoteEnvClient(server.url, action_field="msg") as remote,
    ):
        remote.reset()
        with pytest.raises(EnvProtocolError, match="msg\n  Extra inputs are not permitted"):
            remote.step("x")
        assert remote.reset().prompt == "start seed=None"  # the session survives


def test_lifecycle_errors() -> None:
    client = InProcessEnvClient(EchoEnv())
    client.close()
    with pytest.raises(EnvStateError, match="closed"):
        client.reset()
    with OpenEnvServer(make_env=EchoEnv) as server:
        remote = RemoteEnvClient(server.url)
        assert remote.state_ is ClientState.IDLE
        with pytest.raises(EnvStateError, match=r"step\(\) before reset\(\) \(state idle\)"):
            remote.step("x")
        remote.reset()
        assert remote.state_ is ClientState.IN_EPISODE
        remote.close()
        remote.close()
        assert remote.state_ is ClientState.CLOSED
        with pytest.raises(EnvStateError, match=r"reset\(\) after close\(\)"):
            remote.reset()


def test_tasks_merge_by_row_index_and_eval_tasks_in_eval_mode() -> None:
    with OpenEnvServer(make_env=EchoEnv) as server:
        client = RemoteEnvClient(
            server.url, tasks=[{"q": "train-0"}, {"q": "train-1"}], eval_tasks=[{"q": "eval-0"}]
        )
        assert client.reset(row_index=1).metadata["task"] == {"q": "train-1", "row_index": 1}
        client.eval_mode()
        assert client.reset(row_index=0).metadata["task"] == {"q": "eval-0", "row_index": 0}
        client.train_mode()
        assert client.reset(row_index=0, q="override").metadata["task"] == {
            "q": "override",
            "row_index": 0,
        }
        with pytest.raises(IndexError, match="row_index 2 is outside the 2 tasks"):
            client.reset(row_index=2)
        client.close()


def test_base_url_callable_is_called_again_on_reconnect() -> None:
    calls = []
    with OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=4) as server:

        def base_url() -> str:
            calls.append(1)
            return server.url

        client = RemoteEnvClient(base_url, timeout_s=0.2)
        client.reset()
        client.reset()  # same session: no reconnect
        assert len(calls) == 1
        with pytest.raises(Exception, match="no reply"):
            client.step("sleep:0.5")
        client.reset()  # the session was dropped: reconnects, asking for the URL again
        assert len(calls) == 2
        client.close()
