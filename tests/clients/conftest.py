"""Real clients against the real stack: the official openai SDK (/v1/responses),
langchain-openai, litellm and the openai-agents SDK. One stack for the whole directory
(the integration tests' fixture, so the default model and its flags are the same)."""

from __future__ import annotations

import os

import pytest

from tests.integration.conftest import model_files, model_name, stack  # noqa: F401 - fixtures

# no network here: no client may try to reach a hosted service or fetch data on import
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

QUESTION = "What is the capital of France?"  # greedy: "The capital of France is Paris."
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="session")
def base_url(request) -> str:
    """The stack's OpenAI base URL; FLOTILLA_CLIENTS_BASE_URL points the tests at a stack
    that is already up instead (when working on them)."""
    url = os.environ.get("FLOTILLA_CLIENTS_BASE_URL")
    return url or request.getfixturevalue("stack").base_url + "/v1"
