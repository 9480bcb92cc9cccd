"""The kvstore's wire protocol (docs/kvstore.md): attach, reserve, commit, lookup, pin,
release, keepalive, block events and stats between the kvstore and its workers, schedulers and
gateways, and the step plan's KV parts (``KvLoad``, ``KvStoreRun``, re-exported by
shared/messages.py beside the plan). It follows that module's rules (frozen Structs, fields
only added with defaults from the first release on) and shares its ``encode``/``decode``.

NATS carries hashes, slot ids and pins; KV bytes move through the arena (shared/kv_arena.py)
and the disk tier's files.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct


# ----------------------------------------------------------------- step plans' KV parts
class KvLoad(Struct, frozen=True, array_like=True, gc=False):
    """In a step plan: copy pinned host slots into the worker's KV blocks before the step
    runs (the blocks' tokens then count as computed). A worker attached to another
    kvstore (``store_id``: the one that pinned the slots; "" skips the check), or to none,
    computes those blocks' tokens in this step instead."""

    slot_ids: list[int]
    block_ids: list[int]
    store_id: str = ""


class KvStoreRun(Struct, frozen=True, array_like=True, gc=False):
    """In a step plan: full blocks of one request, computed by this step or before, to copy
    out to the kvstore once the step has run (blocks ``first_block_index``.. of the request)."""

    request_id: str
    first_block_index: int
    block_ids: list[int]
    block_hashes: list[bytes]


# ----------------------------------------------------------------- the kvstore's protocol
class KvLayout(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What one block's KV bytes are. Blocks of another layout or other weights never
    mix: the kvstore keys every block by (namespace, block hash). Fields added later have
    defaults left out of the encoding, so earlier layouts keep their namespaces."""

    weights_version: str  # shared.models.weights_version: changes when the weights do
    dtype: str  # torch dtype name of the KV cache, e.g. "bfloat16"
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_scales: str = ""  # an FP8 cache's scales (kv_quant.kv_scales_tag); "": unscaled

    @property
    def slot_shape(self) -> tuple[int, ...]:
        """One block in an arena slot: [num_layers, 2 (key, value), block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def namespace(self) -> str:
        """A short stable name for this layout (hex): the kvstore's key prefix and file folder."""
        import hashlib

        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:24]


class KvAttachRequest(Struct, frozen=True, kw_only=True):
    """worker -> kvstore: map the arena for this layout (created on first attach)."""

    owner_id: str  # the worker instance: reserved slots are its own until committed
    layout: KvLayout
    itemsize: int  # bytes per element of layout.dtype


class KvAttachReply(Struct, frozen=True, kw_only=True):
    store_id: str  # the kvstore process instance: slot ids mean nothing to another one
    node_id: str
    namespace: str
    arena_path: str  # a file the worker maps (shared/kv_arena.py)
    num_slots: int
    slot_nbytes: int


class KvReserveRequest(Struct, frozen=True, kw_only=True):
    """worker -> kvstore: free host slots to write blocks into (best effort: maybe fewer)."""

    namespace: str
    owner_id: str
    num_slots: int


class KvReserveReply(Struct, frozen=True, kw_only=True):
    store_id: str
    slot_ids: list[int]  # the owner's until committed or returned (or the owner goes silent)


class KvCommitRequest(Struct, frozen=True, kw_only=True):
    """worker -> kvstore: these reserved slots now hold these blocks (copies complete).
    Ignored when ``store_id`` is not the running kvstore's (it restarted)."""

    namespace: str
    owner_id: str
    store_id: str
    returned_slot_ids: list[int] = []  # reserved slots the owner gives back unused
    # the blocks as columns (no struct per block): block i is block_hashes[i] in slot_ids[i],
    # holding token_ids[i * block_size:(i + 1) * block_size] (a hit is confirmed by its
    # tokens, not the hash alone)
    block_hashes: list[bytes] = []
    slot_ids: list[int] = []
    token_ids: list[int] = []
    block_size: int = 0


class KvLookupRequest(Struct, frozen=True, kw_only=True):
    """scheduler -> kvstore: which leading blocks of this chain are held, and where. With
    ``owner_id`` and ``pin_id`` the leading run of host hits is also pinned under
    ``pin_id``, as a KvPinRequest would (within the pin cap), saving the pin's round trip;
    released the same way."""

    namespace: str
    block_hashes: list[bytes]
    owner_id: str = ""  # the scheduler instance, when pinning
    pin_id: str = ""  # unique per pin; "": only look up


class KvLookupReply(Struct, frozen=True, kw_only=True):
    store_id: str
    tiers: list[str]  # the leading run of hits, one tier each: "host" or "disk"
    # measured read speed of the disk tier (0: not measured yet)
    disk_read_bytes_per_s: float = 0.0
    slot_ids: list[int] = []  # the leading host blocks now pinned (a prefix of the run)
    token_ids: list[list[int]] = []  # each pinned block's tokens


class KvPinRequest(Struct, frozen=True, kw_only=True):
    """scheduler -> kvstore: bring the leading run of these blocks into host slots (disk
    hits are read in) and keep them there until released."""

    namespace: str
    owner_id: str  # the scheduler instance
    pin_id: str  # unique per pin; released by this id
    block_hashes: list[bytes]


class KvPinReply(Struct, frozen=True, kw_only=True):
    store_id: str
    slot_ids: list[int]  # the leading run now pinned (maybe fewer than asked, maybe none)
    token_ids: list[list[int]]  # each pinned block's tokens
    tiers: list[str]  # where each pinned block was found


class KvReleaseRequest(Struct, frozen=True, kw_only=True):
    namespace: str
    owner_id: str
    pin_ids: list[str]


class KvKeepAlive(Struct, frozen=True, kw_only=True):
    """Published every few seconds by each owner (worker, scheduler). The kvstore drops
    the reservations and pins of an owner it has not heard from for its owner timeout."""

    owner_id: str


class KvBlockEvent(Struct, frozen=True, kw_only=True):
    """kvstore -> anyone (routing): blocks that entered or left a tier. ``seq`` counts up
    per ``store_id``; a gap means missed events, a new store_id a restarted kvstore."""

    store_id: str
    node_id: str
    namespace: str
    seq: int
    tier: str  # "host" or "disk"
    stored_hashes: list[bytes] = []
    removed_hashes: list[bytes] = []
    timestamp: float = 0.0


class KvTierStats(Struct, frozen=True, kw_only=True):
    tier: str
    num_blocks: int
    num_bytes: int
    capacity_bytes: int
    num_pinned: int = 0


class KvStatsReply(Struct, frozen=True, kw_only=True):
    store_id: str
    node_id: str
    tiers: list[KvTierStats]


KV_MESSAGES: tuple[type[Struct], ...] = (
    KvLayout, KvAttachRequest, KvAttachReply, KvReserveRequest, KvReserveReply, KvCommitRequest,
    KvLookupRequest, KvLookupReply, KvPinRequest, KvPinReply, KvReleaseRequest, KvKeepAlive,
    KvBlockEvent, KvTierStats, KvStatsReply, KvLoad, KvStoreRun,
)
