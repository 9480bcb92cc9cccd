"""The multi-turn load (turn after turn, replies sent back, conversations in flight) against
scripted servers, the server's counters, and ``flotilla bench serve --dataset-name
multi-turn`` end to end."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from cli.bench import server_metrics
from cli.bench.client import RequestSettings
from cli.bench.conversation_load import SKIPPED_ERROR, run_conversations
from cli.bench.conversations import Conversation
from cli.bench.load import DEADLINE_ERROR
from cli.bench.metrics import RequestRecord, summarize, turn_summaries
from cli.main import main
from tests.cli.fake_server import FakeServer

pytestmark = pytest.mark.timeout(60)

CHAT = RequestSettings(model="m", endpoint="chat")


def conversations(num: int, num_turns: int = 3) -> list[Conversation]:
    return [Conversation(conversation_id=f"c{i}", tenant=i % 2, system_prompt=f"system {i % 2}",
                         user_messages=tuple(f"c{i} says {t}" for t in range(num_turns)),
                         output_len=4)
            for i in range(num)]


def render(messages: list[dict]) -> tuple[str, list[int]]:
    return "|".join(m["content"] for m in messages), list(range(len(messages)))


def chat_stream(text: str, prompt_tokens: int = 10, cached_tokens: int = 4) -> bytes:
    payloads = [{"choices": [{"index": 0, "delta": {"content": text}}]},
                {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 4,
                                          "prompt_tokens_details": {"cached_tokens": cached_tokens}}}]
    return "".join(f"data: {json.dumps(p)}\n\n" for p in payloads).encode() + b"data: [DONE]\n\n"


class ChatServer:
    """Replies ``reply <conversation> <turn>`` (the turn from the number of messages), and
    notes every body and the most conversations in flight at once."""

    def __init__(self, fail=lambda body: False, stall=lambda body: False) -> None:
        self.bodies: list[dict] = []
        self.in_flight: set[str] = set()
        self.max_in_flight = 0
        self.fail, self.stall = fail, stall
        self.never = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        key = body.get("user") or body["messages"][1]["content"].split()[0]
        self.in_flight.add(key)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        try:
            await asyncio.sleep(0)  # let the other conversations send theirs
            if self.stall(body):
                await self.never.wait()
            if self.fail(body):
                return httpx.Response(500, content=b'{"error": {"message": "boom"}}')
            turn = (len(body["messages"]) - 2) // 2
            return httpx.Response(200, content=chat_stream(f"reply {key} {turn}"))
        finally:
            self.in_flight.discard(key)


def run(server: ChatServer, convs: list[Conversation], settings=CHAT, **kwargs):
    async def go():
        transport = httpx.MockTransport(server)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
            return await run_conversations(client, convs, settings, render, **kwargs)
    return asyncio.run(go())


def test_each_turn_follows_the_last_and_sends_its_reply_back():
    server = ChatServer()
    result = run(server, conversations(4), max_concurrency=2)
    assert server.max_in_flight == 2 and len(server.bodies) == 12
    for i in range(4):
        bodies = [b for b in server.bodies if b["user"] == f"c{i}"]
        assert [len(b["messages"]) for b in bodies] == [2, 4, 6]
        assert [m["content"] for m in bodies[2]["messages"] if m["role"] == "assistant"] == [
            f"reply c{i} 0", f"reply c{i} 1"]
        assert bodies[0]["messages"][0] == {"role": "system", "content": f"system {i % 2}"}
    assert [(r.conversation_id, r.turn) for r in result.records] == [
        (f"c{i}", t) for i in range(4) for t in range(3)]
    assert all(r.success and r.num_cached_tokens == 4 and r.prompt_len == 2 + 2 * r.turn
               for r in result.records)
    assert result.records[0].output_text == "reply c0 0" and not result.deadline_reached


def test_without_a_limit_every_conversation_starts_at_once_and_session_ids_can_be_left_out():
    server = ChatServer()
    result = run(server, conversations(3), session_ids=False)
    assert server.max_in_flight == 3 and all("user" not in b for b in server.bodies)
    assert len(result.records) == 9 and all(r.success for r in result.records)


def test_the_completions_endpoint_sends_the_templated_text():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=chat_stream("r"))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                     base_url="http://bench") as client:
            return await run_conversations(client, conversations(1, num_turns=2),
                                           RequestSettings(model="m"), render)
    asyncio.run(go())
    assert [b["prompt"] for b in seen] == ["system 0|c0 says 0", "system 0|c0 says 0|r|c0 says 1"]
    assert all("messages" not in b and b["user"] == "c0" for b in seen)


def test_a_failed_turn_ends_its_conversation_and_the_others_go_on():
    server = ChatServer(fail=lambda body: body["user"] == "c1" and len(body["messages"]) == 4)
    result = run(server, conversations(3), max_concurrency=3)
    assert len([b for b in server.bodies if b["user"] == "c1"]) == 2  # turn 2 never sent
    c1 = [r for r in result.records if r.conversation_id == "c1"]
    assert [r.error for r in c1] == [None, "HTTP 500: boom", SKIPPED_ERROR]
    assert sum(r.success for r in result.records) == 7
    summary = result.summary()
    assert (summary["completed"], summary["failed"], summary["outstanding"]) == (7, 2, 0)


def test_the_deadline_cancels_turns_in_flight_and_counts_the_unsent():
    # turn 1 of every conversation stalls: 2 in flight at the deadline, 2 conversations
    # never started, so 4 + 2 x 2 turns were never sent
    server = ChatServer(stall=lambda body: len(body["messages"]) == 4)
    result = run(server, conversations(4), max_concurrency=2, max_duration_s=0.5)
    assert result.deadline_reached
    assert [(r.conversation_id, r.turn) for r in result.records] == [("c0", 0), ("c1", 0)]
    assert [(r.conversation_id, r.turn, r.error) for r in result.in_flight] == [
        ("c0", 1, DEADLINE_ERROR), ("c1", 1, DEADLINE_ERROR)]
    assert result.num_not_sent == 12 - 2 - 2


def test_the_hit_rate_and_per_turn_figures():
    def record(turn: int, prompt: int, cached: int | None, error=None) -> RequestRecord:
        return RequestRecord(prompt_len=prompt, output_len=4, chunk_times_s=[0.1 * (turn + 1)],
                             e2e_s=1.0, num_prompt_tokens=prompt, num_output_tokens=4,
                             num_cached_tokens=cached, error=error, turn=turn)

    records = [record(0, 100, 0), record(0, 100, 50), record(1, 200, 150),
               record(1, 200, 200, error="HTTP 500"), record(2, 300, None)]
    summary = summarize(records, 2.0)
    # the failed request and the one without cached_tokens are left out of the rate
    assert summary["total_cached_tokens"] == 200
    assert summary["prefix_cache_hit_rate"] == pytest.approx(200 / 400)
    turns = turn_summaries(records, 2.0)
    assert [t["turn"] for t in turns] == [0, 1, 2]
    assert [t["completed"] for t in turns] == [2, 1, 1] and turns[1]["failed"] == 1
    assert turns[1]["prefix_cache_hit_rate"] == pytest.approx(0.75)
    assert math.isnan(turns[2]["prefix_cache_hit_rate"])
    assert turns[0]["ttft_ms"]["median"] == pytest.approx(100)


def gateway_metrics_text(queries: dict[str, int], hits: dict[str, int], tier_hits: int) -> str:
    """The real gateway's /metrics after stats events from one scheduler per replica."""
    from services.gateway.metrics import GatewayMetrics
    from shared.scheduler_stats import EngineStats, SchedulerStats

    metrics = GatewayMetrics()
    for replica, num_queries in queries.items():
        metrics.observe_scheduler(SchedulerStats(
            scheduler_id=f"sched-{replica}", replica_id=replica, timestamp=0.0,
            engine=EngineStats(num_blocks_total=10, num_prefix_queries=num_queries,
                               num_prefix_hits=hits[replica],
                               num_kv_tier_hits=tier_hits if replica == "0" else 0)))
    return metrics.render().decode()


def test_the_gateways_prefix_counters_before_and_after():
    before = server_metrics.parse_counters(gateway_metrics_text({"0": 100, "1": 0}, {"0": 10, "1": 0}, 0))
    after = server_metrics.parse_counters(gateway_metrics_text({"0": 900, "1": 500}, {"0": 410, "1": 100}, 80))
    assert after[server_metrics.QUERIES] == {"replica_id=0": 900.0, "replica_id=1": 500.0}
    figures = server_metrics.scheduler_prefix_cache(server_metrics.counter_deltas(before, after))
    assert (figures["queries"], figures["hits"], figures["tier_hits"]) == (1300, 500, 80)
    assert figures["hit_rate"] == pytest.approx(580 / 1300)
    assert figures["device_hit_rate"] == pytest.approx(500 / 1300)
    assert figures["by_replica"]["replica_id=0"]["hit_rate"] == pytest.approx((400 + 80) / 800)
    assert figures["by_replica"]["replica_id=1"]["queries"] == 500


def test_counters_sum_over_scheduler_instances_and_skip_other_samples():
    text = "\n".join([
        "# TYPE flotilla_prefix_cache_hits counter",
        'flotilla_prefix_cache_hits_total{replica_id="0",scheduler_id="a"} 5.0',
        'flotilla_prefix_cache_hits_total{replica_id="0",scheduler_id="b"} 7.0',
        'flotilla_prefix_cache_hits_created{replica_id="0",scheduler_id="a"} 1.7e9',
        'flotilla_routing_decisions_total{policy="kv",reason="prefix"} 3',
        "flotilla_requests_total 9", "vllm:prefix_cache_hits_total 4", "garbage line"])
    assert server_metrics.parse_counters(text) == {
        "flotilla_prefix_cache_hits_total": {"replica_id=0": 12.0},
        "flotilla_routing_decisions_total": {"policy=kv,reason=prefix": 3.0}}
    deltas = server_metrics.counter_deltas({}, server_metrics.parse_counters(text))
    assert math.isnan(server_metrics.scheduler_prefix_cache(deltas)["hit_rate"])


def test_bench_serve_multi_turn_end_to_end(tmp_path, capsys):
    reads = []

    def metrics() -> str:
        reads.append(1)
        if len(reads) == 1:
            return gateway_metrics_text({"0": 50}, {"0": 0}, 0)
        return gateway_metrics_text({"0": 1050}, {"0": 600}, 0)

    def script(call: int, body: dict) -> list[dict]:
        turn = (len(body["messages"]) - 2) // 2
        return [{"choices": [{"index": 0, "delta": {"content": f"answer {call}"}}]},
                {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 3,
                                          "prompt_tokens_details": {"cached_tokens": 40 * turn}}}]

    result = tmp_path / "multi.json"
    with FakeServer(script, metrics) as server:
        code = main(["bench", "serve", "--base-url", server.base_url, "--model", "m",
                     "--tokenizer", "smollm2", "--dataset-name", "multi-turn",
                     "--num-tenants", "2", "--conversations-per-tenant", "2", "--num-turns", "3",
                     "--system-prompt-len", "32", "--user-message-len", "8", "--output-len", "3",
                     "--max-concurrency", "2", "--disable-tqdm", "--result-json", str(result)])
    assert code == 0
    chats = [b for b in server.bodies if b.get("user")]  # the warm-up has no session id
    assert len(chats) == 12 and len(server.bodies) == 13
    assert {b["user"] for b in chats} == {"s0-t0-c0", "s0-t1-c0", "s0-t0-c1", "s0-t1-c1"}
    assert all(b["max_tokens"] == 3 and b["stream_options"] == {"include_usage": True}
               for b in chats)
    run_ = json.loads(result.read_text())["runs"][0]
    assert run_["summary"]["completed"] == 12 and run_["max_concurrency"] == 2
    assert run_["summary"]["prefix_cache_hit_rate"] == pytest.approx(40 * 4 * 3 / 1200)
    assert [t["prefix_cache_hit_rate"] for t in run_["turns"]] == pytest.approx([0, 0.4, 0.8])
    assert run_["server_prefix_cache"]["queries"] == 1000
    assert run_["server_prefix_cache"]["hit_rate"] == pytest.approx(0.6)
    assert run_["dataset"]["num_requests"] == 12 and run_["dataset"]["endpoint"] == "chat"
    out = capsys.readouterr().out
    assert "Per turn" in out and "Scheduler hit rate (cache + tiers):" in out


def test_multi_turn_refuses_a_request_rate(capsys):
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
                 "--tokenizer", "smollm2", "--dataset-name", "multi-turn", "--request-rate", "2"])
    assert code == 1 and "--request-rate does not apply" in capsys.readouterr().err
