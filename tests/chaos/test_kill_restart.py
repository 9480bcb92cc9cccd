"""Request migration: a worker or scheduler killed (kill -9) mid-stream; every greedy stream
in flight still ends with exactly the text of its solo run, with no error and no gap."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests.chaos.streams import StreamReader
from tests.integration.conftest import start_stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

PROMPTS = ["The old lighthouse keeper", "In the year 2150, the city", "My favourite recipe for bread",
           "The river wound through"]
MAX_TOKENS = 32


def body(model_name: str, prompt: str, stream: bool = True, **extra) -> dict:
    return {"model": model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream, **extra}


def migrations(stack) -> float:
    text = httpx.get(stack.base_url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('flotilla_request_migrations_total{outcome="resumed"}'))


def solo_texts(stack, model_name) -> list[str]:
    return [httpx.post(stack.base_url + "/v1/completions", json=body(model_name, p, stream=False),
                       timeout=120).json()["choices"][0]["text"] for p in PROMPTS]


def kill_mid_stream(stack, model_name, victim: str, restart: bool) -> list[StreamReader]:
    """Start a stream per prompt, kill ``victim`` once each has some text, restart it (in
    place) when asked, and wait for every stream to end."""
    readers = [StreamReader(stack.base_url, body(model_name, p)) for p in PROMPTS]
    for reader in readers:
        reader.start()
    assert wait_for(lambda: all(len(r.parts) >= 3 for r in readers), 60), "no text before the kill"
    stack.stop_service(victim, signal.SIGKILL)
    if restart:
        time.sleep(1)
        stack.start_service(victim)
    for reader in readers:
        reader.join(150)
        assert not reader.is_alive(), "a stream hung"
    return readers


def assert_same_as_solo(readers: list[StreamReader], reference: list[str]) -> None:
    for reader, expected in zip(readers, reference):
        assert reader.exception is None, reader.exception
        assert not reader.errors, reader.errors
        assert reader.done, "the stream ended without [DONE]"
        assert reader.text == expected


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory):
    stack = start_stack(tmp_path_factory.mktemp("migration-logs"),
                        service_args={"worker": ["--kv-cache-memory", "256MiB"]})
    yield stack
    stack.stop()


@pytest.mark.parametrize("victim", ["worker", "scheduler"])
def test_a_replica_restarted_in_place_resumes_every_stream(one_replica, model_name, victim):
    reference = solo_texts(one_replica, model_name)
    before = migrations(one_replica)
    readers = kill_mid_stream(one_replica, model_name, victim, restart=True)
    assert_same_as_solo(readers, reference)
    assert migrations(one_replica) >= before + len(PROMPTS)
    one_replica.wait_ready(120)


def test_a_request_that_cannot_move_ends_with_an_error_event(one_replica, model_name):
    """n > 1 is not migrated: its stream ends with an OpenAI error event, never silently."""
    reader = StreamReader(one_replica.base_url, body(model_name, PROMPTS[0], n=2,
                                                     max_tokens=400))
    reader.start()
    assert wait_for(lambda: len(reader.parts) >= 3, 60)
    one_replica.stop_service("worker", signal.SIGKILL)
    reader.join(60)
    one_replica.start_service("worker")
    assert not reader.is_alive() and reader.exception is None
    assert reader.errors and reader.errors[0]["type"] == "service_unavailable"
    assert not reader.done
    one_replica.wait_ready(120)


@pytest.mark.slow  # (make test-slow: a stack of its own, half a minute or more)
def test_two_replicas_one_killed_for_good(tmp_path_factory, model_name):
    """--replicas 2: a scheduler killed and not restarted; its streams finish on the other."""
    stack = start_stack(tmp_path_factory.mktemp("migration2-logs"), replicas=2,
                        service_args={"worker": ["--kv-cache-memory", "256MiB"],
                                      "gateway": ["--heartbeat-timeout-s", "3"]})
    try:
        reference = solo_texts(stack, model_name)
        readers = kill_mid_stream(stack, model_name, "scheduler", restart=False)
        assert_same_as_solo(readers, reference)
    finally:
        stack.stop()


def test_a_gateway_sigterm_finishes_streams_in_flight(one_replica, model_name):
    """Graceful drain: SIGTERM on the gateway refuses new connections but lets the streams
    it is serving run to their end (within --shutdown-timeout), then it exits."""
    readers = [StreamReader(one_replica.base_url, body(model_name, p)) for p in PROMPTS[:2]]
    for reader in readers:
        reader.start()
    assert wait_for(lambda: all(len(r.parts) >= 2 for r in readers), 60)
    gateway = one_replica.processes["gateway"]
    gateway.send_signal(signal.SIGTERM)
    assert wait_for(lambda: refused(one_replica.base_url), 10), "still taking new connections"
    for reader in readers:
        reader.join(120)
    assert all(r.done and not r.errors and r.exception is None for r in readers)
    assert gateway.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it drained on
    one_replica.start_service("gateway")
    one_replica.wait_ready(120)


def refused(base_url: str) -> bool:
    try:
        httpx.get(base_url + "/health/live", timeout=2)
        return False
    except httpx.TransportError:
        return True


@pytest.mark.slow  # (make test-slow: CI runs it after make test)
def test_gateway_workers_one_killed_the_others_keep_serving(tmp_path_factory, model_name):
    """--gateway-workers 2 (SO_REUSEPORT): kill -9 one gateway mid-stream. Each stream either
    ends with its solo text (on the gateway that lives) or loses its connection (on the one
    killed: its client sees the socket close, nothing hangs); new requests meanwhile all go
    to the survivor; the killed one started again serves beside it."""
    stack = start_stack(tmp_path_factory.mktemp("gateways-logs"), gateways=2,
                        service_args={"worker": ["--kv-cache-memory", "256MiB"]})
    try:
        reference = solo_texts(stack, model_name)
        readers = [StreamReader(stack.base_url, body(model_name, p)) for p in PROMPTS * 3]
        for reader in readers:
            reader.start()
        assert wait_for(lambda: all(len(r.parts) >= 2 for r in readers), 60)
        stack.stop_service("gateway-1", signal.SIGKILL)
        assert solo_texts(stack, model_name) == reference  # every one on the survivor
        for reader, expected in zip(readers, reference * 3):
            reader.join(150)
            assert not reader.is_alive(), "a stream hung"
            lost = isinstance(reader.exception, httpx.TransportError)
            assert lost or (reader.done and not reader.errors and reader.text == expected)
        stack.start_service("gateway-1")
        stack.wait_ready(120)
        for _ in range(2):  # on whichever gateway each connection lands
            assert solo_texts(stack, model_name) == reference
    finally:
        stack.stop()
