"""Attention for packed tokens: causal prefill per sequence, decode over the paged KV cache.

Decode uses the Cython kernel of `moe_engine.model.paged_attention` when available (engine.attention =
auto|cython) and the torch path below otherwise (engine.attention = torch); both share the cache
layout [num_blocks, n_kv, block_size, d] and the slot convention block * block_size + offset.
"""
from __future__ import annotations

import importlib
import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      seq_lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention of each sequence over its own tokens; q [T, nq, d], k/v [T, nkv, d].

    Tokens are packed without padding, so each sequence is one SDPA call on its own slice; GQA
    is expanded inside SDPA (enable_gqa), never by copying K/V.
    """
    out = torch.empty_like(q)
    start = 0
    for n in seq_lens:
        end = start + n
        qs = q[start:end].transpose(0, 1).unsqueeze(0)
        ks = k[start:end].transpose(0, 1).unsqueeze(0)
        vs = v[start:end].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = o.squeeze(0).transpose(0, 1)
        start = end
    return out


def torch_write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, nkv, d] into the paged cache at slot_mapping [T] (int64)."""
    bs = key_cache.shape[2]
    blocks = torch.div(slot_mapping, bs, rounding_mode="floor")
    offsets = slot_mapping - blocks * bs
    key_cache[blocks, :, offsets, :] = key
    value_cache[blocks, :, offsets, :] = value


def torch_paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                                 value_cache: torch.Tensor, block_tables: torch.Tensor,
                                 context_lens: torch.Tensor, scale: float, *,
                                 out: Optional[torch.Tensor] = None,
                                 num_threads: int = 0) -> torch.Tensor:
    """One query token per sequence against its cached context; query [N, nq, d].

    The GQA group is folded into the query length ([N, nkv, group, d] against [N, nkv, L, d]) so
    K/V are gathered once per KV head, not repeated per query head. Sequences are padded only to
    the longest context of the call and masked.
    """
    n, nq, d = query.shape
    nkv, bs = key_cache.shape[1], key_cache.shape[2]
    max_len = int(context_lens.max())
    nblk = (max_len + bs - 1) // bs
    tables = block_tables[:, :nblk].long()
    k = key_cache[tables].permute(0, 2, 1, 3, 4).reshape(n, nkv, nblk * bs, d)
    v = value_cache[tables].permute(0, 2, 1, 3, 4).reshape(n, nkv, nblk * bs, d)
    q = query.reshape(n, nkv, nq // nkv, d)
    pos = torch.arange(nblk * bs)
    mask = (pos[None, :] < context_lens[:, None].long()).reshape(n, 1, 1, nblk * bs)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    o = o.reshape(n, nq, d)
    if out is not None:
        out.copy_(o)
        return out
    return o


class DecodeAttention:
    """The decode-attention implementation chosen from engine.attention ('auto'|'cython'|'torch')."""

    def __init__(self, impl: str = "auto", num_threads: int = 0):
        impl = getattr(impl, "value", impl)
        self.num_threads = num_threads
        self.write_kv: Callable = torch_write_kv
        self.decode: Callable = torch_paged_decode_attention
        self.name = "torch"
        if impl in ("auto", "cython"):
            kernels = _load_kernels()
            if kernels is not None and getattr(kernels, "HAS_CYTHON_KERNELS", False):
                self.write_kv = kernels.write_kv
                self.decode = kernels.paged_decode_attention
                self.name = "cython"
            elif impl == "cython":
                raise RuntimeError("engine.attention=cython but the Cython kernels are not built "
                                   "(moe_engine.model.paged_attention.HAS_CYTHON_KERNELS is false)")
        elif impl != "torch":
            raise ValueError(f"unknown attention implementation {impl!r}")

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
        return self.decode(query, key_cache, value_cache, block_tables, context_lens, scale,
                           num_threads=self.num_threads)


def _load_kernels():
    # The extension links its own libgomp beside torch's: two OpenMP pools on the same cores.
    # Its pool must sleep, not spin, between calls, or its idle threads starve torch's GEMM
    # threads (measured: a 20-70x slower step). libgomp reads OMP_WAIT_POLICY when it loads, so
    # set it for that load only; torch's runtime is already initialised and keeps its policy.
    key = "OMP_WAIT_POLICY"
    previous = os.environ.get(key)
    if previous is None:
        os.environ[key] = "PASSIVE"
    try:
        return importlib.import_module("moe_engine.model.paged_attention")
    except ImportError:
        return None
    finally:
        if previous is None:
            os.environ.pop(key, None)
