"""What each scheduler publishes about itself (``SchedulerStats``, after steps, throttled,
and as a heartbeat), split by who reads it: the heartbeat at the top (the gateways'
replica table and readiness, the container probe), ``routing`` (the gateways' KV-aware
routing, docs/routing.md), ``engine``, ``speculation`` and ``moe`` (the gateway's
/metrics).
Messages like the rest of the wire contract (shared/messages.py encodes them).
"""

from __future__ import annotations

import msgspec
from msgspec import Struct

from shared.lora_adapters import LoraRef


class RoutingStats(Struct, frozen=True, kw_only=True):
    """What the gateway's KV-aware routing needs: how this replica keys its blocks
    (block_size, the served model name of the "model:" key), where its tiers below the GPU
    are (its worker's kvstore; "" for none), the prefill it has queued and its measured
    speeds (0: not measured yet)."""

    block_size: int = 0
    model_name: str = ""
    kv_node_id: str = ""
    kv_namespace: str = ""
    num_queued_prefill_tokens: int = 0  # prompt tokens of waiting and still-prefilling requests
    prefill_tokens_per_s: float = 0.0
    host_load_bytes_per_s: float = 0.0
    disk_read_bytes_per_s: float = 0.0
    block_bytes: int = 0  # KV bytes of one block
    block_event_seq: int = 0  # the last SchedulerBlockEvent seq published (0: none yet)
    # what one more decoding sequence adds to each step, in prompt tokens' compute (the
    # slope of decode-only step time over batch size x prefill speed; 0: not measured yet)
    decode_seq_cost_tokens: float = 0.0


class EngineStats(Struct, frozen=True, kw_only=True):
    """The engine's figures for /metrics: its cache, and counts cumulative since the
    scheduler started (they start over when it re-attaches a worker)."""

    num_blocks_used: int = 0
    num_blocks_total: int = 0
    num_preemptions: int = 0
    num_prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_hits: int = 0  # of those, tokens found
    # prompt tokens loaded from the kvstore instead of computed (also counted in each
    # request's num_cached_tokens, not in num_prefix_hits), in all and by the tier each
    # block was found in ("host", "disk")
    num_kv_tier_hits: int = 0
    num_kv_tier_hits_by_tier: dict[str, int] = {}
    worker_busy_s: float = 0.0  # time the worker spent computing steps
    # the vision encoder (docs/vision.md): images encoded, images its cache served, seconds
    num_images_encoded: int = 0
    num_encoder_cache_hits: int = 0
    encoder_time_s: float = 0.0
    # idle share of the worker's wall time over the last interval with work throughout;
    # -1 when there was no such interval
    worker_idle_ratio: float = -1.0
    # steps since the previous stats event (bounded sample)
    recent_step_tokens: list[int] = []
    recent_step_times_s: list[float] = []


class SpeculationStats(Struct, frozen=True, kw_only=True):
    """Speculative decoding's figures for /metrics, cumulative: drafts sent to be verified,
    and of those kept."""

    num_draft_tokens: int = 0
    num_accepted_drafts: int = 0
    num_drafted_steps: int = 0  # a request's verify passes
    num_accepted_per_position: list[int] = []  # [i]: drafts kept at position i
    draft_cap: int = -1  # the drafts a request could get in the last step planned; -1: none


class MoeStats(Struct, frozen=True, kw_only=True):
    """A Mixture-of-Experts model's routing for /metrics (expert load balance), cumulative
    since the scheduler attached its worker: [sparse layer][global expert id] -> tokens
    routed there; [] for a dense model or before the worker's first report."""

    expert_token_counts: list[list[int]] = []


class LoraStats(Struct, frozen=True, kw_only=True):
    """LoRA adapters (docs/lora.md): those registered on this replica (what a request's
    ``model`` may name; the gateway's /v1/models and prefix-cache keys), the adapters of
    its running and waiting requests (vLLM's lora_requests_info) and its slot count
    (0: LoRA off)."""

    adapters: list[LoraRef] = []
    running: list[str] = []
    waiting: list[str] = []
    max_loras: int = 0


class SchedulerStats(Struct, frozen=True, kw_only=True):
    """Published by each scheduler after steps (throttled) and as a heartbeat: the fields
    at the top are the heartbeat's, each part has its reader."""

    scheduler_id: str
    replica_id: str
    timestamp: float
    worker_ready: bool = True  # a worker attached and not draining (else routed around)
    num_running: int = 0
    num_waiting: int = 0
    num_steps: int = 0  # steps taken (the gateway's stall check: it moves while work is held)
    routing: RoutingStats = msgspec.field(default_factory=RoutingStats)
    engine: EngineStats = msgspec.field(default_factory=EngineStats)
    speculation: SpeculationStats = msgspec.field(default_factory=SpeculationStats)
    moe: MoeStats = msgspec.field(default_factory=MoeStats)
    lora: LoraStats = msgspec.field(default_factory=LoraStats)


STATS_MESSAGES: tuple[type[Struct], ...] = (
    RoutingStats, EngineStats, SpeculationStats, MoeStats, LoraStats, SchedulerStats)
