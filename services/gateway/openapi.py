"""/openapi.json: every request and response body, generated from the pydantic models.

The routes read their bodies themselves (``protocol.parse_request``: strict JSON, errors
as OpenAI error JSON naming the parameter), so FastAPI does not see a body parameter.
Each POST route declares its body with ``openapi_extra=request_body(Model)`` and its
answers with ``responses=json_responses(Model, stream=Chunk)``; ``install`` makes the
document put every schema under ``components/schemas``, each once, by name.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from services.gateway.response_models import ErrorResponse

_REF_TEMPLATE = "#/components/schemas/{model}"
_ERROR_STATUSES = {400: "invalid request (the error names the parameter)",
                   401: "missing or wrong API key", 404: "unknown model",
                   413: "request body too large", 429: "queue full (Retry-After)",
                   503: "a service is unavailable"}


def _schema(model: type[BaseModel], mode: str) -> dict[str, Any]:
    return model.model_json_schema(ref_template=_REF_TEMPLATE, mode=mode)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body ``model`` validates."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": _schema(model, "validation")}}}}


def json_responses(model: type[BaseModel], stream: type[BaseModel] | None = None,
                   errors: tuple[int, ...] = (400, 401, 404, 413, 429, 503)) -> dict:
    """``responses`` for a route answering ``model`` as JSON (and, with ``stream``, SSE
    events of ``stream`` chunks when the request sets ``stream``), and OpenAI errors."""
    ok: dict[str, Any] = {"description": "the response", "model": model}
    if stream is not None:
        ok["content"] = {"text/event-stream": {"schema": _schema(stream, "serialization")}}
        ok["description"] = (f"the response; with stream: server-sent events, each "
                             f"'data: <{stream.__name__}>', then 'data: [DONE]'")
    return {200: ok, **{status: {"description": _ERROR_STATUSES[status], "model": ErrorResponse}
                        for status in errors}}


def install(app: FastAPI) -> None:
    """Serve the document built by ``build_openapi`` (once, then cached)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi


def build_openapi(app: FastAPI) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                           description="flotilla's OpenAI-compatible API")
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for path_item in document.get("paths", {}).values():
        for operation in path_item.values():
            bodies = [operation.get("requestBody", {})] + list(operation.get("responses", {}).values())
            for body in bodies:
                for media in body.get("content", {}).values():
                    if "$defs" in media.get("schema", {}) or "title" in media.get("schema", {}):
                        media["schema"] = _hoist(media["schema"], components)
    return document


def _hoist(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, str]:
    """Move a generated schema and its $defs into components; a $ref to it instead."""
    schema = dict(schema)
    for name, definition in schema.pop("$defs", {}).items():
        _add(components, name, definition)
    name = schema["title"]
    _add(components, name, schema)
    return {"$ref": _REF_TEMPLATE.format(model=name)}


def _add(components: dict[str, Any], name: str, schema: dict[str, Any]) -> None:
    if components.setdefault(name, schema) != schema:
        raise ValueError(f"two different schemas are named {name!r} in /openapi.json")
