"""Frozen descriptions of the model, the machine and the workload that the performance model reads.

All sizes are in bytes, bandwidths in bytes/s and compute rates in FLOP/s (SI units, 1 GB = 1e9 B)
so that the formulas in `roofline` and `lens` need no unit conversions. The model is the engine's
own ModelSpec (model/spec.py, the one reader of config.json), re-exported here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Sequence

from moe_engine.model.spec import GB, TORCH_GEMM_STORAGE, HashedOnce, ModelSpec, UnsupportedModelError, dtype_bytes_of

TFLOPS = 1e12

__all__ = ["GB", "TFLOPS", "ModelSpec", "UnsupportedModelError", "dtype_bytes_of", "GemmPoint", "HardwareSpec",
           "LayerOpsPoint", "LayoutPoint", "PrefillAttentionPoint", "DecodeAttentionPoint", "MoeFfnPoint", "WorkloadSpec", "layer_layout",
           "workload_spec_from_lengths", "blocks_for", "ENGINE_COMPONENTS", "EngineFactors", "engine_factor"]


@dataclass(frozen=True)
class GemmPoint:
    """One profiled GEMM: y[tokens, out] = x[tokens, inp] @ W^T at `flops_per_s` achieved."""

    inp: int
    out: int
    tokens: int
    dtype_bytes: int
    flops_per_s: float


@dataclass(frozen=True)
class LayerOpsPoint:
    """A decoder layer's work outside its GEMMs at `tokens` tokens, timed on the engine's code
    for one layer layout (`layer_layout`): before attention (input norm, head split, q/k norm,
    RoPE) and after it (residual adds, post norm, the router's softmax/top-k)."""

    layout: str
    tokens: int
    pre_attention_s: float
    post_attention_s: float


@dataclass(frozen=True)
class LayoutPoint:
    """A profiled time of one layer layout's call at one size; the kinds below differ only in
    what `size` counts and what `seconds` covers, and are read as (size, seconds) curves."""

    layout: str
    size: int
    seconds: float


# Seconds per prompt of prefill attention (K/V written to the cache, one causal SDPA call and
# its slicing) for prompts of `size` tokens, in a pass of such prompts.
PrefillAttentionPoint = LayoutPoint
# Seconds per call of a decode step's attention (K/V write, kernel call, output copy) for `size`
# sequences at a one-block context: the call's cost apart from reading the cache.
DecodeAttentionPoint = LayoutPoint
# Seconds per call of a MoE layer's routed experts over `size` tokens (uniform routing), as the
# engine runs them: one call of the fused expert kernel, every expert's gate|up, GLU, down and
# weighted sum in one parallel region; its weights read from DRAM unless the model fits the
# cache.
MoeFfnPoint = LayoutPoint

# The parts of a step the engine times apart (EngineStats) and the model prices apart.
ENGINE_COMPONENTS = ("dense", "attention", "ffn", "head", "host")


@dataclass(frozen=True)
class EngineFactors:
    """How much longer each part of a step takes inside the engine's run than the profiler's
    micro-benchmarks say, for one layer layout, measured by running the engine itself on the
    model (profile_engine): each micro-benchmark times its part alone and warm, while in a
    run every part finds its tensors evicted by the parts before it (the KV cache, the LM
    head's logits) and the heap in another state (tiny-mixtral's default run: 1.3-2x)."""

    layout: str
    dense: float = 1.0  # norms, QKV/O projections, RoPE, router
    attention: float = 1.0  # K/V write, prefill and decode attention
    ffn: float = 1.0  # routed experts (and a dense layer's MLP)
    head: float = 1.0  # final norm and LM head
    host: float = 1.0  # the engine loop: scheduling, inputs, sampling


# Remembered per spec (whose hash is cached): every priced part of every candidate of a
# search asks for it, and building the string costs ~10 us.
@lru_cache(maxsize=256)
def layer_layout(m: ModelSpec) -> str:
    """What decides a layer's element-wise and attention work, as the key of its
    profiled points: widths, heads, experts, the weights' dtype and the architecture's
    variants of norm, RoPE, attention and routing. Checkpoints of one layout share points."""
    parts = [f"h{m.hidden_size}", f"q{m.num_heads}x{m.head_dim}", f"kv{m.num_kv_heads}x{m.v_head_dim}",
             f"e{m.num_experts}k{m.top_k}i{m.intermediate_size}", f"b{m.dtype_bytes}", f"rot{m.rotary_dim}",
             f"{m.router_scoring}g{m.router_groups}"]
    flags = {"qk": m.qk_norm, "clip": m.clip_qkv is not None, "il": m.rope_interleave,
             "bias": m.router_score_correction, "l2": m.qk_l2_norm,
             "inscaled": m.router_scales_input,
             "sinks": m.attention_sinks, "win": m.attention_window(0) is not None}
    parts += [k if v is True else f"{k}{v}" for k, v in flags.items() if v]
    if m.expert_storage:  # experts held quantized (MXFP4, int8, int4): another kernel path
        parts.append(f"x{m.expert_storage}")
    if m.weight_storage == TORCH_GEMM_STORAGE:  # torch's GEMMs: activations in the model dtype
        parts.append(TORCH_GEMM_STORAGE)
    return "-".join(parts)


@dataclass(frozen=True)
class HardwareSpec(HashedOnce):
    """Memory capacities, bandwidths and peak rates of the accelerator ("device"), the host CPU
    and the link between them; optional profiled figures refine the roofline per shape.

    device_kind "cpu" means there is no accelerator: the device is the CPU itself, device and
    host memory are one pool and resident weights cost no link traffic.
    """

    name: str
    device_kind: str
    device_memory: float
    host_memory: float
    link_bw: float
    device_bw: float
    cpu_bw: float
    device_flops: float
    cpu_flops: float
    cpu_cores: int = 1
    gemm_points: tuple[GemmPoint, ...] = ()
    cpu_attention_bw: float | None = None
    cpu_gemm_points: tuple[GemmPoint, ...] = ()
    op_overhead_s: float = 0.0
    # The engine loop's own host work (scheduling, packing inputs, sampling), profiled: per
    # step, per sequence in a decode step (plus per entry of its logits row: sampling reads
    # it), per prompt token in a prefill pass.
    host_step_s: float = 0.0
    host_seq_s: float = 0.0
    host_token_s: float = 0.0
    host_logit_s: float = 0.0
    # Sequential O_DIRECT read bandwidth of the disk holding the experts (the disk tier's link).
    disk_bw: float = 2.0e9
    # Profiled element-wise work per layer, prefill attention per prompt, decode attention per
    # call and routed experts per call, per layer layout (the CPU's: the profiler times them
    # on the engine's CPU code).
    layer_ops_points: tuple[LayerOpsPoint, ...] = ()
    prefill_attention_points: tuple[PrefillAttentionPoint, ...] = ()
    decode_attention_points: tuple[DecodeAttentionPoint, ...] = ()
    moe_ffn_points: tuple[MoeFfnPoint, ...] = ()
    # Measured in-run over micro-benchmark ratios per layer layout (EngineFactors).
    engine_factors: tuple[EngineFactors, ...] = ()
    notes: str = ""

    @property
    def is_cpu_only(self) -> bool:
        return self.device_kind == "cpu"

    # The cost model keys its processors by the spec (`roofline.cpu_processor`, which also
    # keeps them here, left behind by a pickle or copy) ~10^5 times a search, and a profiled
    # spec hashes ~100 points each time (30 us).
    __hash__ = HashedOnce.__hash__

    @property
    def applied_engine_factors(self) -> tuple[EngineFactors, ...]:
        """The in-run factors the model applies: none on a machine with an accelerator (they
        are measured on the CPU backend, whose steps lack the parts a CUDA step overlaps)."""
        return self.engine_factors if self.is_cpu_only else ()

    def engine_factor(self, m: ModelSpec, component: str) -> float:
        """The in-run factor of `component` (ENGINE_COMPONENTS) for m's layer layout; 1 where
        the engine was not run on it here, and on a machine with an accelerator."""
        return engine_factor(self.applied_engine_factors, m, component)

    def host_seq_cost(self, vocab_size: int) -> float:
        """The engine loop's seconds per sequence of a step, for a model of `vocab_size`."""
        return self.host_seq_s + vocab_size * self.host_logit_s

    def with_host_memory(self, host_memory: float) -> "HardwareSpec":
        from dataclasses import replace

        return replace(self, host_memory=host_memory)

    def with_link_bw(self, link_bw: float) -> "HardwareSpec":
        from dataclasses import replace

        return replace(self, link_bw=link_bw)


@dataclass(frozen=True)
class WorkloadSpec(HashedOnce):
    """Token-length statistics of the requests to run (one shard or the whole corpus)."""

    mean_prompt: float
    max_prompt: int
    gen_len: int
    num_requests: int = 0  # 0 = unbounded (steady state); else the batch is bounded by it
    prompt_lengths: tuple[int, ...] = field(default=(), repr=False)
    # Per-request generation lengths when they differ (rows with their own max_new_tokens):
    # the batch then drains as short requests finish, which a mean length cannot show.
    gen_lengths: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.gen_len < 1:
            raise ValueError(f"gen_len={self.gen_len} must be >= 1")
        if self.gen_lengths and min(self.gen_lengths) < 1:
            raise ValueError("every generation length must be >= 1")
        if self.mean_prompt < 0 or self.max_prompt < self.mean_prompt - 1e-9:
            raise ValueError(f"bad prompt statistics mean={self.mean_prompt} max={self.max_prompt}")

    @property
    def mean_seq_len(self) -> float:
        return self.mean_prompt + self.gen_len

    # A shard's lengths run to 10^5 rows, and the cost model keys its memos by the workload
    # (`roofline.Processor`) for every candidate.
    __hash__ = HashedOnce.__hash__

    # Cached (frozen, so they never go stale): the policy search reads both for every
    # candidate, and a shard's lengths run to 10^5 rows.
    @cached_property
    def prefill_only(self) -> bool:
        """Every request ends at the token its prefill yields (scoring runs, max_new_tokens=1):
        no decode step runs, so the engine packs prompts by the token budget alone."""
        return all(g == 1 for g in self.gen_lengths) if self.gen_lengths else self.gen_len == 1

    @cached_property
    def request_gen_lengths(self) -> tuple[int, ...]:
        """Every request's generation length, in request order (the one length repeated when
        they share it). One tuple for the spec's life: the search's cached replays
        (`schedule.step_trace`) key on it, and a copy per call kept a shard's worth per entry."""
        return self.gen_lengths or (self.gen_len,) * len(self.prompt_lengths)

    @cached_property
    def sum_prompt_sq(self) -> float:
        """Mean of prompt length squared (prefill attention is quadratic per sequence)."""
        if self.prompt_lengths:
            return sum(p * p for p in self.prompt_lengths) / len(self.prompt_lengths)
        return self.mean_prompt ** 2


def workload_spec_from_lengths(prompt_lengths: Sequence[int], gen_len: int | Sequence[int]) -> WorkloadSpec:
    """Summarize a shard's prompt token counts; the request count bounds the batch. `gen_len` is
    one generation length for all requests or one per request (in the same order)."""
    lengths = tuple(int(x) for x in prompt_lengths)
    if not lengths:
        raise ValueError("workload has no requests")
    if min(lengths) < 0:
        raise ValueError("prompt lengths must be >= 0")
    if isinstance(gen_len, (int, float)):
        return WorkloadSpec(mean_prompt=sum(lengths) / len(lengths), max_prompt=max(lengths),
                            gen_len=int(gen_len), num_requests=len(lengths), prompt_lengths=lengths)
    gens = tuple(int(g) for g in gen_len)
    if len(gens) != len(lengths):
        raise ValueError(f"{len(gens)} generation lengths for {len(lengths)} prompts")
    return WorkloadSpec(mean_prompt=sum(lengths) / len(lengths), max_prompt=max(lengths),
                        gen_len=max(1, round(sum(gens) / len(gens))), num_requests=len(lengths),
                        prompt_lengths=lengths, gen_lengths=gens)


def engine_factor(factors: tuple[EngineFactors, ...], m: ModelSpec, component: str) -> float:
    """`component`'s factor of m's layout among `factors`, 1 when it has none."""
    if not factors:
        return 1.0
    layout = layer_layout(m)
    for f in factors:
        if f.layout == layout:
            return getattr(f, component)
    return 1.0


def blocks_for(tokens: float, block_size: int) -> int:
    """Paged-KV blocks one sequence of `tokens` occupies."""
    return int(math.ceil(tokens / block_size))
