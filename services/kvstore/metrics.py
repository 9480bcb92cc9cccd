"""The kvstore's Prometheus metrics (``flotilla_kvstore_*``), served on --metrics-port by
prometheus_client's own HTTP server (the kvstore has no HTTP server of its own).
Bytes are counters: their rate is the tier's bytes/s."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from shared.kv_messages import KvTierStats

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0)


class KvStoreMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        tier = ["tier"]
        self.blocks = Gauge("flotilla_kvstore_blocks", "Blocks held", tier, registry=r)
        self.bytes = Gauge("flotilla_kvstore_bytes", "Bytes held", tier, registry=r)
        self.capacity = Gauge("flotilla_kvstore_capacity_bytes", "Tier size", tier, registry=r)
        self.pinned = Gauge("flotilla_kvstore_pinned_blocks", "Blocks pinned for a load", tier,
                            registry=r)
        self.hits = Counter("flotilla_kvstore_hits", "Blocks found by lookups", tier, registry=r)
        self.misses = Counter("flotilla_kvstore_misses",
                              "Blocks looked up and not found (the run stops at the first)",
                              registry=r)
        self.pinned_blocks = Counter("flotilla_kvstore_pinned", "Blocks pinned, by the tier "
                                     "they were found in", tier, registry=r)
        self.load_latency = Histogram("flotilla_kvstore_load_seconds",
                                      "Time to pin a run (disk blocks read into host slots)",
                                      registry=r, buckets=_LATENCY_BUCKETS)
        self.store_latency = Histogram("flotilla_kvstore_store_seconds",
                                       "Time to write one block to disk", registry=r,
                                       buckets=_LATENCY_BUCKETS)
        self.bytes_read = Counter("flotilla_kvstore_read_bytes", "Bytes read from a tier", tier,
                                  registry=r)
        self.bytes_written = Counter("flotilla_kvstore_written_bytes", "Bytes written to a tier",
                                     tier, registry=r)
        self.blocks_committed = Counter("flotilla_kvstore_committed_blocks",
                                        "Blocks committed to the host tier", registry=r)
        self.corrupt = Counter("flotilla_kvstore_corrupt_blocks",
                               "Disk blocks that failed verification (deleted, recomputed)",
                               registry=r)
        self.dropped_writes = Counter("flotilla_kvstore_dropped_disk_writes",
                                      "Blocks not written to disk: the write queue was full",
                                      registry=r)
        self.expired_owners = Counter("flotilla_kvstore_expired_owners",
                                      "Owners dropped after going silent", registry=r)
        self.disk_read_speed = Gauge("flotilla_kvstore_disk_read_bytes_per_second",
                                     "Measured disk-tier read speed", registry=r)

    def set_tiers(self, tiers: list[KvTierStats]) -> None:
        for stats in tiers:
            self.blocks.labels(stats.tier).set(stats.num_blocks)
            self.bytes.labels(stats.tier).set(stats.num_bytes)
            self.capacity.labels(stats.tier).set(stats.capacity_bytes)
            self.pinned.labels(stats.tier).set(stats.num_pinned)

    def serve(self, port: int, host: str) -> None:
        """Serve /metrics on a background thread (prometheus_client's server)."""
        start_http_server(port, addr=host, registry=self.registry)
