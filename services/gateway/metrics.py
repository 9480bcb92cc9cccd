"""Prometheus metrics served on the gateway's /metrics: the gateway's own request
timings, and each scheduler's figures from its stats events."""

from __future__ import annotations

import time

import bisect
import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from services.gateway.block_index import BlockIndex
from services.gateway.expert_load import ExpertLoadCollector
from services.gateway.routing import Decision
from services.gateway.vllm_metrics import VllmCollector
from shared.scheduler_stats import SchedulerStats

# 1 ms to 16 min: a request queued behind long ones, or a long generation, still lands
# below +Inf (vLLM's users hit caps at 60 s, vllm#15202, and everything in one bucket, #6337)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 480.0, 960.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ChunkHistogram:
    """A histogram for what is observed once per streamed chunk (three observations a
    chunk). prometheus_client's Histogram takes 0.8-1.3 µs an observation on the 2-core
    CPU (a lock and two locked adds), this one 0.16-0.2 µs (timeit; the command is in
    issue 27's notes): it counts in plain lists and hands prometheus_client the family when
    scraped. Only the gateway's event loop touches it, so it needs no lock."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.bounds = name, documentation, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # (le: bound >= value)
        self.sum += value

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric([], buckets, self.sum)
        yield family


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # registered in this order, which is /metrics' order
        self._add_fleet_metrics(self.registry)
        self._add_request_metrics(self.registry)
        self._add_scheduler_metrics(self.registry)
        self._add_lora_metrics(self.registry)
        self._last: dict[str, SchedulerStats] = {}
        self.served_model_name = ""  # the tokenizer's, once the gateway has asked it
        VllmCollector(self, self.registry)  # vllm:* copies of the figures above, last

    def model_name(self, scheduler_id: str | None = None) -> str:
        """vLLM's ``model_name`` label: a replica's served model name as its stats say,
        else the gateway's (one model per fleet: the two agree)."""
        last = self._last.get(scheduler_id) if scheduler_id is not None else None
        if last is not None and last.routing.model_name:
            return last.routing.model_name
        if self.served_model_name or not self._last:
            return self.served_model_name
        return next(iter(self._last.values())).routing.model_name

    def _add_fleet_metrics(self, r: CollectorRegistry) -> None:
        """Requests by outcome, restarts and migrations, and routing."""
        self.requests = Counter("flotilla_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter("flotilla_requests_rejected",
                                "Requests refused before running, by reason (queue_full: 429)",
                                ["reason"], registry=r)
        self.migrations = Counter("flotilla_request_migrations",
                                  "Requests moved to another replica after theirs died, by "
                                  "outcome (resumed, failed: no live replica in time)",
                                  ["outcome"], registry=r)
        self.service_restarts = Gauge("flotilla_service_restarts",
                                      "Times flotilla serve restarted each service it runs",
                                      ["service"], registry=r)
        self.replica_restarts = Counter("flotilla_scheduler_replacements",
                                        "Schedulers seen replaced by a new instance, by replica",
                                        ["replica_id"], registry=r)
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
        self.routing_index_blocks = Gauge(
            "flotilla_routing_index_blocks", "Blocks in the routing index: gpu (distinct "
            "blocks held by some replica) and kvstore (distinct blocks in some node's tiers)",
            ["tier"], registry=r)

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

    def _add_scheduler_metrics(self, r: CollectorRegistry) -> None:
        """Each scheduler's figures, from its stats events."""
        labels = ["replica_id", "scheduler_id"]
        self.num_running = Gauge("flotilla_num_requests_running", "Requests in the running batch",
                                 labels, registry=r)
        self.num_waiting = Gauge("flotilla_num_requests_waiting", "Requests waiting to run",
                                 labels, registry=r)
        self.kv_blocks_used = Gauge("flotilla_kv_cache_blocks_used", "KV cache blocks in use",
                                    labels, registry=r)
        self.kv_blocks_total = Gauge("flotilla_kv_cache_blocks_total", "KV cache blocks",
                                     labels, registry=r)
        self.preemptions = Counter("flotilla_preemptions", "Requests preempted", labels, registry=r)
        self.prefix_queries = Counter("flotilla_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", labels, registry=r)
        self.prefix_hits = Counter("flotilla_prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache", labels, registry=r)
        self.kv_tier_hits = Counter("flotilla_prefix_cache_tier_hits",
                                    "Prompt tokens loaded from the kvstore's tiers instead of "
                                    "computed", labels, registry=r)
        self.draft_tokens = Counter("flotilla_spec_decode_draft_tokens",
                                    "Speculative drafts sent to be verified", labels, registry=r)
        self.accepted_drafts = Counter("flotilla_spec_decode_accepted_tokens",
                                       "Speculative drafts kept (acceptance rate: over the "
                                       "draft tokens)", labels, registry=r)
        self.drafted_steps = Counter("flotilla_spec_decode_drafts",
                                     "Verify passes of a request with drafts (mean accepted "
                                     "length: accepted tokens over these)", labels, registry=r)
        self.accepted_per_position = Counter(
            "flotilla_spec_decode_accepted_tokens_per_pos",
            "Drafts kept at each position (acceptance at a position: over the drafts)",
            (*labels, "position"), registry=r)
        self.draft_cap = Gauge("flotilla_spec_decode_draft_cap",
                               "Drafts a request could get in the last step planned (the "
                               "load-adaptive cap, 0 to num_speculative_tokens)", labels,
                               registry=r)
        self.images_encoded = Counter("flotilla_encoder_images",
                                      "Images run through the vision encoder", labels,
                                      registry=r)
        self.encoder_cache_hits = Counter(
            "flotilla_encoder_cache_hits",
            "Images whose encoder output the worker's cache held (no encode)", labels,
            registry=r)
        self.encoder_time = Counter("flotilla_encoder_seconds",
                                    "Time the worker spent in the vision encoder", labels,
                                    registry=r)
        self.worker_busy = Counter("flotilla_worker_busy_seconds",
                                   "Time the worker spent computing steps", labels, registry=r)
        self.worker_idle_ratio = Gauge(
            "flotilla_worker_idle_ratio",
            "Idle share of the worker's time over the last stats interval with work throughout",
            labels, registry=r)
        self.step_tokens = Histogram("flotilla_scheduled_tokens_per_step", "Tokens computed per step",
                                     buckets=_TOKEN_BUCKETS, registry=r)
        self.step_time = self._latency("flotilla_step_time_seconds", "Worker time per step")
        self.moe_routed_tokens = Counter(
            "flotilla_moe_routed_tokens", "Token-expert pairs a MoE replica routed, all "
            "layers (a token picks top-k experts in each MoE layer)", labels, registry=r)
        self.expert_load = ExpertLoadCollector(r)  # flotilla_moe_expert_load{,_max}

    def _add_lora_metrics(self, r: CollectorRegistry) -> None:
        """LoRA adapters (docs/lora.md): requests and tokens by adapter (this gateway's),
        adapters registered on each replica, and vLLM's lora_requests_info."""
        self.lora_requests = Counter("flotilla_lora_requests",
                                     "Requests for each LoRA adapter", ["lora_name"], registry=r)
        self.lora_prompt_tokens = Counter("flotilla_lora_prompt_tokens",
                                          "Prompt tokens of requests for each LoRA adapter",
                                          ["lora_name"], registry=r)
        self.lora_generation_tokens = Counter(
            "flotilla_lora_generation_tokens", "Tokens generated with each LoRA adapter",
            ["lora_name"], registry=r)
        self.lora_adapters = Gauge("flotilla_lora_adapters",
                                   "LoRA adapters registered on a replica",
                                   ["replica_id", "scheduler_id"], registry=r)
        # vLLM's shape: one sample, the adapters in its labels, the time as its value
        self.lora_requests_info = Gauge(
            "vllm:lora_requests_info", "Running stats on LoRA requests",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)

    def _observe_lora(self, stats: SchedulerStats) -> None:
        lora = stats.lora
        if not lora.max_loras:
            return  # (LoRA off on that replica: no series)
        self.lora_adapters.labels(stats.replica_id, stats.scheduler_id).set(len(lora.adapters))
        replicas = [*(s for sid, s in self._last.items() if sid != stats.scheduler_id), stats]
        running = sorted({name for s in replicas for name in s.lora.running})
        waiting = sorted({name for s in replicas for name in s.lora.waiting})
        self.lora_requests_info.clear()
        self.lora_requests_info.labels(str(lora.max_loras), ",".join(running),
                                       ",".join(waiting)).set(stats.timestamp)

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
        self.routing_index_blocks.labels("gpu").set_function(index.num_gpu_blocks)
        self.routing_index_blocks.labels("kvstore").set_function(index.num_tier_blocks)

    def _latency(self, name: str, text: str) -> Histogram:
        return Histogram(name, text, buckets=_LATENCY_BUCKETS, registry=self.registry)

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        """A scheduler's stats: its heartbeat's load, and the parts made for /metrics
        (``engine``, ``speculation``, ``moe``)."""
        labels = (stats.replica_id, stats.scheduler_id)
        engine, speculation = stats.engine, stats.speculation
        self.num_running.labels(*labels).set(stats.num_running)
        self.num_waiting.labels(*labels).set(stats.num_waiting)
        self.kv_blocks_used.labels(*labels).set(engine.num_blocks_used)
        self.kv_blocks_total.labels(*labels).set(engine.num_blocks_total)
        if engine.worker_idle_ratio >= 0:
            self.worker_idle_ratio.labels(*labels).set(engine.worker_idle_ratio)
        if speculation.draft_cap >= 0:
            self.draft_cap.labels(*labels).set(speculation.draft_cap)
        last = self._last.get(stats.scheduler_id)
        for counter, part, field in (
                (self.preemptions, "engine", "num_preemptions"),
                (self.prefix_queries, "engine", "num_prefix_queries"),
                (self.prefix_hits, "engine", "num_prefix_hits"),
                (self.kv_tier_hits, "engine", "num_kv_tier_hits"),
                (self.worker_busy, "engine", "worker_busy_s"),
                (self.images_encoded, "engine", "num_images_encoded"),
                (self.encoder_cache_hits, "engine", "num_encoder_cache_hits"),
                (self.encoder_time, "engine", "encoder_time_s"),
                (self.draft_tokens, "speculation", "num_draft_tokens"),
                (self.accepted_drafts, "speculation", "num_accepted_drafts"),
                (self.drafted_steps, "speculation", "num_drafted_steps")):
            value = getattr(getattr(stats, part), field)
            before = getattr(getattr(last, part), field) if last is not None else 0
            # cumulative on the scheduler; it starts over when it re-attaches a worker
            counter.labels(*labels).inc(value - before if value >= before else value)
        before = last.speculation.num_accepted_per_position if last is not None else []
        for position, value in enumerate(speculation.num_accepted_per_position):
            previous = before[position] if position < len(before) else 0
            self.accepted_per_position.labels(*labels, str(position)).inc(
                value - previous if value >= previous else value)
        self._observe_moe(stats, last)
        self._observe_lora(stats)
        self._last[stats.scheduler_id] = stats
        for num_tokens, seconds in zip(engine.recent_step_tokens, engine.recent_step_times_s):
            self.step_tokens.observe(num_tokens)
            self.step_time.observe(seconds)

    def _observe_moe(self, stats: SchedulerStats, last: SchedulerStats | None) -> None:
        """A MoE replica's routing: the routed pairs counted on, the balance replaced."""
        self.expert_load.observe(stats)
        routed = sum(map(sum, stats.moe.expert_token_counts))
        before = sum(map(sum, last.moe.expert_token_counts)) if last is not None else 0
        if routed:  # (a dense replica gets no series)
            # cumulative on the scheduler; it starts over when it re-attaches a worker
            self.moe_routed_tokens.labels(stats.replica_id, stats.scheduler_id).inc(
                routed - before if routed >= before else routed)

    def render(self, restarts: dict[str, int] | None = None) -> bytes:
        for service, count in (restarts or {}).items():
            self.service_restarts.labels(service).set(count)
        return generate_latest(self.registry)
