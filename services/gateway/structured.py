"""Structured outputs at the gateway: OpenAI's ``response_format`` -> a StructuredSpec.

A schema is checked here by compiling it to an llguidance grammar without a vocabulary
(no tokenizer, no torch: llguidance is a small Rust extension), with exactly the options the
worker uses (``shared.grammar.grammar_for``, which the worker builds its matchers from), so a schema that
passes here compiles at the worker. Unsupported keywords are refused, not ignored: a 400
beats output that silently breaks the schema. Choice of library: docs/structured-outputs.md.
"""

from __future__ import annotations

import json
import re

from shared.errors import InvalidRequest
from shared.grammar import JSON_OBJECT, JSON_OPTIONS, JSON_SCHEMA, grammar_for  # noqa: F401
from shared.messages import StructuredSpec

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_PARAM = "response_format"


def validate_spec(spec: StructuredSpec) -> None:
    """Raise InvalidRequest (param response_format) unless the worker can enforce ``spec``."""
    try:
        grammar_for(spec)
    except ValueError as exc:
        raise InvalidRequest(f"response_format: unsupported or invalid JSON schema: {exc}",
                             param=_PARAM) from None


def response_format_spec(response_format: dict | None) -> StructuredSpec | None:
    """OpenAI's ``response_format`` -> a validated spec; None for no constraint (``text``)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == JSON_OBJECT:
        return StructuredSpec(kind=JSON_OBJECT)
    if kind != JSON_SCHEMA:
        raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, "
                             f"got {kind!r}", param=_PARAM)
    body = response_format.get("json_schema")
    if not isinstance(body, dict):
        raise InvalidRequest("response_format.json_schema must be an object with a name and a "
                             "schema", param=_PARAM)
    name = body.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest("response_format.json_schema.name must be 1 to 64 characters of "
                             "a-z, A-Z, 0-9, _ and -", param=_PARAM)
    if not isinstance(body.get("strict", False), (bool, type(None))):
        raise InvalidRequest("response_format.json_schema.strict must be a boolean", param=_PARAM)
    if not isinstance(body.get("description", ""), (str, type(None))):
        raise InvalidRequest("response_format.json_schema.description must be a string",
                             param=_PARAM)
    schema = body.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object",
                             param=_PARAM)
    spec = StructuredSpec(kind=JSON_SCHEMA, json_schema=json.dumps(schema, separators=(",", ":")))
    validate_spec(spec)
    return spec
