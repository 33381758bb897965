"""The math of a MoE decoder layer as plain functions over packed tokens [T, ...].

Mirrors transformers' Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5-MoE, DeepSeek-V3/V2,
GPT-OSS, ERNIE-4.5-MoE and Llama-4 (text) numerically (RMSNorm in fp32, router scores in fp32,
top-k weights renormalised where the spec says so) so fp32 runs match them to rounding;
DeepSeek's latent attention is in model/mla.py.
Where the architectures differ, a ModelSpec flag picks the branch.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from moe_engine.model.packed import PackedLinear, is_packed, packed_linear, packed_moe_ffn
from moe_engine.model.spec import ModelSpec, RopeSpec
from moe_engine.model.weights import DenseLayerWeights, ExpertWeights


def linear(x: torch.Tensor, w: torch.Tensor | PackedLinear,
           b: Optional[torch.Tensor] = None, activation: Optional[str] = None) -> torch.Tensor:
    """activation(x @ w.T + b) (activation None or "sigmoid") on the packed CPU kernels when the
    weight is packed, else torch's."""
    if isinstance(w, PackedLinear):
        return packed_linear(x, w, b, activation=activation)
    y = F.linear(x, w, b)
    return torch.sigmoid(y) if activation == "sigmoid" else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back before the weight, as transformers does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor for the configured RoPE type."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope.rope_type
    # Dynamic NTK rescales only once a sequence outgrows max_position_embeddings, and the
    # engine never runs one that long: inside the context it is the default RoPE.
    if kind in ("default", "dynamic"):
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
        return _yarn_inv_freq(rope, head_dim, inv)
    raise ValueError(f"unsupported rope_type {kind!r} (default, dynamic, linear, llama3, yarn)")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn_inv_freq(rope: RopeSpec, head_dim: int, inv: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies, keep the high ones, ramp in between; scale
    cos/sin by attention_factor (from factor, or the mscale ratio when both are given)."""
    old = rope.original_max_position_embeddings or 4096
    attn = rope.attention_factor
    if attn is None:
        if rope.mscale and rope.mscale_all_dim:
            attn = _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
        else:
            attn = _yarn_mscale(rope.factor)

    def corr(rot: float) -> float:
        return head_dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = corr(rope.beta_fast), corr(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra = 1 - ramp
    return inv / rope.factor * (1 - extra) + inv * extra, float(attn)


class RotaryTable:
    """cos/sin for every position up to max_positions, computed once in fp32, stored in dtype.

    With a partial rotary factor (GLM-4.5) only the first `rotary_dim` dims of a head rotate,
    by the rotate-half pairing (i, i + rotary_dim/2) within them, as transformers'
    apply_rotary_pos_emb does; the frequencies are those of a head of rotary_dim dims. With
    rope_interleave (DeepSeek, ERNIE-4.5, Llama-4) dims (2i, 2i+1) rotate together by frequency
    i instead.
    """

    def __init__(self, spec: ModelSpec, max_positions: int, dtype: torch.dtype):
        self.rotary_dim = spec.rotary_dim
        self.interleave = spec.rope_interleave
        inv, scale = rope_inv_freq(spec.rope, self.rotary_dim)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scale).to(dtype)
        self.sin = (emb.sin() * scale).to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, d] by its token positions [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        r = self.rotary_dim
        rotate = _rotate_pairs if self.interleave else _rotate
        if r == x.shape[-1]:
            return rotate(x, cos, sin)
        return torch.cat([rotate(x[..., :r], cos, sin), x[..., r:]], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by angle i, output as [rotated evens | rotated odds]
    (transformers' DeepSeek-V3 layout; V2's complex rotation writes the pairs back interleaved,
    but only dot products of equally laid out q and k follow, which the order leaves alone)."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-4's weightless q/k norm: x / sqrt(mean(x^2) + eps) over the last dim, in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def attention_temperature(q: torch.Tensor, positions: torch.Tensor,
                          spec: ModelSpec) -> torch.Tensor:
    """q [T, nq, d] scaled by 1 + attn_scale * log1p(floor((p + 1) / floor_scale)) at its
    position p (Llama-4's NoPE layers), in fp32 as transformers computes it."""
    floor = torch.floor((positions.float() + 1.0) / spec.attn_temperature_floor)
    scale = torch.log1p(floor) * spec.attn_temperature_scale + 1.0
    return (q * scale.view(-1, 1, 1)).to(q.dtype)


def qkv_projection(dense: DenseLayerWeights, h: torch.Tensor, spec: ModelSpec,
                   rope: Optional[RotaryTable], positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused q|k|v GEMM (+ bias), then `qkv_heads`; returns q [T, nq, d], k and v [T, nkv, d]."""
    return qkv_heads(linear(h, dense.wqkv, dense.bqkv), dense, spec, rope, positions)


def qkv_heads(qkv: torch.Tensor, dense: DenseLayerWeights, spec: ModelSpec,
              rope: Optional[RotaryTable], positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's output [T, q_size + 2 kv_size] split into heads, with q/k norm
    and clipping where the spec has them, and RoPE. rope None: a layer without RoPE (Llama-4's
    NoPE layers, whose q gets the attention temperature where the spec tunes it); Llama-4's
    L2 q/k norm follows RoPE on the other layers. Apart from the GEMM so the hardware profiler
    can time this element-wise work on its own."""
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    eps = spec.rms_norm_eps
    if spec.qk_norm == "projection":
        q, k = rms_norm(q, dense.q_norm, eps), rms_norm(k, dense.k_norm, eps)
    if spec.clip_qkv is not None:
        c = spec.clip_qkv
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    t = qkv.shape[0]
    q = q.reshape(t, spec.num_heads, spec.head_dim)
    k = k.reshape(t, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm == "head":
        q, k = rms_norm(q, dense.q_norm, eps), rms_norm(k, dense.k_norm, eps)
    v = v.reshape(t, spec.num_kv_heads, spec.head_dim)
    if rope is None:
        if spec.attn_temperature_floor is not None:
            q = attention_temperature(q, positions, spec)
        return q, k, v
    q, k = rope.apply(q, positions), rope.apply(k, positions)
    if spec.qk_l2_norm:
        q, k = l2_norm(q, eps), l2_norm(k, eps)
    return q, k, v


def attention_output(dense: DenseLayerWeights, attn: torch.Tensor) -> torch.Tensor:
    """O projection (+ bias) of the attention output [T, q_size]."""
    return linear(attn, dense.wo, dense.bo)


def route(router: torch.Tensor | PackedLinear, h: torch.Tensor, spec: ModelSpec,
          score_correction_bias: Optional[torch.Tensor] = None,
          router_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts each token goes to and their weights: weights [T, k], experts [T, k].

    Scores are the softmax (Mixtral, Qwen, OLMoE, DeepSeek-V2, ERNIE-4.5) or the sigmoid
    (DeepSeek-V3, GLM-4.5) of the router logits, in fp32. Experts are chosen by top-k over the
    scores plus `score_correction_bias` where the spec has one, restricted to the best groups
    where it groups experts (`limit_to_top_groups`); the weights are the chosen experts'
    un-biased scores, renormalised if the spec says so, times routed_scaling_factor.

    GPT-OSS ("topk_softmax"): the router GEMM has a bias, top-k runs over the logits and the
    weights are the softmax of the k chosen logits. Llama-4 ("topk_sigmoid"): the weights are
    the sigmoid of the k chosen logits (they scale the experts' inputs, input_scaled_routing).

    Weights stay fp32 for Mixtral and GLM-4.5; the others cast them to the activations' dtype
    before scaling the expert outputs (same result in fp32).
    """
    # fp32 logits from an fp32 weight (loaded so) where transformers computes them so.
    x = h.float() if spec.router_logits_fp32 else h
    return select_experts(linear(x, router, router_bias).float(), h.dtype, spec,
                          score_correction_bias)


def select_experts(logits: torch.Tensor, dtype: torch.dtype, spec: ModelSpec,
                   score_correction_bias: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` after the router GEMM: fp32 logits [T, E] to (weights [T, k], experts [T, k]),
    weights in `dtype` (the activations') unless the spec keeps them fp32. Apart from the GEMM
    so the hardware profiler can time this element-wise work on its own."""
    if spec.router_scoring in ("topk_softmax", "topk_sigmoid"):
        chosen, experts = torch.topk(logits, spec.top_k, dim=-1)
        weights = (torch.softmax(chosen, dim=-1) if spec.router_scoring == "topk_softmax"
                   else torch.sigmoid(chosen))
        return (weights if spec.router_weights_fp32 else weights.to(dtype)), experts
    if spec.router_scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1)
    choice = scores if score_correction_bias is None else scores + score_correction_bias
    if spec.router_groups > 1:
        choice = limit_to_top_groups(choice, spec.router_groups, spec.router_topk_groups,
                                     spec.router_group_score)
    experts = torch.topk(choice, spec.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if spec.norm_topk_prob:
        # DeepSeek-V3 and GLM-4.5 guard the sum of sigmoid scores with 1e-20, ERNIE-4.5 clamps
        # it below at moe_norm_min; other softmax routers divide by the bare sum. Mirrored so
        # that rounding matches each.
        total = weights.sum(dim=-1, keepdim=True)
        if spec.router_norm_min is not None:
            total = total.clamp(min=spec.router_norm_min)
        elif spec.router_scoring == "sigmoid":
            total = total + 1e-20
        weights = weights / total
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    if not spec.router_weights_fp32:
        weights = weights.to(dtype)
    return weights, experts


def input_scaled_routing(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Llama-4's routing as the experts' usual weighted-sum input: each (token, slot) becomes a
    row h[t] * weights[t, s] (rounded to h's dtype, as transformers scales routed_in) routed to
    experts[t, s] alone with weight 1. Returns rows [T*k, H], weights [T*k, 1] (ones) and
    experts [T*k, 1]; every path that computes experts (moe_ffn, the packed kernels, the
    offload pipeline's streamed and CPU-placed experts) then gives expert(w * h) per row, and
    sum_routed_rows adds a token's k rows back up."""
    t, k = experts.shape
    rows = (h.unsqueeze(1) * weights.to(h.dtype).unsqueeze(-1)).reshape(t * k, h.shape[-1])
    return rows, torch.ones(t * k, 1, dtype=weights.dtype, device=h.device), experts.reshape(-1, 1)


def sum_routed_rows(out: torch.Tensor, tokens: int) -> torch.Tensor:
    """The experts' output per token: out [tokens * k, H] from input_scaled_routing's rows
    summed over each token's k rows (out itself when it already has a row per token)."""
    if out.shape[0] == tokens:
        return out
    return out.view(tokens, -1, out.shape[-1]).sum(dim=1)


def limit_to_top_groups(scores: torch.Tensor, n_group: int, topk_group: int,
                        group_score: str) -> torch.Tensor:
    """scores [T, E] with the experts outside each row's `topk_group` best groups set to -inf.

    The E experts form n_group consecutive groups; a group scores the sum of its two best
    scores ("top2_sum": DeepSeek-V3 and GLM-4.5's noaux_tc) or its best one ("max":
    DeepSeek-V2's group_limited_greedy). V2 fills the excluded experts' softmax scores with 0
    rather than -inf: the same choice, since top_k fits in the kept groups and a softmax
    score is positive.
    """
    t, e = scores.shape
    grouped = scores.view(t, n_group, e // n_group)
    if group_score == "top2_sum":
        per_group = grouped.topk(2, dim=-1).values.sum(dim=-1)
    elif group_score == "max":
        per_group = grouped.max(dim=-1).values
    else:
        raise ValueError(f"unknown group score {group_score!r}; expected top2_sum or max")
    best = torch.topk(per_group, topk_group, dim=-1).indices
    keep = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)


def swiglu(mlp: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate|up fused in one GEMM (one fused kernel call when
    the MLP is packed); with the MLP's biases and clamped activation where it has them."""
    if is_packed(mlp):
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32)
        return packed_moe_ffn([mlp], x, ones, torch.zeros(x.shape[0], 1, dtype=torch.int64))
    gate, up = F.linear(x, mlp.w13, mlp.b13).chunk(2, dim=-1)
    if mlp.clamp is None:
        return F.linear(F.silu(gate) * up, mlp.w2, mlp.b2)
    return F.linear(clamped_swiglu(gate, up, mlp.clamp.alpha, mlp.clamp.limit), mlp.w2, mlp.b2)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float,
                   limit: float) -> torch.Tensor:
    """GPT-OSS's activation: gate clamped above at limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate), in transformers' order of operations."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def ffn_output(dense: DenseLayerWeights, h: torch.Tensor,
               routed: Optional[torch.Tensor]) -> torch.Tensor:
    """A layer's FFN output from its routed part and the part held with its dense weights.

    A dense layer (routed None) runs its MLP; a MoE layer adds its shared expert to the routed
    sum when it has one, scaled by sigmoid(shared_expert_gate(h)) where it is gated
    (Qwen2-MoE), unscaled where it is not (GLM-4.5's shared experts).
    """
    if routed is None:
        return swiglu(dense.mlp, h)
    if dense.shared_expert is None:
        return routed
    if dense.shared_expert_gate is None:
        return routed + swiglu(dense.shared_expert, h)
    gate = linear(h, dense.shared_expert_gate, activation="sigmoid")
    return routed + gate * swiglu(dense.shared_expert, h)


def moe_ffn(experts: list[ExpertWeights], h: torch.Tensor, weights: torch.Tensor,
            indices: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over the tokens routed to them, grouped by expert (one GEMM pair each).

    Tokens of the step are sorted by expert once; each expert then runs on its contiguous slice,
    so the Python loop is over experts, never tokens, and the expert order is free for a pager.
    Packed experts run in one call of the fused kernel, which does the same in C.
    """
    present = next((x for x in experts if x is not None), None)
    if present is not None and is_packed(present):
        return packed_moe_ffn(experts, h, weights, indices)
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
        outs[start:end] = swiglu(experts[e], gathered[start:end])
        start = end
    # Weighting then casting mirrors transformers (in fp32 when the router weights are).
    scaled = (outs * weights.reshape(-1)[order, None]).to(h.dtype)
    out = torch.zeros_like(h)
    out.index_add_(0, token_of, scaled)
    return out
