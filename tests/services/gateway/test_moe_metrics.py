"""The gateway's expert-load figures for MoE replicas, from the schedulers' cumulative
counts: each (layer, expert)'s share against an even split as a histogram, the largest
share, and the routed token-expert pairs; read back through prometheus_client's parser."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.expert_load import expert_shares, share_buckets
from services.gateway.metrics import GatewayMetrics
from shared.scheduler_stats import MoeStats, SchedulerStats

# layer 0: 8 tokens over 4 experts (even: 2 each); layer 1: 40 over 4 (even: 10)
COUNTS = [[1, 3, 0, 4], [10, 10, 9, 11]]
SHARES = [0.5, 1.5, 0.0, 2.0, 1.0, 1.0, 0.9, 1.1]


def stats(replica: str, counts: list[list[int]], scheduler: str = "") -> SchedulerStats:
    return SchedulerStats(scheduler_id=scheduler or f"sched-{replica}", replica_id=replica,
                          timestamp=0.0, moe=MoeStats(expert_token_counts=counts))


def scrape(metrics: GatewayMetrics) -> dict[tuple[str, tuple], float]:
    """/metrics as the text a scraper reads, parsed: (sample name, sorted labels) -> value."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for sample in family.samples}


def moe_samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple], float]:
    return {key: value for key, value in scrape(metrics).items()
            if key[0].startswith("flotilla_moe_") and not key[0].endswith("_created")}


def labels(replica: str, scheduler: str = "", **extra: str) -> tuple:
    return tuple(sorted({"replica_id": replica, "scheduler_id": scheduler or f"sched-{replica}",
                         **extra}.items()))


def test_shares_are_against_an_even_split_and_a_layer_without_tokens_has_none():
    assert expert_shares(COUNTS) == pytest.approx(SHARES)
    assert expert_shares([[0, 0, 0], [6, 0, 0]]) == [3.0, 0.0, 0.0]
    assert expert_shares([]) == [] and expert_shares([[0, 0]]) == []


def test_buckets_are_cumulative_and_a_share_on_a_bound_counts_in_it():
    assert share_buckets(SHARES) == [
        ("0.0", 1), ("0.25", 1), ("0.5", 2), ("0.75", 2), ("0.9", 3), ("1.1", 6),
        ("1.25", 6), ("1.5", 7), ("2.0", 8), ("4.0", 8), ("8.0", 8), ("+Inf", 8)]


def test_the_scrape_holds_the_histogram_the_max_share_and_the_routed_pairs():
    metrics = GatewayMetrics()
    metrics.observe_scheduler(stats("0", COUNTS))
    metrics.observe_scheduler(stats("1", []))  # a dense replica: nothing of its own
    samples = moe_samples(metrics)
    le = {"0.0": 1, "0.25": 1, "0.5": 2, "0.75": 2, "0.9": 3, "1.1": 6, "1.25": 6,
          "1.5": 7, "2.0": 8, "4.0": 8, "8.0": 8, "+Inf": 8}
    expected = {("flotilla_moe_expert_load_bucket", labels("0", le=bound)): float(count)
                for bound, count in le.items()}
    expected |= {("flotilla_moe_expert_load_count", labels("0")): 8.0,
                 ("flotilla_moe_expert_load_sum", labels("0")): pytest.approx(sum(SHARES)),
                 ("flotilla_moe_expert_load_max", labels("0")): 2.0,
                 ("flotilla_moe_routed_tokens_total", labels("0")): 48.0}
    assert samples == expected


def test_counts_are_recomputed_not_added_and_the_routed_counter_survives_a_reattach():
    metrics = GatewayMetrics()
    metrics.observe_scheduler(stats("0", COUNTS))
    metrics.observe_scheduler(stats("0", [[4, 4, 4, 4], [10, 10, 9, 11]]))  # 56 in all
    samples = moe_samples(metrics)
    assert samples[("flotilla_moe_expert_load_count", labels("0"))] == 8  # not 16
    assert samples[("flotilla_moe_expert_load_max", labels("0"))] == pytest.approx(1.1)
    assert samples[("flotilla_moe_routed_tokens_total", labels("0"))] == 56
    metrics.observe_scheduler(stats("0", []))  # re-attached: no report yet
    assert moe_samples(metrics) == {("flotilla_moe_routed_tokens_total", labels("0")): 56.0}
    metrics.observe_scheduler(stats("0", [[0, 0, 0, 8], [0, 0, 0, 0]]))  # counting from zero
    samples = moe_samples(metrics)
    assert samples[("flotilla_moe_routed_tokens_total", labels("0"))] == 64
    assert samples[("flotilla_moe_expert_load_max", labels("0"))] == 4.0
    assert samples[("flotilla_moe_expert_load_count", labels("0"))] == 4  # layer 1: none yet


def test_a_restarted_scheduler_replaces_its_replicas_balance():
    metrics = GatewayMetrics()
    metrics.observe_scheduler(stats("0", COUNTS, scheduler="old"))
    metrics.observe_scheduler(stats("0", [[2, 2]], scheduler="new"))
    samples = moe_samples(metrics)
    peaks = {key: value for key, value in samples.items()
             if key[0] == "flotilla_moe_expert_load_max"}
    assert peaks == {("flotilla_moe_expert_load_max", labels("0", "new")): 1.0}
    assert samples[("flotilla_moe_routed_tokens_total", labels("0", "old"))] == 48
    assert samples[("flotilla_moe_routed_tokens_total", labels("0", "new"))] == 4


def test_a_dense_fleet_gets_no_moe_samples():
    metrics = GatewayMetrics()
    metrics.observe_scheduler(stats("0", []))
    assert moe_samples(metrics) == {}
