"""KV block manager: the free list of paged-cache blocks that sequences' block tables point into.

The cache tensors themselves live in `moe_engine.model.kv_cache`; this module only decides which
block ids a sequence owns, so the scheduler can admit, grow and preempt without touching tensors.
"""
from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Free list of cache blocks; sequences own the blocks listed in their block tables."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.high_water = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks; raises when there are not enough (callers check can_allocate first)."""
        if n > len(self._free):
            raise RuntimeError(f"KV cache exhausted: need {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self.high_water = max(self.high_water, self.num_used)
        return blocks

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
