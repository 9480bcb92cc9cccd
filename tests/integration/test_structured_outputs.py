"""Issue 6 acceptance: 100 structured-output requests over 5 schemas (nested objects, arrays,
enums, bounded numbers), sampled at temperature 0.8, all in flight together: every answer
parses and validates against its schema."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.integration

NUM_PER_SCHEMA = 20
NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMAS = {
    "person": {  # nested objects
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "address": {"type": "object",
                                   "properties": {"city": NAME, "zip": {"type": "string",
                                                                        "pattern": "^[0-9]{5}$"}},
                                   "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "age", "address"], "additionalProperties": False},
    "shopping": {  # an array of objects
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {"item": NAME,
                                             "quantity": {"type": "integer", "minimum": 1,
                                                          "maximum": 12}},
            "required": ["item", "quantity"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "ticket": {  # enums
        "type": "object",
        "properties": {"priority": {"enum": ["low", "medium", "high"]},
                       "category": {"type": "string", "enum": ["bug", "feature", "question"]},
                       "open": {"type": "boolean"}},
        "required": ["priority", "category", "open"], "additionalProperties": False},
    "reading": {  # numbers with bounds
        "type": "object",
        "properties": {"temperature_c": {"type": "number", "minimum": -40, "maximum": 50},
                       "humidity": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                       "station": {"type": "integer", "minimum": 1, "maximum": 999}},
        "required": ["temperature_c", "humidity", "station"], "additionalProperties": False},
    "tags": {  # an array of strings and an optional field
        "type": "object",
        "properties": {"title": NAME,
                       "tags": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 3},
                       "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["title", "tags"], "additionalProperties": False},
}


@pytest.mark.slow  # (make test-slow: CI runs it after make test)
def test_a_hundred_requests_over_five_schemas_all_validate(stack, model_name):
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0,
                                timeout=600)

    async def ask(name: str, schema: dict, seed: int):
        return await client.chat.completions.create(
            model=model_name, temperature=0.8, seed=seed, max_tokens=160,
            messages=[{"role": "user", "content": f"Give me an example {name} as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": name, "schema": schema, "strict": True}})

    async def ask_all():
        return await asyncio.gather(*(ask(name, schema, seed) for name, schema in SCHEMAS.items()
                                      for seed in range(NUM_PER_SCHEMA)))

    responses = asyncio.run(ask_all())
    assert len(responses) == 5 * NUM_PER_SCHEMA
    schemas = [schema for schema in SCHEMAS.values() for _ in range(NUM_PER_SCHEMA)]
    for response, schema in zip(responses, schemas):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    distinct = {r.choices[0].message.content for r in responses}
    assert len(distinct) > 50  # really sampled, not one answer repeated
