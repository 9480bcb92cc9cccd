"""Prometheus metrics served on the gateway's /metrics: the gateway's own figures (its
requests' counts and timings, routing), and each scheduler's figures from its stats events
(scheduler_metrics.py), with vLLM's names beside them (vllm_metrics.py).

Several gateway processes on one port (``flotilla serve --gateway-workers N``) share a
folder named by PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode): each
writes its own figures there and a scrape of any of them sums every process's, the exited
ones' included (their requests happened). What every process hears alike (the schedulers'
stats) is not summed: each serves its own copy, or one process counts it (``fleet_metrics``)."""

from __future__ import annotations

import bisect
import math
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString

from services.gateway.block_index import BlockIndex
from services.gateway.expert_load import ExpertLoadCollector
from services.gateway.routing import Decision
from services.gateway.scheduler_metrics import SchedulerFigures
from services.gateway.vllm_metrics import VllmCollector
from shared.scheduler_stats import SchedulerStats

# 1 ms to 16 min: a request queued behind long ones, or a long generation, still lands
# below +Inf (vLLM's users hit caps at 60 s, vllm#15202, and everything in one bucket, #6337)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 480.0, 960.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def multiprocess() -> bool:
    """prometheus_client's multiprocess mode is on (PROMETHEUS_MULTIPROC_DIR was set when it
    was imported): values live in per-process files of that folder."""
    return bool(getattr(values.ValueClass, "_multiprocess", False))


class ChunkHistogram:
    """A histogram for what is observed once per streamed chunk (three observations a
    chunk). prometheus_client's Histogram takes 0.8-1.3 µs an observation on the 2-core
    CPU (a lock and two locked adds; 3.4 µs in multiprocess mode), this one 0.16-0.2 µs
    (timeit; the command is in issue 27's notes): it counts in plain lists and hands
    prometheus_client the family when scraped, and in multiprocess mode its new counts at
    each flush(). Only the gateway's event loop touches it, so it needs no lock."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.bounds = name, documentation, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0
        self._flushed = ([0] * len(self.counts), 0.0)
        # the multiprocess file's values, as prometheus_client's Histogram makes them
        les = [floatToGoString(bound) for bound in (*buckets, math.inf)]
        self._shared = ([values.ValueClass("histogram", name, name + "_bucket", ("le",), (le,),
                                           documentation) for le in les],
                        values.ValueClass("histogram", name, name + "_sum", (), (),
                                          documentation)) if multiprocess() else None
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # (le: bound >= value)
        self.sum += value

    def flush(self) -> None:
        if self._shared is None:
            return
        (buckets, total), (flushed, flushed_sum) = self._shared, self._flushed
        for index, count in enumerate(self.counts):
            if count != flushed[index]:
                buckets[index].inc(count - flushed[index])
        if self.sum != flushed_sum:
            total.inc(self.sum - flushed_sum)
        self._flushed = (list(self.counts), self.sum)

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric([], buckets, self.sum)
        yield family


class ProcessFigures:
    """This process's own state, read when scraped: flotilla serve's restart counts and
    the routing index's blocks (every process keeps an index of its own)."""

    def __init__(self) -> None:
        self.restarts: dict[str, int] = {}
        self.index: BlockIndex | None = None

    def collect(self):
        restarts = GaugeMetricFamily("flotilla_service_restarts", "Times flotilla serve "
                                     "restarted each service it runs", labels=["service"])
        for service, count in self.restarts.items():
            restarts.add_metric([service], count)
        blocks = GaugeMetricFamily(
            "flotilla_routing_index_blocks", "Blocks in the routing index: gpu (distinct "
            "blocks held by some replica) and kvstore (distinct blocks in some node's tiers)",
            labels=["tier"])
        if self.index is not None:
            blocks.add_metric(["gpu"], self.index.num_gpu_blocks())
            blocks.add_metric(["kvstore"], self.index.num_tier_blocks())
        yield from (restarts, blocks)


class _Exposed:
    """What /metrics serves: flotilla's figures from ``source``, then their vLLM copies."""

    def __init__(self, source: CollectorRegistry, vllm: VllmCollector) -> None:
        self.source, self.vllm = source, vllm

    def collect(self):
        families = list(self.source.collect())
        yield from families
        yield from self.vllm.copies({family.name: family for family in families})


class GatewayMetrics:
    def __init__(self, fleet_metrics: bool = True) -> None:
        self.fleet_metrics = fleet_metrics  # count the step histograms and replacements
        self.figures = figures = CollectorRegistry()  # this process's, in prometheus_client
        # registered in this order, which is /metrics' order
        self._add_fleet_metrics(figures)
        self._add_request_metrics(figures)
        self._add_step_metrics(figures)
        self._chunk_histograms = [self.inter_token_latency, self.tokens_per_chunk,
                                  self.output_delivery]
        self.scheduler = SchedulerFigures()
        self.expert_load = ExpertLoadCollector(None)  # flotilla_moe_expert_load{,_max}
        self._process = ProcessFigures()
        self.served_model_name = ""  # the tokenizer's, once the gateway has asked it
        source = CollectorRegistry()  # flotilla's names: summed files, or this process's
        if multiprocess():
            MultiProcessCollector(source)
        else:
            source.register(figures)
        for local in (self.scheduler, self.expert_load, self._process):
            source.register(local)
        self.registry = CollectorRegistry()  # what /metrics serves
        self.registry.register(_Exposed(source, VllmCollector(self)))

    def model_name(self, scheduler_id: str | None = None) -> str:
        """vLLM's ``model_name`` label: a replica's served model name as its stats say,
        else the gateway's (one model per fleet: the two agree)."""
        last = self.scheduler.last
        stats = last.get(scheduler_id) if scheduler_id is not None else None
        if stats is not None and stats.routing.model_name:
            return stats.routing.model_name
        if self.served_model_name or not last:
            return self.served_model_name
        return next(iter(last.values())).routing.model_name

    def _add_fleet_metrics(self, r: CollectorRegistry) -> None:
        """Requests by outcome, migrations, routing and LoRA requests."""
        self.requests = Counter("flotilla_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter("flotilla_requests_rejected",
                                "Requests refused before running, by reason (queue_full: 429)",
                                ["reason"], registry=r)
        self.migrations = Counter("flotilla_request_migrations",
                                  "Requests moved to another replica after theirs died, by "
                                  "outcome (resumed, failed: no live replica in time)",
                                  ["outcome"], registry=r)
        self.routing_decisions = Counter(
            "flotilla_routing_decisions", "Replica choices by policy and reason (cache, session, "
            "load, saturated, turn; docs/routing.md)", ["policy", "reason"], registry=r)
        self.routing_hit_tokens = Counter(
            "flotilla_routing_expected_hit_tokens",
            "Prompt tokens the chosen replica was expected to find cached, by tier",
            ["tier"], registry=r)
        self.routing_snapshots = Counter(
            "flotilla_routing_block_snapshots", "Block snapshots fetched for the routing "
            "index, by outcome: a scheduler's loaded, failed; a kvstore's kv_loaded, kv_failed, "
            "kv_stale (its node moved to a restarted kvstore meanwhile)", ["outcome"], registry=r)
        self.lora_requests = Counter("flotilla_lora_requests",
                                     "Requests for each LoRA adapter", ["lora_name"], registry=r)
        self.lora_prompt_tokens = Counter("flotilla_lora_prompt_tokens",
                                          "Prompt tokens of requests for each LoRA adapter",
                                          ["lora_name"], registry=r)
        self.lora_generation_tokens = Counter(
            "flotilla_lora_generation_tokens", "Tokens generated with each LoRA adapter",
            ["lora_name"], registry=r)

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """Token counts and the latencies of this gateway's requests."""
        self.prompt_tokens = Counter("flotilla_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("flotilla_generation_tokens", "Tokens generated", registry=r)
        self.requests_finished = Counter(
            "flotilla_requests_finished", "Sequences ended, by finish reason (stop, length, "
            "abort, error; a request with n > 1 ends n)", ["finished_reason"], registry=r)
        self.time_to_first_token = self._latency("flotilla_time_to_first_token_seconds",
                                                 "Time from request to first token")
        # once per streamed chunk: the cheaper histograms
        self.inter_token_latency = ChunkHistogram(
            "flotilla_inter_token_latency_seconds", "Time between streamed tokens",
            _LATENCY_BUCKETS, r)
        self.tokens_per_chunk = ChunkHistogram(
            "flotilla_stream_tokens_per_chunk", "Tokens in each streamed chunk (more than one: "
            "steps' outputs merged while the client's writer was busy)", _TOKEN_BUCKETS, r)
        self.output_delivery = ChunkHistogram(
            "flotilla_output_delivery_seconds", "From the scheduler publishing a step's output "
            "to the gateway writing it to the stream (its newest token in a merged chunk)",
            _LATENCY_BUCKETS, r)
        self.e2e_latency = self._latency("flotilla_e2e_request_latency_seconds",
                                         "Time from request to last token")
        self.queue_time = self._latency("flotilla_queue_time_seconds",
                                        "Time from arrival at the scheduler to first scheduled")
        self.image_preprocess_time = self._latency(
            "flotilla_image_preprocess_seconds", "Time a request with images waited on the "
            "tokenizer tier (decode, resize, tile, normalize; the round trip from this gateway)")

    def _add_step_metrics(self, r: CollectorRegistry) -> None:
        """The schedulers' recent steps, and replaced schedulers: figures every gateway hears
        alike but can only count from when it started, so with several processes one of them
        counts them (``fleet_metrics``) into the summed files."""
        self.step_tokens = Histogram("flotilla_scheduled_tokens_per_step", "Tokens computed per step",
                                     buckets=_TOKEN_BUCKETS, registry=r)
        self.step_time = self._latency("flotilla_step_time_seconds", "Worker time per step")
        self.replica_restarts = Counter("flotilla_scheduler_replacements",
                                        "Schedulers seen replaced by a new instance, by replica",
                                        ["replica_id"], registry=r)

    def observe_chunk(self, num_tokens: int, published_at: float) -> None:
        """A streamed chunk is being written: its size, and its lag behind the scheduler."""
        self.tokens_per_chunk.observe(num_tokens)
        if published_at:
            self.output_delivery.observe(max(0.0, time.time() - published_at))

    def observe_routing(self, decision: Decision) -> None:
        self.routing_decisions.labels(decision.policy, decision.reason).inc()
        for tier, num_tokens in decision.hit_tokens.items():
            self.routing_hit_tokens.labels(tier).inc(num_tokens)

    def watch_block_index(self, index: BlockIndex) -> None:
        self._process.index = index

    def _latency(self, name: str, text: str) -> Histogram:
        return Histogram(name, text, buckets=_LATENCY_BUCKETS, registry=self.figures)

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        """A scheduler's stats: its figures (scheduler_metrics.py), expert load and steps."""
        self.scheduler.observe(stats)
        self.expert_load.observe(stats)
        if self.fleet_metrics:
            for num_tokens, seconds in zip(stats.engine.recent_step_tokens,
                                           stats.engine.recent_step_times_s):
                self.step_tokens.observe(num_tokens)
                self.step_time.observe(seconds)

    def replaced(self, replica_id: str) -> None:
        if self.fleet_metrics:
            self.replica_restarts.labels(replica_id).inc()

    def flush(self) -> None:
        """Hand the per-chunk counts to the multiprocess files (every second, and before a
        scrape: the other processes' scrapes read them there)."""
        for histogram in self._chunk_histograms:
            histogram.flush()

    def render(self, restarts: dict[str, int] | None = None) -> bytes:
        self._process.restarts.update(restarts or {})
        self.flush()
        return generate_latest(self.registry)
