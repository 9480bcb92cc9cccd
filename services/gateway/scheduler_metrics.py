"""Each scheduler's figures on the gateway's /metrics, from its stats events: queue and
batch sizes, KV blocks, prefix-cache, speculation, encoder and MoE counts, LoRA adapters.

Every gateway process hears every scheduler's stats, so each holds the whole of these
figures: they are served by whichever process takes the scrape and never summed over
processes (prometheus_client's multiprocess files hold only the gateway's own figures,
metrics.py). Plain Python state yielded at scrape time, so none of it lands in those files."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from shared.scheduler_stats import SchedulerStats

LABELS = ["replica_id", "scheduler_id"]

# name -> (help, the value in a stats event; None: keep the last one)
GAUGES: dict[str, tuple[str, Callable[[SchedulerStats], float | None]]] = {
    "flotilla_num_requests_running": ("Requests in the running batch", lambda s: s.num_running),
    "flotilla_num_requests_waiting": ("Requests waiting to run", lambda s: s.num_waiting),
    "flotilla_kv_cache_blocks_used": ("KV cache blocks in use",
                                      lambda s: s.engine.num_blocks_used),
    "flotilla_kv_cache_blocks_total": ("KV cache blocks", lambda s: s.engine.num_blocks_total),
    "flotilla_worker_idle_ratio": (
        "Idle share of the worker's time over the last stats interval with work throughout",
        lambda s: s.engine.worker_idle_ratio if s.engine.worker_idle_ratio >= 0 else None),
    "flotilla_spec_decode_draft_cap": (
        "Drafts a request could get in the last step planned (the load-adaptive cap, 0 to "
        "num_speculative_tokens)",
        lambda s: s.speculation.draft_cap if s.speculation.draft_cap >= 0 else None),
    "flotilla_lora_adapters": ("LoRA adapters registered on a replica",
                               lambda s: len(s.lora.adapters) if s.lora.max_loras else None),
}
# name -> (help, part of the stats, its cumulative field)
COUNTERS = {
    "flotilla_preemptions": ("Requests preempted", "engine", "num_preemptions"),
    "flotilla_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", "engine",
                                      "num_prefix_queries"),
    "flotilla_prefix_cache_hits": ("Prompt tokens found in the prefix cache", "engine",
                                   "num_prefix_hits"),
    "flotilla_prefix_cache_tier_hits": ("Prompt tokens loaded from the kvstore's tiers instead "
                                        "of computed", "engine", "num_kv_tier_hits"),
    "flotilla_spec_decode_draft_tokens": ("Speculative drafts sent to be verified",
                                          "speculation", "num_draft_tokens"),
    "flotilla_spec_decode_accepted_tokens": ("Speculative drafts kept (acceptance rate: over "
                                             "the draft tokens)", "speculation",
                                             "num_accepted_drafts"),
    "flotilla_spec_decode_drafts": ("Verify passes of a request with drafts (mean accepted "
                                    "length: accepted tokens over these)", "speculation",
                                    "num_drafted_steps"),
    "flotilla_encoder_images": ("Images run through the vision encoder", "engine",
                                "num_images_encoded"),
    "flotilla_encoder_cache_hits": ("Images whose encoder output the worker's cache held (no "
                                    "encode)", "engine", "num_encoder_cache_hits"),
    "flotilla_encoder_seconds": ("Time the worker spent in the vision encoder", "engine",
                                 "encoder_time_s"),
    "flotilla_worker_busy_seconds": ("Time the worker spent computing steps", "engine",
                                     "worker_busy_s"),
}
PER_POSITION = "flotilla_spec_decode_accepted_tokens_per_pos"
MOE_ROUTED = "flotilla_moe_routed_tokens"
LORA_INFO = "vllm:lora_requests_info"


def _added(value: float, before: float) -> float:
    """What a cumulative count gained; it starts over when its scheduler re-attaches a worker."""
    return value - before if value >= before else value


class SchedulerFigures:
    """The figures above, per (replica, scheduler), from the latest stats of each."""

    def __init__(self) -> None:
        self.last: dict[str, SchedulerStats] = {}  # scheduler id -> its latest stats
        self._gauges: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in GAUGES}
        # counts carried on over a scheduler's restarts of its counts
        self._counts: dict[str, dict[tuple[str, ...], float]] = {
            name: {} for name in (*COUNTERS, PER_POSITION, MOE_ROUTED)}

    def observe(self, stats: SchedulerStats) -> None:
        labels = (stats.replica_id, stats.scheduler_id)
        for name, (_, value_of) in GAUGES.items():
            value = value_of(stats)
            if value is not None:
                self._gauges[name][labels] = value
        last = self.last.get(stats.scheduler_id)
        for name, (_, part, field) in COUNTERS.items():
            value = getattr(getattr(stats, part), field)
            before = getattr(getattr(last, part), field) if last is not None else 0
            self._add(name, labels, _added(value, before))
        before = last.speculation.num_accepted_per_position if last is not None else []
        for position, value in enumerate(stats.speculation.num_accepted_per_position):
            previous = before[position] if position < len(before) else 0
            self._add(PER_POSITION, (*labels, str(position)), _added(value, previous))
        routed = sum(map(sum, stats.moe.expert_token_counts))
        if routed:  # (a dense replica gets no series)
            before = sum(map(sum, last.moe.expert_token_counts)) if last is not None else 0
            self._add(MOE_ROUTED, labels, _added(routed, before))
        self.last[stats.scheduler_id] = stats

    def _add(self, name: str, labels: tuple[str, ...], amount: float) -> None:
        counts = self._counts[name]
        counts[labels] = counts.get(labels, 0.0) + amount

    def collect(self) -> Iterable[Metric]:
        for name, (documentation, _) in GAUGES.items():
            family = GaugeMetricFamily(name, documentation, labels=LABELS)
            for labels, value in self._gauges[name].items():
                family.add_metric(labels, value)
            yield family
        helps = {name: documentation for name, (documentation, _, _) in COUNTERS.items()}
        helps[PER_POSITION] = ("Drafts kept at each position (acceptance at a position: over "
                               "the drafts)")
        helps[MOE_ROUTED] = ("Token-expert pairs a MoE replica routed, all layers (a token "
                             "picks top-k experts in each MoE layer)")
        for name, documentation in helps.items():
            extra = ["position"] if name == PER_POSITION else []
            family = CounterMetricFamily(name, documentation, labels=[*LABELS, *extra])
            for labels, value in self._counts[name].items():
                family.add_metric(labels, value)
            yield family
        yield self._lora_info()

    def _lora_info(self) -> Metric:
        """vLLM's shape: one sample, the adapters running and waiting on any replica in its
        labels, the newest stats' time as its value; none while no replica has LoRA on."""
        family = GaugeMetricFamily(LORA_INFO, "Running stats on LoRA requests", labels=[
            "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        replicas = [stats for stats in self.last.values() if stats.lora.max_loras]
        if replicas:
            newest = max(replicas, key=lambda stats: stats.timestamp)
            running = sorted({name for stats in replicas for name in stats.lora.running})
            waiting = sorted({name for stats in replicas for name in stats.lora.waiting})
            family.add_metric([str(newest.lora.max_loras), ",".join(running), ",".join(waiting)],
                              newest.timestamp)
        return family
