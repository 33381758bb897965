"""Benchmark (issue 12): the fused MoE expert kernel against torch's F.linear, per token count.

One SwiGLU expert (gate|up GEMM, SiLU x up, down GEMM, routing-weighted output) on T tokens, for
small-mixtral's expert shape (H 1024, I 3584) and Mixtral-8x7B's (H 4096, I 14336), or
GPT-OSS's (H = I = 2880; `--shapes gpt-oss --storage mxfp4`: its experts as released):
  kernel      moe_engine.model.packed.packed_moe_ffn, weights bf16 (--storage), fp32 activations
              (--storage bf16p: bf16 pairs and bf16 activations, engine.matmul_precision=medium;
              --storage bf16x3: the same pairs, each activation as three bf16 terms, high;
              --storage int8q: int8 weights, activation rows quantized to int8, medium on
              int8 experts: AVX512-VNNI's vpdpbusd, its peak the compute roof)
  torch fp32  F.linear on fp32 weights (2x the memory of the checkpoint)
  torch bf16  F.linear on the bf16 weights (what a bf16 checkpoint runs through torch)
Each call reads its weights from DRAM as the engine does (copies rotated until they exceed the
last-level cache twice over). The machine's roofs are measured in the same run: read bandwidth
(a streaming sum) and the FMA peak (a register-blocked FMA loop in the kernels' chosen ISA; for
bf16p the bf16 pair dot-product peak, vdpbf16ps where the CPU has it, is the compute roof;
for bf16x3 a third of it, three products a weight).
Medians of --repeats calls.

  .venv/bin/python bench/expert_ffn.py                      # ~5 minutes on 2 cores
  MOE_BATCH_ISA=avx2 .venv/bin/python bench/expert_ffn.py   # force the AVX2 build

The last line printed is (the first shape of --shapes):
  RESULT decode_bw_fraction=<weights GB/s at 8 tokens / read roof>
         prefill_flops_fraction=<GFLOP/s at 256 tokens / FMA peak (bf16p: dot-product peak)>
         vs_torch_bf16=<median over token counts of torch bf16 time / kernel time>
         vs_torch_fp32=<torch fp32 time / kernel time at 16 tokens>
         decode_bw_ceiling=<the decode_bw_fraction the compute roof allows: min(1, peak /
         FLOPs a weight byte at 8 tokens / read roof)>
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_engine.model import packed  # noqa: E402
from moe_engine.model.weights import ExpertWeights  # noqa: E402
from moe_engine.tools import machine_info  # noqa: E402
from moe_engine.tools.profile_hardware import last_level_cache_bytes  # noqa: E402

SHAPES = {"small-mixtral": (1024, 3584), "mixtral-8x7b": (4096, 14336), "gpt-oss": (2880, 2880)}


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rotating(make, nbytes: int, budget: float = 2.5e9):
    """Enough copies that consecutive calls miss the last-level cache (and no more than fit)."""
    copies = max(1, min(math.ceil(2 * last_level_cache_bytes() / nbytes), int(budget // nbytes)))
    items = [make() for _ in range(copies)]
    turn = [0]

    def next_item():
        turn[0] = (turn[0] + 1) % len(items)
        return items[turn[0]]
    return next_item


def bench_shape(name: str, hidden: int, inter: int, tokens: list[int], args) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(2 * inter, hidden, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(hidden, inter, generator=g) * 0.02).bfloat16()
    expert_bytes = (w13.numel() + w2.numel()) * 2
    kernel_bytes = packed.pack_expert(ExpertWeights(w13, w2), args.storage).nbytes()
    kernel_w = rotating(lambda: packed.pack_expert(ExpertWeights(w13, w2), args.storage), kernel_bytes)
    bf16_w = rotating(lambda: (w13.clone(), w2.clone()), expert_bytes)
    fp32_w = rotating(lambda: (w13.float(), w2.float()), 2 * expert_bytes)

    def torch_ffn(ws, x):
        gate, up = F.linear(x, ws[0]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, ws[1])

    rows = []
    for n in tokens:
        flops = 2 * n * 3 * hidden * inter
        x = torch.randn(n, hidden)
        xb = x.bfloat16()
        idx, rw = torch.zeros(n, 1, dtype=torch.int64), torch.ones(n, 1)
        reps = args.repeats if flops < 2e11 else max(3, args.repeats // 3)
        t_kernel = median_seconds(lambda: packed.packed_moe_ffn([kernel_w()], x, rw, idx), reps)
        t_fp32 = median_seconds(lambda: torch_ffn(fp32_w(), x), reps)
        big = flops > args.bf16_flops_limit
        t_bf16 = float("nan") if big else median_seconds(lambda: torch_ffn(bf16_w(), xb), reps)
        row = {"shape": name, "tokens": n, "kernel_s": t_kernel, "fp32_s": t_fp32, "bf16_s": t_bf16,
               "kernel_gflops": flops / t_kernel / 1e9, "kernel_gbps": kernel_bytes / t_kernel / 1e9,
               "fp32_gflops": flops / t_fp32 / 1e9, "bf16_gflops": flops / t_bf16 / 1e9}
        rows.append(row)
        print(f"{name:13s} T={n:5d}  kernel {row['kernel_gflops']:7.1f} GFLOP/s "
              f"{row['kernel_gbps']:6.1f} GB/s | torch fp32 {row['fp32_gflops']:7.1f} GFLOP/s "
              f"(x{t_fp32 / t_kernel:5.2f}) | torch bf16 {row['bf16_gflops']:7.1f} GFLOP/s "
              f"(x{t_bf16 / t_kernel:5.2f})", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024")
    ap.add_argument("--shapes", default="small-mixtral,mixtral-8x7b")
    ap.add_argument("--storage", default="bf16",
                    help="kernel weight storage: " + "|".join(packed.STORAGE_DTYPES))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--bf16-flops-limit", type=float, default=4e11,
                    help="skip torch bf16 above this many FLOPs per call (it runs at ~15 GFLOP/s "
                         "on CPUs without native bf16)")
    args = ap.parse_args()
    if not packed.HAS_PACKED_KERNELS:
        raise SystemExit("the packed kernels are not built: python setup.py build_ext --inplace")
    torch.set_num_threads(args.threads)
    print(machine_info.header(args.threads), flush=True)
    bw = machine_info.read_bandwidth_gbps(args.threads)
    peak = machine_info.fma_peak_gflops(args.threads)
    roof = f"FMA peak {peak:.0f} GFLOP/s"
    if args.storage in packed.PAIR_STORAGES:  # its compute roof is the dot product's
        peak = machine_info.fma_peak_gflops(args.threads, kind="bf16_dot")
        roof += f", bf16 dot-product peak {peak:.0f} GFLOP/s"
        if args.storage == packed.BF16X3_STORAGE:  # three products a weight
            peak /= 3
            roof += f" (bf16x3: a third, {peak:.0f})"
    elif args.storage == packed.QUAD_STORAGE:  # its compute roof is the int8 dot product's
        peak = machine_info.fma_peak_gflops(args.threads, kind="int8_dot")
        roof += f", int8 dot-product peak {peak:.0f} GOP/s"
    print(f"# roofs: read {bw:.1f} GB/s, {roof}; kernel storage {args.storage}, ISA "
          f"{packed.ISA}", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for name in args.shapes.split(","):
        rows += bench_shape(name, *SHAPES[name], tokens, args)
    first = args.shapes.split(",")[0]
    small = {r["tokens"]: r for r in rows if r["shape"] == first}

    def at(n: int, key: str) -> float:
        return small[n][key] if n in small else float("nan")

    ratios_bf16 = [r["bf16_s"] / r["kernel_s"] for r in small.values() if not math.isnan(r["bf16_s"])]
    # At 8 tokens a weight byte feeds kernel_gflops / kernel_gbps FLOPs: at the compute roof the
    # kernel streams at most peak / that, which caps decode_bw_fraction below 1 where the CPU's
    # FMAs are slower than its memory.
    flops_per_byte = at(8, "kernel_gflops") / at(8, "kernel_gbps")
    ceiling = min(1.0, peak / flops_per_byte / bw)
    print(f"# decode_bw_fraction at the compute roof: {ceiling:.2f} (8 tokens: "
          f"{flops_per_byte:.0f} FLOPs a weight byte)")
    print(f"RESULT decode_bw_fraction={at(8, 'kernel_gbps') / bw:.2f} "
          f"prefill_flops_fraction={at(256, 'kernel_gflops') / peak:.2f} "
          f"vs_torch_bf16={statistics.median(ratios_bf16) if ratios_bf16 else float('nan'):.2f} "
          f"vs_torch_fp32={at(16, 'fp32_s') / at(16, 'kernel_s'):.2f} "
          f"decode_bw_ceiling={ceiling:.2f}")


if __name__ == "__main__":
    main()
