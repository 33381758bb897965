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


class WindowPool:
    """The blocks of a model's sliding-window layers (GPT-OSS), apart from the full layers'.

    A query at position p of such a layer sees keys (p - window, p] only, so a sequence of t
    tokens (the one being written included) keeps just the blocks of positions
    [t - window, t - 1]: ModelSpec.window_blocks_per_sequence at most, however long it grows.
    A sequence's `window_table` is indexed by block position like `block_table`; entries of
    blocks that left the window are -1 (freed, never read: see paged_attention's window).
    """

    def __init__(self, allocator: BlockAllocator, window: int):
        self.allocator = allocator
        self.window = window

    def _live(self, num_tokens: int) -> range:
        bs = self.allocator.block_size
        return range(max(0, num_tokens - self.window) // bs, (num_tokens - 1) // bs + 1)

    def needed(self, table: list[int], num_tokens: int) -> int:
        """New blocks a table needs to hold the window of `num_tokens` tokens."""
        return sum(1 for b in self._live(num_tokens) if b >= len(table) or table[b] < 0)

    def expire(self, table: list[int], num_tokens: int) -> None:
        """Free the table's blocks that left the window of `num_tokens` tokens (always safe:
        no later step reads them)."""
        first = self._live(num_tokens).start
        for b in range(min(first, len(table))):
            if table[b] >= 0:
                self.allocator.free([table[b]])
                table[b] = -1

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Expire, then allocate the window's missing blocks (callers check `needed` first)."""
        self.expire(table, num_tokens)
        live = self._live(num_tokens)
        table.extend([-1] * (live.stop - len(table)))
        for b in live:
            if table[b] < 0:
                table[b] = self.allocator.allocate(1)[0]

    def release(self, table: list[int]) -> None:
        self.allocator.free([b for b in table if b >= 0])
        table.clear()
