"""Failures: services down or restarting, clients leaving, wrong API keys. These tests
stop and start services, so they get a stack of their own."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.integration.conftest import free_port, start_stack, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory):
    # 2 running and 2 waiting at most: a fifth request gets 429
    stack = start_stack(tmp_path_factory.mktemp("fault-logs"),
                        service_args={"worker": ["--kv-cache-memory", "256MiB"],
                                      "scheduler": ["--max-num-seqs", "2",
                                                    "--max-queued-requests", "2"],
                                      # requests fail here rather than move (tests/chaos moves them)
                                      "gateway": ["--migration-limit", "0"]})
    yield stack
    stack.stop()


def stream_request(model_name, max_tokens, prompt="Tell me a long story about a dragon.") -> dict:
    return {"model": model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}


def sse_texts(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            payload = json.loads(line[6:])
            assert "error" not in payload, payload
            yield payload["choices"][0]["text"] if payload["choices"] else ""


def blocks_in_use(stack) -> float:
    text = httpx.get(stack.base_url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("flotilla_kv_cache_blocks_used{"))


def test_a_restarted_tokenizer_does_not_break_requests_in_flight(own_stack, model_name):
    body = stream_request(model_name, 48)
    reference = httpx.post(own_stack.base_url + "/v1/completions",
                           json={**body, "stream": False}, timeout=120).json()["choices"][0]["text"]
    with httpx.stream("POST", own_stack.base_url + "/v1/completions", json=body, timeout=120) as r:
        texts = sse_texts(r)
        parts = [next(texts) for _ in range(3)]
        own_stack.stop_service("tokenizer", signal.SIGKILL)
        own_stack.start_service("tokenizer")
        parts += list(texts)
    assert "".join(parts) == reference
    own_stack.wait_ready(120)  # the next test needs a tokenizer again


def test_client_disconnect_aborts_and_frees_blocks(own_stack, model_name):
    with httpx.stream("POST", own_stack.base_url + "/v1/completions",
                      json=stream_request(model_name, 2000), timeout=120) as r:
        texts = sse_texts(r)
        next(texts)
        # the gauge follows the scheduler's stats events (every 0.5 s)
        assert wait_for(lambda: blocks_in_use(own_stack) > 0), "the request holds no blocks"
    assert wait_for(lambda: blocks_in_use(own_stack) == 0), "blocks were not freed"


def metric(stack, name: str) -> float:
    text = httpx.get(stack.base_url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_a_non_streaming_client_leaving_aborts_its_request(own_stack, model_name):
    body = {**stream_request(model_name, 4000), "stream": False}
    outcome = []

    def leave_after_3s() -> None:
        try:
            httpx.post(own_stack.base_url + "/v1/completions", json=body,
                       timeout=httpx.Timeout(60, read=3))
            outcome.append("answered")
        except httpx.ReadTimeout:
            outcome.append("left")  # the client closes the connection

    client = threading.Thread(target=leave_after_3s)
    client.start()
    assert wait_for(lambda: blocks_in_use(own_stack) > 0), "the request holds no blocks"
    client.join(30)
    assert outcome == ["left"]
    assert wait_for(lambda: blocks_in_use(own_stack) == 0), "the abandoned request still runs"
    assert metric(own_stack, "flotilla_num_requests_running") == 0


def test_a_full_queue_answers_429_with_retry_after(own_stack, model_name):
    """--max-num-seqs 2 and --max-queued-requests 2: four long requests fill the batch and the
    queue; a fifth is refused at once with OpenAI's error body, and nothing else is disturbed."""
    leave = threading.Event()
    received = [0] * 4

    def hold(index: int) -> None:
        with httpx.stream("POST", own_stack.base_url + "/v1/completions",
                          json=stream_request(model_name, 4000), timeout=120) as response:
            for _ in response.iter_lines():
                received[index] += 1
                if leave.is_set():
                    return

    holders = [threading.Thread(target=hold, args=(i,)) for i in range(4)]
    for thread in holders:
        thread.start()
    try:
        assert wait_for(lambda: metric(own_stack, "flotilla_num_requests_waiting") == 2
                        and metric(own_stack, "flotilla_num_requests_running") == 2)
        rejected_before = metric(own_stack, "flotilla_requests_rejected_total")
        refused = httpx.post(own_stack.base_url + "/v1/completions", timeout=30,
                             json=stream_request(model_name, 4))
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        assert metric(own_stack, "flotilla_requests_rejected_total") == rejected_before + 1
        running = received[:]
        assert wait_for(lambda: sum(received) > sum(running)), "the running requests stalled"
    finally:
        leave.set()
        for thread in holders:
            thread.join(60)
    assert wait_for(lambda: blocks_in_use(own_stack) == 0, 60)


def test_a_missing_service_gives_503_not_a_hang(own_stack, model_name):
    own_stack.stop_service("scheduler")
    try:
        started = time.monotonic()
        response = httpx.post(own_stack.base_url + "/v1/completions", timeout=60, json={
            "model": model_name, "prompt": "Hi", "max_tokens": 4})
        assert response.status_code == 503, response.text
        assert response.json()["error"]["type"] == "service_unavailable"
        assert time.monotonic() - started < 10
        health = httpx.get(own_stack.base_url + "/health")
        assert health.status_code == 503
        assert health.json()["services"]["scheduler"]["status"] == "unavailable"
    finally:
        own_stack.start_service("scheduler")
    own_stack.wait_ready(120)
    response = httpx.post(own_stack.base_url + "/v1/completions", timeout=60, json={
        "model": model_name, "prompt": "Hi", "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200


def test_a_worker_dying_mid_request_fails_it_with_503(own_stack, model_name):
    """With migration off (--migration-limit 0) the stream ends with an error event."""
    with httpx.stream("POST", own_stack.base_url + "/v1/completions",
                      json=stream_request(model_name, 4000), timeout=120) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        own_stack.stop_service("worker", signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    errors = [json.loads(line[6:])["error"] for line in rest if '"error"' in line]
    assert errors and errors[0]["type"] == "service_unavailable"
    own_stack.start_service("worker")
    own_stack.wait_ready(180)


def test_api_key_is_enforced(own_stack, model_name, tmp_path):
    """A second gateway with an API key, on the same NATS."""
    import subprocess
    import sys

    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--nats-url", own_stack.nats_url,
         "--port", str(port), "--host", "127.0.0.1", "--api-key", "s3cret"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "gateway.log", "w"))
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _reachable(base + "/health"), 60)
        body = {"model": model_name, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
        wrong = httpx.post(base + "/v1/completions", json=body,
                           headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(base + "/v1/completions", json=body).status_code == 401
        right = httpx.post(base + "/v1/completions", json=body, timeout=60,
                           headers={"Authorization": "Bearer s3cret"})
        assert right.status_code == 200
        assert httpx.get(base + "/health").status_code == 200  # health stays open
    finally:
        gateway.terminate()
        gateway.wait(10)


def _reachable(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_worker_restarted_while_idle_never_serves_stale_prefix_blocks(own_stack, model_name):
    """The scheduler's prefix cache points into the old worker's KV. After the worker restarts
    while nothing runs, the same prompt must give the same text (after at most one 503 while
    the scheduler re-attaches), never text computed over an empty cache."""
    body = {"model": model_name, "max_tokens": 16, "temperature": 0,
            "prompt": "The history of the lighthouse begins in antiquity, when fires were lit "
                      "on hilltops to guide ships home. Later, towers of stone carried lamps "
                      "of oil, and their keepers trimmed the wicks through the night. Today"}

    def complete() -> httpx.Response:
        return httpx.post(own_stack.base_url + "/v1/completions", json=body, timeout=120)

    reference = complete().json()["choices"][0]["text"]
    assert complete().json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    own_stack.stop_service("worker", signal.SIGKILL)
    own_stack.start_service("worker")
    own_stack.wait_ready(180)
    response = complete()
    if response.status_code == 503:  # the step reached the new worker first: it refused
        response = complete()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference
