"""Fixed-size KV cache blocks: a free list and per-request block tables (metadata only)."""

from __future__ import annotations

from collections import deque


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    def num_missing_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks to add to ``block_table`` so it holds ``num_tokens`` tokens."""
        return max(0, num_blocks_for(num_tokens, self.block_size) - len(block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free_block_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        return [self._free_block_ids.popleft() for _ in range(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        self._free_block_ids.extend(block_ids)
