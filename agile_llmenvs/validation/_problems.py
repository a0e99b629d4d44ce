"""Problems: one thing wrong under its field path, and the checks that find them."""

from __future__ import annotations

import difflib
import importlib.util
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from agile_llmenvs._imports import LOOKED_UP
from agile_llmenvs.errors import AgileLLMEnvsError, ManifestError, OptionalDependencyError

__all__ = ["FIELD_FIRST", "Found", "Problem", "importable", "installed", "problems_of"]

_ENV_TAGS = ("gym", "offline", "rollout", "dataset", "bandit")
# A message that starts with the field it is about, as the specs' rules write them.
FIELD_FIRST = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*): (.+)$", re.S)
_LOOKED_UP = f" {LOOKED_UP}"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a manifest or config: the field path, and what to do about it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def problems_of(exc: ValidationError, model: type[BaseModel] | None = None) -> list[Problem]:
    """The problems of a pydantic validation error, each under the field path a user writes.

    The env section's kind is dropped from the path (``env.max_turns``, not
    ``env.rollout.max_turns``), and a cross-field rule's message that starts with its field
    (``objective: belongs to ...``) is filed under that field. Given the ``model`` validated,
    a field it does not have is answered with the nearest one it has at that place
    (``trainig`` -> ``training``), at the top level as below.
    """
    problems = []
    for error in exc.errors():
        raw = [str(part) for part in error["loc"]]
        loc = list(raw)
        if len(loc) > 1 and loc[0] == "env" and loc[1] in _ENV_TAGS:
            del loc[1]
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            close = difflib.get_close_matches(raw[-1], _fields_at(model, raw), n=1)
            fix = f"did you mean {close[0]!r}?" if close else "remove it, or fix its spelling"
            message = f"not a field here: {fix}"
        elif error["type"] == "value_error":
            message = message.removeprefix("Value error, ")
            named = FIELD_FIRST.match(message)
            if named:
                loc.append(named.group(1))
                message = named.group(2)
        problems.append(Problem(".".join(loc) or "(top level)", message))
    return problems


def _fields_at(model: type[BaseModel] | None, loc: list[str]) -> list[str]:
    """The field names the models at ``loc``'s parent have: followed from ``model`` through
    fields, optional and union types, lists (an index) and tagged unions (the tag)."""
    if model is None:
        return []
    candidates = [model]
    for part in loc[:-1]:
        inner = [
            found
            for candidate in candidates
            if part in candidate.model_fields
            for found in _models_in(candidate.model_fields[part].annotation)
        ]
        if inner:
            candidates = inner
        elif not part.isdigit():  # a union's tag (``rollout``): the members it names
            candidates = [c for c in candidates if part in _literals(c)] or candidates
    return sorted({name for candidate in candidates for name in candidate.model_fields})


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside ``annotation`` (``X | None``, unions, lists, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models_in(arg)]


def _literals(model: type[BaseModel]) -> set[str]:
    """The literal values a model's fields accept (a tagged union's tags among them)."""
    values: set[str] = set()
    for field in model.model_fields.values():
        if typing.get_origin(field.annotation) is typing.Literal:
            values.update(str(value) for value in typing.get_args(field.annotation))
    return values


class Found(list[Problem]):
    """The problems found so far, and the two ways of finding one."""

    def attempt(
        self, where: str, check: Callable[[], object], section: type[BaseModel] | None = None
    ) -> bool:
        """Run ``check``; what it raises is the problem of ``where``, or of the field of the
        env ``section`` its message starts with (``rubric_name: ...``). True when it passed."""
        try:
            check()
        except Exception as exc:  # a user's module may raise anything while it imports
            text = " ".join(str(exc).split()) or type(exc).__name__
            if not isinstance(exc, AgileLLMEnvsError):  # a foreign error: say which
                text = f"{type(exc).__name__}: {text}"
            named = FIELD_FIRST.match(text)
            field = named.group(1).removeprefix("env.") if named else ""
            if named and named.group(1) in (where, where.split(".", 1)[-1]):
                self.append(Problem(where, named.group(2)))
            elif named and section is not None and field in section.model_fields:
                self.append(Problem(f"env.{field}", named.group(2)))
            else:
                self.append(Problem(where, text))
            return False
        return True

    def exists(self, where: str, value: str | None) -> bool:
        """Whether the file or folder ``value`` exists (or is unset); a problem if not."""
        if value is None or Path(value).exists():
            return True
        relative = "" if Path(value).is_absolute() else _LOOKED_UP
        self.append(Problem(where, f"{value!r} does not exist{relative}"))
        return False


def importable(target: str, *, file: str | None = None) -> Callable[[], object]:
    """A check that ``target`` (``module:attr``, or ``file.py:attr`` without ``file``) imports
    a class or function."""

    def check() -> None:
        if file is None:
            from agile_llmenvs.transport.resolve import load_entrypoint

            obj = load_entrypoint(target)
        else:
            from agile_llmenvs._imports import load_object

            obj = load_object(target, file=file)
        if not callable(obj):
            raise ManifestError(f"{target!r} is a {type(obj).__name__}, not a class or function")

    return check


def installed(package: str, extra: str, feature: str) -> Callable[[], object]:
    """A check that the optional ``package`` (installed by ``extra``) is installed."""
    module = package.replace("-", "_")

    def check() -> None:
        if importlib.util.find_spec(module) is None:
            raise OptionalDependencyError(package, extra=extra, feature=feature)

    return check
