"""Expert load balance of a Mixture-of-Experts replica for /metrics, from its scheduler's
cumulative counts (SchedulerStats.moe): each (sparse layer, expert)'s share of its layer's
tokens against an even split, as one histogram and its largest value per replica. One
series per expert would be 48 layers x 128 experts; the histogram is a dozen. Recomputed
from the latest stats at every scrape, so nothing is counted twice."""

from __future__ import annotations

import bisect
import math

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from shared.scheduler_stats import SchedulerStats

# share of an even split: 1.0 balanced, 0 an expert no token reached, 2 twice its share
SHARE_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0)
LABELS = ["replica_id", "scheduler_id"]


def expert_shares(counts: list[list[int]]) -> list[float]:
    """Per (layer, expert), in layer then expert order: count / (layer total / experts).
    A layer no token reached yet has no shares (its split is undefined)."""
    shares = []
    for layer in counts:
        total = sum(layer)
        if total > 0:
            even = total / len(layer)
            shares += [count / even for count in layer]
    return shares


def share_buckets(shares: list[float]) -> list[tuple[str, int]]:
    """Cumulative histogram buckets (le: share <= bound) over SHARE_BUCKETS and +Inf."""
    ordered = sorted(shares)
    return [(floatToGoString(bound), bisect.bisect_right(ordered, bound))
            for bound in (*SHARE_BUCKETS, math.inf)]


class ExpertLoadCollector:
    """``flotilla_moe_expert_load`` (histogram) and ``flotilla_moe_expert_load_max``
    (gauge) per replica, from the latest counts its scheduler sent; a replica whose latest
    stats route no token (dense, or its worker just attached) has neither."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        # replica id -> (scheduler id, its counts); by replica, so a restarted scheduler
        # replaces its predecessor's figures instead of leaving them behind. Shares are
        # made at scrape time: stats come twice a second, scrapes far less often.
        self._counts: dict[str, tuple[str, list[list[int]]]] = {}
        if registry is not None:
            registry.register(self)

    def observe(self, stats: SchedulerStats) -> None:
        counts = stats.moe.expert_token_counts  # (a frozen message's: kept as it is)
        if any(sum(layer) > 0 for layer in counts):
            self._counts[stats.replica_id] = (stats.scheduler_id, counts)
        else:
            self._counts.pop(stats.replica_id, None)

    def collect(self):
        load = HistogramMetricFamily(
            "flotilla_moe_expert_load", "Each (MoE layer, expert)'s share of its layer's "
            "routed tokens against an even split (1: balanced), since the worker attached",
            labels=LABELS)
        peak = GaugeMetricFamily(
            "flotilla_moe_expert_load_max", "The hottest expert's share of its layer's tokens "
            "against an even split (1: balanced; 2: twice its share)", labels=LABELS)
        for replica_id, (scheduler_id, counts) in sorted(self._counts.items()):
            labels, shares = [replica_id, scheduler_id], expert_shares(counts)
            load.add_metric(labels, share_buckets(shares), sum(shares))
            peak.add_metric(labels, max(shares))
        yield load
        yield peak
