"""Resumable responses (docs/openai-api.md, docs/fault-tolerance.md): two gateway processes
on one real stack with NATS JetStream. Eight greedy background streams on gateway A, A
killed (kill -9) mid-stream, each client resumes on gateway B from its last
sequence_number: the text put together equals the uninterrupted greedy text, with every
event number once. A cancel stops the sequence within a step; an expired id is a 404."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

from cli.stack import free_port
from tests.integration.conftest import start_stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

PROMPTS = ["Tell me about the old lighthouse keeper.", "Describe the city in the year 2150.",
           "What is your favourite recipe for bread?", "Where does the river wind?",
           "Write about a cat on a warm roof.", "Explain why the sky is blue.",
           "Describe a walk in the autumn forest.", "What makes a good friend?"]
MAX_TOKENS = 48


def body(model_name: str, prompt: str, **extra) -> dict:
    return {"model": model_name, "input": prompt, "max_output_tokens": MAX_TOKENS,
            "temperature": 0, **extra}


class EventReader(threading.Thread):
    """One Responses SSE stream: its events (parsed), and how it ended."""

    def __init__(self, method: str, url: str, payload: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.method, self.url, self.payload = method, url, payload
        self.events: list[dict] = []
        self.exception: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.stream(self.method, self.url, json=self.payload, timeout=120) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
        except Exception as exc:  # noqa: BLE001 - the test reports it
            self.exception = exc

    @property
    def response_id(self) -> str:
        return self.events[0]["response"]["id"]

    @property
    def deltas(self) -> list[str]:
        return [e["delta"] for e in self.events if e["type"] == "response.output_text.delta"]

    @property
    def ended(self) -> bool:
        return any(e["type"] in ("response.completed", "response.incomplete", "error")
                   for e in self.events)


def start_gateway(stack, port: int, log_dir, *extra: str) -> subprocess.Popen:
    """Another gateway process on the stack's NATS, on its own port."""
    command = stack.service_command("gateway")
    command[command.index("--port") + 1] = str(port)
    with open(log_dir / f"gateway-{port}.log", "a") as log:
        process = subprocess.Popen([*command, *extra], env=stack.service_env("gateway"),
                                   stdout=log, stderr=subprocess.STDOUT)
    stack.processes[f"gateway-{port}"] = process  # (stack.stop() stops it)
    assert wait_for(lambda: healthy(f"http://127.0.0.1:{port}"), 120), "gateway did not start"
    return process


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=2).json().get("status") == "ok"
    except (httpx.TransportError, ValueError):
        return False


@pytest.fixture(scope="module")
def two_gateways(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("resume-logs")
    stack = start_stack(log_dir, service_args={"worker": ["--kv-cache-memory", "256MiB"]})
    other_port = free_port()
    start_gateway(stack, other_port, log_dir)
    yield stack, f"http://127.0.0.1:{other_port}", log_dir
    stack.stop()


def reference_texts(base_url: str, model_name: str) -> list[str]:
    """Each prompt's greedy text, not stored, uninterrupted."""
    texts = []
    for prompt in PROMPTS:
        reply = httpx.post(base_url + "/v1/responses", json=body(model_name, prompt), timeout=120)
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["output"][0]["content"][0]["text"])
    return texts


@pytest.mark.slow  # (a stack and a second gateway: ~1 min on two cores)
def test_streams_resume_on_another_gateway_after_kill_9(two_gateways, model_name):
    stack, other, _ = two_gateways
    reference = reference_texts(other, model_name)
    readers = [EventReader("POST", stack.base_url + "/v1/responses",
                           body(model_name, p, stream=True, background=True)) for p in PROMPTS]
    for reader in readers:
        reader.start()
    assert wait_for(lambda: all(len(r.deltas) >= 2 for r in readers), 90), "no text before kill"
    stack.stop_service("gateway", signal.SIGKILL)
    for reader in readers:
        reader.join(60)
        assert not reader.is_alive(), "a stream hung after its gateway died"
    num_cut = sum(not r.ended for r in readers)
    print(f"{num_cut} of {len(readers)} streams cut by the kill")
    assert num_cut >= len(readers) // 2, "the kill came after most streams had ended"
    for reader, expected in zip(readers, reference):
        events = list(reader.events)
        if not reader.ended:  # resume on the other gateway from the last number we have
            last = events[-1]["sequence_number"]
            resumed = EventReader("GET", f"{other}/v1/responses/{reader.response_id}"
                                         f"?stream=true&starting_after={last}")
            resumed.run()
            assert resumed.exception is None, resumed.exception
            assert resumed.events[0]["sequence_number"] == last + 1
            events += resumed.events
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        status = events[-1]["response"]["status"]  # (incomplete: max_output_tokens ended it)
        assert events[-1]["type"] == f"response.{status}" and status in ("completed",
                                                                         "incomplete")
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == expected
        stored = httpx.get(f"{other}/v1/responses/{reader.response_id}", timeout=30).json()
        assert stored["status"] == status
        assert stored["output"][0]["content"][0]["text"] == expected
    stack.start_service("gateway")
    stack.wait_ready(120)


def test_cancel_stops_the_sequence_within_a_step(two_gateways, model_name):
    """Cancelled on the gateway that did not take it: the stream ends with a cancel error,
    at most one more step's output is stored after the cancel, the state says cancelled."""
    stack, other, _ = two_gateways
    reader = EventReader("POST", other + "/v1/responses",
                         body(model_name, PROMPTS[0], stream=True, background=True,
                              max_output_tokens=400))
    reader.start()
    assert wait_for(lambda: len(reader.deltas) >= 3, 60)
    reply = httpx.post(f"{stack.base_url}/v1/responses/{reader.response_id}/cancel", timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["status"] == "cancelled"
    reader.join(30)
    assert not reader.is_alive()
    assert reader.events[-1]["type"] == "error"
    assert reader.events[-1]["code"] == "response_cancelled"
    time.sleep(1.0)  # a step that was running when the abort came
    stored = httpx.get(f"{other}/v1/responses/{reader.response_id}", timeout=30).json()
    assert stored["status"] == "cancelled"
    after = outputs_after_cancel(stack.nats_url, reader.response_id.removeprefix("resp_"))
    print(f"{after} step outputs stored after the cancel record")
    assert after <= 2, f"{after} steps' outputs were stored after the cancel"
    again = httpx.post(f"{other}/v1/responses/{reader.response_id}/cancel", timeout=30)
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


def outputs_after_cancel(nats_url: str, request_id: str) -> int:
    """Output messages stored after the cancel record (read from JetStream directly)."""
    import asyncio

    import nats

    async def count() -> int:
        nc = await nats.connect(nats_url)
        try:
            sub = await nc.jetstream().subscribe(f"flotilla.v1.resp.*.{request_id}.*",
                                                 ordered_consumer=True)
            subjects = []
            while True:
                try:
                    subjects.append((await sub.next_msg(timeout=1.0)).subject)
                except nats.errors.TimeoutError:
                    break
            kinds = [subject.rsplit(".", 1)[1] for subject in subjects]
            records = [i for i, kind in enumerate(kinds) if kind == "rec"]
            return kinds[records[-1]:].count("out")  # (the cancel is the last record)
        finally:
            await nc.close()

    return asyncio.run(count())


def test_unknown_and_expired_ids_are_404(two_gateways, model_name):
    """A gateway with a 2 s retention sets the stream's: a response older than that is
    gone, and its id, like one never seen, is a 404 in OpenAI's error format."""
    stack, other, log_dir = two_gateways
    reply = httpx.post(other + "/v1/responses",
                       json=body(model_name, PROMPTS[1], store=True, max_output_tokens=4),
                       timeout=60)
    assert reply.status_code == 200 and reply.json()["status"] in ("completed", "incomplete")
    response_id = reply.json()["id"]
    assert httpx.get(f"{other}/v1/responses/{response_id}", timeout=30).status_code == 200
    for unknown in ("resp_" + "0" * 32, "resp_nothex", "chatcmpl-1"):
        missing = httpx.get(f"{other}/v1/responses/{unknown}", timeout=30)
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "response_not_found"
    short_port = free_port()
    start_gateway(stack, short_port, log_dir, "--response-retention-s", "2")
    short = f"http://127.0.0.1:{short_port}"
    try:
        assert wait_for(lambda: httpx.get(f"{short}/v1/responses/{response_id}",
                                          timeout=30).status_code == 404, 30)
        gone = httpx.get(f"{short}/v1/responses/{response_id}?stream=true", timeout=30)
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "invalid_request_error"
    finally:  # the other tests' responses need the default retention back
        stack.stop_service(f"gateway-{short_port}")
        set_retention(stack.nats_url, 3600.0)


def set_retention(nats_url: str, retention_s: float) -> None:
    import asyncio

    import nats

    async def update() -> None:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            config = (await js.stream_info("flotilla_responses")).config
            config.max_age = retention_s
            await js.update_stream(config)
        finally:
            await nc.close()

    asyncio.run(update())


def test_a_stored_chat_stream_resumes_on_the_other_gateway_by_last_event_id(two_gateways,
                                                                           model_name):
    """A chat stream with store: true, its connection dropped after a few chunks, read on
    with Last-Event-ID from the other gateway: the rest, and the text of an unstored run."""
    stack, other, _ = two_gateways
    request = {"model": model_name, "messages": [{"role": "user", "content": PROMPTS[2]}],
               "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(other + "/v1/chat/completions", json=request, timeout=120)
    expected = reply.json()["choices"][0]["message"]["content"]
    events = []
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", timeout=120,
                      json={**request, "stream": True, "store": True}) as response:
        assert response.status_code == 200, response.read()
        lines = []
        for line in response.iter_lines():  # (events: "id: N", "data: ...", "")
            if line:
                lines.append(line)
                continue
            events.append("\n".join(lines))
            lines = []
            if len(events) == 4:
                break  # the client goes away mid-stream
    last_id = int(events[-1].split("\n")[0].removeprefix("id: "))
    completion_id = json.loads(events[0].split("data: ", 1)[1])["id"]
    with httpx.stream("GET", f"{other}/v1/chat/completions/{completion_id}?stream=true",
                      headers={"Last-Event-ID": str(last_id)}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        rest = [e for e in response.read().decode().split("\n\n") if e]
    events += rest
    assert [int(e.split("\n")[0].removeprefix("id: ")) for e in events] == \
        list(range(len(events)))
    assert events[-1].endswith("data: [DONE]")
    chunks = [json.loads(e.split("data: ", 1)[1]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == expected
    stored = httpx.get(f"{other}/v1/chat/completions/{completion_id}", timeout=30).json()
    assert stored["choices"][0]["message"]["content"] == expected
    assert httpx.get(f"{other}/v1/responses/resp_{completion_id.removeprefix('chatcmpl-')}",
                     timeout=30).status_code == 404  # (a completion's id names no response)
