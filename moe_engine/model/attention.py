"""Attention for packed tokens: causal prefill per sequence, decode over the paged KV cache.

`DecodeAttention` is the one place that chooses the decode path: the Cython kernel of
`moe_engine.model.paged_attention` in the ISA build chosen at import (engine.attention =
auto|cython, on the CPU, when it is built and that build supports the head_dim) or the torch
reference below (engine.attention = torch, any device, and the fallback of auto). Its `name`
and `describe()` say which runs. Both paths share the cache layout [num_blocks, n_kv,
block_size, d] and the slot convention block * block_size + offset (negative slots are padding
and skipped).
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from moe_engine.model.kernel_import import import_kernel


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      seq_lens: list[int], scale: float, *, sinks: Optional[torch.Tensor] = None,
                      window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of each sequence over its own tokens; q [T, nq, d], k [T, nkv, d],
    v [T, nkv, dv] -> [T, nq, dv].

    Tokens are packed without padding, so each sequence is one SDPA call on its own slice; GQA
    is expanded inside SDPA (enable_gqa), never by copying K/V. With attention sinks [nq] or a
    window (a query at i sees keys (i - window, i]), GPT-OSS's, the softmax is written out
    (SDPA has no sink term), the GQA group folded into the query length.
    """
    out = q.new_empty(*q.shape[:2], v.shape[-1])
    start = 0
    for n in seq_lens:
        end = start + n
        if sinks is None and window is None:
            qs = q[start:end].transpose(0, 1).unsqueeze(0)
            ks = k[start:end].transpose(0, 1).unsqueeze(0)
            vs = v[start:end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=True)
            out[start:end] = o.squeeze(0).transpose(0, 1)
        else:
            out[start:end] = _prefill_with_sinks(q[start:end], k[start:end], v[start:end],
                                                 scale, sinks, window)
        start = end
    return out


def _prefill_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        sinks: Optional[torch.Tensor], window: Optional[int]) -> torch.Tensor:
    n, nq, d = q.shape
    nkv = k.shape[1]
    qg = q.float().permute(1, 0, 2).reshape(nkv, nq // nkv * n, d)  # [nkv, G*n, d]
    kf, vf = k.float().permute(1, 0, 2), v.float().permute(1, 0, 2)  # [nkv, n, d]
    pos = torch.arange(n, device=q.device)
    seen = pos[None, :] <= pos[:, None]
    if window is not None:
        seen &= pos[None, :] > pos[:, None] - window
    scores = (qg @ kf.transpose(1, 2)).mul_(scale).view(nkv, nq // nkv, n, n)
    scores = scores.masked_fill(~seen, float("-inf"))
    o = softmax_with_sinks(scores, sinks, nkv) @ vf[:, None]  # [nkv, G, n, d]
    return o.reshape(nq, n, d).transpose(0, 1).to(q.dtype)


def softmax_with_sinks(scores: torch.Tensor, sinks: Optional[torch.Tensor],
                       nkv: int) -> torch.Tensor:
    """softmax over the last dim of scores [..., nkv, G, Tq, Tk] (fp32) with, where given, head
    h's sink logit sinks[h] (query heads h*G.. share KV head h) as one more term of the
    denominator, dropped from the result: transformers' eager GPT-OSS attention, max
    subtracted first as it does."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    shape = scores.shape
    sink = sinks.float().reshape(nkv, -1, 1, 1).expand(*shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


def torch_write_kv(key_cache: torch.Tensor, value_cache: Optional[torch.Tensor],
                   key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, nkv, d] into the paged cache at slot_mapping [T] (int64),
    converted to the cache dtype; negative slots (padding) are skipped. Without a value cache
    (MLA's latent cache, whose values are part of its keys) only the keys are written."""
    bs = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks = torch.div(slots, bs, rounding_mode="floor")
    offsets = slots - blocks * bs
    key_cache[blocks, :, offsets, :] = key[keep].to(key_cache.dtype)
    if value_cache is not None:
        value_cache[blocks, :, offsets, :] = value[keep].to(value_cache.dtype)


def torch_paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                                 value_cache: Optional[torch.Tensor], block_tables: torch.Tensor,
                                 context_lens: torch.Tensor, scale: float, *,
                                 out: Optional[torch.Tensor] = None,
                                 num_threads: int = 0,
                                 value_dim: Optional[int] = None,
                                 sinks: Optional[torch.Tensor] = None,
                                 window: Optional[int] = None) -> torch.Tensor:
    """One query token per sequence against its cached context: the torch reference of the
    Cython kernel, with the same contract (num_threads is ignored), on any device.

    Without a value cache the values are the first `value_dim` dims of the keys (MLA's latent
    cache, model/mla.py) and the result has value_dim dims.

    query [N, nq, d] in fp32 or the cache dtype (the result has the query dtype); softmax and
    accumulation in fp32, like the kernel. The GQA group is folded into the query length
    ([N, nkv, group, d] against [N, nkv, L, d]) so K/V are gathered once per KV head, not
    repeated per query head. Sequences are padded to the longest context of the call and
    masked; a sequence with no context gets zeros. sinks [nq] (GPT-OSS) join each head's
    softmax denominator; with a window only the last `window` positions of the context are
    attended.
    """
    n, nq, d = query.shape
    nkv, bs = key_cache.shape[1], key_cache.shape[2]
    dv = value_cache.shape[-1] if value_cache is not None else value_dim
    ctx = context_lens.long()
    nblk = -(-int(ctx.max()) // bs) if n else 0
    result = torch.zeros(n, nq, dv, dtype=torch.float32, device=query.device)
    if nblk:
        pos = torch.arange(nblk * bs, device=query.device)
        # Table entries past a sequence's last block may hold anything: read block 0 instead.
        used = pos[::bs][None, :] < ctx[:, None]
        tables = torch.where(used, block_tables[:, :nblk].long(), 0)

        def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [N, nkv, nblk * bs, dims] fp32
            return cache[tables].float().permute(0, 2, 1, 3, 4).reshape(n, nkv, nblk * bs, -1)

        q = query.float().reshape(n, nkv, nq // nkv, d)
        seen = pos[None, :] < ctx[:, None]
        if window is not None:
            seen &= pos[None, :] >= ctx[:, None] - window
        mask = seen.reshape(n, 1, 1, nblk * bs)
        keys = gather(key_cache)
        values = gather(value_cache) if value_cache is not None else keys[..., :dv]
        if sinks is None:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        else:
            # One query row per group head: [N, nkv, G, 1, L] in softmax_with_sinks' layout.
            scores = (q.unsqueeze(3) @ keys.unsqueeze(2).transpose(-1, -2)).mul_(scale)
            probs = softmax_with_sinks(scores.masked_fill(~mask.unsqueeze(1), float("-inf")),
                                       sinks, nkv)
            o = (probs @ values.unsqueeze(2)).squeeze(3)
        # A fully masked row (no context) is NaN or garbage depending on the SDPA backend.
        result = torch.where((ctx > 0)[:, None, None], o.reshape(n, nq, dv), 0.0)
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out


class DecodeAttention:
    """The decode-attention path chosen from engine.attention ('auto'|'cython'|'torch').

    'auto' takes the Cython kernel when it can run the model (built, head_dim supported by the
    ISA build chosen at import) and the torch reference otherwise; 'cython' fails instead of
    falling back. `name` is the path that runs ('cython' or 'torch'), `isa` the kernel's ISA
    build (None on torch), `describe()` both, or why the fallback was taken.
    `features` names what the model's attention adds to plain causal attention (ModelSpec
    .attention_features: GPT-OSS's sinks and sliding-window layers); a kernel build without
    one of them (paged_attention.FEATURES) is passed over by auto and refused by 'cython'.
    """

    def __init__(self, impl: str = "auto", num_threads: int = 0,
                 head_dim: Optional[int] = None, latent_value_dim: Optional[int] = None,
                 features: tuple[str, ...] = ()):
        """`head_dim`: the cache entry's width per head (MLA: the latent and the rope key).
        `latent_value_dim`: the cache is MLA's latent cache, whose values are the first
        latent_value_dim dims of its keys (kv_lora_rank)."""
        impl = getattr(impl, "value", impl)
        if impl not in ("auto", "cython", "torch"):
            raise ValueError(f"unknown attention implementation {impl!r}")
        self.num_threads = num_threads
        self.latent_value_dim = latent_value_dim
        self.write_kv: Callable = torch_write_kv
        self.decode: Callable = (torch_paged_decode_attention if latent_value_dim is None else
                                 partial(torch_paged_decode_attention,
                                         value_dim=latent_value_dim))
        self.name = "torch"
        self.isa: Optional[str] = None
        self.fallback_reason: Optional[str] = None
        if impl == "torch":
            return
        kernels = _load_kernels()
        reason = ("the Cython kernels are not built" if kernels is None
                  else kernels.kernel_unavailable(head_dim))
        missing = [f for f in features if kernels is not None and f not in kernels.FEATURES]
        if reason is None and missing:
            reason = f"the Cython kernel does not compute {' or '.join(missing)}"
        if reason is None:
            if latent_value_dim is None:
                self.write_kv = kernels.write_kv
                self.decode = kernels.paged_decode_attention
            else:  # the latent's keys are written by torch_write_kv: one row per token
                self.decode = partial(_latent_on_kernel, kernels.paged_decode_attention,
                                      latent_value_dim)
            self.name = "cython"
            self.isa = kernels.ISA
        elif impl == "cython":
            raise RuntimeError(f"engine.attention=cython but {reason}")
        else:
            self.fallback_reason = reason

    def describe(self) -> str:
        """The path that runs, e.g. 'cython avx2' or 'torch (the Cython kernels are not
        built)'."""
        if self.isa is not None:
            return f"{self.name} {self.isa}"
        return self.name if self.fallback_reason is None else (
            f"{self.name} ({self.fallback_reason})")

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: Optional[torch.Tensor],
                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, sinks: Optional[torch.Tensor] = None,
                 window: Optional[int] = None) -> torch.Tensor:
        # Only models with sinks or windows pass them (the paths take both).
        extra = {} if sinks is None and window is None else {"sinks": sinks, "window": window}
        return self.decode(query, key_cache, value_cache, block_tables, context_lens, scale,
                           num_threads=self.num_threads, **extra)


def _latent_on_kernel(kernel: Callable, value_dim: int, query: torch.Tensor,
                      key_cache: torch.Tensor, value_cache: Optional[torch.Tensor],
                      block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                      out: Optional[torch.Tensor] = None, num_threads: int = 0) -> torch.Tensor:
    """MLA's decode on the GQA kernel: every query head is in the group of the one latent
    "head", and the latent cache is handed over as the keys and as the values, so each block
    is read from memory once (its second reading, as values, comes from the CPU's cache); the
    rope dims of the result are dropped (their share of the P.V work, rope / (rank + rope), is
    the cost of having no kernel of MLA's own)."""
    full = kernel(query, key_cache, key_cache, block_tables, context_lens, scale,
                  num_threads=num_threads)
    if out is None:
        return full[..., :value_dim]
    out.copy_(full[..., :value_dim])
    return out


def _load_kernels():
    return import_kernel("moe_engine.model.paged_attention")
