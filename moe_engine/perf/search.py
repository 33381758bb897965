"""Policy search (Lightning 4.2): exhaustive over a small (N, mu, A_g, F_g, prefill pass) grid
with the resident weight ratio r_w solved in closed form and the KV ratio r_c optimised by a
golden-section search, maximizing predicted generation throughput under the device and host
memory constraints.

Lightning solves an MILP per workload (appendix B.2, "less than a minute"); the grid plus the
closed form for r_w finds the same optimum in about a second because T is monotone in r_w (every
resident byte is one byte less over the link and one byte less of host memory). T is not
monotone in r_c (KV read on the device costs device time, KV on the host crosses the link in
the shadow of compute) but it is convex, so a one-dimensional search finds its best.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

from .lens import Stage1Bound, stage1_bound
from .cost import (DEFAULT_BLOCK_SIZE, DEFAULT_PREFILL_TOKENS, MemoryUse, Policy, Prediction, StepTimes,
                    activation_bytes, peak_activation_bytes, device_budget, device_weight_bytes, is_cpu_backend, memory_use,
                    policy_kv_bytes,
                    predict)
from .roofline import decode_attention_cost, expected_active_experts
from .specs import GB, HardwareSpec, ModelSpec, WorkloadSpec

# Micro-batch sizes and micro-batch counts tried. Geometric with ratio ~1.5 so that the best grid
# point is within ~20% of the continuous optimum in N and mu.
MU_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
NUB_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128)
# Equal predictions (to rounding) prefer the policy holding fewer sequences (less KV). A looser
# tolerance would trade throughput for memory and break "more memory never predicts less".
TIE_TOLERANCE = 1e-9
# Golden-section search over r_c: ratio, and the width (relative to r_c's range) it stops at.
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
KV_RATIO_TOLERANCE = 1e-10
# Prefill pass sizes (tokens) tried on a GPU machine.
PREFILL_GRID = tuple(DEFAULT_PREFILL_TOKENS << i for i in range(8))  # 2048 .. 262144


class NoFeasiblePolicy(RuntimeError):
    """Not even one micro-batch fits: the model does not fit the machine's memory."""


@dataclass(frozen=True)
class PolicyResult:
    """The chosen policy, what the model predicts for it and why."""

    policy: Policy
    prediction: Prediction
    stage1: Stage1Bound
    bottleneck: str
    backend: str
    model: ModelSpec
    hardware: HardwareSpec
    workload: WorkloadSpec
    search_seconds: float
    candidates: int

    @property
    def throughput_tok_s(self) -> float:
        return self.prediction.throughput_tok_s

    def to_json(self) -> dict[str, Any]:
        """What the workflow writes to policy.json (plain JSON types only)."""
        p, pred, m, hw, wl = self.policy, self.prediction, self.model, self.hardware, self.workload
        step = pred.step
        n_layers = m.num_layers
        bound = self.stage1.t_max_gen_tok_s
        return {
            "policy": {
                "batch_size": p.batch_size, "micro_batch_size": p.micro_batch_size,
                "num_micro_batches": p.num_micro_batches, "attention_on_device": p.attention_on_device,
                "ffn_on_device": p.ffn_on_device, "resident_ratio": p.resident_ratio,
                "kv_device_ratio": p.kv_device_ratio, "prefill_tokens": p.prefill_tokens,
                "block_size": p.block_size, "kv_cache_bytes": pred.memory.kv_bytes,
                "host_resident_ratio": p.host_resident_ratio,
            },
            "prediction": {
                "throughput_tok_s": pred.throughput_tok_s, "prefill_s": pred.prefill_s, "decode_s": pred.decode_s,
                "effective_batch": pred.effective_batch,
                "decode_step_s": step.total,
                "per_layer_s": {"t_io": step.t_io / n_layers, "t_cpu": step.t_cpu / n_layers,
                                "t_gpu": step.t_gpu / n_layers},
                "per_step_s": {"t_io": step.t_io, "t_cpu": step.t_cpu, "t_gpu": step.t_gpu, "t_head": step.t_head,
                               "t_host": step.t_host, "t_disk": step.t_disk},
            },
            "bottleneck": self.bottleneck,
            "memory": dataclasses.asdict(pred.memory),
            "stage1": self.stage1.to_json(),
            "prediction_over_bound": pred.throughput_tok_s / bound if bound > 0 else None,
            "backend": self.backend,
            "search": {"seconds": self.search_seconds, "candidates": self.candidates},
            "model": dataclasses.asdict(m),
            "hardware": _hardware_json(hw),
            "workload": {"mean_prompt": wl.mean_prompt, "max_prompt": wl.max_prompt, "gen_len": wl.gen_len,
                         "num_requests": wl.num_requests},
            "roofline": roofline_points(m, hw, p, wl, self.backend),
        }


def _hardware_json(hw: HardwareSpec) -> dict[str, Any]:
    d = dataclasses.asdict(hw)
    d["gemm_points"] = len(hw.gemm_points)
    d["cpu_gemm_points"] = len(hw.cpu_gemm_points)
    return d


def roofline_points(m: ModelSpec, hw: HardwareSpec, p: Policy, wl: WorkloadSpec, backend: str) -> dict[str, Any]:
    """Operational intensities (FLOPs/byte) of the decode operators under the policy, for the
    Lightning Fig. 4-5 plot: attention against its KV bytes; the MoE FFN against the weight bytes
    it reads per micro-batch (device memory roof) and against the bytes streamed per step over the
    link for the whole batch N (link roof)."""
    ctx = wl.mean_prompt + wl.gen_len / 2.0
    attn = decode_attention_cost(m, 1, ctx)
    mu, n = p.micro_batch_size, p.batch_size
    active = expected_active_experts(mu, m.num_experts, m.top_k)
    ffn_flops_mu = 2.0 * mu * m.top_k * m.expert_params
    ffn_bytes_mu = active * m.expert_bytes
    streamed = (1.0 - p.resident_ratio) * m.experts_bytes_per_layer
    ffn_flops_n = 2.0 * n * m.top_k * m.expert_params
    return {
        "attention_intensity": attn.intensity,
        "ffn_intensity_device": ffn_flops_mu / ffn_bytes_mu if ffn_bytes_mu else None,
        "ffn_intensity_link": ffn_flops_n / streamed if streamed > 0 else None,
        "cpu_only": is_cpu_backend(hw, backend),
    }


def _max_resident_ratio(m: ModelSpec, hw: HardwareSpec, wl: WorkloadSpec, policy: Policy) -> tuple[float, float] | None:
    """Largest r_w (then r_c if attention is on the device) the device memory allows, or None.

    Device use is r_w*W + 2(1-r_w)*W_layer + fixed, linear in r_w, so the bound is closed-form.
    """
    budget = device_budget(hw, False)
    w_total, w_layer = device_weight_bytes(m, policy.ffn_on_device)
    fixed = peak_activation_bytes(m, wl, policy) + m.embedding_bytes / 2
    if w_total + fixed <= budget:
        r_c = 0.0
        if policy.attention_on_device:
            kv = policy_kv_bytes(m, wl, policy)
            r_c = min(1.0, (budget - w_total - fixed) / kv) if kv else 1.0
        return 1.0, r_c
    denom = w_total - 2.0 * w_layer
    if denom <= 0:
        return None
    r_w = (budget - 2.0 * w_layer - fixed) / denom
    if r_w < 0:
        return None
    return min(r_w, 1.0), 0.0


def _max_host_ratio(m: ModelSpec, hw: HardwareSpec, wl: WorkloadSpec, policy: Policy,
                    cpu_backend: bool) -> tuple[float, MemoryUse] | None:
    """Largest r_host (whole experts per layer) the host memory allows, with the memory use of
    the policy with every expert in host memory, or None.

    Host use falls by (1 - r_host) * (X - 2 X_layer) as experts move to disk (X all experts'
    bytes, 2 X_layer the read ring for two layers of them), linear, so the bound is closed-form.
    More experts in host memory never reads more from disk, so the largest that fits is best.
    """
    if policy.host_resident_ratio != 1.0:
        policy = dataclasses.replace(policy, host_resident_ratio=1.0)
    mem = memory_use(m, hw, wl, policy, cpu_backend)
    excess = mem.host_bytes - mem.host_budget
    if excess <= 0:
        return 1.0, mem
    layer = m.experts_bytes_per_layer
    gain = m.num_moe_layers * layer - 2.0 * layer
    if gain <= 0 or not m.num_experts:
        return None
    r = 1.0 - excess / gain
    if r < 0:
        return None
    return math.floor(r * m.num_experts + 1e-9) / m.num_experts, mem  # what the pager can hold


def _candidate_batches(num_requests: int, prefill_only: bool = False):
    """(mu, N) pairs of the grid; with K requests bounded, N and mu above K collapse onto K.

    A prefill-only run holds no decode batch: its prediction and memory depend on mu (the
    decode activations it reserves) but not on N, so every N above mu would price the same as
    N = mu and lose the tie to it (`_better`); only N = mu is scored."""
    seen = set()
    for mu in MU_GRID:
        for nub in NUB_GRID[:1] if prefill_only else NUB_GRID:
            n, m_eff = mu * nub, mu
            if num_requests:
                n, m_eff = min(n, num_requests), min(mu, num_requests)
            if (m_eff, n) not in seen:
                seen.add((m_eff, n))
                yield m_eff, n


def _useful_pass_sizes(choices: tuple[int, ...], wl: WorkloadSpec, n: int) -> tuple[int, ...]:
    """The pass sizes that differ for batch n: beyond the prompt tokens a pass can ever hold
    (the run's, or N's for an unbounded one) a larger pass changes nothing, so only the
    smallest of those is kept."""
    if wl.prefill_only:  # passes fill the budget whatever N: only the run's tokens bound them
        cap = wl.num_requests * max(1.0, wl.mean_prompt) if wl.num_requests else math.inf
    else:
        cap = max(n, wl.num_requests) * max(1.0, wl.mean_prompt)
    out = []
    for pf in sorted(choices):
        out.append(pf)
        if pf >= cap:
            break
    return tuple(out)


def _best_kv_ratio(model: ModelSpec, hw: HardwareSpec, wl: WorkloadSpec, at_max: Prediction, r_max: float,
                   best: Prediction | None) -> Prediction:
    """The KV fraction on the device r_c in [0, r_max] that predicts the most, for attention on
    the device. More of the cache on the device is not always faster: the part on the host
    crosses the link while the device computes, and the part on the device costs device time,
    so the best r_c balances the two. The run's time is convex in r_c (a sum of maxima of terms
    linear in it), so a golden-section search finds the optimum; it runs only when a bound (the
    link carrying the least KV while the device reads the least) could beat the best so far."""
    p = at_max.policy
    if best is not None:
        # The read ratio moves no byte of memory: the bound fits as the policy does.
        bound = predict(model, hw, wl, dataclasses.replace(p, kv_read_ratio=0.0), False, at_max.memory)
        if bound.throughput_tok_s <= best.throughput_tok_s * (1.0 - TIE_TOLERANCE):
            return at_max
    evaluated = {r_max: at_max}

    def neg_throughput(r: float) -> float:  # minimised: the tokens are fixed, so it follows time
        if r not in evaluated:
            evaluated[r] = predict(model, hw, wl, dataclasses.replace(p, kv_device_ratio=r), False)
        return -evaluated[r].throughput_tok_s

    lo, hi = 0.0, r_max
    a, b = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
    fa, fb = neg_throughput(a), neg_throughput(b)
    neg_throughput(0.0)
    while hi - lo > KV_RATIO_TOLERANCE * max(r_max, 1e-12):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - GOLDEN * (hi - lo)
            fa = neg_throughput(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + GOLDEN * (hi - lo)
            fb = neg_throughput(b)
    return max(evaluated.values(), key=lambda pr: (pr.throughput_tok_s, pr.policy.kv_device_ratio))


def choose_policy(model: ModelSpec, hw: HardwareSpec, wl: WorkloadSpec, *, backend: str,
                  block_size: int = DEFAULT_BLOCK_SIZE, prefill_tokens: int | None = None) -> PolicyResult:
    """Search (N, mu, attention on device, FFN on device, r_w, r_c) for the highest predicted
    generation throughput that fits device and host memory.

    backend "cpu" (or a CPU-only hardware spec): the device is the CPU, all weights are resident
    (paging host memory into host memory gains nothing), attention and FFN run on the same cores.
    """
    start = time.perf_counter()
    cpu_backend = is_cpu_backend(hw, backend)
    prefill_choices = (prefill_tokens,) if prefill_tokens else (DEFAULT_PREFILL_TOKENS,)
    if prefill_tokens is None and not cpu_backend:
        # Prefill pass sizes from a grid that depends on no rate (a faster link or device must
        # find every candidate of a slower one), capped so a pass's activations take at most a
        # quarter of the device memory: the rest holds resident weights, which every decode
        # step benefits from. Larger passes re-stream the non-resident weights less often
        # (Lens eq. 2) but leave less room for resident weights, so every size is scored.
        quarter = device_budget(hw, False) / 4
        prefill_choices = tuple(t for t in PREFILL_GRID
                                if activation_bytes(model, t, t / max(1.0, wl.mean_prompt)) <= quarter)
        prefill_choices = prefill_choices or (DEFAULT_PREFILL_TOKENS,)
    placements = [(False, True)] if cpu_backend else [(a, f) for a in (False, True) for f in (True, False)]
    scored: list[tuple[Prediction, float]] = []  # (prediction at the largest r_c, that r_c)
    for attn_dev, ffn_dev in placements:
        for mu, n in _candidate_batches(wl.num_requests, wl.prefill_only):
            for pf in _useful_pass_sizes(prefill_choices, wl, n):
                policy = Policy(n, mu, attn_dev, ffn_dev, 1.0, 0.0, pf, block_size)
                if not cpu_backend:
                    solved = _max_resident_ratio(model, hw, wl, policy)
                    if solved is None:
                        continue
                    policy = dataclasses.replace(policy, resident_ratio=solved[0], kv_device_ratio=solved[1])
                host = _max_host_ratio(model, hw, wl, policy, cpu_backend)
                if host is None:
                    continue
                r_host, mem = host  # mem: this policy's, as long as every expert is in host memory
                if r_host < 1.0:  # the disk tier; the device tier lies inside the host tier
                    policy = dataclasses.replace(policy, host_resident_ratio=r_host,
                                                 resident_ratio=min(policy.resident_ratio, r_host))
                    mem = memory_use(model, hw, wl, policy, cpu_backend)
                if not mem.fits:
                    continue
                scored.append((predict(model, hw, wl, policy, cpu_backend, mem), policy.kv_device_ratio))
    candidates = len(scored)
    best: Prediction | None = None
    # Best first, so the bound below discards most candidates without a search over r_c.
    for pred, r_max in sorted(scored, key=lambda s: -s[0].throughput_tok_s):
        if pred.policy.attention_on_device and r_max > 0:
            pred = _best_kv_ratio(model, hw, wl, pred, r_max, best)
        if best is None or _better(pred, best):
            best = pred
    if best is None:
        raise NoFeasiblePolicy(
            f"no policy fits: model {model.name} needs {model.total_bytes / 1e9:.1f} GB of weights; "
            f"hardware {hw.name} has {hw.host_memory / 1e9:.1f} GB host and {hw.device_memory / 1e9:.1f} GB device memory")
    p = best.policy
    streamed = None
    if not cpu_backend:
        w_total, _ = device_weight_bytes(model, p.ffn_on_device)
        streamed = (1.0 - p.resident_ratio) * w_total
    host_kv = best.memory.kv_bytes * (1.0 - (p.kv_device_ratio if p.attention_on_device else 0.0))
    bound = stage1_bound(model, hw, wl.mean_prompt, wl.gen_len, host_kv, streamed_bytes=streamed)
    elapsed = time.perf_counter() - start
    return PolicyResult(p, best, bound, best.step.bottleneck, "cpu" if cpu_backend else backend, model, hw, wl,
                        elapsed, candidates)


def _better(a: Prediction, b: Prediction) -> bool:
    """a beats b if faster, or equally fast with fewer sequences."""
    if a.throughput_tok_s > b.throughput_tok_s * (1.0 + TIE_TOLERANCE):
        return True
    tie = a.throughput_tok_s >= b.throughput_tok_s * (1.0 - TIE_TOLERANCE)
    return tie and a.policy.batch_size < b.policy.batch_size


def apply_policy(engine, policy: "PolicyResult | Mapping[str, Any]"):
    """Map a policy (a PolicyResult or the dict from policy.json) onto the engine's knobs:
    N -> max_num_seqs, micro-batches -> num_micro_batches, r_w -> resident_ratio, KV bytes ->
    kv_cache_gb (decimal GB, rounded up), placements -> attention_on_device / ffn_on_device,
    prefill pass size -> max_prefill_tokens, r_host < 1 -> host_resident_ratio (the disk tier).
    Returns a new EngineConfig."""
    data = policy.to_json() if isinstance(policy, PolicyResult) else dict(policy)
    p = data["policy"]
    # Rounded up to whole MB so the engine (blocks_for_budget, also decimal GB) gets every block.
    kv_gb = math.ceil(p["kv_cache_bytes"] / GB * 1000.0) / 1000.0
    r_host = float(p.get("host_resident_ratio", 1.0))
    return dataclasses.replace(
        engine,
        max_num_seqs=int(p["batch_size"]),
        num_micro_batches=int(p["num_micro_batches"]),
        resident_ratio=float(min(1.0, max(0.0, p["resident_ratio"]))),
        kv_cache_gb=max(kv_gb, 0.001),
        attention_on_device=bool(p["attention_on_device"]),
        ffn_on_device=bool(p["ffn_on_device"]),
        max_prefill_tokens=int(p.get("prefill_tokens", engine.max_prefill_tokens)),
        block_size=int(p.get("block_size", engine.block_size)),
        host_resident_ratio=(engine.host_resident_ratio if r_host >= 1.0 else r_host),
    )


__all__ = ["PolicyResult", "NoFeasiblePolicy", "choose_policy", "apply_policy", "roofline_points",
           "MemoryUse", "StepTimes"]
