"""Structured outputs on chat: response_format json_object and json_schema (strict),
streaming, the SDK's ``parse`` helper with a pydantic model, and bad formats (400)."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pydantic
import pytest

from tests.conformance.helpers import expect_400

pytestmark = pytest.mark.integration

PERSON_SCHEMA = {  # nested object, enum, bounded integers
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {
            "type": "object",
            "properties": {"kind": {"type": "string", "enum": ["cat", "dog", "fish"]},
                           "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
            "required": ["kind", "legs"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
PALETTE_SCHEMA = {  # array of enum strings, bounded number, boolean
    "type": "object",
    "properties": {
        "colors": {"type": "array", "minItems": 1, "maxItems": 3,
                   "items": {"type": "string", "enum": ["red", "green", "blue", "yellow"]}},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "warm": {"type": "boolean"},
    },
    "required": ["colors", "score", "warm"],
    "additionalProperties": False,
}
PERSON_PROMPT = [{"role": "user", "content": "Describe Ann, a 30 year old woman with a dog, "
                                             "as JSON with her name, age and pet."}]
PALETTE_PROMPT = [{"role": "user", "content": "Pick up to three colors for a sunset and rate "
                                              "the palette from 0 to 1, as JSON."}]


def json_schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


def test_json_object(client, model_name):
    for seed in (1, 2):
        response = client.chat.completions.create(
            model=model_name, temperature=0.7, seed=seed, max_tokens=120,
            messages=[{"role": "user", "content": "Describe a cat named Tom, aged 3, as a "
                                                  "JSON object with its name and age."}],
            response_format={"type": "json_object"})
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("schema, messages", [(PERSON_SCHEMA, PERSON_PROMPT),
                                              (PALETTE_SCHEMA, PALETTE_PROMPT)],
                         ids=["nested-enum-bounded", "array-number"])
def test_json_schema(client, model_name, schema, messages):
    for seed in (1, 2):
        response = client.chat.completions.create(
            model=model_name, temperature=0.7, seed=seed, max_tokens=150, messages=messages,
            response_format=json_schema_format("answer", schema))
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_schema_streaming(client, model_name):
    chunks = list(client.chat.completions.create(
        model=model_name, temperature=0.7, seed=3, max_tokens=150, messages=PERSON_PROMPT,
        response_format=json_schema_format("person", PERSON_SCHEMA), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    assert [c.choices[0].finish_reason for c in chunks
            if c.choices and c.choices[0].finish_reason] == ["stop"]


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int


class Person(pydantic.BaseModel):
    name: str
    age: int
    pet: Pet


def test_sdk_parse_with_a_pydantic_model(client, model_name):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    completion = parse(model=model_name, messages=PERSON_PROMPT, temperature=0.7, seed=4,
                       max_tokens=150, response_format=Person)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Person), message.content
    assert message.refusal is None


def test_text_response_format_is_plain_text(client, model_name):
    response = client.chat.completions.create(
        model=model_name, messages=PERSON_PROMPT, temperature=0, max_tokens=8,
        response_format={"type": "text"})
    assert isinstance(response.choices[0].message.content, str)
    assert response.choices[0].message.content


@pytest.mark.parametrize("response_format", [
    json_schema_format("bad", {"type": "object", "properties": 5}),
    json_schema_format("bad", {"type": "no-such-type"}),
    {"type": "json_schema"},  # no json_schema
    {"type": "xml"},
], ids=["properties-not-an-object", "unknown-type", "missing-json-schema", "unknown-format"])
def test_bad_response_format_is_400(client, model_name, response_format):
    expect_400(lambda: client.chat.completions.create(
        model=model_name, messages=PERSON_PROMPT, max_tokens=8, response_format=response_format),
        "response_format")
