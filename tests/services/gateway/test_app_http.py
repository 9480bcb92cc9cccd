"""The HTTP app driven over HTTP (FastAPI's TestClient, lifespan included) in front of a
stand-in service (fake_service.py): routing of the OpenAI routes to the service, their
answers and errors, the probes and the API key. The integration tests drive the same app
in front of the real stack."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.streams import Delta
from shared.errors import ServiceUnavailable
from tests.services.gateway.fake_service import MAX_MODEL_LEN, MODEL, FakeService


@pytest.fixture()
def service() -> FakeService:
    return FakeService()


@pytest.fixture()
def client(service):
    with TestClient(create_app(GatewayConfig(), service)) as client:
        yield client


def test_the_lifespan_starts_and_stops_the_service(service):
    with TestClient(create_app(GatewayConfig(), service)):
        assert service.started and not service.stopped
    assert service.stopped


def test_models_list_and_retrieve(client):
    listed = client.get("/v1/models").json()
    assert [card["id"] for card in listed["data"]] == [MODEL]
    assert listed["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_a_completion_is_submitted_and_its_deltas_gathered(client, service):
    reply = client.post("/v1/completions", json={"model": MODEL, "prompt": "one two three",
                                                   "max_tokens": 5, "stop": ["!"]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["id"] == "cmpl-r0" and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hello world"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 2
    [submitted] = service.submitted
    assert submitted.prompt_token_ids == [3, 3, 5] and submitted.stop == ["!"]
    assert submitted.sampling.max_tokens == 5 and submitted.n == 1
    assert service.metrics.prompt_tokens._value.get() == 3


def test_a_chat_completion_streams_as_server_sent_events(client, service):
    with client.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "stream": True, "user": "u1",
            "messages": [{"role": "user", "content": "hi there"}]}) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Hello world"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # no max_tokens: the room the prompt leaves in the context
    assert service.submitted[0].sampling.max_tokens == MAX_MODEL_LEN - 2
    assert service.submitted[0].session == "u1"


@pytest.mark.parametrize("continuous", [True, False])
def test_continuous_usage_puts_the_usage_so_far_on_every_chunk(client, service, continuous):
    service.answer = [Delta("Hello", 2), Delta(" big", 1), Delta(" world", 3, "length")]
    options = {"include_usage": True, "continuous_usage_stats": continuous}
    with client.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "stream": True, "stream_options": options,
            "messages": [{"role": "user", "content": "hi there"}]}) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    usages = [chunk["usage"] for chunk in choice_chunks]
    if continuous:  # the role chunk, then one per delta (the finish reason its own)
        assert [u["completion_tokens"] for u in usages] == [0, 2, 3, 6, 6]
        assert {u["prompt_tokens"] for u in usages} == {2}
    else:
        assert usages == [None] * 5


def test_a_refused_submit_is_an_openai_error(client, service):
    service.refuse = ServiceUnavailable("no scheduler is ready")
    reply = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert reply.status_code == 503
    assert reply.json()["error"]["message"] == "no scheduler is ready"


def test_a_batch_whose_later_prompt_is_refused_releases_the_earlier_ones(client, service):
    service.refuse, service.accept = ServiceUnavailable("queue full"), 1
    reply = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]})
    assert reply.status_code == 503
    assert len(service.submitted) == 1 and service.released == ["r0"]


def test_a_prompt_too_long_for_the_context_is_refused_before_submitting(client, service):
    reply = client.post("/v1/completions", json={"model": MODEL, "prompt": "a b c",
                                                   "max_tokens": MAX_MODEL_LEN})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    assert service.submitted == []


def test_bad_json_and_unknown_routes(client):
    reply = client.post("/v1/completions", content=b"{not json",
                        headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    missing = client.get("/v2/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == \
        "invalid_request_error"


def test_tokenize_and_detokenize(client):
    tokens = client.post("/tokenize", json={"model": MODEL, "prompt": "ab cde"}).json()
    assert tokens == {"tokens": [2, 3], "count": 2, "max_model_len": MAX_MODEL_LEN}
    assert client.post("/detokenize", json={"tokens": [2, 1]}).json() == {"prompt": "xx x"}
    both = client.post("/tokenize", json={"prompt": "a", "messages": []})
    assert both.status_code == 400


def test_health_follows_the_replicas_readiness(client, service):
    assert client.get("/health/live").json() == {"live": True}
    report = client.get("/health")
    assert report.status_code == 200 and report.json()["replicas"]["0"]["ready"]
    assert report.json()["services"]["gateway"]["status"] == "ok"
    service.replica_ready = False
    assert client.get("/health").status_code == 503
    assert client.get("/health/ready").json() == {"ready": False, "status": "unavailable"}


def test_metrics_render_the_services_counters(client):
    client.get("/v1/models")
    text = client.get("/metrics").text
    assert 'flotilla_requests_total{endpoint="/v1/models",status="200"} 1.0' in text


def test_the_api_key_guards_the_api_but_not_the_probes(service):
    with TestClient(create_app(GatewayConfig(api_key="k"), service)) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert client.get("/health").status_code == 200


def test_a_longer_answer_streams_every_delta(service):
    service.answer = [Delta(f"t{i} ", 1) for i in range(5)] + [Delta("", 0, "stop")]
    with TestClient(create_app(GatewayConfig(), service)) as client:
        body = client.post("/v1/completions",
                           json={"model": MODEL, "prompt": "x", "max_tokens": 6}).json()
    assert body["choices"][0]["text"] == "t0 t1 t2 t3 t4 "
    assert body["choices"][0]["finish_reason"] == "stop"
