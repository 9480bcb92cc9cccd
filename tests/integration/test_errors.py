"""Bad input gets OpenAI-style errors with the right status; nothing else is disturbed."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.base_url, timeout=60) as client:
        yield client


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def chat(model_name, **extra) -> dict:
    return {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], **extra}


@pytest.mark.parametrize("extra,param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"temperature": 3.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": -0.1}, "top_p"),  # 0 is allowed, as in OpenAI: the top token only
    ({"stream": "yes"}, "stream"),
    ({"bogus_option": 1}, "bogus_option"),
    ({"n": 3}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, None),
])
def test_invalid_chat_parameters_are_400(http, model_name, extra, param):
    assert_error(http.post("/v1/chat/completions", json=chat(model_name, **extra)), 400, param)


def test_malformed_json_is_400(http):
    response = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                         headers={"content-type": "application/json"})
    assert_error(response, 400)


def test_non_utf8_body_is_400(http):
    response = http.post("/v1/completions", content=b'{"model": "\xff\xfe", "prompt": "hi"}',
                         headers={"content-type": "application/json"})
    assert "UTF-8" in assert_error(response, 400)["message"]


def test_prompt_plus_max_tokens_over_the_context_is_400(http, model_name):
    response = http.post("/v1/completions", json={"model": model_name, "prompt": "Hello",
                                                  "max_tokens": 9000})
    error = assert_error(response, 400, "max_tokens")
    assert error["code"] == "context_length_exceeded"


def test_unknown_model_is_404(http):
    error = assert_error(http.post("/v1/chat/completions", json=chat("gpt-17")), 404, "model")
    assert error["code"] == "model_not_found"


def test_oversized_body_is_413(http, model_name):
    big = {"model": model_name, "prompt": "x" * (5 * 1024 * 1024)}
    assert_error(http.post("/v1/completions", json=big), 413)


def test_unknown_route_is_404_json(http):
    assert_error(http.get("/v1/nothing-here"), 404)


def test_the_stack_still_serves_after_bad_input(http, model_name):
    response = http.post("/v1/completions", json={"model": model_name, "prompt": "Hello",
                                                  "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("prompt,bad_id", [([1, 2, 49152], 49152), ([[5, 6], [7, 70000]], 70000)])
def test_token_ids_outside_the_vocabulary_are_400(http, model_name, prompt, bad_id):
    response = http.post("/v1/completions", json={"model": model_name, "prompt": prompt,
                                                  "max_tokens": 2})
    error = assert_error(response, 400, "prompt")
    assert f"token id {bad_id} is out of range" in error["message"]
    ok = http.post("/v1/completions", json={"model": model_name, "prompt": [1, 2, 49151],
                                            "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 3
