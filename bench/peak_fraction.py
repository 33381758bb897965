"""Benchmark (issue 12): the packed kernels' calls as a fraction of the FMA peak, each call
timed right beside the peak probe, on every ISA build the CPU runs.

On a host whose speed moves from call to call (the shared VMs here: one kernel call moved by
0.1-0.2 of the peak between runs of one process), an absolute GFLOP/s says more about the host
than about the kernel. Here every round times the register-blocked FMA loop of the same ISA and
thread count (`packed.fma_peak_flops`, 30 ms) and then the call, and reports the call's rate
over that probe: medians and quartiles of --rounds such pairs. The shapes are small-mixtral's
(hidden 1024, intermediate 3584, 8 experts top-2, vocabulary 32000), the weights bf16 as the
checkpoint ships them, fp32 activations (engine.matmul_precision=highest):
  moe_ffn T      packed_moe_ffn of T tokens (T*2/8 rows an expert): a decode step's experts at
                 T = batch size, a prefill pass's at T = its tokens
  gate|up R      packed_linear, one expert's gate|up weight (7168 x 1024), R rows
  lm_head R      packed_linear, the LM head (32000 x 1024), R rows

  .venv/bin/python bench/peak_fraction.py                      # ~4 minutes on 2 cores (3 ISAs)
  .venv/bin/python bench/peak_fraction.py --isa avx2 --threads 1,2 --rounds 30

The last line printed is (the first --isa, the last --threads):
  RESULT moe_ffn_128=<fraction> moe_ffn_512=<fraction> gate_up_128=<fraction>
         lm_head_128=<fraction> isa=<isa> threads=<n>
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_engine.model import packed  # noqa: E402
from moe_engine.model.weights import ExpertWeights  # noqa: E402
from moe_engine.tools import machine_info  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K, VOCAB = 1024, 3584, 8, 2, 32000
PROBE_S = 0.03


def _weights(g: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    return (torch.randn(rows, cols, generator=g) * 0.02).bfloat16()


def make_cases(isa: str, threads: int, tokens: list[int], rows: list[int]) -> dict:
    """name -> (call, FLOPs of one call)."""
    g = torch.Generator().manual_seed(0)
    experts = [packed.pack_expert(ExpertWeights(_weights(g, 2 * INTER, HIDDEN),
                                                _weights(g, HIDDEN, INTER)), "bf16")
               for _ in range(EXPERTS)]
    gate_up = packed.pack_linear(_weights(g, 2 * INTER, HIDDEN), "bf16")
    head = packed.pack_linear(_weights(g, VOCAB, HIDDEN), "bf16")
    cases = {}
    for t in tokens:
        x = torch.randn(t, HIDDEN, generator=g)
        idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(t)])
        rw = torch.rand(t, TOP_K, generator=g)
        cases[f"moe_ffn_{t}"] = (
            lambda x=x, idx=idx, rw=rw: packed.packed_moe_ffn(experts, x, rw, idx, isa=isa,
                                                              threads=threads),
            2 * t * TOP_K * 3 * HIDDEN * INTER)
    for r in rows:
        x = torch.randn(r, HIDDEN, generator=g)
        cases[f"gate_up_{r}"] = (lambda x=x: packed.packed_linear(x, gate_up, isa=isa, threads=threads),
                                 2 * r * 2 * INTER * HIDDEN)
        cases[f"lm_head_{r}"] = (lambda x=x: packed.packed_linear(x, head, isa=isa, threads=threads),
                                 2 * r * VOCAB * HIDDEN)
    return cases


def call_seconds(fn, min_s: float = 0.02) -> float:
    """Mean seconds of one call over at least `min_s` (one untimed call first)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_s:
            return elapsed / n


def fractions(cases: dict, isa: str, threads: int, rounds: int) -> dict[str, list[float]]:
    """Per case, `rounds` ratios of the call's FLOP/s to the probe's run just before it."""
    out: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (fn, flops) in cases.items():
            peak = packed.fma_peak_flops(PROBE_S, threads, isa=isa)
            out[name].append(flops / call_seconds(fn) / peak)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", default=None,
                    help="comma-separated ISA builds (default: every one the CPU runs but generic, best first)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", default="32,128,512,2048", help="moe_ffn token counts")
    ap.add_argument("--rows", default="128", help="gate|up and LM head rows")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if not packed.HAS_PACKED_KERNELS:
        raise SystemExit("the packed kernels are not built: python setup.py build_ext --inplace")
    isas = (args.isa.split(",") if args.isa
            else [i for i in reversed(packed.supported_isas()) if i != "generic"])
    threads = [int(t) for t in args.threads.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    print(machine_info.header(max(threads)), flush=True)
    print(f"# FMA peak probe {PROBE_S * 1e3:.0f} ms before each call, {args.rounds} rounds; "
          f"fraction = call GFLOP/s / probe GFLOP/s: median (quartiles)", flush=True)
    last = None
    for isa in isas:
        for th in threads:
            torch.set_num_threads(th)
            got = fractions(make_cases(isa, th, tokens, rows), isa, th, args.rounds)
            for name, v in got.items():
                q = statistics.quantiles(v, n=4)
                print(f"{isa:10s} threads={th} {name:14s} {statistics.median(v):5.2f} "
                      f"({q[0]:.2f}-{q[2]:.2f})", flush=True)
            if isa == isas[0]:
                last = (got, th)
    got, th = last
    keys = [k for k in ("moe_ffn_128", "moe_ffn_512", "gate_up_128", "lm_head_128") if k in got]
    print("RESULT " + " ".join(f"{k}={statistics.median(got[k]):.2f}" for k in keys)
          + f" isa={isas[0]} threads={th}")


if __name__ == "__main__":
    main()
