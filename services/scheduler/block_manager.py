"""Fixed-size KV cache blocks: reference counts, a free list, and the prefix cache
(metadata only; the KV bytes live in the worker).

A block is in exactly one place: in use (ref_count > 0), cached and evictable
(ref_count 0 with a hash: its KV is kept for a later prefix hit, least recently freed
evicted first), or free (ref_count 0, no hash).

Once ``keep_journal()`` is called, the hashes that become findable (``cache_block``) and
that stop being findable (an allocation evicting a cached block) are journaled until
``take_journal()`` drains them: the scheduler publishes them for the gateways' routing
(block_events.py). The in-process engine never asks, and keeps no journal.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()  # confirms a hash hit token by token
    from_kvstore: bool = False  # cached by a load from the kvstore: never stored back


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        # block hash -> findable now? (the last change wins); None: no journal kept
        self._journal: dict[bytes, bool] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and evictable cached ones."""
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[bytes]:
        """Every findable block's hash."""
        return list(self._cached)

    def keep_journal(self) -> None:
        if self._journal is None:
            self._journal = {}

    def take_journal(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes now findable, hashes no longer findable) since the last call."""
        if not self._journal:
            return [], []
        journal, self._journal = self._journal, {}
        return ([block_hash for block_hash, held in journal.items() if held],
                [block_hash for block_hash, held in journal.items() if not held])

    def num_missing_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks to add to ``block_table`` so it holds ``num_tokens`` tokens."""
        return max(0, num_blocks_for(num_tokens, self.block_size) - len(block_table))

    def can_allocate(self, num_blocks: int, num_reused_evictable: int = 0) -> bool:
        """Room for ``num_blocks`` new blocks after ``num_reused_evictable`` cached
        blocks leave the evictable pool (they are being reused by a prefix hit)."""
        return num_blocks <= self.num_free_blocks - num_reused_evictable

    # ------------------------------------------------------------ prefix cache
    def cached_prefix(self, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest run of leading blocks already cached, each
        confirmed by comparing its tokens, not the hash alone."""
        hit_ids: list[int] = []
        cached, blocks = self._cached, self.blocks
        # the prompt's full blocks as tuples, cut lazily (a 16k-token hit: 1,023 of them)
        block_tokens = zip(*[iter(token_ids)] * self.block_size)
        for block_hash, tokens in zip(block_hashes, block_tokens):
            block_id = cached.get(block_hash)
            if block_id is None or blocks[block_id].token_ids != tokens:
                break
            hit_ids.append(block_id)
        return hit_ids

    def num_evictable(self, block_ids: Sequence[int]) -> int:
        return sum(1 for block_id in block_ids if block_id in self._evictable)

    def num_sole(self, block_ids: Sequence[int]) -> int:
        """Blocks of ``block_ids`` no other sequence holds: what freeing them gives back."""
        return sum(1 for block_id in block_ids if self.blocks[block_id].ref_count == 1)

    def reuse(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block_id in block_ids:
            self._evictable.pop(block_id, None)
            self.blocks[block_id].ref_count += 1

    def cache_block(self, block_id: int, block_hash: bytes, token_ids: Sequence[int], *,
                    from_kvstore: bool = False) -> bool:
        """Make a full, computed (or loaded) block findable by its hash; True if it was
        not cached before. If another block already holds the same content, keep that
        one: this block is freed normally later."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.from_kvstore = from_kvstore
        self._cached[block_hash] = block_id
        if self._journal is not None:
            self._journal[block_hash] = True
        return True

    def holds(self, block_id: int, block_hash: bytes) -> bool:
        """Whether the block still holds this content (not evicted and reused since)."""
        return self.blocks[block_id].block_hash == block_hash

    # ------------------------------------------------------------ allocate / free
    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            if self._free_block_ids:
                block_id = self._free_block_ids.popleft()
            else:  # evict the least recently freed cached block
                block_id, _ = self._evictable.popitem(last=False)
                block = self.blocks[block_id]
                del self._cached[block.block_hash]
                if self._journal is not None:
                    self._journal[block.block_hash] = False
                block.block_hash, block.token_ids, block.from_kvstore = None, (), False
            self.blocks[block_id].ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Freed in reverse, so a sequence's tail
        is evicted before its prefix, which more requests are likely to share."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is not None:
                self._evictable[block_id] = None
            else:
                self._free_block_ids.append(block_id)
