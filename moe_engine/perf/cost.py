"""Per-layer decode latency, prefill latency, memory use and predicted throughput of one policy.

Lightning eqs. 12-14: a decode step's layer takes T = max(T_io, T_cpu, T_gpu) because CGOPipe
overlaps the link, the CPU and the accelerator. On the CPU backend the "accelerator" and the CPU
are the same cores, so their times add, and resident weights need no link.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, NamedTuple

from .roofline import (HEAD_OPS, Processor, cpu_attention_time, cpu_processor, dense_mlp_time, device_attention_time,
                       device_processor, expected_active_experts, expert_ffn_time,
                       o_proj_router_time, pre_attention_time, prefill_attention_time)
from .schedule import StepBucket, step_trace
from .specs import ENGINE_COMPONENTS, HardwareSpec, ModelSpec, WorkloadSpec, blocks_for

# Slack factors (docs/perf_model.md explains them).
# Device: the CUDA context, cuBLAS workspaces and the caching allocator's fragmentation take about
# 1 GB plus ~10% of what the tensors need; 0.9*M - 1 GB is 0.86*M on a 24 GB L4.
DEVICE_MEMORY_FRACTION = 0.90
DEVICE_RESERVED_BYTES = 1.0e9
# Host: the OS, the Python process (tokenizer, torch, Arrow buffers of the shard) and pinned-page
# rounding; Lightning's and FlexGen's policies leave ~20% of DRAM free.
HOST_MEMORY_FRACTION = 0.80
HOST_RESERVED_BYTES = 0.0
DEFAULT_BLOCK_SIZE = 16
DEFAULT_PREFILL_TOKENS = 2048


@dataclass(frozen=True)
class Policy:
    """Lightning's 6-tuple (N, mu, A_g, F_g, r_w, r_c) plus the KV cache it implies."""

    batch_size: int
    micro_batch_size: int
    attention_on_device: bool
    ffn_on_device: bool
    resident_ratio: float
    kv_device_ratio: float = 0.0
    prefill_tokens: int = DEFAULT_PREFILL_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE
    # Fraction of the KV the device attention reads from device memory when it is not r_c: set
    # only by the search, to 0 with r_c at its largest, for a bound no r_c can beat (the link
    # carries the least KV while the device reads the least).
    kv_read_ratio: float | None = field(default=None, repr=False)
    # r_host: the hottest fraction of each layer's experts held in host memory; the rest stays
    # on disk and is read each step it is routed to (the disk tier, docs/offload.md).
    host_resident_ratio: float = 1.0

    @property
    def num_micro_batches(self) -> int:
        return max(1, math.ceil(self.batch_size / self.micro_batch_size))

    @property
    def placement(self) -> tuple[int, bool, bool, float, float | None]:
        """Every field a layer's micro-batches are priced by (`micro_batch_parts`,
        `_decode_micro_batches`): the key their remembered prices are kept under. The rest
        (N, r_w, r_host, the pass size) reach only the link, disk and step counts."""
        return (self.micro_batch_size, self.attention_on_device, self.ffn_on_device, self.kv_device_ratio,
                self.kv_read_ratio)


@dataclass(frozen=True)
class StepTimes:
    """Seconds one decode step spends on each resource (summed over layers) and in total."""

    t_io: float
    t_cpu: float
    t_gpu: float
    t_head: float
    total: float
    t_host: float = 0.0  # the engine loop's own work (scheduling, inputs, sampling)
    t_disk: float = 0.0  # disk tier reads

    @property
    def bottleneck(self) -> str:
        named = {"link": self.t_io, "cpu": self.t_cpu, "device": self.t_gpu,
                 "host loop": self.t_host, "disk": self.t_disk}
        return max(named, key=named.get)


@dataclass(frozen=True)
class MemoryUse:
    device_bytes: float
    host_bytes: float
    device_budget: float
    host_budget: float
    kv_bytes: float

    @property
    def fits(self) -> bool:
        # A relative epsilon: r_w solved in closed form lands exactly on the budget.
        eps = 1e-9
        return (self.device_bytes <= self.device_budget * (1 + eps)
                and self.host_bytes <= self.host_budget * (1 + eps))


@dataclass(frozen=True)
class Prediction:
    """Predicted generation throughput of one policy on one workload."""

    policy: Policy
    throughput_tok_s: float
    step: StepTimes
    prefill_s: float
    decode_s: float
    memory: MemoryUse
    effective_batch: int


def is_cpu_backend(hw: HardwareSpec, backend: str) -> bool:
    return backend == "cpu" or hw.is_cpu_only


def device_budget(hw: HardwareSpec, cpu_backend: bool) -> float:
    """Bytes the policy may place on the accelerator."""
    if cpu_backend:
        return host_budget(hw)
    return max(0.0, DEVICE_MEMORY_FRACTION * hw.device_memory - DEVICE_RESERVED_BYTES)


def host_budget(hw: HardwareSpec) -> float:
    return HOST_MEMORY_FRACTION * hw.host_memory - HOST_RESERVED_BYTES


def kv_bytes(m: ModelSpec, wl: WorkloadSpec, num_seqs: int, block_size: int) -> float:
    """Paged KV of `num_seqs` sequences at their final length (mean prompt + generation), whole
    blocks, plus one spare block each so the last token never waits for an allocation."""
    blocks = blocks_for(wl.mean_seq_len, block_size) + 1
    # GPT-OSS's sliding layers hold a window's blocks only (kv_bytes_per_sequence).
    return num_seqs * m.kv_bytes_per_sequence(blocks * block_size, block_size)


def device_weight_bytes(m: ModelSpec, ffn_on_device: bool) -> tuple[float, float]:
    """(all layers, largest layer) bytes of the weights the accelerator needs: the dense part
    always, the experts only when the FFN runs there."""
    moe = m.moe_layer_bytes if ffn_on_device else m.dense_params_per_layer * m.dtype_bytes
    dense = m.dense_layer_bytes
    total = m.num_moe_layers * moe + m.num_dense_layers * dense
    return total, max(moe if m.num_moe_layers else 0, dense if m.num_dense_layers else 0)


def activation_bytes(m: ModelSpec, tokens: float, seqs: float) -> float:
    """Peak live activations of one layer for `tokens` tokens of `seqs` sequences: residual,
    normed input, q/k/v, attention output, the experts' gate/up intermediates of every routed
    copy, fp32 router logits, and fp32 LM-head logits of each sequence's last token."""
    b = m.dtype_bytes
    per_token = (4 * m.hidden_size + m.qkv_out_features) * b
    per_token += m.top_k * 2 * m.intermediate_size * b + 2 * m.shared_expert_intermediate_size * b
    per_token += 4 * m.num_experts
    return tokens * per_token + seqs * 4 * m.vocab_size


def peak_activation_bytes(m: ModelSpec, wl: WorkloadSpec, policy: Policy) -> float:
    """The larger of a decode micro-batch and a prefill pass of `policy.prefill_tokens`."""
    decode = activation_bytes(m, policy.micro_batch_size, policy.micro_batch_size)
    pf_tokens = min(policy.prefill_tokens, resident_seqs(wl, policy) * max(1.0, wl.mean_prompt))
    prefill = activation_bytes(m, pf_tokens, pf_tokens / max(1.0, wl.mean_prompt))
    return max(decode, prefill)


def prefill_pass_seqs(wl: WorkloadSpec, policy: Policy) -> int:
    """Prompts one prefill pass holds in a prefill-only run: as many as the token budget takes
    (at least one: an over-budget prompt runs alone), whatever the decode batch N, since none of
    them stays to decode. Bounded by the request count."""
    seqs = max(1, int(policy.prefill_tokens // max(1.0, wl.mean_prompt)))
    return min(seqs, wl.num_requests) if wl.num_requests else seqs


def resident_seqs(wl: WorkloadSpec, policy: Policy) -> int:
    """Sequences holding KV at once: N, or one prefill pass of a prefill-only run."""
    return prefill_pass_seqs(wl, policy) if wl.prefill_only else policy.batch_size


def longest_seq_kv_bytes(m: ModelSpec, wl: WorkloadSpec, block_size: int) -> float:
    """KV of the longest request alone (longest prompt, longest generation): a cache sized for
    mean-length sequences must still hold it, or the engine rejects that row."""
    gen = max(wl.gen_lengths) if wl.gen_lengths else wl.gen_len
    tokens = (blocks_for(wl.max_prompt + gen, block_size) + 1) * block_size
    return m.kv_bytes_per_sequence(tokens, block_size)


def policy_kv_bytes(m: ModelSpec, wl: WorkloadSpec, policy: Policy) -> float:
    """The KV cache a policy allocates: its resident sequences, and never less than the longest
    request alone."""
    return max(kv_bytes(m, wl, resident_seqs(wl, policy), policy.block_size),
               longest_seq_kv_bytes(m, wl, policy.block_size))


def disk_expert_bytes(m: ModelSpec, policy: Policy) -> tuple[float, float]:
    """(bytes left on disk, bytes of the read ring) under r_host: the ring holds two layers of
    disk experts, so a layer's reads land while the previous one computes."""
    per_layer = (1.0 - policy.host_resident_ratio) * m.experts_bytes_per_layer
    return m.num_moe_layers * per_layer, (2.0 * per_layer if m.num_moe_layers else 0.0)


def disk_layer_time(m: ModelSpec, hw: HardwareSpec, policy: Policy, n_tokens: float) -> float:
    """Seconds to read one MoE layer's disk experts that `n_tokens` tokens route to (each
    expert read once per step whatever its token count: the batch amortizes the read)."""
    r_disk = 1.0 - policy.host_resident_ratio
    if r_disk <= 0.0 or not m.num_experts:
        return 0.0
    touched = expected_active_experts(n_tokens, m.num_experts, m.top_k) / m.num_experts
    return r_disk * touched * m.experts_bytes_per_layer / hw.disk_bw


def memory_use(m: ModelSpec, hw: HardwareSpec, wl: WorkloadSpec, policy: Policy, cpu_backend: bool) -> MemoryUse:
    """Device and host bytes a policy needs (the constraints of the search)."""
    kv = policy_kv_bytes(m, wl, policy)
    act = peak_activation_bytes(m, wl, policy)
    on_disk, ring = disk_expert_bytes(m, policy)
    if cpu_backend:
        # One pool: every weight not on disk, the disk tier's ring, the whole KV cache and the
        # activations live in host memory.
        used = m.total_bytes - on_disk + ring + kv + act
        budget = host_budget(hw)
        return MemoryUse(used, used, budget, budget, kv)
    w_total, w_layer = device_weight_bytes(m, policy.ffn_on_device)
    streamed_layer = (1.0 - policy.resident_ratio) * w_layer
    kv_dev = policy.kv_device_ratio * kv if policy.attention_on_device else 0.0
    device = (policy.resident_ratio * w_total + 2.0 * streamed_layer + act + kv_dev
              + m.embedding_bytes / 2)  # the LM head stays on the device
    host_weights = (1.0 - policy.resident_ratio) * w_total
    if not policy.ffn_on_device:
        host_weights += m.num_moe_layers * m.experts_bytes_per_layer
    pinned = 2.0 * streamed_layer  # staging pages for the next layer
    host = host_weights - on_disk + ring + (kv - kv_dev) + pinned + m.embedding_bytes / 2
    return MemoryUse(device, host, device_budget(hw, False), host_budget(hw), kv)


def _procs(hw: HardwareSpec, cpu_backend: bool) -> tuple[Processor, Processor]:
    cpu = cpu_processor(hw)
    return (cpu if cpu_backend else device_processor(hw)), cpu


class MicroBatchParts(NamedTuple):
    """One layer's seconds for one micro-batch per part the engine times (its EngineStats'
    dense, ffn and attention), where the two movable parts run, and the link bytes that moves."""

    dense: float  # norms, QKV/O projections, RoPE, router: always on the device processor
    ffn: float  # routed (+ shared) experts, or a dense layer's MLP
    prefill_attention: float
    decode_attention: float
    ffn_on_device: bool
    attention_on_device: bool
    link_in: float
    link_out: float

    @property
    def attention(self) -> float:
        return self.prefill_attention + self.decode_attention

    # Summed part by part in one order (a part elsewhere adds 0.0, which changes no bit): a
    # step's price does not depend on how its parts are grouped.
    @property
    def device(self) -> float:
        on = self.attention_on_device
        return (self.dense + (self.ffn if self.ffn_on_device else 0.0)
                + (self.prefill_attention if on else 0.0) + (self.decode_attention if on else 0.0))

    @property
    def cpu(self) -> float:
        on = self.attention_on_device
        return ((0.0 if self.ffn_on_device else self.ffn) + (0.0 if on else self.prefill_attention)
                + (0.0 if on else self.decode_attention))


def micro_batch_parts(m: ModelSpec, hw: HardwareSpec, policy: Policy, tokens: float, decode: float,
                      ctx: float, prompts: float, wl: WorkloadSpec | None, cpu_backend: bool,
                      moe_layer: bool) -> MicroBatchParts:
    """One layer for one micro-batch of `tokens` tokens: `decode` decode sequences at mean
    context `ctx` and `prompts` prompts whose tokens make up the rest (the engine packs both
    into one micro-batch: the GEMMs and element-wise work run over all its rows, attention per
    kind). The dense and FFN parts depend on the token count alone, so each processor prices
    them once for every candidate policy of a search."""
    dev, cpu = _procs(hw, cpu_backend)
    b = m.dtype_bytes
    dense = dev.remember(("dense", m, tokens), lambda: pre_attention_time(m, dev, tokens)
                         + o_proj_router_time(m, dev, tokens))
    ffn_on_device = policy.ffn_on_device or not moe_layer
    ffn_proc = dev if ffn_on_device else cpu
    ffn = ffn_proc.remember(("ffn", m, tokens, moe_layer),
                            lambda: expert_ffn_time(m, ffn_proc, tokens) if moe_layer
                            else dense_mlp_time(m, ffn_proc, tokens))
    link_in = link_out = prefill_attention = decode_attention = 0.0
    if not ffn_on_device:  # hidden states to the host and back
        link_out += tokens * m.hidden_size * b
        link_in += tokens * m.hidden_size * b
    on_device = policy.attention_on_device and not cpu_backend
    if prompts and wl is not None:
        # Prefill attention runs where the step's attention runs; its K/V goes to the host cache.
        prefill_attention = prefill_attention_time(m, dev if on_device else cpu, wl, prompts)
        if on_device:
            link_out += (tokens - decode) * m.kv_bytes_per_token_layer * (1.0 - policy.kv_device_ratio)
    if decode:
        if on_device:
            read = policy.kv_device_ratio if policy.kv_read_ratio is None else policy.kv_read_ratio
            decode_attention = device_attention_time(m, hw, decode, ctx, read)
            link_in += ((1.0 - policy.kv_device_ratio) * decode * m.attended_context(ctx)
                        * m.kv_bytes_per_token_layer)
        else:
            decode_attention = cpu_attention_time(m, hw, decode, ctx)
    if not on_device:
        link_out += tokens * m.qkv_out_features * b  # q/k/v to the host
        link_in += tokens * m.num_heads * m.v_head_dim * b  # attention output back
    return MicroBatchParts(dense, ffn, prefill_attention, decode_attention, ffn_on_device, on_device, link_in,
                           link_out)


def _micro_batch_times(m: ModelSpec, hw: HardwareSpec, policy: Policy, tokens: float, decode: float,
                       ctx: float, prompts: float, wl: WorkloadSpec | None, cpu_backend: bool,
                       moe_layer: bool) -> tuple[float, float, float, float]:
    """(device s, CPU s, link bytes in, link bytes out) of one layer for one micro-batch
    (`micro_batch_parts`)."""
    p = micro_batch_parts(m, hw, policy, tokens, decode, ctx, prompts, wl, cpu_backend, moe_layer)
    return p.device, p.cpu, p.link_in, p.link_out


def _layer_link_time(m: ModelSpec, hw: HardwareSpec, policy: Policy, moe_layer: bool, link_in: float,
                     link_out: float) -> float:
    """The link's seconds for one layer: the non-resident weights join the inbound traffic, and
    opposite directions run concurrently (Lightning 4.1)."""
    w_layer = m.moe_layer_bytes if moe_layer else m.dense_layer_bytes
    if moe_layer and not policy.ffn_on_device:
        w_layer = m.dense_params_per_layer * m.dtype_bytes
    link_in += (1.0 - policy.resident_ratio) * w_layer
    return max(link_in, link_out) / hw.link_bw


def _decode_micro_batches(m: ModelSpec, hw: HardwareSpec, policy: Policy, n_tokens: int, ctx: float,
                          cpu_backend: bool, moe_layer: bool) -> tuple[float, float, float, float]:
    """(device s, CPU s, link bytes in, out) of one layer's decode step of `n_tokens` sequences
    in micro-batches of mu."""
    mu = policy.micro_batch_size
    full, rest = divmod(n_tokens, mu)
    t_gpu = t_cpu = t_link_in = t_link_out = 0.0
    for size, count in ((mu, full), (rest, 1 if rest else 0)):
        if count == 0:
            continue
        g, c, li, lo = _micro_batch_times(m, hw, policy, size, size, ctx, 0.0, None, cpu_backend, moe_layer)
        t_gpu += count * g
        t_cpu += count * c
        t_link_in += count * li
        t_link_out += count * lo
    return t_gpu, t_cpu, t_link_in, t_link_out


def layer_decode_times(m: ModelSpec, hw: HardwareSpec, policy: Policy, n_tokens: int, ctx: float,
                       cpu_backend: bool, moe_layer: bool = True) -> tuple[float, float, float]:
    """(T_io, T_cpu, T_gpu) of one layer for a decode step of `n_tokens` sequences at mean context
    `ctx`, split into micro-batches of mu (Lightning eqs. 13-14, with QKV/O/router included)."""
    # Remembered by the placement alone, without the weights' residency, which only the link
    # time below reads: the search prices each (N, mu, placement) at the same contexts for
    # every r_w it solves.
    key = ("decode_layer", m, n_tokens, ctx, policy.placement, cpu_backend, moe_layer)
    t_gpu, t_cpu, t_link_in, t_link_out = _procs(hw, cpu_backend)[0].remember_layer(
        key, lambda: _decode_micro_batches(m, hw, policy, n_tokens, ctx, cpu_backend, moe_layer))
    if cpu_backend:
        return 0.0, t_cpu, t_gpu
    return _layer_link_time(m, hw, policy, moe_layer, t_link_in, t_link_out), t_cpu, t_gpu


def _step_micro_batch(policy: Policy, step: StepBucket) -> tuple[int, float, float, float]:
    """(micro-batches, tokens, decode sequences, prompts of each) of an engine step: the
    scheduler splits its sequences into up to N/mu micro-batches of balanced tokens, taken here
    as equal shares."""
    n_ub = max(1, min(policy.num_micro_batches, math.ceil(step.decode_seqs + step.prefill_prompts)))
    return (n_ub, (step.decode_seqs + step.prefill_tokens) / n_ub, step.decode_seqs / n_ub,
            step.prefill_prompts / n_ub)


def layer_step_times(m: ModelSpec, hw: HardwareSpec, policy: Policy, wl: WorkloadSpec, step: StepBucket,
                     cpu_backend: bool, moe_layer: bool = True) -> tuple[float, float, float]:
    """(T_io, T_cpu, T_gpu) of one layer for an engine step carrying prefill and decode tokens
    (`schedule.step_trace`): the scheduler splits its sequences into up to N/mu micro-batches
    of balanced tokens, taken here as equal shares."""
    n_ub, tokens, decode, prompts = _step_micro_batch(policy, step)
    g, c, li, lo = _micro_batch_times(m, hw, policy, tokens, decode, step.decode_context, prompts, wl,
                                      cpu_backend, moe_layer)
    g, c, li, lo = n_ub * g, n_ub * c, n_ub * li, n_ub * lo
    if cpu_backend:
        return 0.0, c, g
    return _layer_link_time(m, hw, policy, moe_layer, li, lo), c, g


def head_time(m: ModelSpec, hw: HardwareSpec, n_tokens: int, cpu_backend: bool) -> float:
    """Final norm, LM head GEMM and sampling of one step, on the device."""
    dev, _ = _procs(hw, cpu_backend)
    return ((dev.gemm(n_tokens, m.hidden_size, m.vocab_size, m.dtype_bytes) + HEAD_OPS * dev.op_overhead_s)
            * dev.factor(m, "head"))


def host_time(m: ModelSpec, hw: HardwareSpec, seqs: float, prefill_tokens: float) -> float:
    """The engine loop's seconds for one step of `seqs` sequences carrying `prefill_tokens`
    prompt tokens: its per-step, per-sequence and per-prompt-token work."""
    return ((hw.host_step_s + seqs * hw.host_seq_cost(m.vocab_size) + prefill_tokens * hw.host_token_s)
            * hw.engine_factor(m, "host"))


def _over_layers(m: ModelSpec, hw: HardwareSpec, policy: Policy, tokens: float, cpu_backend: bool,
                 layer_times: Callable[[bool], tuple[float, float, float]]) -> tuple[list[float], float, float]:
    """Sum a step's layers: ([T_io, T_cpu, T_gpu] over all layers, the layers' seconds, disk
    seconds) from `layer_times(moe_layer)`; per layer max(T_io, T_cpu, T_gpu) on a GPU machine
    (the three overlap), T_cpu + T_gpu on the CPU backend (the same cores do both)."""
    totals = [0.0, 0.0, 0.0]
    seconds = t_disk = 0.0
    for count, moe in ((m.num_moe_layers, True), (m.num_dense_layers, False)):
        if count == 0:
            continue
        io, c, g = layer_times(moe)
        d = disk_layer_time(m, hw, policy, tokens) if moe else 0.0
        totals = [totals[0] + count * io, totals[1] + count * c, totals[2] + count * g]
        t_disk += count * d
        # The next layer's disk reads run while this one computes (CGOPipe with the disk as
        # one more link): a layer takes the longer of the two.
        seconds += count * (max(c + g, d) if cpu_backend else max(io, c, g, d))
    return totals, seconds, t_disk


def decode_step_times(m: ModelSpec, hw: HardwareSpec, policy: Policy, n_tokens: int, ctx: float,
                      cpu_backend: bool) -> StepTimes:
    """One decode step of `n_tokens` sequences at mean context `ctx` over all layers, plus the LM
    head and the engine loop."""
    totals, layers, t_disk = _over_layers(
        m, hw, policy, n_tokens, cpu_backend,
        lambda moe: layer_decode_times(m, hw, policy, n_tokens, ctx, cpu_backend, moe))
    head = head_time(m, hw, n_tokens, cpu_backend)
    # The engine loop runs between steps on the host, overlapping nothing (the next step's
    # inputs depend on this step's tokens).
    host = host_time(m, hw, n_tokens, 0.0)
    return StepTimes(totals[0], totals[1], totals[2], head, layers + head + host, host, t_disk)


def engine_step_times(m: ModelSpec, hw: HardwareSpec, policy: Policy, wl: WorkloadSpec, step: StepBucket,
                      cpu_backend: bool) -> StepTimes:
    """One engine step as the scheduler runs it, prefill and decode tokens together: the layers
    over all the step's tokens (`layer_step_times`), the LM head over one row per sequence (a
    prompt's last token, a decode's new one), and the engine loop's per-step, per-sequence and
    per-prompt-token work."""
    totals, layers, t_disk = _over_layers(
        m, hw, policy, step.prefill_tokens + step.decode_seqs, cpu_backend,
        lambda moe: layer_step_times(m, hw, policy, wl, step, cpu_backend, moe))
    seqs = step.decode_seqs + step.prefill_prompts
    head = head_time(m, hw, seqs, cpu_backend)
    host = host_time(m, hw, seqs, step.prefill_tokens)
    return StepTimes(totals[0], totals[1], totals[2], head, layers + head + host, host, t_disk)


def traced_component_times(m: ModelSpec, hw: HardwareSpec, policy: Policy, wl: WorkloadSpec) -> dict[str, float]:
    """Seconds of a bounded run on the CPU backend, replayed step by step as the engine's
    scheduler runs it (`schedule.step_trace`), per part of a step as the engine times them
    (ENGINE_COMPONENTS: its EngineStats' dense, attention, ffn, head, and the rest of its wall
    time as host). What the profiler sets against the engine's own times of the same
    run to measure the in-run factors (tools/profile_engine.py)."""
    parts = dict.fromkeys(ENGINE_COMPONENTS, 0.0)
    for step in step_trace(wl.prompt_lengths, wl.request_gen_lengths, policy.batch_size, policy.prefill_tokens):
        n_ub, tokens, decode, prompts = _step_micro_batch(policy, step)
        for count, moe in ((m.num_moe_layers, True), (m.num_dense_layers, False)):
            if count == 0:
                continue
            p = micro_batch_parts(m, hw, policy, tokens, decode, step.decode_context, prompts, wl, True, moe)
            per_steps = step.steps * count * n_ub
            parts["dense"] += per_steps * p.dense
            parts["attention"] += per_steps * p.attention
            parts["ffn"] += per_steps * p.ffn
        seqs = step.decode_seqs + step.prefill_prompts
        parts["head"] += step.steps * head_time(m, hw, seqs, True)
        parts["host"] += step.steps * host_time(m, hw, seqs, step.prefill_tokens)
    return parts


def _traced_run_time(m: ModelSpec, hw: HardwareSpec, policy: Policy, wl: WorkloadSpec,
                     cpu_backend: bool) -> tuple[float, float, StepTimes]:
    """(seconds of the steps carrying prefill, seconds of decode-only steps, the fullest decode
    step's breakdown) of a bounded run with known prompt lengths, replayed step by step as the
    engine's scheduler runs it (`schedule.step_trace`)."""
    trace = step_trace(wl.prompt_lengths, wl.request_gen_lengths, policy.batch_size, policy.prefill_tokens)
    prefill = decode = 0.0
    full: tuple[float, StepTimes] | None = None
    for bucket in trace:
        t = engine_step_times(m, hw, policy, wl, bucket, cpu_backend)
        if bucket.carries_prefill:
            prefill += bucket.steps * t.total
        else:
            decode += bucket.steps * t.total
            if full is None or bucket.decode_seqs > full[0]:
                full = (bucket.decode_seqs, t)
    if full is None:
        full = (1, decode_step_times(m, hw, policy, 1, wl.mean_prompt + 1.0, cpu_backend))
    return prefill, decode, full[1]


def _prefill_pass_time(m: ModelSpec, dev: Processor, wl: WorkloadSpec, chunk: float, moe: bool) -> float:
    """One layer's compute in a prefill pass of `chunk` of the workload's prompt tokens."""
    t = pre_attention_time(m, dev, chunk) + o_proj_router_time(m, dev, chunk)
    t += expert_ffn_time(m, dev, chunk) if moe else dense_mlp_time(m, dev, chunk)
    return t + prefill_attention_time(m, dev, wl, chunk / max(1.0, wl.mean_prompt))


def prefill_time(m: ModelSpec, hw: HardwareSpec, policy: Policy, wl: WorkloadSpec, n_seqs: int,
                 cpu_backend: bool) -> float:
    """Prefill of `n_seqs` prompts, all on the device (Lightning section 4), in passes of
    `policy.prefill_tokens` tokens: each pass streams the non-resident weights once per layer
    (overlapped with compute) and writes the new K/V back to the host."""
    dev, _ = _procs(hw, cpu_backend)
    total_tokens = n_seqs * wl.mean_prompt
    if total_tokens <= 0:
        return 0.0
    passes = max(1, math.ceil(total_tokens / policy.prefill_tokens))
    chunk = total_tokens / passes
    compute = 0.0
    for count, moe in ((m.num_moe_layers, True), (m.num_dense_layers, False)):
        if count == 0:
            continue
        per_pass = dev.remember_layer(("prefill_pass", m, wl, chunk, moe),
                                      lambda: _prefill_pass_time(m, dev, wl, chunk, moe))
        layer_compute = passes * per_pass
        if moe:  # each pass reads the layer's disk experts again, in the shadow of compute
            layer_compute = max(layer_compute, passes * disk_layer_time(m, hw, policy, chunk))
        if not cpu_backend:
            w_layer = m.moe_layer_bytes if moe else m.dense_layer_bytes
            io_in = passes * (1.0 - policy.resident_ratio) * w_layer / hw.link_bw
            io_out = total_tokens * m.kv_bytes_per_token_layer * (1.0 - policy.kv_device_ratio) / hw.link_bw
            layer_compute = max(layer_compute, io_in, io_out)
        compute += count * layer_compute
    seqs_per_pass = int(math.ceil(chunk / max(1.0, wl.mean_prompt)))
    host = passes * host_time(m, hw, seqs_per_pass, chunk)
    return compute + passes * head_time(m, hw, seqs_per_pass, cpu_backend) + host


def _decode_time(m: ModelSpec, hw: HardwareSpec, policy: Policy, wl: WorkloadSpec, n_seqs: int,
                 cpu_backend: bool) -> tuple[float, StepTimes]:
    """Seconds for the g-1 decode steps of `n_seqs` sequences (prefill yields the first token)
    whose context grows from p+1 to p+g-1; Simpson's rule over the context (a step's time is
    piecewise linear in it). Returns the time and the middle step's breakdown."""
    p, g = wl.mean_prompt, wl.gen_len
    steps = g - 1
    ctxs = (p + 1.0, p + 1.0 + max(0, steps - 1) / 2.0, p + max(1.0, float(steps)))
    ends = [decode_step_times(m, hw, policy, n_seqs, c, cpu_backend) for c in ctxs]
    mean_step = (ends[0].total + 4 * ends[1].total + ends[2].total) / 6.0
    return steps * mean_step, ends[1]


@dataclass(frozen=True)
class OccupancyBucket:
    """Decode steps that run with about `batch` sequences in flight, whose mean age (tokens
    generated so far) is `mean_age`."""

    batch: int
    steps: int
    mean_age: float


@lru_cache(maxsize=64)
def batch_occupancy(gen_lengths: tuple[int, ...], max_batch: int) -> tuple[OccupancyBucket, ...]:
    """How full the decode batch is over a bounded run under continuous batching.

    Requests are admitted in order as slots free up (at most `max_batch` in flight); request i
    decodes g_i - 1 steps (its first token comes from prefill). Steps are grouped by their
    in-flight count into geometric buckets (1, 2, 3, 4, 6, 8, 12, ...), so a run whose batch
    drains as short requests finish costs a handful of step-time evaluations, not one per step.
    """
    import heapq

    import numpy as np

    decode = [g - 1 for g in gen_lengths]
    slots = [0] * min(max_batch, len(decode))  # step at which each slot frees up
    heapq.heapify(slots)
    starts = np.empty(len(decode), dtype=np.int64)
    for i, d in enumerate(decode):
        start = heapq.heappop(slots)
        starts[i] = start
        heapq.heappush(slots, start + d)
    ends = starts + np.asarray(decode, dtype=np.int64)
    total = int(ends.max()) if len(ends) else 0
    if total == 0:
        return ()
    live = ends > starts
    alive = np.zeros(total + 1, dtype=np.int64)
    started = np.zeros(total + 1, dtype=np.int64)  # sum of start steps of the sequences alive
    np.add.at(alive, starts[live], 1)
    np.add.at(alive, ends[live], -1)
    np.add.at(started, starts[live], starts[live])
    np.add.at(started, ends[live], -starts[live])
    alive, started = np.cumsum(alive)[:total], np.cumsum(started)[:total]
    steps = np.arange(total)
    age = np.where(alive > 0, steps - started / np.maximum(alive, 1), 0.0)
    # Bucket by in-flight count: edges 1, 2, 3, 4, 6, 8, 12, 16, ... (ratio <= 1.5).
    edges = sorted({1, 2, 3} | {int(round(2 ** (k / 2))) for k in range(4, 64)
                                if 2 ** (k / 2) <= max(4, max_batch) * 1.5})
    which = np.searchsorted(np.asarray(edges), alive, side="right") - 1
    buckets = []
    for b in np.unique(which[alive > 0]):
        sel = (which == b) & (alive > 0)
        n = int(sel.sum())
        buckets.append(OccupancyBucket(max(1, int(round(alive[sel].mean()))), n,
                                       float(age[sel].mean())))
    return tuple(buckets)


def _bounded_decode_time(m: ModelSpec, hw: HardwareSpec, policy: Policy, wl: WorkloadSpec,
                         cpu_backend: bool) -> tuple[float, StepTimes]:
    """Decode seconds of a bounded run (K requests with per-request generation lengths,
    wl.gen_lengths; `predict` calls it only then), summed over its occupancy buckets; returns
    the time and the fullest bucket's step breakdown."""
    total, full = 0.0, None
    for b in batch_occupancy(tuple(wl.gen_lengths), policy.batch_size):
        step = decode_step_times(m, hw, policy, b.batch, wl.mean_prompt + 1.0 + b.mean_age,
                                 cpu_backend)
        total += b.steps * step.total
        if full is None or b.batch >= full[0]:
            full = (b.batch, step)
    if full is None:  # every request ends at its first token
        return 0.0, decode_step_times(m, hw, policy, 1, wl.mean_prompt + 1.0, cpu_backend)
    return total, full[1]


def predict(m: ModelSpec, hw: HardwareSpec, wl: WorkloadSpec, policy: Policy, cpu_backend: bool,
            mem: MemoryUse | None = None) -> Prediction:
    """Generation throughput (generated tokens / (prefill + decode time), Lightning 5.1) of a
    policy. A bounded run with every request's prompt length (a shard) is replayed step by step
    as the scheduler runs it (`_traced_run_time`); with per-request generation lengths alone the
    prefill passes are followed by the decode batch as it drains (`batch_occupancy`); otherwise a
    bounded request count K runs in ceil(K/N) waves of at most N. `mem`: the policy's
    `memory_use`, when the caller has it already (the search checks the fit first)."""
    if mem is None:
        mem = memory_use(m, hw, wl, policy, cpu_backend)
    if wl.prefill_only:
        return _predict_prefill_only(m, hw, wl, policy, cpu_backend, mem)
    if wl.num_requests and len(wl.prompt_lengths) == wl.num_requests:
        prefill, decode, step = _traced_run_time(m, hw, policy, wl, cpu_backend)
    elif wl.gen_lengths:
        prefill = prefill_time(m, hw, policy, wl, wl.num_requests, cpu_backend)
        decode, step = _bounded_decode_time(m, hw, policy, wl, cpu_backend)
    else:
        return _predict_waves(m, hw, wl, policy, cpu_backend, mem)
    total = prefill + decode
    tokens = sum(wl.gen_lengths) if wl.gen_lengths else wl.num_requests * wl.gen_len
    return Prediction(policy, tokens / total if total > 0 else 0.0, step, prefill, decode, mem,
                      min(policy.batch_size, wl.num_requests))


def _predict_waves(m: ModelSpec, hw: HardwareSpec, wl: WorkloadSpec, policy: Policy, cpu_backend: bool,
                   mem: MemoryUse) -> Prediction:
    """One generation length for all: ceil(K/N) waves of at most N sequences (one wave of N in
    steady state, K = 0), each prefilled in passes, then decoded g - 1 steps."""
    n = policy.batch_size
    k = wl.num_requests
    waves = [(n, k // n), (k % n, 1)] if k else [(n, 1)]
    total_time = prefill = decode = 0.0
    tokens = 0
    mid_step = None
    for size, count in waves:
        if size == 0 or count == 0:
            continue
        pf = prefill_time(m, hw, policy, wl, size, cpu_backend)
        dc, step = _decode_time(m, hw, policy, wl, size, cpu_backend)
        prefill += count * pf
        decode += count * dc
        tokens += count * size * wl.gen_len
        mid_step = mid_step or step
    total_time = prefill + decode
    eff = min(n, k) if k else n
    return Prediction(policy, tokens / total_time if total_time > 0 else 0.0, mid_step, prefill, decode, mem, eff)


def _predict_prefill_only(m: ModelSpec, hw: HardwareSpec, wl: WorkloadSpec, policy: Policy,
                          cpu_backend: bool, mem: MemoryUse) -> Prediction:
    """A run whose every request ends at its prefill token: passes of `prefill_pass_seqs`
    prompts, each paying its per-step costs (host loop, LM head, op launches); N plays no part,
    so the search keeps the smallest."""
    per = prefill_pass_seqs(wl, policy)
    k = wl.num_requests or per
    full, rest = divmod(k, per)
    prefill = full * prefill_time(m, hw, policy, wl, per, cpu_backend)
    if rest:
        prefill += prefill_time(m, hw, policy, wl, rest, cpu_backend)
    step = decode_step_times(m, hw, policy, 1, wl.mean_prompt + 1.0, cpu_backend)
    return Prediction(policy, k / prefill if prefill > 0 else 0.0, step, prefill, 0.0, mem, per)
