"""The math of a Mixtral-style decoder layer as plain functions over packed tokens [T, ...].

Mirrors transformers' modeling_mixtral numerically (RMSNorm in fp32, router softmax in fp32,
top-k weights renormalised) so fp32 runs match it to rounding.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moe_engine.model.spec import ModelSpec, RopeSpec
from moe_engine.model.weights import DenseLayerWeights, ExpertWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back before the weight, as transformers does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor for the configured RoPE type."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope.rope_type
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / rope.factor, 1.0
    if kind == "llama3":
        old = rope.original_max_position_embeddings or 8192
        low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        old = rope.original_max_position_embeddings or 4096
        attn = rope.attention_factor
        if attn is None:
            attn = 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0

        def corr(rot: float) -> float:
            return head_dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(rope.theta))

        low = max(math.floor(corr(rope.beta_fast)), 0)
        high = min(math.ceil(corr(rope.beta_slow)), head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extra = 1 - ramp
        return inv / rope.factor * (1 - extra) + inv * extra, float(attn)
    raise ValueError(f"unsupported rope_type {kind!r} (default, linear, llama3, yarn)")


class RotaryTable:
    """cos/sin for every position up to max_positions, computed once in fp32, stored in dtype."""

    def __init__(self, spec: ModelSpec, max_positions: int, dtype: torch.dtype):
        inv, scale = rope_inv_freq(spec.rope, spec.head_dim)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scale).to(dtype)
        self.sin = (emb.sin() * scale).to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, d] by its token positions [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


def qkv_projection(dense: DenseLayerWeights, h: torch.Tensor, spec: ModelSpec,
                   rope: RotaryTable, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused q|k|v GEMM plus RoPE; returns q [T, nq, d], k and v [T, nkv, d]."""
    qkv = F.linear(h, dense.wqkv)
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    t = h.shape[0]
    q = rope.apply(q.reshape(t, spec.num_heads, spec.head_dim), positions)
    k = rope.apply(k.reshape(t, spec.num_kv_heads, spec.head_dim), positions)
    return q, k, v.reshape(t, spec.num_kv_heads, spec.head_dim)


def route(router: torch.Tensor, h: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral router: softmax over all experts in fp32, top-k, renormalise the k weights."""
    probs = torch.softmax(F.linear(h, router).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def moe_ffn(experts: list[ExpertWeights], h: torch.Tensor, weights: torch.Tensor,
            indices: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over the tokens routed to them, grouped by expert (one GEMM pair each).

    Tokens of the step are sorted by expert once; each expert then runs on its contiguous slice,
    so the Python loop is over experts, never tokens, and the expert order is free for a pager.
    """
    t, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    gathered = h[token_of]
    outs = torch.empty_like(gathered)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        end = start + n
        gate_up = F.linear(gathered[start:end], experts[e].w13)
        gate, up = gate_up.chunk(2, dim=-1)
        outs[start:end] = F.linear(F.silu(gate) * up, experts[e].w2)
        start = end
    # Weighting in fp32 then casting mirrors transformers (router weights are fp32).
    scaled = (outs * weights.reshape(-1)[order, None]).to(h.dtype)
    out = torch.zeros_like(h)
    out.index_add_(0, token_of, scaled)
    return out
