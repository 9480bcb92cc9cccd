"""`flotilla bench` reads a MoE server's expert load balance from the gateway's /metrics
after a run: the hottest expert's share, the cells above 2x and at most 0.5x, the
histogram's buckets, per replica and in all; a dense server gives none."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from cli.bench import report, serve, server_metrics
from cli.main import main
from services.gateway.metrics import GatewayMetrics
from shared.scheduler_stats import MoeStats, SchedulerStats
from tests.cli.fake_server import FakeServer
from tests.cli.test_bench_serve_fake_server import usage_only

pytestmark = pytest.mark.timeout(60)

# replica 0: shares 0.5 1.5 0 2 | 1 1 0.9 1.1; replica 1: 0 0 0 4
AFTER = {"0": [[1, 3, 0, 4], [10, 10, 9, 11]], "1": [[0, 0, 0, 12]]}
BEFORE = {"0": [[1, 1, 0, 2], [5, 5, 4, 6]]}  # 24 pairs routed before the run


def gateway_text(counts: dict[str, list[list[int]]]) -> str:
    """The real gateway's /metrics after one stats event per replica."""
    metrics = GatewayMetrics()
    for replica, layers in counts.items():
        metrics.observe_scheduler(SchedulerStats(
            scheduler_id=f"sched-{replica}", replica_id=replica, timestamp=0.0,
            moe=MoeStats(expert_token_counts=layers)))
    return metrics.render().decode()


def test_the_balance_is_read_per_replica_and_in_all():
    text = gateway_text(AFTER)
    deltas = server_metrics.counter_deltas(
        server_metrics.parse_counters(gateway_text(BEFORE)), server_metrics.parse_counters(text))
    figures = server_metrics.expert_load(text, deltas)
    assert figures["buckets"] == {
        "0.0": 4, "0.25": 4, "0.5": 5, "0.75": 5, "0.9": 6, "1.1": 9, "1.25": 9, "1.5": 10,
        "2.0": 11, "4.0": 12, "8.0": 12, "+Inf": 12}
    assert figures["max_share"] == 4.0 and figures["num_cells"] == 12
    assert figures["share_above_2x"] == pytest.approx(1 / 12)
    assert figures["share_at_most_half"] == pytest.approx(5 / 12)
    assert figures["routed_tokens"] == 36  # 24 more on replica 0, 12 on replica 1
    zero, one = figures["by_replica"]["replica_id=0"], figures["by_replica"]["replica_id=1"]
    assert (zero["max_share"], zero["num_cells"], zero["share_above_2x"],
            zero["share_at_most_half"]) == (2.0, 8, 0.0, 0.25)
    assert (one["max_share"], one["share_above_2x"], one["share_at_most_half"]) == (4.0, 0.25, 0.75)
    line = report.expert_load_line(figures)
    assert "hottest expert 4.00x an even split" in line
    assert "of 12 (layer, expert) cells 8.3% above 2x, 41.7% at most 0.5x" in line


def test_a_dense_server_or_another_servers_metrics_give_none():
    assert server_metrics.expert_load(gateway_text({"0": []})) is None
    assert server_metrics.expert_load("# HELP vllm:num_requests_running x\n"
                                      "vllm:num_requests_running 3.0\n") is None
    assert server_metrics.expert_load("") is None
    assert "routed_tokens" not in server_metrics.expert_load(gateway_text(AFTER))


def test_bench_serve_writes_the_balance_and_prints_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(server_metrics, "STATS_SETTLE_S", 0.0)  # the stats are there already
    reads = []

    def metrics() -> str:  # the read before the run, then the one after
        reads.append(1)
        return gateway_text(BEFORE if len(reads) == 1 else AFTER)

    result = tmp_path / "serve.json"
    with FakeServer(lambda call, body: usage_only(body["max_tokens"]), metrics) as server:
        code = main(["bench", "serve", "--base-url", server.base_url, "--model", "m",
                     "--tokenizer", "smollm2", "--num-prompts", "2", "--input-len", "8",
                     "--output-len", "2", "--ignore-eos", "--disable-tqdm",
                     "--result-json", str(result)])
    assert code == 0 and len(reads) == 2
    run = json.loads(result.read_text())["runs"][0]
    assert run["server_expert_load"]["max_share"] == 4.0
    assert run["server_expert_load"]["routed_tokens"] == 36
    assert run["server_expert_load"]["buckets"]["2.0"] == 11
    assert run["server_speculative"] is None
    assert capsys.readouterr().out.count("MoE expert load (server") == 1


@pytest.mark.parametrize("text", [gateway_text({"0": []}), None], ids=["dense", "no-metrics"])
def test_a_dense_server_or_none_gives_no_expert_figures(monkeypatch, text):
    monkeypatch.setattr(server_metrics, "STATS_SETTLE_S", 0.0)
    args = argparse.Namespace(api_key=None)

    async def figures() -> dict:
        if text is None:  # no /metrics (404)
            with FakeServer(lambda call, body: []) as server:
                return await serve.server_figures(server.base_url, args, {})
        with FakeServer(lambda call, body: [], lambda: text) as server:
            return await serve.server_figures(server.base_url, args, {})

    assert asyncio.run(figures()) == {"server_speculative": None, "server_expert_load": None}
