"""Which replica gets a request (docs/routing.md): pure, synchronous policy code.

- ``least-loaded``: the replica with the fewest requests (running + waiting from its
  stats, or this gateway's own count of requests there, whichever is larger).
- ``round-robin``: the ready replicas in turn.
- ``kv`` (the default): the replica expected to serve the request soonest. For each ready
  replica, from the block index (block_index.py):

      seconds = tokens to compute / prefill speed
              + host hits x block bytes / host load speed
              + disk hits x block bytes x (1 / disk read speed + 1 / host load speed)
              + queued prefill tokens / prefill speed
              + load x decode cost x (1 + output tokens) / prefill speed

  The last term is the replica's other requests sharing every step of this one, its
  prefill and each of its decode steps (output tokens: the request's max_tokens, or the
  mean output of this gateway's finished requests if smaller). It is what makes a short
  cached prefix on a busier replica lose to an idle replica: a hit saves its tokens once,
  one more stream costs the decode cost (below) on each of the request's steps.

  Hits count only as a leading run of the prompt's blocks: the GPU cache's run, then the
  replica's node kvstore's run after it (every replica of a node shares its kvstore), each
  tier block only while loading it beats recomputing it. A speed not measured yet is the
  mean of the replicas that measured it, else a default. Ties go to the less loaded. The
  cheapest is taken only if it holds more of the prompt than the least loaded replica;
  otherwise the least loaded is (kv is least-loaded, by its own load count, wherever
  the cache decides nothing).

  The decode cost per stream (in prompt tokens) is one figure for the whole fleet: the
  median of the replicas' figures, each its measured one (the slope of its decode step
  time over batch size, services/scheduler/tiering.py) or DECODE_COST_TOKENS where not
  measured. A slope from a few dozen steps is noisy (0.1 to 40 tokens on the 2-core CPU,
  median 2 to 4): one replica's outlier must not price every replica, nor its own.

  Saturation valve: a session leaves its replica once that one's load exceeds the least
  loaded one's by at least T + W, T = max(saturation_margin, saturation_ratio x the
  fleet's mean load) (with few requests in flight one request of imbalance counts, with
  many a proportionate share); no replica is chosen for what it holds at T + 1 + W or
  more. W is the requests the replica's hit over the least loaded one's is worth (hit
  tokens / (decode cost x (1 + output tokens)), rounded down: 0 for a short prefix, so a
  hot short prefix spreads at T + 1).

  Sessions: a request naming a session (``prompt_cache_key``, else ``user``; within its
  cache salt) goes to the replica its session last went to while that one is ready and
  not saturated (a bounded LRU map, entries expire after session_ttl_s).

The prompt is hashed (shared/prefix_hash.py, the scheduler's own keys) only under ``kv``
with more than one ready replica.
"""

from __future__ import annotations

import itertools
import statistics
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.gateway.block_index import DISK, HOST, BlockIndex, block_keys
from services.gateway.config import RoutingPolicy
from shared.config import check_choice
from shared.scheduler_stats import RoutingStats, SchedulerStats
from shared.prefix_hash import extra_keys, usable_block_hashes

GPU = "gpu"
# decision reasons: a cache hit decided it, a session, load alone (no hit made a
# difference), the valve turned a request away from the replica its cache or session
# favoured, or round-robin's turn
CACHE, SESSION, LOAD, SATURATED, TURN = "cache", "session", "load", "saturated", "turn"
DECODE_COST_TOKENS = 4.0  # another request's share of a step, in prompt tokens' compute,
# where a replica has not measured its own: ~4.5 for SmolLM2 on the CPU (docs/routing.md), less
# on a GPU, whose decode steps cost about the same with 1 or 30 streams
DEFAULT_OUTPUT_TOKENS = 128.0  # a request's expected output until this gateway has seen some end
OUTPUT_MEAN_WEIGHT = 0.05  # of each finished request in the running mean of output tokens
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0  # until some replica measures it
DEFAULT_HOST_LOAD_BYTES_PER_S = 10e9  # host RAM -> KV cache (about PCIe)
DEFAULT_DISK_READ_BYTES_PER_S = 2e9  # disk -> host RAM (about NVMe)


@dataclass(frozen=True)
class RoutingParams:
    policy: RoutingPolicy = RoutingPolicy.KV
    saturation_margin: int = 1  # requests over the least loaded replica's, at least
    saturation_ratio: float = 0.5  # ... or this share of the fleet's mean load, if more
    session_ttl_s: float = 600.0
    max_sessions: int = 100_000


@dataclass(frozen=True)
class Replica:
    """What the router knows of one ready replica: its last stats, and this gateway's
    own counts (requests in flight there now, and when those stats came; prompt tokens
    not prefilled yet)."""

    stats: SchedulerStats
    num_sent: int = 0
    num_sent_prefill_tokens: int = 0
    num_sent_at_stats: int | None = None  # None: not known, the larger figure counts

    @property
    def scheduler_id(self) -> str:
        return self.stats.scheduler_id

    @property
    def routing(self) -> RoutingStats:
        """The part of its stats made for routing."""
        return self.stats.routing

    @property
    def load(self) -> int:
        """Requests running or waiting there. Stats are up to half a second old: a request
        of ours that just ended still shows in them (a session's next turn would find its
        replica a request busier than it is), so ours count as of now and only the rest
        of the stats' figure (other gateways' requests) is taken from them."""
        in_stats = self.stats.num_running + self.stats.num_waiting
        if self.num_sent_at_stats is None:
            return self.baseline_load
        return self.num_sent + max(0, in_stats - self.num_sent_at_stats)

    @property
    def baseline_load(self) -> int:
        """least-loaded's figure, as before kv: the larger of the stats' running + waiting
        and this gateway's requests there. Kept so that the cache-blind baseline stays the
        one kv is measured against (with ``load``, a finished turn's slot shows free at
        once and least-loaded sends a conversation's next turn back to it: cache affinity
        by accident of a benchmark without think time, BENCHMARKS.md)."""
        return max(self.stats.num_running + self.stats.num_waiting, self.num_sent)

    @property
    def queued_prefill_tokens(self) -> int:
        return max(self.routing.num_queued_prefill_tokens, self.num_sent_prefill_tokens)


@dataclass(frozen=True)
class Decision:
    scheduler_id: str
    policy: RoutingPolicy
    reason: str
    hit_tokens: dict[str, int] = field(default_factory=dict)  # expected, by tier
    num_compute_tokens: int = 0  # prompt tokens it is expected to compute
    estimated_s: float = 0.0  # kv: the chosen replica's estimate

    @property
    def num_hit_tokens(self) -> int:
        return sum(self.hit_tokens.values())


@dataclass(frozen=True)
class _Estimate:
    seconds: float
    hit_tokens: dict[str, int]
    num_compute_tokens: int

    @property
    def num_hit_tokens(self) -> int:
        return sum(self.hit_tokens.values())


class PendingPrefill:
    """Prompt tokens this gateway sent to each replica and has no first output of yet
    (its stats tell the queue only every half second; a burst must see its own)."""

    def __init__(self) -> None:
        self._by_request: dict[str, tuple[str, int]] = {}
        self._by_scheduler: dict[str, int] = {}

    def add(self, request_id: str, scheduler_id: str, num_tokens: int) -> None:
        self.done(request_id)
        self._by_request[request_id] = (scheduler_id, num_tokens)
        self._by_scheduler[scheduler_id] = self._by_scheduler.get(scheduler_id, 0) + num_tokens

    def done(self, request_id: str) -> None:
        """Its first output came, or it ended or moved (any number of times)."""
        entry = self._by_request.pop(request_id, None)
        if entry is not None:
            scheduler_id, num_tokens = entry
            left = self._by_scheduler[scheduler_id] - num_tokens
            if left:
                self._by_scheduler[scheduler_id] = left
            else:
                del self._by_scheduler[scheduler_id]

    def of(self, scheduler_id: str) -> int:
        return self._by_scheduler.get(scheduler_id, 0)


class Sessions:
    """Session key -> the scheduler it last went to: LRU-bounded, entries expire."""

    def __init__(self, max_sessions: int, ttl_s: float) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._map: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def get(self, key: tuple[str, str], now: float) -> str | None:
        entry = self._map.get(key)
        if entry is None:
            return None
        if now >= entry[1]:
            del self._map[key]
            return None
        self._map.move_to_end(key)
        return entry[0]

    def put(self, key: tuple[str, str], scheduler_id: str, now: float) -> None:
        self._map[key] = (scheduler_id, now + self.ttl_s)
        self._map.move_to_end(key)
        while len(self._map) > self.max_sessions:
            self._map.popitem(last=False)

    def __len__(self) -> int:
        return len(self._map)


class Router:
    def __init__(self, params: RoutingParams, index: BlockIndex) -> None:
        check_choice(params.policy, RoutingPolicy, "routing")
        self.params = params
        self.index = index
        self.sessions = Sessions(params.max_sessions, params.session_ttl_s)
        self._turns = itertools.count()
        self.mean_output_tokens = DEFAULT_OUTPUT_TOKENS

    def observe_output(self, num_tokens: int) -> None:
        """A request ended with ``num_tokens`` output tokens (the kv cost's expectation)."""
        self.mean_output_tokens += OUTPUT_MEAN_WEIGHT * (num_tokens - self.mean_output_tokens)

    def choose(self, replicas: Sequence[Replica], token_ids: Sequence[int], *,
               cache_salt: str | None = None, session: str | None = None,
               now: float = 0.0, max_tokens: int | None = None,
               lora_key: str = "", images: Sequence[tuple[int, str]] = ()) -> Decision | None:
        """The replica for a prompt of ``token_ids`` among the ready ``replicas`` (None
        when there is none); ``max_tokens``: its output limit; ``lora_key``: its LoRA
        adapter's part of the block keys (``LoraRef.cache_key``; "": the base model);
        ``images``: its images' keys (prefix_hash.image_keys)."""
        if not replicas:
            return None
        policy = self.params.policy
        if policy == RoutingPolicy.ROUND_ROBIN:
            ordered = sorted(replicas, key=lambda r: r.stats.replica_id)
            return Decision(ordered[next(self._turns) % len(ordered)].scheduler_id, policy, TURN,
                            num_compute_tokens=len(token_ids))
        if policy == RoutingPolicy.LEAST_LOADED or len(replicas) == 1:
            least_loaded = min(replicas, key=lambda r: r.baseline_load)
            decision = Decision(least_loaded.scheduler_id, policy, LOAD,
                                num_compute_tokens=len(token_ids))
        else:
            least_loaded = min(replicas, key=lambda r: r.load)
            output_tokens = min(max_tokens, self.mean_output_tokens) if max_tokens \
                else self.mean_output_tokens
            decision = self._choose_kv(replicas, least_loaded, token_ids, cache_salt, session,
                                       now, output_tokens, lora_key, images)
        if session and policy == RoutingPolicy.KV:
            self.sessions.put((cache_salt or "", session), decision.scheduler_id, now)
        return decision

    def _choose_kv(self, replicas: Sequence[Replica], least_loaded: Replica,
                   token_ids: Sequence[int], cache_salt: str | None, session: str | None,
                   now: float, output_tokens: float, lora_key: str = "",
                   images: Sequence[tuple[int, str]] = ()) -> Decision:
        estimates = self.estimates(replicas, token_ids, cache_salt, output_tokens, lora_key,
                                   images)
        threshold = self.saturation_threshold(replicas)
        hits = {sid: e.num_hit_tokens for sid, e in estimates.items()}
        # Slack W: the requests a replica's hit over the least loaded one's is worth (each
        # costs the decode cost on every step of this request). A short prefix is worth
        # none, so a hot one still spreads; a conversation's history or a tenant's prefix
        # outweighs the imbalance its recompute elsewhere would fix.
        request_tokens = self.decode_cost_tokens(replicas) * (1 + output_tokens)

        def slack(replica: Replica) -> int:
            return int(max(0, hits[replica.scheduler_id] - hits[least_loaded.scheduler_id])
                       // request_tokens)

        # A holder may run one request further ahead than a session's replica: placing a
        # new conversation on its tenant's prefix saves that prefill now, while keeping a
        # session on a busier replica only defers the move that rebalances it.
        open_ = [r for r in replicas if r.load - least_loaded.load < threshold + 1 + slack(r)]
        best = min(replicas, key=lambda r: (estimates[r.scheduler_id].seconds, r.load))
        sticky_id = self.sessions.get((cache_salt or "", session), now) if session else None
        sticky = next((r for r in replicas if r.scheduler_id == sticky_id), None)
        if sticky is not None and sticky.load - least_loaded.load < threshold + slack(sticky):
            chosen, reason = sticky, SESSION
        else:
            if sticky is not None:  # it saturated: the session leaves it
                open_ = [r for r in open_ if r is not sticky]
            chosen = min(open_, key=lambda r: (estimates[r.scheduler_id].seconds, r.load))
            fewest = min(open_, key=lambda r: (r.load, estimates[r.scheduler_id].seconds))
            if hits[chosen.scheduler_id] <= hits[fewest.scheduler_id]:
                # no cache advantage over the least loaded: least-loaded's pick (the cost's
                # queued-token figures are half a second old and would only tip it away)
                chosen = fewest
            if sticky is not None or (best not in open_ and hits[best.scheduler_id]
                                      > hits[fewest.scheduler_id]):
                reason = SATURATED  # the valve turned it from its session or a holder
            elif hits[chosen.scheduler_id] > min(hits.values()):
                reason = CACHE
            else:
                reason = LOAD
        estimate = estimates[chosen.scheduler_id]
        return Decision(chosen.scheduler_id, RoutingPolicy.KV, reason, estimate.hit_tokens,
                        estimate.num_compute_tokens, estimate.seconds)

    def saturation_threshold(self, replicas: Sequence[Replica]) -> float:
        """Requests over the least loaded replica's load that make a replica saturated:
        relative to the fleet's mean load, so that the valve acts at 6 requests in flight
        on 3 replicas as at 600 (a fixed margin of 8 let a 1/2/3 placement of sessions
        stand for a whole run). At least 1: the least loaded one is always open."""
        mean_load = sum(r.load for r in replicas) / len(replicas)
        return max(self.params.saturation_margin, self.params.saturation_ratio * mean_load, 1)

    def estimates(self, replicas: Sequence[Replica], token_ids: Sequence[int],
                  cache_salt: str | None, output_tokens: float = DEFAULT_OUTPUT_TOKENS,
                  lora_key: str = "", images: Sequence[tuple[int, str]] = ()
                  ) -> dict[str, _Estimate]:
        """Each replica's expected seconds to serve this request, less what is the same
        on every replica (see above)."""
        keys_by_spec: dict[tuple[int, str], list[int]] = {}
        gpu_runs: dict[str, int] = {}
        for spec in {(r.routing.block_size, r.routing.model_name) for r in replicas}:
            block_size, model_name = spec
            if block_size <= 0:
                continue
            keys_by_spec[spec] = block_keys(usable_block_hashes(
                token_ids, block_size, extra_keys(model_name, cache_salt, lora_key), images))
            gpu_runs |= self.index.gpu_prefix_blocks(
                [r.scheduler_id for r in replicas
                 if (r.routing.block_size, r.routing.model_name) == spec], keys_by_spec[spec])
        prefill_speed = _mean_measured([r.routing.prefill_tokens_per_s for r in replicas],
                                       DEFAULT_PREFILL_TOKENS_PER_S)
        host_speed = _mean_measured([r.routing.host_load_bytes_per_s for r in replicas],
                                    DEFAULT_HOST_LOAD_BYTES_PER_S)
        disk_speed = _mean_measured([r.routing.disk_read_bytes_per_s for r in replicas],
                                    DEFAULT_DISK_READ_BYTES_PER_S)
        decode_cost = self.decode_cost_tokens(replicas)
        estimates = {}
        for replica in replicas:
            stats = replica.routing  # (its figures, 0 where not measured yet)
            keys = keys_by_spec.get((stats.block_size, stats.model_name), [])
            gpu_run = gpu_runs.get(replica.scheduler_id, 0)
            tiers = self.index.tier_run(stats.kv_node_id, stats.kv_namespace, keys, gpu_run) \
                if stats.kv_node_id and stats.kv_namespace else []
            estimates[replica.scheduler_id] = _estimate(
                replica, len(token_ids), output_tokens, gpu_run, tiers,
                stats.prefill_tokens_per_s or prefill_speed,
                stats.host_load_bytes_per_s or host_speed,
                stats.disk_read_bytes_per_s or disk_speed,
                decode_cost)
        return estimates

    @staticmethod
    def decode_cost_tokens(replicas: Sequence[Replica]) -> float:
        """One more stream's cost per step, in prompt tokens, for every replica: the median
        of each replica's measured figure, or DECODE_COST_TOKENS where it has none."""
        figures = [r.routing.decode_seq_cost_tokens or DECODE_COST_TOKENS for r in replicas]
        return statistics.median(figures) if figures else DECODE_COST_TOKENS


def _estimate(replica: Replica, num_tokens: int, output_tokens: float, gpu_blocks: int,
              tiers: list[str], prefill_speed: float, host_speed: float,
              disk_speed: float, decode_cost_tokens: float = DECODE_COST_TOKENS) -> _Estimate:
    block_size, block_bytes = replica.routing.block_size, replica.routing.block_bytes
    recompute_s = block_size / prefill_speed
    hits = {GPU: gpu_blocks * block_size, HOST: 0, DISK: 0}
    load_s = 0.0
    for tier in tiers:  # a leading run, while loading a block beats computing it
        block_load_s = block_bytes / host_speed + (block_bytes / disk_speed if tier == DISK else 0)
        if block_load_s >= recompute_s:
            break
        hits[tier] += block_size
        load_s += block_load_s
    num_compute = max(0, num_tokens - sum(hits.values()))
    # the replica's other requests share its prefill step(s) and each decode step
    shared_steps = replica.load * decode_cost_tokens * (1 + output_tokens)
    seconds = (num_compute + replica.queued_prefill_tokens + shared_steps) / prefill_speed \
        + load_s
    return _Estimate(seconds, {tier: n for tier, n in hits.items() if n}, num_compute)


def _mean_measured(values: list[float], default: float) -> float:
    measured = [value for value in values if value > 0]
    return sum(measured) / len(measured) if measured else default
