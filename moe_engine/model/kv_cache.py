"""Paged KV cache in host memory: the per-layer block tensors and their size budget.

Layout per layer: [num_blocks, n_kv_heads, block_size, head_dim]; the slot of token position p of a
sequence is block_table[p // block_size] * block_size + p % block_size. MLA (DeepSeek) caches one
latent entry per token instead, [num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim] in
`key`, whose first kv_lora_rank dims are also the values: `value` is then empty.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass
class KVCache:
    """The cache tensors: key[layer] and value[layer], each [num_blocks, n_kv, block_size, d];
    value is [] for a latent cache (ModelSpec.kv_cache_layout)."""

    key: list[torch.Tensor]
    value: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(cls, spec: ModelSpec, num_blocks: int, block_size: int,
                 dtype: torch.dtype) -> "KVCache":
        if num_blocks < 1:
            raise ValueError("KV cache budget is smaller than one block")
        heads, key_dim, value_dim = spec.kv_cache_layout
        shape = (spec.num_layers, num_blocks, heads, block_size)
        # One allocation per K/V; zeros so stale pages never hold NaNs a masked kernel could touch.
        k = torch.zeros(shape + (key_dim,), dtype=dtype)
        v = torch.zeros(shape + (value_dim,), dtype=dtype) if value_dim else None
        return cls(key=list(k.unbind(0)), value=list(v.unbind(0)) if v is not None else [],
                   block_size=block_size)

    @property
    def num_blocks(self) -> int:
        return self.key[0].shape[0]
