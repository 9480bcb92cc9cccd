"""Fixtures of the OpenAI-conformance suite: one real stack for the whole session and
the official ``openai`` SDK pointed at it.

The suite checks flotilla against OpenAI's API reference (plus vLLM's extensions that
flotilla documents) through the SDK a client would use, so both the wire shapes and the
behaviour behind them are checked. Requests are kept short (few tokens) so the suite
stays fast on two CPU cores.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from shared.models import resolve_model
from tests.integration.conftest import start_stack

MODEL = "smollm2"


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    stack = start_stack(tmp_path_factory.mktemp("conformance-logs"),
                        service_args={"worker": ["--kv-cache-memory", "512MiB"]})
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def model_name() -> str:
    return resolve_model(MODEL).name


@pytest.fixture(scope="session")
def client(stack) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0,
                       timeout=60) as sdk:
        yield sdk


@pytest.fixture(scope="session")
def make_async_client(stack):
    """AsyncOpenAI clients are bound to the event loop they first run in: make one per loop."""
    def make() -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused",
                                  max_retries=0, timeout=60)
    return make


@pytest.fixture(scope="session")
def http(stack):
    with httpx.Client(base_url=stack.base_url, timeout=60) as session:
        yield session


@pytest.fixture(scope="session")
def tokenize(http, model_name):
    """The server's own token count: tokenize(messages=[...]) (the rendered chat prompt,
    generation prompt included) or tokenize(prompt="...")."""
    def count(**body) -> list[int]:
        response = http.post("/tokenize", json={"model": model_name, **body})
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["count"] == len(data["tokens"])
        return data["tokens"]
    return count
