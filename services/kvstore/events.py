"""Block events, batched: what entered or left each tier since the last flush, as
``KvBlockEvent``s with a sequence number counting up per store. Pure."""

from __future__ import annotations

from collections.abc import Iterable

from shared.kv_messages import KvBlockEvent

MAX_HASHES_PER_EVENT = 2000  # ~70 KB of hashes: well under NATS's 1 MB message limit


class EventBatcher:
    def __init__(self, store_id: str, node_id: str) -> None:
        self.store_id = store_id
        self.node_id = node_id
        self.seq = 0
        # (namespace, tier) -> hash -> held after the last change? (the last change wins,
        # so a block stored and removed within one batch is reported as it ends up)
        self._pending: dict[tuple[str, str], dict[bytes, bool]] = {}

    def add(self, namespace: str, tier: str, stored: Iterable[bytes] = (),
            removed: Iterable[bytes] = ()) -> None:
        changes = None
        for held, hashes in ((True, stored), (False, removed)):
            for block_hash in hashes:
                if changes is None:
                    changes = self._pending.setdefault((namespace, tier), {})
                changes.pop(block_hash, None)  # keep the order of the last change
                changes[block_hash] = held

    def __bool__(self) -> bool:
        return bool(self._pending)

    def flush(self, now: float) -> list[KvBlockEvent]:
        events = []
        for (namespace, tier), changes in self._pending.items():
            items = list(changes.items())
            for start in range(0, len(items), MAX_HASHES_PER_EVENT):
                chunk = items[start:start + MAX_HASHES_PER_EVENT]
                self.seq += 1
                events.append(KvBlockEvent(
                    store_id=self.store_id, node_id=self.node_id, namespace=namespace,
                    seq=self.seq, tier=tier, timestamp=now,
                    stored_hashes=[h for h, held in chunk if held],
                    removed_hashes=[h for h, held in chunk if not held]))
        self._pending.clear()
        return events
