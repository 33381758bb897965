"""Multi-head latent attention (DeepSeek-V2/V3) in its absorbed form, over a latent KV cache.

transformers caches the latent c (kv_lora_rank, after kv_a_layernorm) and the rope key k_pe
(qk_rope_head_dim, shared by every head), then up-projects c to each head's nope key
W_UK c and value W_UV c before attending. The engine caches the same [c | k_pe] per token and
never up-projects it: a head's score q_nope . (W_UK c) + q_pe . k_pe is
(W_UK^T q_nope) . c + q_pe . k_pe, so the query is moved into the latent space once
(`mla_projection`: q_latent = [W_UK^T q_nope | q_pe]) and attention runs as one-key-head
(MQA) attention whose keys are the cached [c | k_pe] and whose values are their first
kv_lora_rank dims; the attended latent is mapped to the head's value by W_UV afterwards
(`latent_to_values`), before o_proj. Prefill takes the same form as decode: attention then
needs no weights, so it runs wherever the KV cache is (the offload pipeline's CPU attention),
at the cost of attending over kv_lora_rank + rope dims instead of nope + rope.
"""
from __future__ import annotations

import torch

from moe_engine.model.layers import RotaryTable, linear, rms_norm
from moe_engine.model.packed import PackedLinear
from moe_engine.model.spec import ModelSpec
from moe_engine.model.weights import DenseLayerWeights, MlaWeights

# q_a_layernorm and kv_a_layernorm are built with RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_projection(dense: DenseLayerWeights, h: torch.Tensor, spec: ModelSpec,
                   rope: RotaryTable, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q in the latent space [T, heads, rank + rope], the cache entry [c | k_pe] [T, 1,
    rank + rope] and the values, a view of its first rank dims [T, 1, rank]."""
    a, m = spec.mla, dense.mla
    t = h.shape[0]
    q_width = a.q_lora_rank or spec.q_size
    q, c, k_pe = linear(h, dense.wqkv).split([q_width, a.kv_lora_rank, a.qk_rope_head_dim], -1)
    if m.wq_b is not None:
        q = linear(rms_norm(q, m.q_a_norm, LATENT_NORM_EPS), m.wq_b)
    q_nope, q_pe = q.reshape(t, spec.num_heads, spec.head_dim).split(
        [a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
    query = torch.cat([per_head(q_nope, m.w_uk), rope.apply(q_pe, positions)], dim=-1)
    c = rms_norm(c, m.kv_a_norm, LATENT_NORM_EPS)
    key = torch.cat([c, rope.apply(k_pe.reshape(t, 1, -1), positions).reshape(t, -1)], dim=-1)
    key = key.unsqueeze(1)
    return query, key, key[..., :a.kv_lora_rank]


def latent_to_values(m: MlaWeights, attn: torch.Tensor) -> torch.Tensor:
    """The attended latents [T, heads * rank] mapped by each head's W_UV: [T, heads * v]."""
    heads = len(m.w_uv)
    t = attn.shape[0]
    return per_head(attn.reshape(t, heads, -1), m.w_uv).reshape(t, -1)


def per_head(x: torch.Tensor, w: torch.Tensor | tuple[PackedLinear, ...]) -> torch.Tensor:
    """x [T, heads, k] through each head's own map: x[:, h] @ w[h] for w [heads, k, n] (one
    batched matmul), or one packed GEMM per head (rows independent of their batch)."""
    if isinstance(w, torch.Tensor):
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)
    return torch.stack([linear(x[:, h], w_h) for h, w_h in enumerate(w)], dim=1)
