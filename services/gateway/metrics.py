"""Prometheus metrics served on the gateway's /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.messages import SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("flotilla_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("flotilla_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("flotilla_generation_tokens", "Tokens generated", registry=r)
        self.time_to_first_token = Histogram(
            "flotilla_time_to_first_token_seconds", "Time from request to first token",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "flotilla_inter_token_latency_seconds", "Time between streamed tokens",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("flotilla_e2e_request_latency_seconds",
                                     "Time from request to last token", buckets=_LATENCY_BUCKETS,
                                     registry=r)
        labels = ["replica_id", "scheduler_id"]
        self.num_running = Gauge("flotilla_num_requests_running", "Requests in the running batch",
                                 labels, registry=r)
        self.num_waiting = Gauge("flotilla_num_requests_waiting", "Requests waiting to run",
                                 labels, registry=r)
        self.kv_blocks_used = Gauge("flotilla_kv_cache_blocks_used", "KV cache blocks in use",
                                    labels, registry=r)
        self.kv_blocks_total = Gauge("flotilla_kv_cache_blocks_total", "KV cache blocks",
                                     labels, registry=r)
        self.preemptions = Gauge("flotilla_num_preemptions", "Preemptions since the scheduler started",
                                 labels, registry=r)

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        labels = (stats.replica_id, stats.scheduler_id)
        self.num_running.labels(*labels).set(stats.num_running)
        self.num_waiting.labels(*labels).set(stats.num_waiting)
        self.kv_blocks_used.labels(*labels).set(stats.num_blocks_used)
        self.kv_blocks_total.labels(*labels).set(stats.num_blocks_total)
        self.preemptions.labels(*labels).set(stats.num_preemptions)

    def render(self) -> bytes:
        return generate_latest(self.registry)
