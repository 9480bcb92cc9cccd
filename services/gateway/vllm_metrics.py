"""vLLM's metric names on the gateway's /metrics, beside flotilla's own (docs/ARCHITECTURE.md,
Metrics): llm-d's endpoint picker, KServe and most dashboards and alert rules read these.
Each is made at scrape time from the flotilla figure it mirrors (nothing is measured twice,
and the two names cannot drift apart), renamed, with ``model_name`` added to its labels;
flotilla's own labels (replica_id, scheduler_id, position) stay on as extra labels."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from services.gateway.metrics import GatewayMetrics

# vLLM's name -> the GatewayMetrics attribute holding the flotilla figure it mirrors
GATEWAY_FIGURES = {  # the gateway's request figures: labelled with the served model
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:request_success": "requests_finished",
    "vllm:time_to_first_token_seconds": "time_to_first_token",
    "vllm:inter_token_latency_seconds": "inter_token_latency",
    "vllm:e2e_request_latency_seconds": "e2e_latency",
    "vllm:request_queue_time_seconds": "queue_time",
}
REPLICA_FIGURES = {  # each scheduler's figures: labelled with its replica's model
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:spec_decode_num_drafts": "drafted_steps",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_drafts",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_position",
}
KV_USAGE = "vllm:kv_cache_usage_perc"


class VllmCollector:
    """Yields the vLLM-named copies of ``metrics``' figures at each scrape."""

    def __init__(self, metrics: GatewayMetrics, registry: CollectorRegistry) -> None:
        self.metrics = metrics
        registry.register(self)

    def describe(self) -> list:
        return []  # (names are not known before a collect: no registry-time check)

    def collect(self) -> Iterable[Metric]:
        served = self.metrics.model_name()
        for name, attribute in GATEWAY_FIGURES.items():
            yield from _renamed(getattr(self.metrics, attribute), name, lambda _: served)
        for name, attribute in REPLICA_FIGURES.items():
            yield from _renamed(getattr(self.metrics, attribute), name,
                                lambda labels: self.metrics.model_name(labels["scheduler_id"]))
        yield self._kv_usage()

    def _kv_usage(self) -> Metric:
        """Used over total KV blocks per replica, 0..1 as vLLM's (a cached block no
        request holds counts as free in both: it is evictable)."""
        usage = Metric(KV_USAGE, "KV-cache usage: the share of KV blocks in use (1: all)",
                       "gauge")
        totals = {tuple(sorted(s.labels.items())): s.value
                  for s in _samples(self.metrics.kv_blocks_total)}
        for sample in _samples(self.metrics.kv_blocks_used):
            total = totals.get(tuple(sorted(sample.labels.items())), 0.0)
            usage.add_sample(KV_USAGE, {**sample.labels, "model_name": self.metrics.model_name(
                sample.labels["scheduler_id"])}, sample.value / total if total > 0 else 0.0)
        return usage


def _samples(source) -> list:
    return [sample for family in source.collect() for sample in family.samples]


def _renamed(source, name: str, model_of: Callable[[dict], str]) -> Iterable[Metric]:
    """``source``'s families under ``name``: each sample's name and labels rewritten
    (its suffix kept: _total, _bucket, _count, _sum; no _created, which vLLM turns off)."""
    for family in source.collect():
        copy = Metric(name, family.documentation, family.type)
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            copy.add_sample(name + sample.name[len(family.name):],
                            {**sample.labels, "model_name": model_of(sample.labels)},
                            sample.value)
        yield copy
