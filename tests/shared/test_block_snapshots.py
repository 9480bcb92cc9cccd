"""Snapshot paging shared by the scheduler and the kvstore: pages cut across parts keep
each part's namespace and tier, add up to the whole, and a snapshot expires."""

from __future__ import annotations

import pytest

from shared.block_snapshots import SNAPSHOT_TTL_S, KeptSnapshots, page_parts
from shared.errors import InvalidRequest
from shared.messages import BlockSnapshotPart

PARTS = [BlockSnapshotPart(namespace="a", tier="host", block_hashes=[b"1", b"2", b"3"]),
         BlockSnapshotPart(namespace="a", tier="disk", block_hashes=[]),
         BlockSnapshotPart(namespace="b", tier="disk", block_hashes=[b"4", b"5"])]


@pytest.mark.parametrize("limit", [1, 2, 3, 4, 10])
def test_pages_add_up_to_the_parts(limit):
    got: dict[tuple[str, str], list[bytes]] = {}
    for offset in range(0, 5, limit):
        for part in page_parts(PARTS, offset, limit):
            assert 0 < len(part.block_hashes) <= limit
            got.setdefault((part.namespace, part.tier), []).extend(part.block_hashes)
    assert got == {("a", "host"): [b"1", b"2", b"3"], ("b", "disk"): [b"4", b"5"]}
    assert page_parts(PARTS, 5, limit) == []


def test_kept_snapshots_page_until_they_expire():
    kept = KeptSnapshots()
    kept.keep(7, PARTS, now=0.0)
    reply = kept.page("k1", 7, 2, now=1.0, limit=2)
    assert (reply.source_id, reply.seq, reply.num_hashes, reply.offset) == ("k1", 7, 5, 2)
    assert [(p.tier, p.block_hashes) for p in reply.parts] == [("host", [b"3"]), ("disk", [b"4"])]
    with pytest.raises(InvalidRequest):
        kept.page("k1", 7, 0, now=SNAPSHOT_TTL_S)
    with pytest.raises(InvalidRequest):
        kept.page("k1", 8, 0, now=1.0)
