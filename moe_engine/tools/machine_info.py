"""What a benchmark must say about the machine it ran on, and the machine's roofs measured with
the project's own kernels.

The CPU differs between the machines this project runs on (an AVX-512 Xeon one day, an AVX2-only
EPYC the next), so every benchmark prints `header()`: CPU model, the ISA extensions that matter
here, the kernel builds chosen at run time, threads, torch version and date.
"""
from __future__ import annotations

import os
import platform
import time

import torch

from moe_engine.cpu_features import cpu_flags as cpu_flags_reported
from moe_engine.cpu_features import cpuinfo_field
from moe_engine.host_alloc import tune_host_allocator
# CPU flags (as /proc/cpuinfo spells them) that decide which kernel paths can run.
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                  "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or "unknown CPU"


def cpu_flags() -> list[str]:
    """The RELEVANT_FLAGS this CPU reports."""
    flags = cpu_flags_reported()
    return [f for f in RELEVANT_FLAGS if f in flags]


def kernel_paths() -> dict[str, str]:
    """The kernel builds this process runs: packed GEMM ISA and the attention kernel."""
    from moe_engine.model import packed, paged_attention

    return {"packed_isa": packed.ISA or "not built",
            "packed_isas_supported": ",".join(packed.supported_isas()) or "none",
            "attention_kernel": (f"cython {paged_attention.ISA}"
                                 if paged_attention.HAS_CYTHON_KERNELS else "not built")}


def header(threads: int) -> str:
    """One line for the top of every benchmark's output. It also applies the engine's malloc
    settings (moe_engine/host_alloc.py) first, so the baselines a benchmark times beside the engine
    run under the same allocator whichever is built first."""
    allocator = tune_host_allocator()
    paths = kernel_paths()
    return (f"# {cpu_model()} [{' '.join(cpu_flags()) or 'no AVX2'}], {os.cpu_count()} cpus, "
            f"threads={threads}, packed ISA {paths['packed_isa']} (supported: "
            f"{paths['packed_isas_supported']}), attention kernel {paths['attention_kernel']}, "
            f"malloc {allocator}, torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def read_bandwidth_gbps(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """Best of `repeats` read passes over a buffer far larger than the last-level cache, with
    the extension's vectorized sum (same compiler and OpenMP runtime as the kernels)."""
    from moe_engine.model import paged_attention

    buf = torch.ones(mib * (1 << 20) // 4)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass also faults the pages in
        t0 = time.perf_counter()
        if paged_attention.HAS_CYTHON_KERNELS:
            paged_attention.read_sum(buf, threads)
        else:
            buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9


def fma_peak_gflops(threads: int, seconds: float = 0.5, kind: str = "fma") -> float:
    """The compute roof: a register-blocked loop in the packed kernels' chosen ISA of fp32 FMAs,
    of bf16 pair dot products (kind "bf16_dot": the roof of bf16p weights) or of int8 quad dot
    products (kind "int8_dot": the roof of int8q weights)."""
    from moe_engine.model import packed

    return packed.fma_peak_flops(seconds, threads, kind=kind) / 1e9
