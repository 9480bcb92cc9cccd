"""NATS lost and back under load: the whole stack on its own nats-server (as with an
external ``--nats-url``), greedy streams in flight, the server killed (kill -9) and started
again on the same port 2 s later.

Every stream in flight must end (its text and [DONE], or an SSE error event), never
hang; a stream that ends well has exactly the text of its solo run (the gateway resumes
a request that lost its replica from the tokens it had: nothing lost, nothing twice);
and the stack serves a new request within 10 s of NATS being back."""

from __future__ import annotations

import time

import httpx
import pytest

from cli.stack import free_port
from tests.nats_server import NatsServer
from tests.chaos.streams import StreamReader
from tests.integration.conftest import start_stack

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.slow]  # (a minute)

PROMPTS = ["The old lighthouse keeper", "In the year 2150, the city",
           "My favourite recipe for bread", "The river wound through"]
MAX_TOKENS = 48
NUM_STREAMS = 8
STREAM_END_S = 40  # after NATS is back (a hang would be the 120 s step timeout, or forever)
SERVE_AGAIN_S = 10


@pytest.fixture(scope="module")
def nats_and_stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("nats-restart-logs")
    nats = NatsServer(free_port(), log_dir / "nats.log")
    nats.start()
    try:
        stack = start_stack(log_dir, nats_url=nats.url,
                            service_args={"worker": ["--kv-cache-memory", "256MiB"]})
    except BaseException:
        nats.stop()
        raise
    yield nats, stack
    stack.stop()
    nats.stop()


def body(model_name: str, prompt: str, stream: bool = True) -> dict:
    return {"model": model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def complete(base_url: str, request: dict) -> httpx.Response:
    return httpx.post(base_url + "/v1/completions", json=request, timeout=30)


def test_streams_end_and_the_stack_serves_again_after_nats_restarts(nats_and_stack, model_name):
    nats, stack = nats_and_stack
    base = stack.base_url
    references = {}
    for prompt in PROMPTS:
        response = complete(base, body(model_name, prompt, stream=False))
        assert response.status_code == 200, response.text
        references[prompt] = response.json()["choices"][0]["text"]

    readers = [StreamReader(base, body(model_name, PROMPTS[i % len(PROMPTS)]))
               for i in range(NUM_STREAMS)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 60
    while not all(reader.parts for reader in readers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(reader.parts for reader in readers), "the streams did not start"
    assert not any(reader.done for reader in readers), "a stream ended before NATS was killed"

    nats.kill()
    time.sleep(2)
    nats.start()
    back_at = time.monotonic()

    served_after_s, answers = None, []
    while served_after_s is None and time.monotonic() - back_at < SERVE_AGAIN_S:
        try:
            response = complete(base, {**body(model_name, "Hello", stream=False), "max_tokens": 2})
            answers.append((round(time.monotonic() - back_at, 1), response.status_code,
                            response.text[:160]))
            if response.status_code == 200:
                served_after_s = time.monotonic() - back_at
                break
        except httpx.HTTPError as exc:
            answers.append((round(time.monotonic() - back_at, 1), repr(exc)))
        time.sleep(0.25)
    assert served_after_s is not None, f"no success within {SERVE_AGAIN_S}s of NATS back: {answers}"

    for reader in readers:
        reader.join(timeout=max(0.1, back_at + STREAM_END_S - time.monotonic()))
    hung = [i for i, reader in enumerate(readers) if reader.is_alive()]
    assert not hung, f"streams {hung} still open {STREAM_END_S}s after NATS came back"
    for reader in readers:
        assert reader.exception is None, reader.exception
        if reader.errors:  # an error event ends the stream: it must say why
            assert all(e.get("message") for e in reader.errors), reader.errors
            assert reader.errors[-1].get("type") == "service_unavailable", reader.errors
        else:
            assert reader.done, "a stream ended with neither [DONE] nor an error event"
            assert reader.text == references[reader.request["prompt"]]
    assert stack.health()["status"] == "ok"


def test_a_second_outage_while_idle_changes_nothing(nats_and_stack, model_name):
    """NATS lost while nothing runs: the services come back on their own again."""
    nats, stack = nats_and_stack
    nats.kill()
    time.sleep(2)
    nats.start()
    back_at = time.monotonic()
    while time.monotonic() - back_at < SERVE_AGAIN_S:
        try:
            if complete(stack.base_url, body(model_name, "Hello", stream=False)).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    else:
        pytest.fail(f"no success within {SERVE_AGAIN_S}s of NATS back")
    stack.check_alive()  # raises if a service exited


def test_without_jetstream_the_stack_serves_and_store_is_a_400(nats_and_stack, model_name):
    """This nats-server runs without JetStream (an external NATS as many are): the gateway
    serves as before, store and background are a 400 naming them, no id is found."""
    _, stack = nats_and_stack
    request = {"model": model_name, "input": "Hi", "max_output_tokens": 4}
    assert httpx.post(stack.base_url + "/v1/responses", json=request,
                      timeout=60).json()["status"] in ("completed", "incomplete")
    for field in ("store", "background"):
        refused = httpx.post(stack.base_url + "/v1/responses", json={**request, field: True},
                             timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field
        assert "response store" in refused.json()["error"]["message"]
    chat = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "store": True}
    refused = httpx.post(stack.base_url + "/v1/chat/completions", json=chat, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "store"
    missing = httpx.get(stack.base_url + "/v1/responses/resp_" + "0" * 32, timeout=30)
    assert missing.status_code == 404
