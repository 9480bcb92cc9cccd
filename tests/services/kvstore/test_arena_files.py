"""Arena files at start: a dead kvstore's are removed, a live one's (locked) are kept."""

from __future__ import annotations

import os

from services.kvstore.service import lock_arena, remove_stale_arenas


def test_only_dead_kvstores_arenas_are_removed(tmp_path):
    dead = tmp_path / "flotilla-kv-node1-ns-dead"
    live = tmp_path / "flotilla-kv-node1-ns-live"
    other_node = tmp_path / "flotilla-kv-node2-ns-dead"
    for path in (dead, live, other_node):
        path.write_bytes(b"x")
    fd = lock_arena(live)
    try:
        assert remove_stale_arenas(tmp_path, "node1") == 1
        assert not dead.exists() and live.exists() and other_node.exists()
    finally:
        os.close(fd)
    assert remove_stale_arenas(tmp_path, "node1") == 1 and not live.exists()
