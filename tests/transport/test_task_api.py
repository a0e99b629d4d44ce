"""OpenEnv 0.10's task API on both fronts (``agile-llmenvs serve``'s server and the ASGI app
under uvicorn): the same answers as OpenEnv's own ``create_app`` serving the same env, and
OpenEnv's own ``HarborEnv`` client reads the tasks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serving import UvicornApp

pytest.importorskip("uvicorn")

from agile_llmenvs.transport import OpenEnvServer, create_asgi_app
from agile_llmenvs.transport._openenv import Action, Environment, Observation, State

TASKS = {
    "train": [{"index": i, "task_id": f"t{i}", "task_name": f"add {i}"} for i in range(5)],
    "hard": [{"index": 0, "task_id": "h0", "task_name": "prove it"}],
}


class Say(Action):
    text: str


class Heard(Observation):
    text: str = ""


class TaskedEnvironment(Environment):
    """An env that knows its tasks, as OpenEnv's task API asks (``get_task`` async)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed: Any = None, episode_id: Any = None, **kwargs: Any) -> Heard:
        return Heard(text="go")

    def step(self, action: Say, timeout_s: Any = None, **kwargs: Any) -> Heard:
        return Heard(text=action.text)

    @property
    def state(self) -> State:
        return State(step_count=0)

    def list_splits(self) -> list[Any]:
        return ["train", {"name": "hard", "type": "test"}]

    def list_tasks(self, split: str) -> list[dict[str, Any]]:
        return TASKS[split]

    def num_tasks(self, split: str) -> int:
        return len(TASKS[split])

    async def get_task(self, split: str, index: int) -> dict[str, Any]:
        return TASKS[split][index]

    def get_task_range(self, split: str, start: int | None, stop: int | None) -> list[Any]:
        return TASKS[split][start:stop]


class Untasked(TaskedEnvironment):
    list_tasks = None  # type: ignore[assignment]


CALLS: list[tuple[str, str, Any]] = [
    ("GET", "/list_environments", None),
    ("GET", "/harbor_env/splits", None),
    ("GET", "/HARBOR_ENV/splits", None),
    ("GET", "/other/splits", None),
    ("POST", "/harbor_env/tasks", {"split": "train"}),
    ("POST", "/harbor_env/num_tasks", {"split": "hard"}),
    ("POST", "/harbor_env/task", {"split": "train", "index": 3}),
    ("POST", "/harbor_env/task", {"split": "train", "index": 99}),
    ("POST", "/harbor_env/task", {"split": "train"}),
    ("POST", "/harbor_env/task_range", {"split": "train", "start": 1, "stop": 3}),
    ("POST", "/harbor_env/task_range", {"split": "train"}),
    ("POST", "/harbor_env/tasks", {"split": "train", "extra": 1}),
]


def _answers(url: str) -> list[tuple[int, Any]]:
    replies = [httpx.request(method, url + path, json=body) for method, path, body in CALLS]
    return [(r.status_code, r.json()) for r in replies]


@pytest.fixture
def theirs() -> Iterator[str]:
    """OpenEnv's ``create_app`` serving the env, the reference."""
    http_server = pytest.importorskip("openenv.core.env_server.http_server")
    app = http_server.create_app(TaskedEnvironment, Say, Heard, env_name="harbor_env")
    with UvicornApp(app) as served:
        yield served.url


@pytest.fixture(params=["serve", "uvicorn"])
def ours(request: pytest.FixtureRequest) -> Iterator[str]:
    arguments: dict[str, Any] = {
        "make_env": TaskedEnvironment,
        "action_cls": Say,
        "observation_cls": Heard,
        "env_name": "harbor_env",
    }
    if request.param == "serve":
        with OpenEnvServer(**arguments) as server:
            yield server.url
        return
    with UvicornApp(create_asgi_app(**arguments)) as served:
        yield served.url


def test_the_task_api_answers_as_create_app_does(theirs: str, ours: str) -> None:
    want = _answers(theirs)
    assert want[0] == (200, ["harbor_env"])
    assert want[1] == (
        200,
        [{"name": "train", "type": "train"}, {"name": "hard", "type": "test"}],
    )
    assert want[3] == (404, {"detail": "unknown environment 'other'"})
    assert want[7] == (400, {"detail": "Invalid task index"})
    assert want[8][0] == want[11][0] == 422
    assert _answers(ours) == want


def test_openenv_s_own_harbor_client_reads_the_tasks(ours: str) -> None:
    harbor = pytest.importorskip("openenv.harbor.client")
    client = harbor.HarborEnv(ours)
    try:
        assert client.splits() == [
            {"name": "train", "type": "train"},
            {"name": "hard", "type": "test"},
        ]
        assert client.num_tasks("train") == 5
        task = client.get_task("train", 2)
        assert (task.index, task.task_id, task.task_name) == (2, "t2", "add 2")
        assert [t.task_id for t in client.get_task_range("train", 3, 9)] == ["t3", "t4"]
    finally:
        client.close()


def test_an_env_without_the_method_is_501_on_both() -> None:
    for serve in (OpenEnvServer, None):
        arguments = {"make_env": Untasked, "action_cls": Say, "observation_cls": Heard}
        if serve is None:
            with UvicornApp(create_asgi_app(**arguments, env_name="harbor_env")) as served:
                url = served.url
                reply = httpx.post(url + "/harbor_env/tasks", json={"split": "train"})
        else:
            with OpenEnvServer(**arguments, env_name="harbor_env") as server:
                reply = httpx.post(server.url + "/harbor_env/tasks", json={"split": "train"})
        assert (reply.status_code, reply.json()) == (
            501,
            {"detail": "list_tasks is not supported for this environment"},
        )
