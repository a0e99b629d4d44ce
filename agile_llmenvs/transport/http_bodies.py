"""Request bodies as FastAPI reads them: JSON only under a JSON content type, validated into a
request model, and FastAPI's 422 (its words and error shapes) when they are not."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from agile_llmenvs.transport.http import HttpRequest, HttpResponse
from agile_llmenvs.transport.protocol import strict_json_loads, validation_errors

__all__ = ["body_model", "json_body", "unprocessable"]


def json_body(request: HttpRequest, default: Any = None) -> Any:
    """The request body as JSON, or the 422 FastAPI answers for a body that is not.

    As in FastAPI, a body is read as JSON only when its content type says JSON; any other
    body (no content type included) is the raw text, which no request model takes.
    """
    body = request.body
    if not body:
        if default is not None:
            return default
        missing = {"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}
        return HttpResponse(422, {"detail": [missing]})
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json" and not kind.endswith("+json"):
        not_an_object = {
            "type": "model_attributes_type",
            "loc": ["body"],
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": body.decode("utf-8", "replace"),
        }
        return HttpResponse(422, {"detail": [not_an_object]})
    try:
        return strict_json_loads(body)
    except ValueError as exc:
        invalid = {
            "type": "json_invalid",
            "loc": ["body", getattr(exc, "pos", 0)],
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": getattr(exc, "msg", str(exc))},
        }
        return HttpResponse(422, {"detail": [invalid]})


def body_model(request: HttpRequest, model: Any, default: Any = None) -> Any:
    """The request body as ``model`` (FastAPI's 422 when it is not JSON or not valid)."""
    payload = json_body(request, default)
    if isinstance(payload, HttpResponse):
        return payload
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        return unprocessable(exc, "body")


def unprocessable(exc: ValidationError, *prefix: str) -> HttpResponse:
    errors = validation_errors(exc, *prefix)
    for error in errors:
        error.pop("url", None)
    return HttpResponse(422, {"detail": errors})
