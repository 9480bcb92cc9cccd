"""litellm's OpenAI-compatible provider ("openai/<model>" with api_base) against the stack."""

from __future__ import annotations

import litellm
import pytest

from tests.clients.conftest import QUESTION

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": QUESTION}]


def test_completion_and_streaming_agree(base_url, model_name):
    options = {"model": "openai/" + model_name, "api_base": base_url, "api_key": "unused",
               "messages": MESSAGES, "temperature": 0, "max_tokens": 24}
    response = litellm.completion(**options)
    text = response.choices[0].message.content
    assert "Paris" in text
    assert response.usage.completion_tokens > 0
    chunks = list(litellm.completion(**options, stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"
