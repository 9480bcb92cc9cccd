"""The llguidance grammar of a structured-output spec: one function that the gateway
(to check a schema up front) and the worker (to build its token masks) both use, so a
schema that passes at the gateway compiles at the worker."""

from __future__ import annotations

import json
from typing import Any

import llguidance

from shared.messages import StructuredSpec

JSON_OBJECT = "json_object"
JSON_SCHEMA = "json_schema"
_ANY_OBJECT = '{"type": "object"}'
# One space after "," and ":", no other whitespace: a small model cannot spin on whitespace, and
# ", " / ": " are how most JSON in training data looks. Overrides win over a schema's own
# "x-guidance" options (which we also strip).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": ", "lenient": False}


def grammar_for(spec: StructuredSpec) -> str:
    """The llguidance grammar (JSON text) for a spec; ValueError if the spec is unusable.

    Pure and vocabulary-free; the worker builds its matchers from this same text."""
    if spec.kind == JSON_OBJECT:
        schema_text = _ANY_OBJECT
    elif spec.kind == JSON_SCHEMA:
        schema_text = spec.json_schema
    else:
        raise ValueError(f"unknown structured output kind {spec.kind!r}")
    try:
        schema = json.loads(schema_text)
    except ValueError as exc:
        raise ValueError(f"the schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError("the schema must be a JSON object")
    schema.pop("x-guidance", None)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise ValueError(error.strip())
    return grammar
