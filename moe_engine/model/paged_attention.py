"""Decode attention over the paged host KV cache, and appending K/V rows to it.

Thin wrapper around the Cython kernel `moe_engine._kernels.paged_attention` (built from
kernels_cy/ by setup.py). It validates shapes, dtypes and contiguity, then hands raw pointers to
the kernel, which releases the GIL and runs one OpenMP task per (sequence, KV head).

Cache layout, one layer: key_cache and value_cache are [num_blocks, n_kv_heads, block_size,
head_dim], fp32, bf16 or fp16. Each (block, KV head) is one contiguous run of
block_size*head_dim elements, so the task for (sequence, KV head) streams contiguous runs and
reads every KV byte once for all query heads of its GQA group.

The kernel is built once per ISA (kernels_cy/paged_attention_impl.h); the one that runs is the
ISA the packed kernels chose at import (`moe_engine.model.packed.ISA`: CPUID, or MOE_BATCH_ISA),
and every call takes `isa=` too. head_dim must be a multiple of that ISA's vector width (4
generic, 8 avx2 and avxvnni, 16 the AVX-512 builds).

This module is the kernel only: it does not choose a fallback. When the extension is not built
(HAS_CYTHON_KERNELS is False) or the ISA cannot run the head_dim (`kernel_unavailable` says
why), its functions refuse to run; the engine's decode path is chosen once, in
`moe_engine.model.attention.DecodeAttention`, which then takes the torch reference.
"""
from __future__ import annotations

import torch

from typing import Optional

from moe_engine.model import packed
from moe_engine.model.kernel_import import import_kernel

# None when not built: DecodeAttention takes the torch reference
_ext = import_kernel("moe_engine._kernels.paged_attention")

HAS_CYTHON_KERNELS: bool = _ext is not None
# What the kernel adds to plain causal attention (ModelSpec.attention_features names).
FEATURES: tuple[str, ...] = ("attention sinks", "sliding-window layers")
HAS_OPENMP: bool = bool(_ext is not None and _ext.OPENMP_ENABLED)
# The ISA build that runs: one choice per process, shared with the packed kernels.
ISA: Optional[str] = packed.ISA if _ext is not None else None

_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_CODES = (
    {torch.float32: _ext.DTYPE_F32, torch.bfloat16: _ext.DTYPE_BF16, torch.float16: _ext.DTYPE_F16}
    if _ext is not None else {}
)


def supported_isas() -> list[str]:
    """ISA builds of the kernel this CPU can run, best last ([] when not built)."""
    return packed.supported_isas() if _ext is not None else []


def head_dim_multiple(isa: Optional[str] = None) -> int:
    """head_dim must be a multiple of this on `isa` (default: ISA), its vector width."""
    return _ext.head_dim_multiple(packed.isa_code(isa or ISA))


def kernel_unavailable(head_dim: Optional[int] = None, isa: Optional[str] = None) -> Optional[str]:
    """Why the kernel cannot run a model with this head_dim on `isa` (default: the ISA chosen
    at import), or None when it can."""
    if _ext is None:
        return "the Cython kernels are not built (python setup.py build_ext --inplace)"
    name = isa or ISA
    if name not in supported_isas():
        return _unsupported(name)
    multiple = head_dim_multiple(name)
    if head_dim is not None and (head_dim <= 0 or head_dim % multiple != 0):
        return f"head_dim {head_dim} is not a multiple of {multiple} (the {name} vector width)"
    return None


def _unsupported(name: Optional[str]) -> str:
    return f"ISA {name!r} is not supported by this CPU (supported: {supported_isas()})"


def _isa(isa: Optional[str]) -> str:
    """isa, or ISA by default; one this CPU cannot run is refused rather than run (it would
    fault)."""
    name = isa or ISA
    if name not in supported_isas():
        raise ValueError(_unsupported(name))
    return name


def _require_kernel(head_dim: Optional[int] = None, isa: Optional[str] = None) -> None:
    reason = kernel_unavailable(head_dim, isa)
    if reason is not None:
        raise RuntimeError(f"the paged-attention kernel cannot run: {reason}; "
                           "DecodeAttention falls back to the torch reference")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _require(t.dim() == 4, f"{name} must be [num_blocks, n_kv_heads, block_size, head_dim], "
                               f"got shape {tuple(t.shape)}")
        _require(t.dtype in _CACHE_DTYPES, f"{name} dtype must be float32, bfloat16 or float16, "
                                           f"got {t.dtype}")
        _require(t.device.type == "cpu", f"{name} must be on the CPU, got {t.device}")
        _require(t.is_contiguous(), f"{name} must be contiguous")
    _require(key_cache.shape == value_cache.shape and key_cache.dtype == value_cache.dtype,
             f"key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache "
             f"{tuple(value_cache.shape)} {value_cache.dtype} must match")


def _check_attention_args(query, key_cache, value_cache, block_tables, context_lens, out) -> None:
    _check_cache(key_cache, value_cache)
    _require(query.dim() == 3, f"query must be [num_seqs, n_q_heads, head_dim], got shape "
                               f"{tuple(query.shape)}")
    _require(query.dtype in (torch.float32, key_cache.dtype),
             f"query dtype must be float32 or the cache dtype {key_cache.dtype}, got {query.dtype}")
    _require(query.device.type == "cpu" and query.is_contiguous(), "query must be a contiguous "
                                                                   "CPU tensor")
    num_seqs, n_q, d = query.shape
    _, n_kv, _, d_cache = key_cache.shape
    _require(d == d_cache, f"query head_dim {d} != cache head_dim {d_cache}")
    _require(n_kv > 0 and n_q % n_kv == 0, f"n_q_heads {n_q} must be a multiple of n_kv_heads {n_kv}")
    _require(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
             f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq], got "
             f"{tuple(block_tables.shape)}")
    _require(context_lens.shape == (num_seqs,), f"context_lens must be [num_seqs={num_seqs}], got "
                                                f"{tuple(context_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        _require(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
        _require(t.device.type == "cpu" and t.is_contiguous(), f"{name} must be a contiguous "
                                                               "CPU tensor")
    if out is not None:
        _require(out.shape == query.shape and out.dtype == query.dtype,
                 f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}")
        _require(out.device.type == "cpu" and out.is_contiguous(), "out must be a contiguous "
                                                                   "CPU tensor")


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                           out: torch.Tensor | None = None, num_threads: int = 0,
                           isa: Optional[str] = None, sinks: Optional[torch.Tensor] = None,
                           window: Optional[int] = None) -> torch.Tensor:
    """Attention of one new query token per sequence over its cached keys and values.

    query [num_seqs, n_q_heads, head_dim], fp32 or the cache dtype (the output has the query
    dtype); key_cache/value_cache one layer, [num_blocks, n_kv_heads, block_size, head_dim];
    block_tables int32 [num_seqs, max_blocks_per_seq] (entries past a sequence's last block are
    ignored); context_lens int32 [num_seqs] (a sequence with 0 tokens gets a zero output);
    scale multiplies q.k (usually head_dim ** -0.5). Query heads h*G..h*G+G-1 share KV head h
    (G = n_q_heads / n_kv_heads). num_threads 0 uses torch.get_num_threads(). isa None runs
    the ISA chosen at import (ISA). Softmax and accumulation are fp32; a sequence's result does
    not depend on num_threads nor on the other sequences of the call. GPT-OSS: sinks [n_q]
    (any float dtype) join each head's softmax denominator; with a window only the last
    `window` tokens of a context are attended (the table entries of earlier blocks are not read).
    """
    _check_attention_args(query, key_cache, value_cache, block_tables, context_lens, out)
    num_seqs, n_q, d = query.shape
    if sinks is not None:
        _require(sinks.shape == (n_q,) and sinks.device.type == "cpu",
                 f"sinks must be a CPU tensor [{n_q}], got {tuple(sinks.shape)} on {sinks.device}")
        sinks = sinks.float().contiguous()
    _require(window is None or window > 0, f"window must be positive, got {window}")
    _require_kernel()
    isa = _isa(isa)
    _require_kernel(d, isa)
    num_blocks, n_kv, block_size, _ = key_cache.shape
    q32 = query if query.dtype == torch.float32 else query.float()
    if out is not None and out.dtype == torch.float32:
        res = out
    else:
        res = torch.empty((num_seqs, n_q, d), dtype=torch.float32)
    # An explicit count, never OpenMP's default: torch's and the extension's OpenMP runtimes
    # would otherwise each size their team to the machine and oversubscribe it.
    threads = num_threads if num_threads > 0 else torch.get_num_threads()
    _ext.decode_attention(q32.data_ptr(), res.data_ptr(), key_cache.data_ptr(),
                          value_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
                          num_seqs, n_q, n_kv, d, num_blocks, block_size, block_tables.shape[1],
                          _DTYPE_CODES[key_cache.dtype], float(scale), threads,
                          packed.isa_code(isa), sinks.data_ptr() if sinks is not None else 0,
                          window or 0)
    if res.dtype == query.dtype:
        return res
    if out is None:
        return res.to(query.dtype)
    out.copy_(res)
    return out


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new rows key/value [num_tokens, n_kv_heads, head_dim] (any float dtype, converted
    to the cache dtype with torch's rounding) at slot_mapping int64 [num_tokens], where
    slot = block * block_size + offset. Negative slots mark padding tokens and are skipped."""
    _check_cache(key_cache, value_cache)
    num_blocks, n_kv, block_size, d = key_cache.shape
    for name, t in (("key", key), ("value", value)):
        _require(t.dim() == 3 and tuple(t.shape[1:]) == (n_kv, d),
                 f"{name} must be [num_tokens, {n_kv}, {d}], got {tuple(t.shape)}")
        _require(t.is_floating_point() and t.device.type == "cpu", f"{name} must be a float CPU "
                                                                   "tensor")
    _require(key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} "
                                       "must match")
    _require(slot_mapping.dtype == torch.int64 and slot_mapping.shape == (key.shape[0],),
             f"slot_mapping must be int64 [{key.shape[0]}], got {slot_mapping.dtype} "
             f"{tuple(slot_mapping.shape)}")
    _require(slot_mapping.device.type == "cpu" and slot_mapping.is_contiguous(),
             "slot_mapping must be a contiguous CPU tensor")
    _require_kernel()
    k = key.to(key_cache.dtype).contiguous()
    v = value.to(value_cache.dtype).contiguous()
    _ext.write_kv(key_cache.data_ptr(), value_cache.data_ptr(), k.data_ptr(), v.data_ptr(),
                  slot_mapping.data_ptr(), k.shape[0], n_kv, d, num_blocks, block_size,
                  k.element_size())


def read_sum(buf: torch.Tensor, threads: int, isa: Optional[str] = None) -> float:
    """Sum of a contiguous fp32 CPU tensor whose size is a multiple of 2**16, read with `isa`'s
    vectors (default: the best this CPU has) on `threads` threads: the read-bandwidth probe
    that benchmarks set the kernel against."""
    _require_kernel()
    _require(buf.dtype == torch.float32 and buf.device.type == "cpu" and buf.is_contiguous(),
             "read_sum takes a contiguous fp32 CPU tensor")
    return _ext.read_sum(buf.data_ptr(), buf.numel(), max(threads, 1),
                         packed.isa_code(_isa(isa or supported_isas()[-1])))
