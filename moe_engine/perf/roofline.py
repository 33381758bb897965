"""Hierarchical roofline (MoE-Lightning section 3.2) applied to one transformer layer.

Every operator is a (FLOPs, bytes read where it runs, bytes moved over the link) triple; its time
on a processor is the largest of the three roofs (Lightning eq. 7):

    t = max(flops / P_i, bytes_local / B_i, bytes_moved / B_ji)

GEMMs use profiled times for the exact shape when the hardware spec carries them (the roofline
with datasheet peaks is optimistic for skinny decode shapes, and on a CPU it is off by 2-4x).
"""
from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, TypeVar

from .specs import (DecodeAttentionPoint, EngineFactors, GemmPoint, HardwareSpec, LayerOpsPoint, LayoutPoint,
                    ModelSpec, MoeFfnPoint, PrefillAttentionPoint, WorkloadSpec, engine_factor, layer_layout)


T = TypeVar("T")


@dataclass(frozen=True)
class OpCost:
    """Work of one operator: FLOPs, bytes read from the memory of the processor running it."""

    flops: float
    local_bytes: float

    def __add__(self, other: "OpCost") -> "OpCost":
        return OpCost(self.flops + other.flops, self.local_bytes + other.local_bytes)

    @property
    def intensity(self) -> float:
        """Operational intensity in FLOPs per byte (Lightning Def. 3.1)."""
        return self.flops / self.local_bytes if self.local_bytes else math.inf


def roofline_time(flops: float, local_bytes: float, peak_flops: float, local_bw: float,
                  moved_bytes: float = 0.0, link_bw: float = math.inf) -> float:
    """Lightning eq. 7: the slowest of the compute roof, the local memory roof and the link roof."""
    return max(flops / peak_flops, local_bytes / local_bw, moved_bytes / link_bw if moved_bytes else 0.0)


def attainable_flops(intensity: float, peak_flops: float, bw: float) -> float:
    """Lightning eq. 8: attainable FLOP/s at operational intensity `intensity` (FLOPs/byte)."""
    return min(peak_flops, bw * intensity)


def gemm_cost(tokens: float, inp: int, out: int, dtype_bytes: float) -> OpCost:
    """y = x W^T with x [tokens, inp]: 2*tokens*inp*out FLOPs; weights plus activations read."""
    return OpCost(2.0 * tokens * inp * out, (inp * out + tokens * (inp + out)) * dtype_bytes)


def _interp_time(points: tuple[tuple[int, float], ...], tokens: float) -> float:
    """Piecewise-linear time(tokens) through measured points; a GEMM's time is close to affine
    in the token count (weights read once plus per-token work), so extrapolate with the end
    segments' slopes, never below the smallest measured time for fewer tokens."""
    xs = [p[0] for p in points]
    ts = [p[1] for p in points]
    if len(points) == 1:
        return ts[0] * max(1.0, tokens / xs[0])
    i = bisect.bisect_left(xs, tokens)
    if i <= 0:
        return ts[0]
    if i >= len(xs):
        i = len(xs) - 1
    x0, x1, t0, t1 = xs[i - 1], xs[i], ts[i - 1], ts[i]
    slope = (t1 - t0) / (x1 - x0)
    return max(ts[0], t0 + slope * (tokens - x0))


@lru_cache(maxsize=4096)
def _profiled_curve(points: tuple[GemmPoint, ...], inp: int, out: int, dtype_bytes: int
                    ) -> tuple[tuple[tuple[int, float], ...], float] | None:
    """Measured (tokens, seconds) curve for the shape, or the curve of the nearest profiled shape
    of the same dtype together with the factor that rescales it (weight size ratio)."""
    same = [p for p in points if p.dtype_bytes == dtype_bytes]
    if not same:
        return None
    exact = [p for p in same if p.inp == inp and p.out == out]
    scale = 1.0
    if not exact:
        size = inp * out
        ref = min(same, key=lambda p: abs(math.log((p.inp * p.out) / size)))
        exact = [p for p in same if p.inp == ref.inp and p.out == ref.out]
        scale = size / (ref.inp * ref.out)
    curve = tuple(sorted((p.tokens, 2.0 * p.tokens * p.inp * p.out / p.flops_per_s) for p in exact))
    return curve, scale


def gemm_time(tokens: float, inp: int, out: int, dtype_bytes: int, peak_flops: float, bw: float,
              points: tuple[GemmPoint, ...] = ()) -> float:
    """Seconds for one GEMM of `tokens` rows on a processor: profiled when available, else roofline."""
    curve = _profiled_curve(points, inp, out, dtype_bytes) if points and tokens > 0 else None
    return _gemm_time_on(curve, tokens, inp, out, dtype_bytes, peak_flops, bw)


def _gemm_time_on(curve: tuple[tuple[tuple[int, float], ...], float] | None, tokens: float, inp: int, out: int,
                  dtype_bytes: float, peak_flops: float, bw: float) -> float:
    """`gemm_time` given the shape's profiled curve (`_profiled_curve`), None for the roofline."""
    if tokens <= 0:
        return 0.0
    if curve is not None:
        pts, scale = curve
        return _interp_time(pts, tokens) * scale
    c = gemm_cost(tokens, inp, out, dtype_bytes)
    return roofline_time(c.flops, c.local_bytes, peak_flops, bw)


def expected_active_experts(tokens: float, num_experts: int, top_k: int) -> float:
    """Expected number of distinct experts a micro-batch of `tokens` touches under uniform routing."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


# Entries each of a processor's memos holds before it starts over (~150-300 bytes each, up to
# ~20 MB for the four memos of a spec's two processors): a search asks for ~10^4 distinct GEMMs
# and part prices; a traced run's fractional token counts, or the golden-section search's
# continuous r_c, could grow them without end.
_MEMO_ENTRIES = 1 << 14


@dataclass(frozen=True, eq=False)
class Processor:
    """One compute unit as the roofline sees it, with what was profiled on it: GEMM rates per
    shape, a layer's element-wise work, prefill and decode attention and routed-expert calls
    per layer layout.

    It remembers the GEMM times it was asked for and the curves it read them from: the policy
    search prices the same shapes at the same token counts for every candidate policy (the
    golden-section search over r_c changes no GEMM at all), and finding a shape's curve among
    the profiled points hashes all of them. Equality is identity, so the memos are never
    hashed."""

    flops: float
    bw: float
    gemm_points: tuple[GemmPoint, ...] = ()
    op_overhead_s: float = 0.0
    layer_ops_points: tuple[LayerOpsPoint, ...] = ()
    prefill_attention_points: tuple[PrefillAttentionPoint, ...] = ()
    moe_ffn_points: tuple[MoeFfnPoint, ...] = ()
    engine_factors: tuple[EngineFactors, ...] = ()
    decode_attention_points: tuple[DecodeAttentionPoint, ...] = ()
    _gemm_memo: dict[tuple[float, int, int, float], float] = field(default_factory=dict, init=False, repr=False)
    _curves: dict[tuple, object] = field(default_factory=dict, init=False, repr=False)
    _prices: dict[tuple, object] = field(default_factory=dict, init=False, repr=False)
    _layers: dict[tuple, object] = field(default_factory=dict, init=False, repr=False)

    def gemm(self, tokens: float, inp: int, out: int, dtype_bytes: int) -> float:
        key = (tokens, inp, out, dtype_bytes)
        t = self._gemm_memo.get(key)
        if t is None:
            if len(self._gemm_memo) >= _MEMO_ENTRIES:
                self._gemm_memo.clear()
            curve = None
            if self.gemm_points and tokens > 0:
                curve = self._curve(("gemm", inp, out, dtype_bytes),
                                    lambda: _profiled_curve(self.gemm_points, inp, out, dtype_bytes))
            t = self._gemm_memo[key] = _gemm_time_on(curve, tokens, inp, out, dtype_bytes, self.flops, self.bw)
        return t

    def _curve(self, key: tuple, read: Callable[[], object]):
        """What `read` finds among the points, read once per key (shape, layout, workload)."""
        return _remember(self._curves, key, read)

    def remember(self, key: tuple, price: Callable[[], T]) -> T:
        """`price()` computed once per key on this unit: a part of a layer the cost model prices
        for every candidate policy at the same token counts (`cost.micro_batch_parts`). The key
        names the part and everything its price depends on besides this unit."""
        return _remember(self._prices, key, price)

    def remember_layer(self, key: tuple, price: Callable[[], T]) -> T:
        """As `remember`, for a layer's sums over its micro-batches, whose keys carry the
        policy's placement (a continuous r_c among them): a memo of their own, so their turnover
        never drops the part prices."""
        return _remember(self._layers, key, price)

    def factor(self, m: ModelSpec, component: str) -> float:
        """The in-run factor of one part of m's layers on this unit (HardwareSpec.engine_factor)."""
        return engine_factor(self.engine_factors, m, component)

    def layer_ops(self, m: ModelSpec, tokens: float) -> tuple[float, float] | None:
        """Profiled (before, after attention) element-wise seconds of one of `m`'s layers at
        `tokens` tokens, None when its layout was not profiled here."""
        if not self.layer_ops_points or tokens <= 0:
            return None
        layout = layer_layout(m)
        curves = self._curve(("layer_ops", layout), lambda: _layer_ops_curves(self.layer_ops_points, layout))
        if curves is None:
            return None
        return _interp_time(curves[0], tokens), _interp_time(curves[1], tokens)

    def routed_experts(self, m: ModelSpec, tokens: float) -> float | None:
        """Profiled seconds of one call of `m`'s routed experts over `tokens` tokens (the fused
        kernel, all experts at once), None when its layout was not profiled here."""
        if not self.moe_ffn_points or tokens <= 0:
            return None
        curve = self._layout_curve("moe_ffn", self.moe_ffn_points, m)
        return None if curve is None else _interp_time(curve, tokens)

    def prefill_attention_curve(self, m: ModelSpec) -> tuple[tuple[int, float], ...] | None:
        """Profiled (prompt length, seconds per prompt) of `m`'s layout, None if absent."""
        if not self.prefill_attention_points:
            return None
        return self._layout_curve("prefill_attention", self.prefill_attention_points, m)

    def prefill_attention_per_prompt(self, m: ModelSpec, wl: WorkloadSpec) -> float | None:
        """Profiled seconds of one prompt's attention in `m`'s layout, read at each of the
        workload's prompt lengths and averaged (at the mean length without per-prompt
        lengths), None if the layout was not profiled. Remembered per workload: a shard has up
        to 10^5 prompts."""
        curve = self.prefill_attention_curve(m)
        if curve is None:
            return None
        if not wl.prompt_lengths:
            return _interp_time(curve, wl.mean_prompt)
        return self._curve(("prefill_prompt", layer_layout(m), wl),
                           lambda: _mean_prompt_time(curve, wl.prompt_lengths))

    def decode_attention_curve(self, m: ModelSpec) -> tuple[tuple[int, float], ...] | None:
        """Profiled (sequences, seconds) of one decode attention call of `m`'s layout (the call's
        own cost beside its KV reads), None if absent."""
        if not self.decode_attention_points:
            return None
        return self._layout_curve("decode_attention", self.decode_attention_points, m)

    def _layout_curve(self, kind: str, points: tuple[LayoutPoint, ...], m: ModelSpec):
        layout = layer_layout(m)
        return self._curve((kind, layout), lambda: _layout_curve(points, layout))


def _remember(memo: dict, key: tuple, compute: Callable[[], object]):
    try:
        return memo[key]
    except KeyError:
        if len(memo) >= _MEMO_ENTRIES:  # fractional token counts of traced runs: bounded
            memo.clear()
        value = memo[key] = compute()
        return value


# One processor per spec, so its memo serves every candidate of a search; equal specs share
# it (a spec's hash is cached: `HardwareSpec.__hash__`). The spec also keeps its own processors
# in its __dict__ (as functools.cached_property writes a frozen instance): the cost model asks
# for them ~10^6 times a search, and a shared lookup compares every field of an equal spec
# loaded apart from the one that made the processor.
def device_processor(hw: HardwareSpec) -> Processor:
    return _kept(hw, "_device_processor", _device_processor)


def cpu_processor(hw: HardwareSpec) -> Processor:
    return _kept(hw, "_cpu_processor", _cpu_processor)


def _kept(hw: HardwareSpec, name: str, make: Callable[[HardwareSpec], Processor]) -> Processor:
    proc = hw.__dict__.get(name)
    if proc is None:
        proc = hw.__dict__[name] = make(hw)
    return proc


@lru_cache(maxsize=4)
def _device_processor(hw: HardwareSpec) -> Processor:
    # The element-wise and prefill-attention points are the CPU's: they describe the device
    # only when the CPU is the device.
    cpu_only = hw.is_cpu_only
    return Processor(hw.device_flops, hw.device_bw, hw.gemm_points, hw.op_overhead_s,
                     hw.layer_ops_points if cpu_only else (),
                     hw.prefill_attention_points if cpu_only else (),
                     hw.moe_ffn_points if cpu_only else (),
                     hw.applied_engine_factors)


@lru_cache(maxsize=4)
def _cpu_processor(hw: HardwareSpec) -> Processor:
    points = hw.cpu_gemm_points or (hw.gemm_points if hw.is_cpu_only else ())
    return Processor(hw.cpu_flops, hw.cpu_bw, points, hw.op_overhead_s, hw.layer_ops_points,
                     hw.prefill_attention_points, hw.moe_ffn_points, hw.applied_engine_factors,
                     hw.decode_attention_points)


@lru_cache(maxsize=256)
def _layer_ops_curves(points: tuple[LayerOpsPoint, ...], layout: str
                      ) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[int, float], ...]] | None:
    """(tokens, seconds) curves before and after attention for one layout, None if absent."""
    rows = sorted((p.tokens, p.pre_attention_s, p.post_attention_s) for p in points if p.layout == layout)
    if not rows:
        return None
    return tuple((n, pre) for n, pre, _ in rows), tuple((n, post) for n, _, post in rows)


@lru_cache(maxsize=256)
def _layout_curve(points: tuple[LayoutPoint, ...], layout: str) -> tuple[tuple[int, float], ...] | None:
    """(size, seconds) of one layout's points, by size (a prefill's prompt length, a decode
    call's batch, an expert call's tokens), None if the layout has none."""
    rows = tuple(sorted((p.size, p.seconds) for p in points if p.layout == layout))
    return rows or None


def _mean_prompt_time(curve: tuple[tuple[int, float], ...], lengths: tuple[int, ...]) -> float:
    """Mean over the prompts of the per-prompt time read off the curve at each one's length
    (SDPA's cost is step-like in the length: at the mean length it is up to 20% off the mean)."""
    counts = Counter(lengths)
    return sum(n * _interp_time(curve, p) for p, n in counts.items()) / len(lengths)


# Non-GEMM operator launches per layer and micro-batch, counted in the engine's layer code
# (moe_engine/model/layers.py, runner.py): an RMSNorm is 8 ops, RoPE 11 per tensor; attention
# adds the cache write and the kernel call's checks; the MoE block its router softmax/top-k, the
# sort/bincount/gather/scatter, and per active expert a slice, chunk, SiLU, multiply and store.
# They matter where a launch costs as much as the work: small models on a CPU. Revisit the
# counts when the engine's layer code changes.
_PRE_ATTN_OPS = 34
_ATTN_OPS = 16
_POST_ATTN_OPS = 28
_OPS_PER_EXPERT = 6
HEAD_OPS = 12
ATTN_OPS = _ATTN_OPS
PREFILL_OPS_PER_SEQ = 6  # slice q/k/v, transposes, causal SDPA, store: one loop turn per prompt


def pre_attention_time(m: ModelSpec, proc: Processor, mu: float) -> float:
    """RMSNorm + fused QKV projection (+ RoPE) for a micro-batch of `mu` tokens; MLA adds
    q_b_proj and each head's map of its query into the latent space. The element-wise part is
    the profiled time of the model's layout, else its operator launches."""
    t = proc.gemm(mu, m.hidden_size, m.qkv_out_features, m.dtype_bytes)
    if m.mla is not None:
        a = m.mla
        if a.q_lora_rank:
            t += proc.gemm(mu, a.q_lora_rank, m.q_size, m.dtype_bytes)
        t += _per_head_time(m, proc, mu, a.qk_nope_head_dim, a.kv_lora_rank)
    ops = proc.layer_ops(m, mu)
    return (t + (ops[0] if ops is not None else _PRE_ATTN_OPS * proc.op_overhead_s)) * proc.factor(m, "dense")


def _per_head_time(m: ModelSpec, proc: Processor, mu: float, inp: int, out: int) -> float:
    """One GEMM launch per head (MLA's latent maps run so on the packed kernels)."""
    return m.num_heads * (proc.gemm(mu, inp, out, m.dtype_bytes) + proc.op_overhead_s)


def o_proj_router_time(m: ModelSpec, proc: Processor, mu: float) -> float:
    """Output projection and router (Lightning's model leaves both out; they are ~3% of Mixtral's
    weights but a whole GEMM launch each per micro-batch); MLA first maps each head's attended
    latent to its value."""
    t = proc.gemm(mu, m.num_heads * m.v_head_dim, m.hidden_size, m.dtype_bytes)
    if m.mla is not None:
        t += _per_head_time(m, proc, mu, m.mla.kv_lora_rank, m.mla.v_head_dim)
    t += proc.gemm(mu, m.hidden_size, m.num_experts, m.dtype_bytes)
    ops = proc.layer_ops(m, mu)
    return (t + (ops[1] if ops is not None else _POST_ATTN_OPS * proc.op_overhead_s)) * proc.factor(m, "dense")


def expert_ffn_time(m: ModelSpec, proc: Processor, mu: float) -> float:
    """Routed experts (+ shared experts) of one MoE layer for `mu` tokens: the profiled call of
    the layout's experts where there is one (the fused kernel runs them all in one parallel
    region: at a few tokens a step that costs half of pricing each expert as its own GEMM
    calls), else each touched expert reads its weights once and runs gate/up/down on its share
    of the tokens."""
    t = proc.routed_experts(m, mu)
    if t is None:
        active = expected_active_experts(mu, m.num_experts, m.top_k)
        per_expert = mu * m.top_k / active if active else 0.0
        # Quantized experts (MXFP4, int8/int4) read their storage's bytes per weight (fractional:
        # no profiled GEMM curve is keyed by it, so the roofline prices them).
        width = m.expert_bytes / m.expert_params if m.expert_storage else m.dtype_bytes
        t = active * (_swiglu_time(proc, per_expert, m.hidden_size, m.intermediate_size, width)
                      + _OPS_PER_EXPERT * proc.op_overhead_s)
    if m.shared_expert_intermediate_size:
        t += _swiglu_time(proc, mu, m.hidden_size, m.shared_expert_intermediate_size, m.dtype_bytes)
    return t * proc.factor(m, "ffn")


def _swiglu_time(proc: Processor, tokens: float, h: int, inter: int, dtype_bytes: float) -> float:
    """Fused gate|up GEMM (h -> 2*inter, one launch, as the engine stores w1|w3) plus down."""
    return proc.gemm(tokens, h, 2 * inter, dtype_bytes) + proc.gemm(tokens, inter, h, dtype_bytes)


def dense_mlp_time(m: ModelSpec, proc: Processor, mu: float) -> float:
    """The dense MLP of a non-MoE layer for `mu` tokens."""
    return _swiglu_time(proc, mu, m.hidden_size, m.dense_intermediate_size, m.dtype_bytes) * proc.factor(m, "ffn")


def decode_attention_cost(m: ModelSpec, mu: float, ctx: float) -> OpCost:
    """Decode attention of `mu` queries over `ctx` cached tokens each (one layer): QK^T and PV are
    2*d FLOPs per (query head, cached token) each; every cached K/V byte is read once per step
    because all query heads of a GQA group share one pass over the cache (MLA: every head over
    the one latent entry, with its score and value widths). Sliding-window layers attend their
    window only (`ModelSpec.attended_context`, averaged over the layers)."""
    ctx = m.attended_context(ctx)
    flops = 2.0 * mu * ctx * m.num_heads * sum(m.attention_widths)
    return OpCost(flops, mu * ctx * m.kv_bytes_per_token_layer)


def cpu_attention_time(m: ModelSpec, hw: HardwareSpec, mu: float, ctx: float) -> float:
    """Decode attention on the CPU: reading the cache at the profiled kernel's KV streaming rate
    when known, plus the call's own cost at `mu` sequences where the model's layout was profiled
    (cache write, output copy, the kernel's per-sequence setup: on a small model several times
    its reads), else its operator launches."""
    cpu = cpu_processor(hw)
    return cpu.remember(("cpu_attention", m, mu, ctx), lambda: _cpu_attention_time(m, hw, cpu, mu, ctx))


def _cpu_attention_time(m: ModelSpec, hw: HardwareSpec, cpu: Processor, mu: float, ctx: float) -> float:
    c = decode_attention_cost(m, mu, ctx)
    bw = hw.cpu_attention_bw or hw.cpu_bw
    curve = cpu.decode_attention_curve(m)
    call = _interp_time(curve, mu) if curve is not None else _ATTN_OPS * hw.op_overhead_s
    return (roofline_time(c.flops, c.local_bytes, hw.cpu_flops, bw) + call) * hw.engine_factor(m, "attention")


def device_attention_time(m: ModelSpec, hw: HardwareSpec, mu: float, ctx: float, kv_on_device: float) -> float:
    """Decode attention on the accelerator reading the resident KV fraction from device memory;
    the rest of the cache crosses the link (charged to T_io by the caller)."""
    c = decode_attention_cost(m, mu, ctx)
    return roofline_time(c.flops, c.local_bytes * kv_on_device, hw.device_flops, hw.device_bw)


def prefill_attention_flops(m: ModelSpec, prompt_len_sq_mean: float) -> float:
    """Causal self-attention over a prompt of length p: ~p^2/2 (query, key) pairs per head."""
    return 2.0 * (prompt_len_sq_mean / 2.0) * m.num_heads * sum(m.attention_widths)


def prefill_attention_time(m: ModelSpec, proc: Processor, wl: WorkloadSpec, prompts: float) -> float:
    """Attention of one layer in a prefill pass of `prompts` of the workload's prompts: the
    profiled seconds per prompt of the model's layout, read at each prompt's length and averaged
    over the workload (at the mean length without per-prompt lengths), else the causal FLOPs at
    the processor's peak plus the launches of the attention call and of each prompt's SDPA."""
    per_prompt = proc.prefill_attention_per_prompt(m, wl)
    if per_prompt is not None:
        return prompts * per_prompt * proc.factor(m, "attention")
    flops = prefill_attention_flops(m, wl.sum_prompt_sq) * prompts
    launches = (ATTN_OPS + PREFILL_OPS_PER_SEQ * prompts) * proc.op_overhead_s
    return (flops / proc.flops + launches) * proc.factor(m, "attention")
