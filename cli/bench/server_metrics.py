"""The server's own counters around a run: flotilla's gateway /metrics (prefix-cache
queries and hits per replica, from the schedulers' stats; speculative decoding's drafts;
routing counters if any; a MoE model's routed pairs), read before and after, and their
difference; and a MoE model's expert load balance as the last read shows it. Another
server's /metrics, or none, gives none."""

from __future__ import annotations

import math
import re

import httpx

# counters worth a delta: the scheduler-side prefix cache (per replica), speculative
# decoding, routing and MoE routing
COUNTER_PREFIXES = ("flotilla_prefix_cache_", "flotilla_spec_decode_", "flotilla_rout",
                    "flotilla_moe_")
QUERIES = "flotilla_prefix_cache_queries_total"  # prompt tokens looked up
HITS = "flotilla_prefix_cache_hits_total"  # prompt tokens found in the worker's own cache
TIER_HITS = "flotilla_prefix_cache_tier_hits_total"  # loaded from the kvstore's tiers instead
DRAFT_TOKENS = "flotilla_spec_decode_draft_tokens_total"  # drafts verified
ACCEPTED = "flotilla_spec_decode_accepted_tokens_total"  # drafts kept
DRAFTS = "flotilla_spec_decode_drafts_total"  # a request's verify passes
ACCEPTED_PER_POS = "flotilla_spec_decode_accepted_tokens_per_pos_total"  # kept, by position
ROUTED = "flotilla_moe_routed_tokens_total"  # token-expert pairs a MoE model routed
# each (layer, expert)'s share of its layer's tokens against an even split, per replica
EXPERT_LOAD = "flotilla_moe_expert_load"
EXPERT_LOAD_MAX = "flotilla_moe_expert_load_max"  # the hottest expert's share
# a scheduler's instance id changes when it restarts: its replica is what stays
_DROPPED_LABELS = ("scheduler_id",)
# the schedulers' stats reach the gateway every 0.5 s: wait this long before the last read
STATS_SETTLE_S = 1.2

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Counters = dict[str, dict[str, float]]  # counter name -> label set ("replica_id=0") -> value


def parse_samples(text: str, keep) -> Counters:
    """The samples of the Prometheus text whose names ``keep(name)`` takes, by name and
    label set ("replica_id=0,le=2.0"), summed over the dropped labels."""
    samples: Counters = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or not keep(match[1]):
            continue
        labels = sorted((key, value) for key, value in _LABEL.findall(match[2] or "")
                        if key not in _DROPPED_LABELS)
        key = ",".join(f"{name}={value}" for name, value in labels)
        try:
            value = float(match[3])
        except ValueError:
            continue
        by_labels = samples.setdefault(match[1], {})
        by_labels[key] = by_labels.get(key, 0.0) + value
    return samples


def parse_counters(text: str, prefixes: tuple[str, ...] = COUNTER_PREFIXES) -> Counters:
    """The ``*_total`` samples of the Prometheus text whose names start with one of
    ``prefixes``, summed over the dropped labels."""
    return parse_samples(text, lambda name: name.endswith("_total") and name.startswith(prefixes))


def counter_deltas(before: Counters, after: Counters) -> Counters:
    """after - before, per counter and label set (absent before: from zero)."""
    return {name: {key: value - before.get(name, {}).get(key, 0.0)
                   for key, value in by_labels.items()}
            for name, by_labels in after.items()}


def scheduler_prefix_cache(deltas: Counters) -> dict:
    """The schedulers' prefix-cache figures over the run, in all and per replica: prompt
    tokens looked up, found in the worker's cache, and loaded from the kvstore's tiers (a
    tier hit is not in the worker's hits; both are in the responses' cached_tokens)."""
    def figures(queries: float, hits: float, tier_hits: float) -> dict:
        return {"queries": queries, "hits": hits, "tier_hits": tier_hits,
                "hit_rate": (hits + tier_hits) / queries if queries else math.nan,
                "device_hit_rate": hits / queries if queries else math.nan}

    def of(name: str, key: str | None = None) -> float:
        values = deltas.get(name, {})
        return sum(values.values()) if key is None else values.get(key, 0.0)

    return {**figures(of(QUERIES), of(HITS), of(TIER_HITS)),
            "by_replica": {key: figures(of(QUERIES, key), of(HITS, key), of(TIER_HITS, key))
                           for key in sorted(deltas.get(QUERIES, {}))}}


def speculative_decoding(deltas: Counters) -> dict | None:
    """Speculative decoding over the run, all replicas: drafts verified and kept, the
    acceptance rate, the mean accepted length (kept drafts per verify pass) and the share of
    verify passes that kept a draft at each position; None when no draft was verified."""
    def total(name: str) -> float:
        return sum(deltas.get(name, {}).values())

    num_drafts = total(DRAFTS)
    if not total(DRAFT_TOKENS) or not num_drafts:
        return None
    by_position: dict[int, float] = {}
    for key, value in deltas.get(ACCEPTED_PER_POS, {}).items():
        position = int(dict(part.split("=", 1) for part in key.split(","))["position"])
        by_position[position] = by_position.get(position, 0.0) + value
    return {"draft_tokens": total(DRAFT_TOKENS), "accepted_tokens": total(ACCEPTED),
            "verify_passes": num_drafts,
            "acceptance_rate": total(ACCEPTED) / total(DRAFT_TOKENS),
            "mean_accepted_length": total(ACCEPTED) / num_drafts,
            "acceptance_by_position": [by_position[i] / num_drafts
                                       for i in sorted(by_position)]}


def expert_load(text: str, deltas: Counters | None = None) -> dict | None:
    """A MoE model's expert load balance as the server's /metrics shows it now (its counts
    since its workers attached, so the run's and any traffic before it): the hottest
    expert's share of an even split, the shares of (layer, expert) cells above 2x and at
    most 0.5x, and the histogram's cumulative buckets, in all and per replica; with
    ``deltas``, the token-expert pairs routed over the run. None: no MoE figures."""
    samples = parse_samples(text, lambda name: name.startswith(EXPERT_LOAD))
    by_replica: dict[str, dict[str, float]] = {}  # label set -> le -> cumulative count
    for key, count in samples.get(f"{EXPERT_LOAD}_bucket", {}).items():
        labels = dict(part.split("=", 1) for part in key.split(","))
        bound = labels.pop("le")
        replica = ",".join(f"{name}={value}" for name, value in sorted(labels.items()))
        by_replica.setdefault(replica, {})[bound] = count
    if not by_replica:
        return None
    peaks = samples.get(EXPERT_LOAD_MAX, {})
    every: dict[str, float] = {}
    for buckets in by_replica.values():
        for bound, count in buckets.items():
            every[bound] = every.get(bound, 0.0) + count
    figures = _balance(every, max(peaks.values(), default=math.nan))
    figures["by_replica"] = {replica: _balance(buckets, peaks.get(replica, math.nan))
                             for replica, buckets in sorted(by_replica.items())}
    if deltas is not None and ROUTED in deltas:
        figures["routed_tokens"] = sum(deltas[ROUTED].values())
    return figures


def _balance(buckets: dict[str, float], max_share: float) -> dict:
    """One histogram of shares (le bound as written -> cumulative count) in figures."""
    by_bound = {float(bound): count for bound, count in buckets.items()}  # ("+Inf": inf)
    num_cells = by_bound.get(math.inf, 0.0)

    def share(count: float) -> float:
        return count / num_cells if num_cells else math.nan

    return {"max_share": max_share, "num_cells": num_cells,
            "share_above_2x": share(num_cells - by_bound.get(2.0, math.nan)),
            "share_at_most_half": share(by_bound.get(0.5, math.nan)),
            "buckets": dict(sorted(buckets.items(), key=lambda item: float(item[0])))}


async def read_metrics(base_url: str, api_key: str | None) -> str | None:
    """The server's /metrics text now, or None if it has none we can read."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=10) as client:
            response = await client.get("/metrics")
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return response.text


async def read_counters(base_url: str, api_key: str | None) -> Counters | None:
    """The server's counters now, or None if it has no /metrics we can read."""
    text = await read_metrics(base_url, api_key)
    return None if text is None else parse_counters(text)
