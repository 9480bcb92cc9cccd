"""vLLM's metric names on the gateway's /metrics, beside flotilla's own (docs/ARCHITECTURE.md,
Metrics): llm-d's endpoint picker, KServe and most dashboards and alert rules read these.
Each is made at scrape time from the flotilla family it mirrors, as /metrics is about to
serve it (summed over gateway processes where those are), so nothing is measured twice
and the two names cannot drift apart: renamed, with ``model_name`` added to its labels;
flotilla's own labels (replica_id, scheduler_id, position) stay on as extra labels."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from services.gateway.metrics import GatewayMetrics

# vLLM's name -> the flotilla family it mirrors
GATEWAY_FIGURES = {  # the gateway's request figures: labelled with the served model
    "vllm:prompt_tokens": "flotilla_prompt_tokens",
    "vllm:generation_tokens": "flotilla_generation_tokens",
    "vllm:request_success": "flotilla_requests_finished",
    "vllm:time_to_first_token_seconds": "flotilla_time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "flotilla_inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds": "flotilla_e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "flotilla_queue_time_seconds",
}
REPLICA_FIGURES = {  # each scheduler's figures: labelled with its replica's model
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
KV_USAGE = "vllm:kv_cache_usage_perc"


class VllmCollector:
    """Makes the vLLM-named copies of flotilla's families at each scrape."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def copies(self, families: dict[str, Metric]) -> Iterable[Metric]:
        served = self.metrics.model_name()
        for name, source in GATEWAY_FIGURES.items():
            if source in families:
                yield _renamed(families[source], name, lambda _: served)
        for name, source in REPLICA_FIGURES.items():
            if source in families:
                yield _renamed(families[source], name,
                               lambda labels: self.metrics.model_name(labels["scheduler_id"]))
        yield self._kv_usage(families)

    def _kv_usage(self, families: dict[str, Metric]) -> Metric:
        """Used over total KV blocks per replica, 0..1 as vLLM's (a cached block no
        request holds counts as free in both: it is evictable)."""
        usage = Metric(KV_USAGE, "KV-cache usage: the share of KV blocks in use (1: all)",
                       "gauge")
        totals = {tuple(sorted(s.labels.items())): s.value
                  for s in _samples(families, "flotilla_kv_cache_blocks_total")}
        for sample in _samples(families, "flotilla_kv_cache_blocks_used"):
            total = totals.get(tuple(sorted(sample.labels.items())), 0.0)
            usage.add_sample(KV_USAGE, {**sample.labels, "model_name": self.metrics.model_name(
                sample.labels["scheduler_id"])}, sample.value / total if total > 0 else 0.0)
        return usage


def _samples(families: dict[str, Metric], name: str) -> list:
    return list(families[name].samples) if name in families else []


def _renamed(family: Metric, name: str, model_of: Callable[[dict], str]) -> Metric:
    """``family`` under ``name``: each sample's name and labels rewritten (its suffix kept:
    _total, _bucket, _count, _sum; no _created, which vLLM turns off)."""
    copy = Metric(name, family.documentation, family.type)
    for sample in family.samples:
        if sample.name.endswith("_created"):
            continue
        copy.add_sample(name + sample.name[len(family.name):],
                        {**sample.labels, "model_name": model_of(sample.labels)}, sample.value)
    return copy
