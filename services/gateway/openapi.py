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

from services.gateway.request_base import REFUSED
from services.gateway.response_models import ErrorResponse

_REF_TEMPLATE = "#/components/schemas/{model}"
_HOIST = "x-flotilla-component"  # marks a generated schema to move into components
_ERROR_STATUSES = {400: "invalid request (the error names the parameter)",
                   401: "missing or wrong API key", 404: "unknown model",
                   413: "request body too large", 429: "queue full (Retry-After)",
                   503: "a service is unavailable"}


def _schema(model: type[BaseModel], mode: str) -> dict[str, Any]:
    """The model's schema, marked to be moved into components (``build_openapi``)."""
    return {**model.model_json_schema(ref_template=_REF_TEMPLATE, mode=mode), _HOIST: True}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body ``model`` validates; the shapes it
    knows only to refuse are left out (``request_base.refused_model``)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": _without_refused(_schema(model, "validation"))}}}}


def _without_refused(schema: dict[str, Any]) -> dict[str, Any]:
    definitions = schema.get("$defs", {})
    refused = {_REF_TEMPLATE.format(model=name) for name, definition in definitions.items()
               if definition.get(REFUSED)}

    def prune(node: Any) -> Any:
        if isinstance(node, list):
            return [prune(item) for item in node
                    if not (isinstance(item, dict) and item.get("$ref") in refused)]
        if not isinstance(node, dict):
            return node
        if "mapping" in node:  # a discriminator
            node = {**node, "mapping": {tag: ref for tag, ref in node["mapping"].items()
                                        if ref not in refused}}
        return {key: prune(value) for key, value in node.items()}

    pruned = prune(schema)
    pruned["$defs"] = {name: definition for name, definition in pruned.get("$defs", {}).items()
                       if not definition.get(REFUSED)}
    return pruned


def sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI 3.1 describes each event): its ``data``
    is a JSON ``chunk``, an error object that ends the stream, or the final ``[DONE]``."""
    payload = {"anyOf": [_schema(chunk, "serialization"), _schema(ErrorResponse, "serialization")]}
    return {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"},
        "data": {"anyOf": [{"const": "[DONE]"}, {
            "type": "string", "contentMediaType": "application/json",
            "contentSchema": payload}]}}}


def json_responses(model: type[BaseModel], stream: type[BaseModel] | None = None,
                   errors: tuple[int, ...] = tuple(_ERROR_STATUSES)) -> dict:
    """``responses`` for a route answering ``model`` as JSON (and, with ``stream``, SSE
    events of ``stream`` chunks when the request sets ``stream``), and OpenAI errors."""
    ok: dict[str, Any] = {"description": "the response", "model": model}
    if stream is not None:
        ok["content"] = {"text/event-stream": {"schema": sse_event(stream)}}
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
    error_schema = _hoist(_schema(ErrorResponse, "serialization"), components)
    for path, path_item in document.get("paths", {}).items():
        for method, operation in path_item.items():
            if method == "post" or path.startswith("/v1/"):  # the API, not the probes
                _add_error_responses(operation, error_schema)
            bodies = [operation.get("requestBody", {})] + list(operation.get("responses", {}).values())
            for body in bodies:
                content = body.get("content", {})
                if len(content) > 1 and content.get("application/json") == {"schema": {}}:
                    del content["application/json"]  # FastAPI's placeholder (e.g. /metrics: text)
                for media in content.values():
                    schema = media.get("schema", {})
                    if "title" in schema or "$defs" in schema:  # a model's schema, inline
                        schema[_HOIST] = True
                    media["schema"] = _hoisted(schema, components)
    return document


def _hoisted(node: Any, components: dict[str, Any]) -> Any:
    """``node`` with every schema marked for components replaced by a $ref to it."""
    if isinstance(node, list):
        return [_hoisted(item, components) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get(_HOIST):
        return _hoist(node, components)
    return {key: _hoisted(value, components) for key, value in node.items()}


def _add_error_responses(operation: dict[str, Any], error_schema: dict[str, str]) -> None:
    """Every API operation answers errors in OpenAI's shape; a route that declares none
    gets them all."""
    responses = operation.setdefault("responses", {})
    if any(status.startswith(("4", "5")) for status in responses):
        return
    for status, description in _ERROR_STATUSES.items():
        responses[str(status)] = {"description": description, "content": {
            "application/json": {"schema": error_schema}}}


def _hoist(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, str]:
    """Move a generated schema and its $defs into components; a $ref to it instead."""
    schema = {key: value for key, value in schema.items() if key != _HOIST}
    for name, definition in schema.pop("$defs", {}).items():
        _add(components, name, definition)
    name = schema["title"]
    _add(components, name, schema)
    return {"$ref": _REF_TEMPLATE.format(model=name)}


def _add(components: dict[str, Any], name: str, schema: dict[str, Any]) -> None:
    if components.setdefault(name, schema) != schema:
        raise ValueError(f"two different schemas are named {name!r} in /openapi.json")
