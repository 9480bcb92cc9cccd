"""The request body as JSON: msgspec parses it, the standard library takes over for what
msgspec refuses, so every body reads, or is refused, as json.loads has it."""

from __future__ import annotations

import asyncio
import math

import pytest

from services.gateway.http_input import read_json
from shared.errors import InvalidRequest


class _Body:
    def __init__(self, body: bytes) -> None:
        self._body = body

    async def body(self) -> bytes:
        return self._body


def _read(body: bytes):
    return asyncio.run(read_json(_Body(body)))


@pytest.mark.parametrize("body, expected", [
    (b'{"prompt": [1, 2, 3], "max_tokens": 2.0}', {"prompt": [1, 2, 3], "max_tokens": 2.0}),
    (b'{"a": 1, "a": 2}', {"a": 2}),  # the last duplicate wins
    (b'{"a": "\\ud800"}', {"a": "\ud800"}),  # a lone surrogate escape: json takes it
    (b'{"\\ud800": 1}', {"\ud800": 1}),
    (b'{"a": 123456789012345678901234567890}', {"a": 123456789012345678901234567890}),
    (b'\t{"a": -0.0, "b": 1e-400}\n', {"a": -0.0, "b": 0.0}),
])
def test_bodies_read_as_json_loads_reads_them(body, expected):
    assert _read(body) == expected


@pytest.mark.parametrize("body", [b'{"a": NaN}', b'{"a": Infinity}', b'{"a": 1e400}'])
def test_non_finite_numbers_read_as_before(body):
    assert not math.isfinite(_read(body)["a"])


@pytest.mark.parametrize("body, message", [
    (b'{"a": "\xff"}', "the request body is not valid UTF-8"),
    (b'{"a":1} x', "the request body is not valid JSON: Extra data: line 1 column 9 (char 8)"),
    (b"", "the request body is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    (b'\xef\xbb\xbf{"a":1}', "the request body is not valid JSON: Unexpected UTF-8 BOM (decode "
     "using utf-8-sig): line 1 column 1 (char 0)"),
    (b"[1]", "the request body must be a JSON object"),
    (b'"x"', "the request body must be a JSON object"),
])
def test_bad_bodies_get_the_same_400(body, message):
    with pytest.raises(InvalidRequest) as error:
        _read(body)
    assert error.value.message == message
