"""What every OpenAI request model shares: strict types, null as "the default", and the
error that names the parameter at fault.

OpenAI documents most parameters as nullable, a null meaning the parameter's default, and
clients send nulls for what they leave unset. So a null for an optional parameter is
dropped before validation (the default applies), and the published JSON schema says such
a parameter may be null. A required parameter keeps its null, which is then checked like
any other value.
"""

from __future__ import annotations

from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, model_validator


def _optional_may_be_null(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """JSON schema: every optional property also admits null (which means its default)."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required or _admits_null(prop):
            continue
        outer = {key: prop.pop(key) for key in ("title", "description", "default", "deprecated")
                 if key in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **outer}


def _admits_null(prop: dict[str, Any]) -> bool:
    if prop.get("type") == "null" or prop == {}:
        return True
    return any(_admits_null(option) for option in prop.get("anyOf", ()))


def _integral_as_int(value: Any) -> Any:
    """An integer as JSON Schema has it: 2.0 is one too (a string "2" is not). Applied to a
    parameter's value and the items of a list (token ids, one list deep), where a float
    parameter takes the int just as well; objects inside are left as they are."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        ints = exact_ints(value)
        if ints is not None:  # a token-id prompt: nothing to convert (16k ids: 2 ms in Python)
            return ints
        return [_integral_as_int(item) if not isinstance(item, dict) else item for item in value]
    return value


def exact_ints(value: list, item_type: Any = int) -> list[int] | None:
    """A copy of ``value`` when every item is an ``item_type`` (an int type, maybe with
    msgspec bounds; bools and floats are not ints here), checked in C; else None."""
    try:
        return msgspec.convert(value, list[item_type], strict=True)
    except msgspec.ValidationError:
        return None


class OpenAIModel(BaseModel):
    # strict: "5" is not a number, as in OpenAI's API; unknown parameters are refused
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_optional_may_be_null)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:  # and 2.0 means 2
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: _integral_as_int(value) for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required()}


def only_schema(accepted: dict[str, Any], note: str, deprecated: bool = False):
    """``json_schema_extra`` for a parameter OpenAI defines more widely than it is honoured
    here: the published schema shows only what is accepted (a wider value is a 400 naming
    the parameter), so a client or a fuzzer generated from it sends nothing refused."""
    def narrow(schema: dict[str, Any]) -> None:
        title = schema.get("title")
        schema.clear()
        schema.update(accepted, description=f"{note} (any other value is refused)")
        if title:
            schema["title"] = title
        if deprecated:
            schema["deprecated"] = True
    return narrow


REFUSED = "x-flotilla-refused"  # in a model's JSON schema: a known shape that is refused


def refused_model(note: str) -> dict[str, Any]:
    """``json_schema_extra`` of a model that is a 400 wherever it appears: /openapi.json
    leaves it out of the unions it is a member of (the validation keeps the clear error)."""
    return {REFUSED: note}


def only_null(note: str, deprecated: bool = False):
    """``json_schema_extra`` for a parameter refused unless null (see ``only_schema``)."""
    return only_schema({"type": "null"}, note, deprecated)


class ParameterError(ValueError):
    """Raised inside a validator: becomes a 400 naming ``param`` (parse_request)."""

    def __init__(self, param: str, message: str, code: str = "unsupported_parameter") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def refuse_if(condition: bool, param: str, message: str) -> None:
    """A parameter that cannot be honoured: a 400 naming it, never silently ignored."""
    if condition:
        raise ParameterError(param, message)
