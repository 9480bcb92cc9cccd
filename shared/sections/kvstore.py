"""The kvstore's knobs (docs/kvstore.md): its tiers below the workers' caches, and how its
clients find it and load from it."""

from __future__ import annotations

import re
from typing import Annotated

from shared.config import Section, knob, parse_size

# A node id names the arena files and (dots made underscores) a NATS subject token; a
# Kubernetes node name is one.
_NODE_ID = re.compile(r"^[A-Za-z0-9_.-]+$")


class KvClient(Section, frozen=True, kw_only=True):
    """Workers and schedulers: which kvstore they use."""

    kv_node_id: Annotated[str, knob(
        "node id of the kvstore to use (empty: none; flotilla serve gives its own kvstore's, "
        "see its --kv-node-id)", serve=False)] = ""


class KvNode(Section, frozen=True, kw_only=True):
    """The kvstore: which node it is."""

    node_id: Annotated[str, knob(
        "this node's id: its workers and schedulers pass it as --kv-node-id",
        serve=False)] = "local"

    def __post_init__(self) -> None:
        if not _NODE_ID.match(self.node_id):
            raise ValueError(f"node_id must be letters, digits, '-', '_' or '.', not "
                             f"{self.node_id!r}")


class KvTiers(Section, frozen=True, kw_only=True):
    kv_host_memory: Annotated[str, knob(
        "host-RAM tier per namespace (model layout), e.g. 4GiB: shared memory, taken as it "
        "fills")] = "4GiB"
    kv_shm_dir: Annotated[str, knob(
        "directory of the shared-memory arena files (a tmpfs; a temp dir when it does not "
        "exist)")] = "/dev/shm"
    kv_disk_dir: Annotated[str, knob("disk tier directory (empty: no disk tier)")] = ""
    kv_disk_size: Annotated[str, knob("disk tier size, e.g. 16GiB")] = "16GiB"
    kv_disk_queue: Annotated[int, knob(
        "blocks waiting for the disk; when full, new ones are not written (and counted)")] = 256
    owner_timeout_s: Annotated[float, knob(
        "seconds without a keepalive after which an owner's pins and reservations are "
        "dropped")] = 15.0
    max_pinned_fraction: Annotated[float, knob(
        "most of the host slots that pins may hold (0-1); the rest keeps stores working")] = 0.5
    max_reserved_fraction: Annotated[float, knob(
        "most of the host slots that reservations may hold, all owners together (0-1)")] = 0.5
    event_interval_s: Annotated[float, knob("block events are batched for this long")] = 0.05
    metrics_port: Annotated[int, knob(
        "the kvstore serves Prometheus metrics on this port (0: off)")] = 0
    metrics_host: Annotated[str, knob("address the kvstore's metrics server listens on")] = \
        "0.0.0.0"

    def __post_init__(self) -> None:
        for name in ("kv_host_memory", "kv_disk_size"):
            try:
                parse_size(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
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


class KvLoads(Section, frozen=True, kw_only=True):
    """The worker: how it copies a load from the kvstore."""

    kv_load_layer_groups: Annotated[int, knob(
        "CUDA: copy each load from the kvstore in this many layer groups (at most one a "
        "layer), so a forward's first layers run while later ones still load (1: the whole "
        "load first; docs/kvstore.md has the TTFT each gave)")] = 8

    def __post_init__(self) -> None:
        if self.kv_load_layer_groups < 1:
            raise ValueError(f"kv_load_layer_groups must be at least 1, not "
                             f"{self.kv_load_layer_groups}")
