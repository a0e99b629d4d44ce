"""The OpenAPI document and the ``/docs`` and ``/redoc`` pages of the ASGI app, as OpenEnv's
``create_app`` serves them (FastAPI's)."""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from typing import Any

from pydantic.json_schema import models_json_schema

from agile_llmenvs.transport._openenv import (
    ResetRequest,
    ResetResponse,
    StepRequest,
    StepResponse,
)
from agile_llmenvs.transport.env_types import EnvTypes

__all__ = [
    "REDOC_JS",
    "SWAGGER_CSS",
    "SWAGGER_JS",
    "openapi_document",
    "redoc_html",
    "swagger_html",
]

#: Where ``/docs`` and ``/redoc`` load their scripts (FastAPI's defaults).
SWAGGER_JS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"
SWAGGER_CSS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"
REDOC_JS = "https://cdn.jsdelivr.net/npm/redoc@2/bundles/redoc.standalone.js"


def openapi_document(
    types: EnvTypes, env_name: str, serves: Callable[[str], bool]
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of an app serving an env of wire ``types``, named
    ``env_name``, with the paths ``serves`` says the app serves."""
    models = [ResetRequest, ResetResponse, StepRequest, StepResponse]
    env_models = [types.action, types.observation, types.state]
    keys, top = models_json_schema(
        [(m, "validation") for m in (*models, *env_models)],
        ref_template="#/components/schemas/{model}",
    )
    schemas: dict[str, Any] = top.get("$defs", {})

    def ref(model: type) -> dict[str, Any]:
        return dict(keys[(model, "validation")])

    paths = _paths(types, ref)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "OpenEnv Environment HTTP API",
            "version": "1.0.0",
            "description": f"`{env_name}`, served by agile_llmenvs. WebSocket sessions "
            "at `/ws` (OpenEnv's `reset`, `step`, `state`, `close` and `mcp` messages).",
        },
        "paths": {path: ops for path, ops in paths.items() if serves(path)},
        "components": {"schemas": schemas},
    }


def _paths(types: EnvTypes, ref: Callable[[type], dict[str, Any]]) -> dict[str, Any]:
    """Every route's operation, ``create_app``'s tags and summaries; ``ref(model)`` is the
    reference to a model's schema."""
    anything: dict[str, Any] = {"type": "object"}
    step_body = {
        "allOf": [ref(StepRequest), {"properties": {"action": ref(types.action)}}],
    }
    step_reply = {
        "allOf": [ref(StepResponse), {"properties": {"observation": ref(types.observation)}}]
    }
    return {
        "/reset": _operation(
            "post",
            "Environment Control",
            "Reset a fresh environment",
            _reply(ref(ResetResponse)),
            body={"required": False, **_json_body(ref(ResetRequest))},
        ),
        "/step": _operation(
            "post",
            "Environment Control",
            "Execute an action on a fresh environment",
            _reply(step_reply),
            body={"required": True, **_json_body(step_body)},
        ),
        "/state": _operation(
            "get", "State Management", "Get a fresh environment's state", _reply(ref(types.state))
        ),
        "/metadata": _operation(
            "get", "Environment Info", "Get environment metadata", _reply(anything)
        ),
        "/schema": _operation(
            "get",
            "Schema",
            "Get the action, observation and state JSON schemas",
            _reply(anything),
        ),
        "/health": _operation("get", "Health", "Health check", _reply(anything)),
        "/mcp": _operation(
            "post",
            "MCP",
            "MCP JSON-RPC endpoint",
            _reply(anything),
            body={"required": True, **_json_body(anything)},
        ),
        "/sessions": _operation("get", "Health", "Live and allowed sessions", _reply(anything)),
    }


def _operation(
    method: str,
    tag: str,
    summary: str,
    responses: dict[str, Any],
    *,
    body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One path's operation, its keys in FastAPI's order."""
    operation: dict[str, Any] = {"tags": [tag], "summary": summary}
    if body is not None:
        operation["requestBody"] = body
    operation["responses"] = responses
    return {method: operation}


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _reply(schema: dict[str, Any], what: str = "Successful Response") -> dict[str, Any]:
    return {"200": {"description": what, **_json_body(schema)}}


def swagger_html(spec: str, title: str) -> str:
    spec_js = json.dumps(spec)
    return (
        "<!DOCTYPE html><html><head>"
        f'<link type="text/css" rel="stylesheet" href="{SWAGGER_CSS}">'
        f"<title>{html.escape(title)}</title></head><body>"
        '<div id="swagger-ui"></div>'
        f'<script src="{SWAGGER_JS}"></script>'
        "<script>const ui = SwaggerUIBundle({url: "
        f"{spec_js}, dom_id: '#swagger-ui', layout: 'BaseLayout', deepLinking: true, "
        "presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset]})"
        "</script></body></html>"
    )


def redoc_html(spec: str, title: str) -> str:
    return (
        "<!DOCTYPE html><html><head>"
        f"<title>{html.escape(title)}</title>"
        '<meta charset="utf-8"/></head><body>'
        f'<redoc spec-url="{html.escape(spec)}"></redoc>'
        f'<script src="{REDOC_JS}"></script></body></html>'
    )
