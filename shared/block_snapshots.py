"""Block snapshots for the gateways' routing index (docs/routing.md): the limits both
holders (a scheduler's GPU prefix cache, a kvstore's host and disk tiers) page by, and
the kept snapshots a kvstore pages out. Pure: no I/O, no clock (callers pass ``now``).

A snapshot is taken on ``BlockSnapshotRequest(offset=0)``, right after the holder's
pending block events are drained, so it is exactly the state after the seq it reports;
it is kept SNAPSHOT_TTL_S (at most MAX_SNAPSHOTS_KEPT) and paged out
MAX_HASHES_PER_PAGE hashes at a time, later pages naming it by ``snapshot_seq``.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.errors import InvalidRequest
from shared.messages import BlockSnapshotPart, BlockSnapshotReply

MAX_HASHES_PER_PAGE = 16_000  # ~550 KB: under NATS's default 1 MB payload
SNAPSHOT_TTL_S = 10.0  # a reader pages one snapshot within this
MAX_SNAPSHOTS_KEPT = 4


def page_parts(parts: Sequence[BlockSnapshotPart], offset: int,
               limit: int) -> list[BlockSnapshotPart]:
    """The hashes ``offset:offset + limit`` of the parts read one after another, still
    grouped by part (a part cut by a page boundary goes out in two pieces)."""
    page: list[BlockSnapshotPart] = []
    start = 0  # where the part begins in the whole
    for part in parts:
        end = start + len(part.block_hashes)
        if end > offset and limit > 0:
            lo = max(0, offset - start)
            hashes = part.block_hashes[lo:lo + limit]
            page.append(BlockSnapshotPart(namespace=part.namespace, tier=part.tier,
                                          block_hashes=hashes))
            limit -= len(hashes)
            offset += len(hashes)
        start = end
    return page


class KeptSnapshots:
    """The snapshots a holder took lately, by the seq each describes."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[float, list[BlockSnapshotPart], int]] = {}

    def keep(self, seq: int, parts: list[BlockSnapshotPart], now: float) -> None:
        self._kept = {s: kept for s, kept in self._kept.items() if now - kept[0] < SNAPSHOT_TTL_S}
        if seq not in self._kept:
            self._kept[seq] = (now, parts, sum(len(part.block_hashes) for part in parts))
            while len(self._kept) > MAX_SNAPSHOTS_KEPT:
                del self._kept[min(self._kept)]

    def page(self, source_id: str, seq: int, offset: int, now: float,
             limit: int | None = None) -> BlockSnapshotReply:
        """One page from ``offset`` (``limit`` hashes, MAX_HASHES_PER_PAGE by default);
        InvalidRequest when that snapshot has expired or was never taken."""
        kept = self._kept.get(seq)
        if kept is None or now - kept[0] >= SNAPSHOT_TTL_S:
            raise InvalidRequest(f"snapshot {seq} is gone: ask for a new one (offset 0)",
                                 param="snapshot_seq", code="snapshot_gone")
        _, parts, num_hashes = kept
        return BlockSnapshotReply(source_id=source_id, seq=seq, num_hashes=num_hashes,
                                  offset=offset,
                                  parts=page_parts(parts, offset, limit or MAX_HASHES_PER_PAGE))
