"""/openapi.json: a valid OpenAPI 3.1 document whose every POST has a request body schema
and every route a response schema, with OpenAI's parameter names and constraints."""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute
from openapi_spec_validator import validate

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from tests.services.gateway.fake_service import FakeService

_UNDOCUMENTED = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


@pytest.fixture(scope="module")
def app():
    return create_app(GatewayConfig(), FakeService())  # no lifespan: nothing starts


@pytest.fixture(scope="module")
def document(app):
    return app.openapi()


def _resolve(document: dict, schema: dict) -> dict:
    ref = schema["$ref"]
    assert ref.startswith("#/components/schemas/"), ref
    return document["components"]["schemas"][ref.removeprefix("#/components/schemas/")]


def test_the_document_validates_as_openapi_3_1(document):
    assert document["openapi"].startswith("3.1")
    validate(document)  # raises on any violation of the OpenAPI 3.1 schema


def test_every_route_is_documented(app, document):
    routes = [route for route in app.routes if isinstance(route, APIRoute)]
    paths = {route.path.replace("{model:path}", "{model}") for route in routes}
    assert paths - _UNDOCUMENTED <= set(document["paths"])
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
            "/v1/models", "/v1/models/{model}"} <= set(document["paths"])


# POSTs whose whole request is in their path, as OpenAI's (cancel a stored response)
_NO_BODY = {"/v1/responses/{response_id}/cancel"}


def test_every_post_has_a_request_body_schema(document):
    posts = {path: item["post"] for path, item in document["paths"].items()
             if "post" in item and path not in _NO_BODY}
    assert len(posts) >= 4
    for path, operation in posts.items():
        body = operation.get("requestBody")
        assert body and body["required"], path
        schema = _resolve(document, body["content"]["application/json"]["schema"])
        assert schema["type"] == "object" and schema["properties"], path
        # every body names its model, but those that name a LoRA adapter to load or unload
        assert ("lora_name" if "lora_adapter" in path else "model") in schema["properties"], path


def test_every_operation_has_a_response_schema(document):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            ok = operation["responses"]["200"]
            media = next(iter(ok["content"].values()))
            assert media.get("schema"), f"{method} {path}"
            if path.startswith("/v1/") and method == "post":
                error = _resolve(document, operation["responses"]["400"]["content"][
                    "application/json"]["schema"])
                assert error["properties"]["error"], path


def test_streaming_endpoints_describe_their_events(document):
    for path, chunk in (("/v1/chat/completions", "ChatCompletionChunk"),
                        ("/v1/completions", "Completion")):
        content = document["paths"][path]["post"]["responses"]["200"]["content"]
        done, payload = content["text/event-stream"]["schema"]["properties"]["data"]["anyOf"]
        assert done == {"const": "[DONE]"}
        assert payload["contentMediaType"] == "application/json"
        assert payload["contentSchema"]["anyOf"] == [
            {"$ref": f"#/components/schemas/{chunk}"},
            {"$ref": "#/components/schemas/ErrorResponse"}]


def test_request_schemas_carry_openai_names_and_constraints(document):
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    props = chat["properties"]
    assert chat["required"] == ["model", "messages"] and chat["additionalProperties"] is False
    for name in ("store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                 "modalities", "reasoning_effort", "verbosity", "max_completion_tokens",
                 "tool_choice", "response_format", "prediction", "web_search_options", "audio"):
        assert name in props, name
    temperature = props["temperature"]["anyOf"]
    assert {"type": "number", "minimum": 0.0, "maximum": 2.0} in temperature
    assert {"type": "null"} in temperature  # OpenAI's parameters are nullable
    assert props["max_tokens"]["deprecated"] is True
    completion = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"type": "integer", "minimum": 0.0, "maximum": 5.0} in completion["logprobs"]["anyOf"]
