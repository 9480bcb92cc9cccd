"""vLLM's metric names on the gateway's /metrics: a GatewayMetrics fed known request timings
and SchedulerStats, its text read back with prometheus_client's parser; each vllm: series
carries model_name and equals the flotilla figure it mirrors."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import GatewayMetrics
from services.gateway.routes_generate import _timed
from services.gateway.streams import Delta
from services.gateway.vllm_metrics import GATEWAY_FIGURES, KV_USAGE, REPLICA_FIGURES
from shared.scheduler_stats import EngineStats, RoutingStats, SchedulerStats, SpeculationStats

# what llm-d, KServe and vLLM's dashboards read (issue 54), as a scraper sees the samples
EXPECTED = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
FLOTILLA_NAMES = {  # vllm name -> the flotilla family it mirrors
    "vllm:prompt_tokens": "flotilla_prompt_tokens",
    "vllm:generation_tokens": "flotilla_generation_tokens",
    "vllm:request_success": "flotilla_requests_finished",
    "vllm:time_to_first_token_seconds": "flotilla_time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "flotilla_inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds": "flotilla_e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "flotilla_queue_time_seconds",
    "vllm:num_requests_running": "flotilla_num_requests_running",
    "vllm:num_requests_waiting": "flotilla_num_requests_waiting",
    "vllm:num_preemptions": "flotilla_preemptions",
    "vllm:prefix_cache_queries": "flotilla_prefix_cache_queries",
    "vllm:prefix_cache_hits": "flotilla_prefix_cache_hits",
    "vllm:spec_decode_num_drafts": "flotilla_spec_decode_drafts",
    "vllm:spec_decode_num_draft_tokens": "flotilla_spec_decode_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "flotilla_spec_decode_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "flotilla_spec_decode_accepted_tokens_per_pos",
}
LATENCIES = ("time_to_first_token_seconds", "inter_token_latency_seconds",
             "e2e_request_latency_seconds", "request_queue_time_seconds")


def stats(replica: str, model: str, used: int, queries: int, hits: int, drafts: int,
          kept: int) -> SchedulerStats:
    return SchedulerStats(
        scheduler_id=f"sched-{replica}", replica_id=replica, timestamp=0.0, num_running=3,
        num_waiting=int(replica) + 1, routing=RoutingStats(model_name=model),
        engine=EngineStats(num_blocks_used=used, num_blocks_total=40, num_preemptions=2,
                           num_prefix_queries=queries, num_prefix_hits=hits),
        speculation=SpeculationStats(num_draft_tokens=drafts, num_accepted_drafts=kept,
                                     num_drafted_steps=drafts // 2,
                                     num_accepted_per_position=[kept - 1, 1]))


def fed() -> GatewayMetrics:
    """Two replicas (the second's stats twice: counters add the difference), and the
    timings of requests as the gateway records them."""
    metrics = GatewayMetrics()
    metrics.served_model_name = "smol"
    metrics.observe_scheduler(stats("0", "smol", used=10, queries=100, hits=40, drafts=8, kept=5))
    metrics.observe_scheduler(stats("1", "smol", used=4, queries=50, hits=0, drafts=4, kept=2))
    metrics.observe_scheduler(stats("1", "smol", used=30, queries=90, hits=20, drafts=10, kept=6))
    metrics.prompt_tokens.inc(17)
    metrics.requests_finished.labels("stop").inc(3)
    for seconds in (0.0005, 0.3, 7.0, 500.0):  # below the first bucket and above 480 s
        metrics.time_to_first_token.observe(seconds)
        metrics.e2e_latency.observe(seconds * 2)
        metrics.queue_time.observe(seconds / 2)
        metrics.inter_token_latency.observe(seconds / 10)
    return metrics


def scrape(metrics: GatewayMetrics) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, as a scraper parses /metrics."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for sample in family.samples}


def test_every_vllm_name_is_exposed_with_model_name():
    samples = scrape(fed())
    names = {name for name, _ in samples if name.startswith("vllm:")}
    assert EXPECTED <= names
    assert not [name for name in names if name.endswith("_created")]  # as vLLM: none
    for (name, labels), _ in samples.items():
        if name.startswith("vllm:"):
            assert dict(labels).get("model_name") == "smol", name


def test_each_vllm_series_equals_its_flotilla_figure():
    samples = scrape(fed())
    assert set(FLOTILLA_NAMES) == set(GATEWAY_FIGURES) | set(REPLICA_FIGURES)
    compared = 0
    for (name, labels), value in samples.items():
        family = next((f for f in FLOTILLA_NAMES if name.startswith(f + "_") or name == f), None)
        if family is None:
            continue
        plain = tuple(item for item in labels if item[0] != "model_name")
        assert samples[(FLOTILLA_NAMES[family] + name[len(family):], plain)] == value, name
        compared += 1
    assert compared > 100  # every bucket of four histograms, and the counters and gauges
    replica_1 = (("model_name", "smol"), ("replica_id", "1"), ("scheduler_id", "sched-1"))
    assert samples[("vllm:prefix_cache_queries_total", replica_1)] == 90
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", replica_1)] == 6
    assert samples[("vllm:num_requests_waiting", replica_1)] == 2
    assert samples[("vllm:prompt_tokens_total", (("model_name", "smol"),))] == 17
    assert samples[("vllm:time_to_first_token_seconds_count", (("model_name", "smol"),))] == 4


def test_kv_cache_usage_is_a_fraction_of_the_blocks():
    samples = scrape(fed())
    usage = {dict(labels)["replica_id"]: value for (name, labels), value in samples.items()
             if name == KV_USAGE}
    assert usage == {"0": 0.25, "1": 0.75}  # 10 and 30 of 40 blocks


def test_latency_buckets_span_a_millisecond_to_past_eight_minutes():
    samples = scrape(fed())
    for prefix in ("vllm:", "flotilla_"):
        for latency in LATENCIES:
            name = prefix + (latency if prefix == "vllm:" or latency != "request_queue_time_seconds"
                             else "queue_time_seconds") + "_bucket"
            bounds = sorted(float(dict(labels)["le"]) for n, labels in samples if n == name)
            finite = [b for b in bounds if not math.isinf(b)]
            assert finite[0] <= 0.001 and finite[-1] >= 480, name
    # 500 s lands in a finite bucket (960), not only in +Inf
    assert samples[("vllm:time_to_first_token_seconds_bucket",
                    (("le", "480.0"), ("model_name", "smol")))] == 3
    assert samples[("vllm:time_to_first_token_seconds_bucket",
                    (("le", "960.0"), ("model_name", "smol")))] == 4


def test_finished_sequences_are_counted_by_reason():
    metrics = GatewayMetrics()
    metrics.served_model_name = "smol"

    async def deltas(reason: str):
        yield Delta("a", 1)
        yield Delta("b", 1, finish_reason=reason)

    async def run(reason: str) -> None:
        stream = SimpleNamespace(first_token_at=None, wake_at_end=True)
        async for _ in _timed(deltas(reason), stream, metrics, 0.0):
            pass

    for reason in ("stop", "length", "stop"):
        asyncio.run(run(reason))
    samples = scrape(metrics)
    assert samples[("vllm:request_success_total",
                    (("finished_reason", "stop"), ("model_name", "smol")))] == 2
    assert samples[("vllm:request_success_total",
                    (("finished_reason", "length"), ("model_name", "smol")))] == 1
    assert samples[("vllm:generation_tokens_total", (("model_name", "smol"),))] == 6


def test_a_replica_labels_its_own_model_name():
    metrics = GatewayMetrics()  # the tokenizer not asked yet: the replica's name is used
    metrics.observe_scheduler(stats("0", "other", used=1, queries=0, hits=0, drafts=0, kept=1))
    samples = scrape(metrics)
    running = [dict(labels)["model_name"] for (name, labels) in samples
               if name == "vllm:num_requests_running"]
    assert running == ["other"]
    assert samples[("vllm:prompt_tokens_total", (("model_name", "other"),))] == 0
