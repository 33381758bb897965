"""Paged KV cache in host memory: the per-layer block tensors and their size budget.

Layout per layer: [num_blocks, n_kv_heads, block_size, head_dim]; the slot of token position p of a
sequence is block_table[p // block_size] * block_size + p % block_size. MLA (DeepSeek) caches one
latent entry per token instead, [num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim] in
`key`, whose first kv_lora_rank dims are also the values: `value` is then empty.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_engine.host_alloc import huge_page_zeros
from moe_engine.model.spec import GB, ModelSpec


def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers, stored in `dtype` (the engine's
    dtype may override the checkpoint's)."""
    return spec.with_dtype(str(dtype)).kv_bytes_per_token


def blocks_for_budget(spec: ModelSpec, dtype: torch.dtype, budget_gb: float, block_size: int) -> int:
    """How many blocks of `block_size` tokens fit in `budget_gb` GB (1e9 bytes: the unit the
    policy search plans kv_cache_gb in, so the engine allocates the blocks it planned)."""
    per_block = kv_bytes_per_token(spec, dtype) * block_size
    return int(budget_gb * GB // per_block)


def kv_pool_blocks(spec: ModelSpec, dtype: torch.dtype, budget_gb: float, block_size: int,
                   max_num_seqs: int) -> tuple[int, Optional[int]]:
    """(blocks of the full layers, blocks of the sliding-window layers or None) for a budget.

    A model with both kinds of layers (GPT-OSS) keeps its windowed layers' K/V in a pool of
    their own, where a sequence holds at most spec.window_blocks_per_sequence blocks however long
    it grows: enough for max_num_seqs sequences, within half the budget (at least one sequence's
    worth); the full layers get the rest. Otherwise every layer shares one pool, as before.
    """
    if not spec.pools_window_kv:
        return blocks_for_budget(spec, dtype, budget_gb, block_size), None
    windowed = spec.num_windowed_layers
    layer_block = spec.with_dtype(str(dtype)).kv_bytes_per_token_layer * block_size
    per_seq = spec.window_blocks_per_sequence(block_size)
    half = int(budget_gb * GB / 2 // (windowed * layer_block))
    window_blocks = max(per_seq, min(max_num_seqs * per_seq, half))
    rest = budget_gb * GB - window_blocks * windowed * layer_block
    return int(rest // ((spec.num_layers - windowed) * layer_block)), window_blocks


@dataclass
class KVCache:
    """The cache tensors: key[layer] and value[layer], each [num_blocks, n_kv, block_size, d];
    value is [] for a latent cache (ModelSpec.kv_cache_layout)."""

    key: list[torch.Tensor]
    value: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(cls, spec: ModelSpec, num_blocks: int, block_size: int,
                 dtype: torch.dtype, window_blocks: Optional[int] = None) -> "KVCache":
        """num_blocks per layer, or window_blocks on the sliding-window layers when given
        (kv_pool_blocks)."""
        if num_blocks < 1:
            raise ValueError("KV cache budget is smaller than one block")
        heads, key_dim, value_dim = spec.kv_cache_layout
        blocks_of = [window_blocks if window_blocks is not None and
                     spec.attention_window(i) is not None else num_blocks
                     for i in range(spec.num_layers)]
        # One allocation per K/V and pool; zeros so stale pages never hold NaNs a masked
        # kernel could touch; huge pages, since attention reads each block as a run of its own
        # (host_alloc). A latent cache (MLA) has no value tensors.
        pools = {}
        for blocks in set(blocks_of):
            shape = (blocks_of.count(blocks), blocks, heads, block_size)
            values = (iter(huge_page_zeros(shape + (value_dim,), dtype).unbind(0))
                      if value_dim else None)
            pools[blocks] = (iter(huge_page_zeros(shape + (key_dim,), dtype).unbind(0)), values)
        return cls(key=[next(pools[b][0]) for b in blocks_of],
                   value=[next(pools[b][1]) for b in blocks_of] if value_dim else [],
                   block_size=block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks of the largest pool (the full layers' where a model has two)."""
        return max(t.shape[0] for t in self.key)
