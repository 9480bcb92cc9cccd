"""`flotilla bench serve` reads speculative decoding's figures from the gateway's /metrics
around a run: drafts kept, the mean accepted length and acceptance by position."""

from __future__ import annotations

import pytest

from cli.bench import report, server_metrics
from services.gateway.metrics import GatewayMetrics
from shared.scheduler_stats import EngineStats, SchedulerStats, SpeculationStats


def gateway_counters(replicas: dict[str, tuple[int, int, int, list[int]]]
                     ) -> server_metrics.Counters:
    """The real gateway's /metrics, parsed, after one stats event per replica:
    (draft tokens, kept, verify passes, kept per position)."""
    metrics = GatewayMetrics()
    for replica, (drafts, kept, passes, per_position) in replicas.items():
        metrics.observe_scheduler(SchedulerStats(
            scheduler_id=f"sched-{replica}", replica_id=replica, timestamp=0.0,
            engine=EngineStats(num_blocks_total=10), speculation=SpeculationStats(
                num_draft_tokens=drafts, num_accepted_drafts=kept, num_drafted_steps=passes,
                num_accepted_per_position=per_position)))
    return server_metrics.parse_counters(metrics.render().decode())


def test_the_runs_drafts_come_from_the_counters_difference_over_replicas():
    before = gateway_counters({"0": (40, 20, 10, [8, 7, 5, 0]), "1": (0, 0, 0, [])})
    after = gateway_counters({"0": (80, 50, 20, [17, 15, 12, 6]), "1": (40, 30, 10, [10, 9, 7, 4])})
    figures = server_metrics.speculative_decoding(server_metrics.counter_deltas(before, after))
    assert figures["draft_tokens"] == 80 and figures["accepted_tokens"] == 60
    assert figures["verify_passes"] == 20
    assert figures["acceptance_rate"] == pytest.approx(0.75)
    assert figures["mean_accepted_length"] == pytest.approx(3.0)
    assert figures["acceptance_by_position"] == pytest.approx([0.95, 0.85, 0.7, 0.5])
    line = report.speculative_line(figures)
    assert "60 of 80 drafts kept" in line and "3.00 a verify pass" in line


def test_no_drafts_no_figures():
    counters = gateway_counters({"0": (0, 0, 0, [])})
    assert server_metrics.speculative_decoding(
        server_metrics.counter_deltas(counters, counters)) is None
    assert server_metrics.speculative_decoding({}) is None
