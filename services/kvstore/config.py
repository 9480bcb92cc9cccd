"""kvstore configuration."""

from __future__ import annotations

import re

from shared.config import ServiceConfig, parse_size

# A node id names the arena files and (dots made underscores) a NATS subject token; a
# Kubernetes node name is one.
_NODE_ID = re.compile(r"^[A-Za-z0-9_.-]+$")


class KvStoreConfig(ServiceConfig, frozen=True, kw_only=True):
    """flotilla kvstore: the node's KV tiers below the worker's cache (host RAM, disk)."""

    node_id: str = "local"  # workers and schedulers of this node use it as --kv-node-id
    kv_host_memory: str = "4GiB"  # host tier size per namespace (the arena file is sparse)
    kv_shm_dir: str = "/dev/shm"  # where arena files go (a temp dir when it does not exist)
    kv_disk_dir: str = ""  # "": no disk tier
    kv_disk_size: str = "16GiB"
    kv_disk_queue: int = 256  # blocks waiting to be written; more are dropped (and counted)
    owner_timeout_s: float = 15.0  # an owner silent this long loses its pins and reservations
    max_pinned_fraction: float = 0.5  # of the host slots; the rest keeps stores working
    max_reserved_fraction: float = 0.5  # of the host slots, all owners together
    event_interval_s: float = 0.05  # block events are batched this long
    metrics_port: int = 0  # Prometheus metrics on this port (0: off)
    metrics_host: str = "0.0.0.0"
    shutdown_timeout: float = 5.0  # s; on SIGTERM: finish queued disk writes at most this long

    __help__ = {
        "node_id": "this node's id: workers and schedulers pass it as --kv-node-id",
        "kv_host_memory": "host RAM tier per namespace (model layout), e.g. 4GiB",
        "kv_shm_dir": "directory of the shared-memory arena files (a tmpfs)",
        "kv_disk_dir": "disk tier directory (empty: no disk tier)",
        "kv_disk_size": "disk tier size, e.g. 16GiB",
        "kv_disk_queue": "blocks waiting for the disk; when full, new ones are not written",
        "owner_timeout_s": "seconds without a keepalive after which an owner's pins and "
                           "reservations are dropped",
        "max_pinned_fraction": "most of the host slots that pins may hold (0-1)",
        "max_reserved_fraction": "most of the host slots that reservations may hold (0-1)",
        "event_interval_s": "block events are batched for this long",
        "metrics_port": "serve Prometheus metrics on this port (0: off)",
        "metrics_host": "address the metrics server listens on",
        "shutdown_timeout": "on SIGTERM, seconds to finish queued disk writes",
    }

    def __post_init__(self) -> None:
        if not _NODE_ID.match(self.node_id):
            raise ValueError(f"node_id must be letters, digits, '-', '_' or '.', not {self.node_id!r}")
        for name in ("kv_host_memory", "kv_disk_size"):
            parse_size(getattr(self, name))  # raises ValueError on a bad size
        for name in ("max_pinned_fraction", "max_reserved_fraction"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1]")
        if self.owner_timeout_s <= 0 or self.event_interval_s <= 0:
            raise ValueError("owner_timeout_s and event_interval_s must be positive")
        if self.kv_disk_queue < 1:
            raise ValueError("kv_disk_queue must be at least 1")

    @property
    def host_memory_bytes(self) -> int:
        return parse_size(self.kv_host_memory)

    @property
    def disk_size_bytes(self) -> int:
        return parse_size(self.kv_disk_size)


# cli/stack.py finds a service's config as services.<kind>.config.<Kind>Config
KvstoreConfig = KvStoreConfig
