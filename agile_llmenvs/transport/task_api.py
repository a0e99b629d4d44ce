"""OpenEnv 0.10's task API (the ORS-compatible routes its Harbor client calls), on both fronts.

An env that knows its tasks says so with methods OpenEnv names: ``list_splits()``,
``list_tasks(split)``, ``num_tasks(split)``, ``get_task(split, index)`` and
``get_task_range(split, start, stop)`` (each may be async). The server answers, as
``create_app`` does, each call on a fresh env, closed after:

- ``GET /list_environments``: ``[env_name]``;
- ``GET /{env_name}/splits``: the splits, each ``{"name", "type"}`` (a bare name's type is its
  own when it is ``train``, ``validation`` or ``test``, else ``validation``);
- ``POST /{env_name}/tasks`` ``{"split"}``: ``{"tasks", "env_name"}``;
- ``POST /{env_name}/num_tasks`` ``{"split"}``: ``{"num_tasks"}``;
- ``POST /{env_name}/task`` ``{"split", "index"}``: ``{"task"}``;
- ``POST /{env_name}/task_range`` ``{"split", "start", "stop"}``: ``{"tasks"}``.

Another ``env_name`` is 404 (``unknown environment 'x'``, the case ignored), an env without
the method 501 (``get_task is not supported for this environment``), an ``IndexError`` 400
(``Invalid task index``), a body that is not the request 422, as FastAPI words it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agile_llmenvs.transport.http import HttpRequest, HttpResponse
from agile_llmenvs.transport.http_bodies import body_model

__all__ = ["TaskRoutes"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Split(_Request):
    split: str = Field(description="Task split name")


class _Task(_Split):
    index: int = Field(description="Task index within the split")


class _Range(_Split):
    start: int | None = Field(default=None, description="Inclusive start index")
    stop: int | None = Field(default=None, description="Exclusive stop index")


#: route -> (the env's method, the request model, how the reply wraps the result)
_POSTS: dict[str, tuple[str, type[_Request], str]] = {
    "tasks": ("list_tasks", _Split, "tasks"),
    "num_tasks": ("num_tasks", _Split, "num_tasks"),
    "task": ("get_task", _Task, "task"),
    "task_range": ("get_task_range", _Range, "tasks"),
}
_SPLIT_TYPES = frozenset({"train", "validation", "test"})


class TaskRoutes:
    """The task API's answers for one server.

    Args:
        pool: The server's :class:`~agile_llmenvs.transport.env_pool.EnvPool` (its
            ``env_name``).
        with_fresh_env: Runs a call on a fresh env, closed after (and raises
            :class:`~agile_llmenvs.transport.routes.AtCapacity` when no slot is free).
    """

    def __init__(
        self, pool: Any, with_fresh_env: Callable[[Callable[[Any], Any]], Awaitable[Any]]
    ) -> None:
        self.pool, self.with_fresh_env = pool, with_fresh_env

    @property
    def env_name(self) -> str:
        """The name the routes answer to (``/{env_name}/...``)."""
        return str(self.pool.env_name)

    def serves(self, method: str, path: str) -> bool:
        """Whether ``method path`` is a task-API route."""
        if method == "GET" and path == "/list_environments":
            return True
        parts = path.strip("/").split("/")
        if len(parts) != 2:
            return False
        return (method, parts[1]) == ("GET", "splits") or (method == "POST" and parts[1] in _POSTS)

    async def answer(self, request: HttpRequest) -> HttpResponse:
        """The answer to a request :meth:`serves`."""
        path = request.path.rstrip("/")
        if path == "/list_environments":
            return HttpResponse(200, [self.env_name])
        name, route = path.strip("/").split("/")
        if name.lower() != self.env_name.lower():
            return HttpResponse(404, {"detail": f"unknown environment {name!r}"})
        if route == "splits":
            splits = await self._call("list_splits")
            if isinstance(splits, HttpResponse):
                return splits
            return HttpResponse(200, [_split(s) for s in splits])
        method, model, key = _POSTS[route]
        parsed = body_model(request, model)
        if isinstance(parsed, HttpResponse):
            return parsed
        result = await self._call(method, *parsed.model_dump().values())
        if isinstance(result, HttpResponse):
            return result
        reply: dict[str, Any] = {key: _plain(result)}
        if route == "tasks":
            reply["env_name"] = self.env_name
        return HttpResponse(200, reply)

    async def _call(self, method: str, *args: Any) -> Any:
        """``env.method(*args)`` on a fresh env, or the error answer."""

        def call(env: Any) -> Any:
            found = getattr(env, method, None)
            if not callable(found):
                raise NotImplementedError
            return found(*args)

        try:
            return await self.with_fresh_env(call)
        except NotImplementedError:
            return HttpResponse(501, {"detail": f"{method} is not supported for this environment"})
        except IndexError:
            return HttpResponse(400, {"detail": "Invalid task index"})


def _split(split: Any) -> dict[str, Any]:
    """A split as ``{"name", "type"}`` (OpenEnv's normalisation)."""
    if isinstance(split, BaseModel):
        return split.model_dump(mode="json")
    if isinstance(split, dict):
        return dict(_plain(split))
    if isinstance(split, str):
        return {"name": split, "type": split if split in _SPLIT_TYPES else "validation"}
    return {"name": str(split), "type": "validation"}


def _plain(value: Any) -> Any:
    """``value`` as JSON data: models dumped, dataclasses and objects as their fields, and
    anything else that is not JSON as its text."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "__dict__"):
        return {k: _plain(v) for k, v in vars(value).items()}
    return str(value)
