"""response_format -> StructuredSpec, and schema validation without a tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.gateway.structured import JSON_OPTIONS, grammar_for, response_format_spec, validate_spec
from shared.errors import InvalidRequest
from shared.messages import StructuredSpec

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


def _schema_format(schema, name="person", **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, **extra}}


def test_text_and_none_are_no_constraint():
    assert response_format_spec(None) is None
    assert response_format_spec({"type": "text"}) is None


def test_json_object():
    assert response_format_spec({"type": "json_object"}) == StructuredSpec(kind="json_object")


def test_json_schema_carries_the_schema_as_json_text():
    spec = response_format_spec(_schema_format(PERSON, strict=True, description="a person"))
    assert spec.kind == "json_schema"
    assert json.loads(spec.json_schema) == PERSON


@pytest.mark.parametrize("schema", [
    {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}}}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer"},
                                                       {"type": "string"}]}}},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                               "minItems": 1, "maxItems": 3}}},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                      "c": {"type": "string", "pattern": "^[A-Z]{2}$"}}},
])
def test_supported_features_pass(schema):
    assert response_format_spec(_schema_format(schema)) is not None


@pytest.mark.parametrize("response_format, words", [
    ({"type": "json_schema"}, "name and a schema"),
    ({"type": "json_schema", "json_schema": "x"}, "name and a schema"),
    (_schema_format(None), "schema must be a JSON schema object"),
    (_schema_format([1, 2]), "schema must be a JSON schema object"),
    (_schema_format("{}"), "schema must be a JSON schema object"),
    (_schema_format(PERSON, name="has space"), "name must be"),
    (_schema_format(PERSON, name="x" * 65), "name must be"),
    (_schema_format(PERSON, name=""), "name must be"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "name must be"),
    (_schema_format(PERSON, strict="yes"), "strict must be a boolean"),
    ({"type": "yaml"}, "response_format.type"),
    (_schema_format({"type": "foo"}), "foo"),
    (_schema_format({"type": "string", "pattern": "[a-"}), "regex"),
    (_schema_format({"$ref": "#/$defs/missing"}), "missing"),
    (_schema_format({"type": "integer", "minimum": "x"}), "minimum"),
    (_schema_format({"type": "string", "format": "no-such-format"}), "format"),
    (_schema_format({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (_schema_format({"not": {"type": "string"}}), "not"),
])
def test_invalid_response_format_is_a_400_on_response_format(response_format, words):
    with pytest.raises(InvalidRequest) as info:
        response_format_spec(response_format)
    assert info.value.param == "response_format"
    assert info.value.status == 400
    assert words in info.value.message


def test_validate_spec_refuses_bad_specs():
    for spec in (StructuredSpec(kind="json_schema", json_schema="{not json"),
                 StructuredSpec(kind="json_schema", json_schema="[]"),
                 StructuredSpec(kind="regex", json_schema="{}")):
        with pytest.raises(InvalidRequest) as info:
            validate_spec(spec)
        assert info.value.param == "response_format"
    validate_spec(StructuredSpec(kind="json_object"))


def test_schema_options_cannot_loosen_whitespace():
    schema = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    grammar = json.loads(grammar_for(StructuredSpec(kind="json_schema",
                                                    json_schema=json.dumps(schema))))
    (embedded,) = [g["json_schema"]["x-guidance"] for g in grammar["grammars"]]
    assert embedded == JSON_OPTIONS and embedded["whitespace_flexible"] is False


def test_the_gateway_check_does_not_import_torch():
    code = ("import sys, services.gateway.structured as s; "
            "s.response_format_spec({'type': 'json_schema', 'json_schema': "
            "{'name': 'n', 'schema': {'type': 'object'}}}); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
