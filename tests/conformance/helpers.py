"""Checks the conformance modules share."""

from __future__ import annotations

import json

import openai
import pytest


def error_body(exc: openai.APIStatusError) -> dict:
    """The OpenAI error envelope of a failed request, checked for its four fields."""
    body = json.loads(exc.response.text)
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"], error
    return error


def param_matches(param: str | None, expected: str | tuple[str, ...]) -> bool:
    """``param`` names ``expected`` (or a field inside it: "response_format.type")."""
    options = (expected,) if isinstance(expected, str) else expected
    return param is not None and any(param == option or param.startswith(option + ".")
                                     or param.startswith(option + "[") for option in options)


def expect_400(call, param: str | tuple[str, ...], code: str | None = None) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    assert caught.value.status_code == 400
    error = error_body(caught.value)
    assert error["type"] == "invalid_request_error", error
    assert param_matches(error["param"], param), error
    if code is not None:
        assert error["code"] == code, error
    return error
