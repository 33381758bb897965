"""MoE-Lens performance model (section 5): the stage-1 hardware bound and the stage-2 prediction
for a bounded request batch over a paged KV cache; Klotski's batch-group planner (section 7).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .specs import HardwareSpec, ModelSpec


def gemm_intensity_per_token(m: ModelSpec) -> float:
    """Lens eq. 1 without the factor n: GEMM FLOPs per weight element read, per parallel token,
    (6 k h h_i + 4h^2 + 4h^2/s) / (6 E h h_i + 4h^2 + 4h^2/s), using the model's real attention
    weight count instead of the 4h^2 + 4h^2/s approximation."""
    active = 3 * m.top_k * m.hidden_size * m.intermediate_size + m.attn_params_per_layer + m.shared_params
    total = 3 * m.num_experts * m.hidden_size * m.intermediate_size + m.attn_params_per_layer + m.shared_params
    return active / total


def tokens_to_saturate(device_flops: float, link_bw: float, num_experts: int, top_k: int,
                       dtype_bytes: int = 2) -> float:
    """Lens eq. 2: parallel tokens n >= (C_GPU / B_IO) * (E / k) so that the GEMMs on weights
    streamed over the link keep the accelerator busy. Each weight element costs `dtype_bytes` on
    the link and brings 2 FLOPs per token that uses it, hence the dtype_bytes/2 factor (1 for bf16,
    the case the paper's Table 2 assumes)."""
    return device_flops / link_bw * (num_experts / top_k) * (dtype_bytes / 2.0)


def tokens_to_saturate_exact(m: ModelSpec, device_flops: float, link_bw: float) -> float:
    """Eq. 2 with the full eq. 1 intensity (attention and shared weights included)."""
    return device_flops / link_bw * (m.dtype_bytes / 2.0) / gemm_intensity_per_token(m)


def kv_bytes_to_saturate(m: ModelSpec, device_flops: float, link_bw: float, seq_len: int) -> float:
    """Table 2: KV cache bytes that hold `tokens_to_saturate` sequences of `seq_len` tokens."""
    n = tokens_to_saturate(device_flops, link_bw, m.num_experts, m.top_k, m.dtype_bytes)
    return n * seq_len * m.kv_bytes_per_token


def pme(prompt_len: float, gen_len: float) -> float:
    """Lens eq. 3, parallelism-memory efficiency: 2(p+g) / ((2p+g) g), tokens computed per
    token-slot of KV cache held per step over a sequence's life."""
    if gen_len <= 0:
        raise ValueError("gen_len must be >= 1")
    return 2.0 * (prompt_len + gen_len) / ((2.0 * prompt_len + gen_len) * gen_len)


def overlap_capacity_gain(prompt_len: float, gen_len: float) -> float:
    """Lens eq. 7: C_eff / C = (p+g) / (p+g/2), the KV capacity gained by overlapping prefill and
    decode (a sequence holds p+g/2 slots on average instead of p+g at the peak)."""
    return (prompt_len + gen_len) / (prompt_len + gen_len / 2.0)


@dataclass(frozen=True)
class Stage1Bound:
    """Lens eq. 4 and its ingredients."""

    pme: float
    kv_capacity_tokens: float
    delta_s: float
    t_gpu_tok_s: float
    t_max_tok_s: float
    t_max_gen_tok_s: float
    memory_bound: bool

    def to_json(self) -> dict:
        return {"pme": self.pme, "kv_capacity_tokens": self.kv_capacity_tokens, "delta_s": self.delta_s,
                "t_gpu_tok_s": self.t_gpu_tok_s, "t_max_tok_s": self.t_max_tok_s,
                "t_max_gen_tok_s": self.t_max_gen_tok_s,
                "regime": "kv-capacity-bound" if self.memory_bound else "compute-bound"}


def device_token_rate(m: ModelSpec, flops: float) -> float:
    """T_GPU: tokens/s the accelerator can process when compute-bound (2 FLOPs per active weight
    of the decoder layers; the LM head runs once per sequence and step, not per prompt token)."""
    active = (m.num_moe_layers * (m.attn_params_per_layer + m.router_params + m.shared_params
                                  + m.top_k * m.expert_params)
              + m.num_dense_layers * (m.attn_params_per_layer + m.dense_mlp_params))
    return flops / (2.0 * active)


def stage1_bound(m: ModelSpec, hw: HardwareSpec, prompt_len: float, gen_len: float,
                 kv_capacity_bytes: float, streamed_bytes: float | None = None) -> Stage1Bound:
    """Lens eq. 4: T_max = min(PME * M / delta, T_GPU) in tokens/s (prompt + generated tokens).

    delta is the time to bring the streamed weights in once per step: over the link on a GPU
    machine; on a CPU-only machine the "link" is the memory bus every step re-reads the weights
    over. `t_max_gen_tok_s` rescales to generated tokens only (g of every p+g tokens), the unit
    the policy's predicted throughput uses.
    """
    weights = m.total_bytes if streamed_bytes is None else streamed_bytes
    bw = hw.cpu_bw if hw.is_cpu_only else hw.link_bw
    delta = weights / bw
    # Tokens of (p + g)-token sequences the cache holds (GPT-OSS's sliding layers hold a window
    # of each, so a token costs less there than kv_bytes_per_token).
    seq_len = max(prompt_len + gen_len, 1.0)
    per_token = (m.kv_bytes_per_sequence(seq_len) / seq_len if m.pools_window_kv
                 else m.kv_bytes_per_token)
    capacity = kv_capacity_bytes / per_token
    e = pme(prompt_len, gen_len)
    t_gpu = device_token_rate(m, hw.device_flops)
    mem_rate = e * capacity / delta if delta > 0 else math.inf
    t_max = min(mem_rate, t_gpu)
    return Stage1Bound(e, capacity, delta, t_gpu, t_max, t_max * gen_len / (prompt_len + gen_len), mem_rate < t_gpu)


@dataclass(frozen=True)
class Stage2Prediction:
    """Lens eqs. 8-14 for a batch of K requests on a paged KV cache."""

    q: float
    decoding_seqs: float
    t1_tok_s: float
    t2_tok_s: float
    throughput_tok_s: float
    iterations: float


def stage2_throughput(num_requests: int, prompt_len: float, gen_len: int, kv_blocks: int, block_size: int,
                      delta_s: float, t_gpu_tok_s: float) -> Stage2Prediction:
    """Generation throughput (tokens/s) of K requests with prefill/decode overlap (Lens 5.5).

    q (eq. 8) sequences are admitted per iteration so that the blocks they hold over their life
    sum to the cache; each iteration takes delta while I/O-bound. T1 (eq. 10) is the capacity-
    bound rate with the pipeline's epilogue; T2 (eqs. 11-13) the compute-bound rate with its
    prologue; the prediction is their minimum (eq. 14). T_GPU is read as tokens per iteration
    (the parallel tokens the device absorbs in one delta), as eqs. 11-12 use it.
    """
    k, p, g, b = num_requests, prompt_len, gen_len, block_size
    blocks_over_life = sum(math.ceil((p + i) / b) for i in range(g + 1))
    q = kv_blocks / blocks_over_life
    t1 = k / (k + g * q) * (g * q / delta_s)
    tokens_per_iter = t_gpu_tok_s * delta_s
    t_prefill = tokens_per_iter * p / (p + g)
    iterations = 2 * g + max(0.0, k * p - (t_prefill + tokens_per_iter) / 2.0 * g) / t_prefill
    t2 = k * g / (iterations * delta_s)
    return Stage2Prediction(q, g * q, t1, t2, min(t1, t2), iterations)


def klotski_min_batches(t_attn: float, t_gate: float, t_hot: float, t_cold: tuple[float, ...],
                        io_gate: float, io_expert: float, io_attn: float, num_hot: int) -> int:
    """Klotski ineqs. 4-7: the smallest batch-group count n for which attention and gate compute
    of n batches (plus hot-expert and queued cold-expert compute) hides the transfers of the gate,
    the K hot experts, each queued cold expert and the next layer's attention weights."""
    per_batch = t_attn + t_gate
    if per_batch <= 0:
        raise ValueError("attention + gate time per batch must be > 0")
    needs = [io_gate / t_attn if t_attn > 0 else math.inf,
             (io_gate + num_hot * io_expert) / per_batch,
             (io_gate + (num_hot + 1) * io_expert - t_hot) / per_batch,
             (io_gate + (num_hot + len(t_cold)) * io_expert + io_attn - t_hot - sum(t_cold)) / per_batch]
    return max(1, math.ceil(max(needs) - 1e-12))
