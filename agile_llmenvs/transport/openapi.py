"""The OpenAPI document and the ``/docs`` and ``/redoc`` pages of the ASGI app, as OpenEnv's
``create_app`` serves them (FastAPI's)."""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING, Any

from pydantic.json_schema import models_json_schema

from agile_llmenvs.transport._openenv import (
    ResetRequest,
    ResetResponse,
    StepRequest,
    StepResponse,
)

if TYPE_CHECKING:
    from agile_llmenvs.transport.sessions import SessionHost

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


def openapi_document(host: SessionHost) -> dict[str, Any]:
    """The OpenAPI 3.1 document of an app over ``host`` (whose wire types are known)."""
    types = host.types
    assert types is not None
    models = [ResetRequest, ResetResponse, StepRequest, StepResponse]
    env_models = [types.action, types.observation, types.state]
    keys, top = models_json_schema(
        [(m, "validation") for m in (*models, *env_models)],
        ref_template="#/components/schemas/{model}",
    )
    schemas: dict[str, Any] = top.get("$defs", {})

    def ref(model: type) -> dict[str, Any]:
        return dict(keys[(model, "validation")])

    def json_body(schema: dict[str, Any]) -> dict[str, Any]:
        return {"content": {"application/json": {"schema": schema}}}

    def reply(schema: dict[str, Any], what: str = "Successful Response") -> dict[str, Any]:
        return {"200": {"description": what, **json_body(schema)}}

    anything: dict[str, Any] = {"type": "object"}
    step_body = {
        "allOf": [ref(StepRequest), {"properties": {"action": ref(types.action)}}],
    }
    step_reply = {
        "allOf": [ref(StepResponse), {"properties": {"observation": ref(types.observation)}}]
    }
    paths: dict[str, Any] = {
        "/reset": {
            "post": {
                "tags": ["Environment Control"],
                "summary": "Reset a fresh environment",
                "requestBody": {"required": False, **json_body(ref(ResetRequest))},
                "responses": reply(ref(ResetResponse)),
            }
        },
        "/step": {
            "post": {
                "tags": ["Environment Control"],
                "summary": "Execute an action on a fresh environment",
                "requestBody": {"required": True, **json_body(step_body)},
                "responses": reply(step_reply),
            }
        },
        "/state": {
            "get": {
                "tags": ["State Management"],
                "summary": "Get a fresh environment's state",
                "responses": reply(ref(types.state)),
            }
        },
        "/metadata": {
            "get": {
                "tags": ["Environment Info"],
                "summary": "Get environment metadata",
                "responses": reply(anything),
            }
        },
        "/schema": {
            "get": {
                "tags": ["Schema"],
                "summary": "Get the action, observation and state JSON schemas",
                "responses": reply(anything),
            }
        },
        "/health": {
            "get": {
                "tags": ["Health"],
                "summary": "Health check",
                "responses": reply(anything),
            }
        },
        "/mcp": {
            "post": {
                "tags": ["MCP"],
                "summary": "MCP JSON-RPC endpoint",
                "requestBody": {"required": True, **json_body(anything)},
                "responses": reply(anything),
            }
        },
        "/sessions": {
            "get": {
                "tags": ["Health"],
                "summary": "Live and allowed sessions",
                "responses": reply(anything),
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "OpenEnv Environment HTTP API",
            "version": "1.0.0",
            "description": f"`{host.env_name}`, served by agile_llmenvs. WebSocket sessions "
            "at `/ws` (OpenEnv's `reset`, `step`, `state`, `close` and `mcp` messages).",
        },
        "paths": {path: ops for path, ops in paths.items() if host.routes.serves(path)},
        "components": {"schemas": schemas},
    }


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
