"""Real clients against the real stack: the official openai SDK (/v1/responses),
langchain-openai, litellm and the openai-agents SDK. One stack for the whole directory,
started as the integration tests start theirs; it stops when the directory is done, so it
does not sit beside the integration tests' own stack for the rest of a full run."""

from __future__ import annotations

import os

import pytest

from tests.integration.conftest import model_files, model_name, start_stack  # noqa: F401

# no network here: no client may try to reach a hosted service or fetch data on import
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

QUESTION = "What is the capital of France?"  # greedy: "The capital of France is Paris."
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="package")
def base_url(request) -> str:
    """The stack's OpenAI base URL; FLOTILLA_CLIENTS_BASE_URL points the tests at a stack
    that is already up instead (when working on them)."""
    url = os.environ.get("FLOTILLA_CLIENTS_BASE_URL")
    return url or request.getfixturevalue("stack").base_url + "/v1"


@pytest.fixture(scope="package")
def stack(request, tmp_path_factory):
    request.getfixturevalue("model_files")  # the model converted first, once
    stack = start_stack(tmp_path_factory.mktemp("clients-stack-logs"),
                        service_args={"worker": ["--kv-cache-memory", "512MiB"]})
    yield stack
    stack.stop()
