"""The scheduler's requests to its node's kvstore (docs/kvstore.md): look a request's
blocks up, pin the hit worth loading, release pins, keep its pins alive: the bus calls
of the tiered KV connector (kv_connector.py); the choice itself is tiering.py's.

One round trip for host hits: the lookup also pins the leading run of host hits
(``KvLookupRequest.pin_id``), and when the hit worth loading lies within it, that pin is
the hit. A second call, a pin, is made only when the hit wants disk blocks (after
releasing the lookup's pin: a disk hit reads files, so the round trip is small beside it).

The kvstore is never waited on for long: a lookup has LOOKUP_TIMEOUT_S (plus a little
per lookup already in flight), after which (or on an error, or with NATS down) the
request is a miss and runs as it would without a kvstore, and the pin it may have made
is released. A pin may read blocks from disk and has PIN_TIMEOUT_S. After a few failed
calls in a row with no reply meanwhile, the kvstore is left alone for SILENT_BACKOFF_S,
so a hung kvstore does not add its timeout to every request (a slow one, answering
other calls, is not left alone).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TypeVar

import msgspec
import structlog

from services.scheduler.intake import PrefixQuery
from services.scheduler.request import TierHit
from services.scheduler.tiering import DISK, TierSpeeds
from shared.bus import Bus
from shared.errors import FlotillaError, ServiceUnavailable
from shared.messages import encode
from shared.kv_messages import (
    KvKeepAlive, KvLookupReply, KvLookupRequest, KvPinReply, KvPinRequest, KvReleaseRequest,
)
from shared.subjects import Subjects

log = structlog.get_logger()

LOOKUP_TIMEOUT_S = 0.05  # for a lookup alone
# ... and this much more per lookup already in flight: the kvstore answers them in turn,
# so under a burst (128 requests at once) the last waits for the others (~0.1 ms each on
# two busy cores); a miss would cost it its whole prefill.
LOOKUP_QUEUE_ALLOWANCE_S = 0.001
HOST_PIN_TIMEOUT_S = 0.2  # a pin of host hits only moves no bytes
PIN_TIMEOUT_S = 1.0  # disk hits are read into host slots during the pin
KEEPALIVE_INTERVAL_S = 2.0
MAX_FAILURES_IN_A_ROW = 3
SILENT_BACKOFF_S = 2.0

Rep = TypeVar("Rep")


def new_pin_id() -> str:
    return os.urandom(16).hex()  # unique as a uuid4, without building one per request


def _with_encoded_token_ids(message_type: type) -> type:
    """``message_type`` read with its ``token_ids`` (each pinned block's tokens) left
    encoded: a 16k prompt's 1,023 blocks cost ~0.6 ms to decode into lists and ~0.35 ms to
    compare slice by slice; their bytes compare with the request's own in ~0.15 ms."""
    fields = []
    for field in msgspec.structs.fields(message_type):
        kind = msgspec.Raw if field.name == "token_ids" else field.type
        if field.default is not msgspec.NODEFAULT:
            default = field.default
        elif field.default_factory is not msgspec.NODEFAULT:
            default = field.default_factory()
        else:
            fields.append((field.name, kind))
            continue
        if field.name == "token_ids":
            default = msgspec.Raw(encode(default))
        fields.append((field.name, kind, default))
    return msgspec.defstruct(message_type.__name__, fields, kw_only=True, frozen=True)


LookupReply = _with_encoded_token_ids(KvLookupReply)
PinReply = _with_encoded_token_ids(KvPinReply)
_decode_blocks = msgspec.msgpack.Decoder(list[list[int]]).decode


class KvClient:
    def __init__(self, bus: Bus, subjects: Subjects, *, owner_id: str, node_id: str,
                 namespace: str, block_bytes: int, block_size: int, speeds: TierSpeeds) -> None:
        self.bus = bus
        self.subjects = subjects
        self.owner_id = owner_id  # the scheduler instance: pins are its own
        self.node_id = node_id
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.speeds = speeds
        self.store_id = ""  # the kvstore process last heard from
        self._unsent_releases: list[str] = []
        self._failures_in_a_row = 0
        self._silent_until = 0.0
        self._last_reply_at = 0.0  # monotonic time of the last reply from the kvstore
        self._lookups_in_flight = 0

    async def find_hit(self, query: PrefixQuery, token_ids: Sequence[int]) -> TierHit | None:
        """A pinned hit of the blocks beyond the query's GPU prefix, if one is worth
        loading; None on a miss (or any trouble with the kvstore)."""
        block_hashes = query.block_hashes[query.num_gpu_blocks:]
        started = time.monotonic()
        if not block_hashes or started < self._silent_until:
            return None
        pin_id = new_pin_id()
        deadline_s = LOOKUP_TIMEOUT_S + self._lookups_in_flight * LOOKUP_QUEUE_ALLOWANCE_S
        self._lookups_in_flight += 1
        try:
            lookup = await self._ask("lookup", KvLookupRequest(
                namespace=self.namespace, block_hashes=block_hashes, owner_id=self.owner_id,
                pin_id=pin_id), LookupReply, deadline_s)
        finally:
            self._lookups_in_flight -= 1
        if lookup is None:  # it may have pinned the host run all the same: let go of it
            await self.release([pin_id])
            return None
        self.store_id = lookup.store_id
        self.speeds.observe_disk_read(lookup.disk_read_bytes_per_s)
        num_blocks = self.speeds.num_blocks_worth_loading(lookup.tiers, self.block_bytes,
                                                          self.block_size)
        looked_up = time.monotonic()
        if _serves(lookup, num_blocks):
            pin = lookup
        else:
            if lookup.slot_ids:  # not the hit wanted: let go of it
                await self.release([pin_id])
            if num_blocks == 0:
                return None
            pin_id = new_pin_id()  # a new id: the release of the old one may come later
            timeout = PIN_TIMEOUT_S if DISK in lookup.tiers[:num_blocks] else HOST_PIN_TIMEOUT_S
            pin = await self._ask("pin", KvPinRequest(
                namespace=self.namespace, owner_id=self.owner_id, pin_id=pin_id,
                block_hashes=block_hashes[:num_blocks]), PinReply, timeout)
            if pin is None:  # it may still have pinned them: let go of them anyway
                await self.release([pin_id])
                return None
        self.store_id = pin.store_id
        num_confirmed = min(num_blocks, self._num_confirmed(pin, query.num_gpu_blocks, token_ids))
        log.debug("kv_hit_pinned", num_blocks=num_confirmed, num_asked=num_blocks,
                  lookup_ms=round((looked_up - started) * 1e3, 2),
                  pin_ms=round((time.monotonic() - looked_up) * 1e3, 2),
                  round_trips=1 if pin is lookup else 2)
        if num_confirmed == 0:
            if pin.slot_ids:  # (a pin of no block leaves nothing to release)
                await self.release([pin_id])
            return None
        return TierHit(pin_id, pin.store_id, query.num_gpu_blocks,
                       tuple(pin.slot_ids[:num_confirmed]), tuple(pin.tiers[:num_confirmed]))

    def _num_confirmed(self, pin, first_block: int, token_ids: Sequence[int]) -> int:
        """Leading pinned blocks whose tokens are the request's (a hash alone is no proof).
        ``pin``: a LookupReply or PinReply (tokens still encoded), or a KvLookupReply or
        KvPinReply."""
        if not isinstance(token_ids, list):
            token_ids = list(token_ids)  # a slice of a list is a list: compared as is
        count, size = 0, self.block_size
        start = first_block * size
        pinned_tokens = pin.token_ids
        if isinstance(pinned_tokens, msgspec.Raw):
            num_pinned = len(pin.slot_ids)
            wanted = token_ids[start:start + num_pinned * size]
            # all of them alike, byte for byte: the common case, at once (msgspec has one
            # msgpack encoding of these lists; the request's blocks are cut in C by zip
            # over one iterator); else read and compared block by block
            if len(wanted) == num_pinned * size and bytes(pinned_tokens) == encode(
                    list(zip(*[iter(wanted)] * size))):
                return num_pinned
            pinned_tokens = _decode_blocks(pinned_tokens)
        for block_tokens in pinned_tokens[:len(pin.slot_ids)]:
            if block_tokens != token_ids[start:start + size]:
                break
            count += 1
            start += size
        return count

    async def _ask(self, verb: str, message: msgspec.Struct, reply_type: type[Rep],
                   timeout: float) -> Rep | None:
        sent_at = time.monotonic()
        try:
            reply = await self.bus.request(self.subjects.kvstore(self.node_id, verb), message,
                                           reply_type, timeout=timeout)
        except (FlotillaError, msgspec.DecodeError) as exc:
            # Only a kvstore that has said nothing since this call went out counts towards
            # the backoff: one that answers other calls meanwhile is slow, not gone.
            if self._last_reply_at < sent_at:
                self._failures_in_a_row += 1
                if self._failures_in_a_row >= MAX_FAILURES_IN_A_ROW:
                    self._silent_until = time.monotonic() + SILENT_BACKOFF_S
                    self._failures_in_a_row = 0
            log.debug("kvstore_call_failed", verb=verb, error=str(exc))
            return None
        self._failures_in_a_row = 0
        self._last_reply_at = time.monotonic()
        return reply

    # ------------------------------------------------------------ pins
    async def release(self, pin_ids: list[str]) -> None:
        """Release pins (fire and forget); with NATS down they are sent with the next
        keepalive, since a pin of an owner that keeps alive is never dropped."""
        self._unsent_releases.extend(pin_ids)
        if not self._unsent_releases:
            return
        pending, self._unsent_releases = self._unsent_releases, []
        try:
            await self.bus.publish(self.subjects.kvstore(self.node_id, "release"), KvReleaseRequest(
                namespace=self.namespace, owner_id=self.owner_id, pin_ids=pending))
        except ServiceUnavailable:
            self._unsent_releases = pending + self._unsent_releases

    async def keep_alive(self) -> None:
        try:
            await self.bus.publish(self.subjects.kvstore(self.node_id, "keepalive"),
                                   KvKeepAlive(owner_id=self.owner_id))
        except ServiceUnavailable:
            return
        await self.release([])


def _serves(lookup: LookupReply, num_blocks: int) -> bool:
    """Whether the host blocks a lookup pinned are the hit worth loading: the blocks
    wanted lie within them, or are all host hits (then the pin cap cut the pin short, and
    a second pin would meet the same cap: what is pinned is used, maybe nothing). Pinned
    blocks beyond ``num_blocks`` (never with host hits only: each saves the same) stay
    pinned, unused, until the release."""
    return num_blocks > 0 and (num_blocks <= len(lookup.slot_ids)
                               or DISK not in lookup.tiers[:num_blocks])
