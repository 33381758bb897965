"""Paged KV cache in host memory: per-layer block tensors and the block allocator.

Layout per layer: [num_blocks, n_kv_heads, block_size, head_dim]; the slot of token position p of a
sequence is block_table[p // block_size] * block_size + p % block_size.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from moe_engine.model.spec import ModelSpec


def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elem


def blocks_for_budget(spec: ModelSpec, dtype: torch.dtype, budget_gb: float, block_size: int) -> int:
    """How many blocks of `block_size` tokens fit in `budget_gb` GiB."""
    per_block = kv_bytes_per_token(spec, dtype) * block_size
    return int(budget_gb * (1 << 30) // per_block)


@dataclass
class KVCache:
    """The cache tensors: key[layer] and value[layer], each [num_blocks, n_kv, block_size, d]."""

    key: list[torch.Tensor]
    value: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(cls, spec: ModelSpec, num_blocks: int, block_size: int,
                 dtype: torch.dtype) -> "KVCache":
        if num_blocks < 1:
            raise ValueError("KV cache budget is smaller than one block")
        shape = (spec.num_layers, num_blocks, spec.num_kv_heads, block_size, spec.head_dim)
        # One allocation per K/V; zeros so stale pages never hold NaNs a masked kernel could touch.
        k = torch.zeros(shape, dtype=dtype)
        v = torch.zeros(shape, dtype=dtype)
        return cls(key=list(k.unbind(0)), value=list(v.unbind(0)), block_size=block_size)

    @property
    def num_blocks(self) -> int:
        return self.key[0].shape[0]


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
