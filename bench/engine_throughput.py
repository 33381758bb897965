"""Benchmark (issue 12): the engine on fixed workloads against the machine's roofs.

Workload: N prompts of 128 random token ids (seeded), 128 new tokens each, EOS ignored, one
`generate` call; small-mixtral in its checkpoint dtype (bf16) unless --dtype says otherwise.
For each N in --batches: prefill tok/s and decode tok/s (the engine's own split of step time),
end-to-end new tok/s, and the roofline bound for the same work from the FMA peak and the read
bandwidth measured right before and after each run, their mean (prefill FLOPs / FMA peak + per
decode step max(weight + KV bytes / bandwidth, FLOPs / FMA peak)). The baseline, run side by
side on the largest N, is the engine's torch GEMM path in fp32 (the fastest path before the
packed kernels; torch's bf16 GEMM is ~8x slower than fp32 on CPUs without native bf16).

  .venv/bin/python bench/engine_throughput.py                    # ~10 minutes on 2 cores
  .venv/bin/python bench/engine_throughput.py --batches 64 --no-baseline
  MOE_BATCH_ISA=avx2 .venv/bin/python bench/engine_throughput.py # force the AVX2 build
  .venv/bin/python bench/engine_throughput.py --matmul-precision medium,highest --no-baseline

--matmul-precision takes a list: each runs every N, side by side; the roofline of medium (bf16
activations on bf16 pairs) uses the bf16 dot-product peak measured in the same run, and the
RESULT line, from the first precision, adds vs_<second>=<new tok/s ratio at the largest N>.
With --expert-dtype int8, medium holds the experts as int8q (int8 activations): their FLOPs
are set against the int8 dot-product peak (vpdpbusd), the rest against the bf16 one.

  .venv/bin/python bench/engine_throughput.py --batches 128 --no-baseline --expert-dtype int8 \
      --matmul-precision medium,highest

The last line printed is:
  RESULT new_tok_s=<x> decode_tok_s=<y> prefill_tok_s=<z> roofline_fraction=<f> vs_baseline=<r>
(figures of the largest N).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from engine_vs_transformers import roofline_seconds  # noqa: E402  (bench/ is sys.path[0])
from moe_engine.config import EngineConfig  # noqa: E402
from moe_engine.engine.llm_engine import LLMEngine  # noqa: E402
from moe_engine.engine.request import Request, SamplingParams  # noqa: E402
from moe_engine.tools import machine_info  # noqa: E402


def bench_checkpoint(path: Path | None) -> Path:
    """small-mixtral, built once into the cache (857 MB; building takes ~1 minute)."""
    if path is not None:
        return path
    from moe_engine.io import default_cache_dir
    from moe_engine.tools.checkpoints import build_checkpoint

    target = default_cache_dir() / "bench" / "small-mixtral"
    if not (target / "config.json").exists():
        build_checkpoint("small-mixtral", target)
    return target


def workload(n: int, prompt_len: int, new_tokens: int, vocab: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    # ids from 100 on: clear of the special tokens at the start of the vocabulary
    return [Request(f"r{i}", prompt_token_ids=[rng.randrange(100, vocab) for _ in range(prompt_len)],
                    sampling=sp) for i in range(n)]


def run(model_dir: Path, n: int, args, dtype: str, gemm: str, precision: str = "highest") -> dict:
    config = EngineConfig(threads=args.threads, kv_cache_gb=args.kv_cache_gb, max_num_seqs=n,
                          max_prefill_tokens=args.max_prefill_tokens, num_micro_batches=1,
                          policy="config", gemm=gemm, expert_dtype=args.expert_dtype,
                          matmul_precision=precision)
    engine = LLMEngine(model_dir, config, dtype=dtype)
    requests = workload(n, args.prompt_len, args.new_tokens, engine.spec.vocab_size)
    t0 = time.perf_counter()
    results = list(engine.generate(requests))
    wall = time.perf_counter() - t0
    assert all(r.status == "ok" and r.completion_tokens == args.new_tokens for r in results), \
        [r.error for r in results if r.status != "ok"][:3]
    s = engine.stats.to_dict()
    out = {"n": n, "gemm": engine.gemm_path, "attention": engine.attention_path,
           "new_tok_s": n * args.new_tokens / wall, "wall_s": wall,
           "prefill_tok_s": s["prefill_tok_s"], "decode_tok_s": s["decode_tok_s"],
           "time": {k: round(s[k], 2) for k in ("attention_time_s", "ffn_time_s", "dense_time_s",
                                               "head_time_s", "prefill_time_s", "decode_time_s")},
           "weights_bytes": engine.weights_bytes, "spec": engine.spec,
           "kv_elem": engine.runner.cache.key[0].element_size()}
    del engine
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="auto", help="weight storage (auto: the checkpoint's)")
    ap.add_argument("--expert-dtype", default="auto", help="auto|bf16|fp32|int8|int4")
    ap.add_argument("--kv-cache-gb", type=float, default=4.0)
    ap.add_argument("--max-prefill-tokens", type=int, default=4096)
    ap.add_argument("--matmul-precision", default="highest",
                    help="highest|high|medium, or a list run side by side (high,highest)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    print(machine_info.header(args.threads), flush=True)
    model_dir = bench_checkpoint(args.model_dir)
    precisions = args.matmul_precision.split(",")

    int8q = args.expert_dtype == "int8" and "medium" in precisions

    def roofs() -> tuple[float, dict[str, float]]:
        """(read GB/s, compute roof in GFLOP/s per precision, and "int8q" for int8 experts
        under medium, whose int8 dot products have a roof of their own), measured now."""
        peaks = {"highest": machine_info.fma_peak_gflops(args.threads)}
        if {"medium", "high"} & set(precisions):
            dot = machine_info.fma_peak_gflops(args.threads, kind="bf16_dot")
            # high does three bf16 products (one per activation term) for each fp32 one
            peaks.update(medium=dot, high=dot / 3)
        if int8q:
            peaks["int8q"] = machine_info.fma_peak_gflops(args.threads, kind="int8_dot")
        return machine_info.read_bandwidth_gbps(args.threads), peaks

    # The roofs are measured again after every run and each run is set against the mean of the
    # measurements before and after it: on a shared host the FMA peak and the read bandwidth
    # move by 10-40% from minute to minute (docs/benchmarks.md), and a roof taken minutes
    # before a run measures another machine.
    bw, peaks = roofs()
    print(f"# roofs: read {bw:.1f} GB/s, FMA peak {peaks['highest']:.0f} GFLOP/s (fp32)"
          + (f", bf16 dot-product peak {peaks['medium']:.0f} (medium; high's a third of it)"
             if "medium" in peaks else "")
          + (f", int8 dot-product peak {peaks['int8q']:.0f} (int8q experts)" if int8q else "")
          + f"; {args.prompt_len}-token random prompts, {args.new_tokens} new tokens, EOS ignored",
          flush=True)
    rows, last_of = [], {}
    for n in [int(x) for x in args.batches.split(",")]:
        for precision in precisions:
            r = run(model_dir, n, args, args.dtype, "auto", precision)
            bw_after, peaks_after = roofs()
            r["roofs"] = {"read_gbps": [round(bw, 1), round(bw_after, 1)],
                          "peak_gflops": [round(peaks[precision]), round(peaks_after[precision])]}
            quads = r["spec"].expert_storage == "int8q"
            bound = roofline_seconds(r["spec"], r["weights_bytes"], [args.prompt_len] * n,
                                     args.new_tokens, n, (bw + bw_after) / 2,
                                     (peaks[precision] + peaks_after[precision]) / 2,
                                     kv_elem=r["kv_elem"],
                                     expert_gflops=((peaks["int8q"] + peaks_after["int8q"]) / 2
                                                    if quads else None))
            bw, peaks = bw_after, peaks_after
            r["roofline_tok_s"] = n * args.new_tokens / bound["total_s"]
            r["roofline_fraction"] = r["new_tok_s"] / r["roofline_tok_s"]
            r["precision"] = precision
            last_of[precision] = r
            if precision == precisions[0]:
                rows.append(r)
            print(f"N={n:4d} {precision} {r['gemm']}: new {r['new_tok_s']:.1f} tok/s, prefill "
                  f"{r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.0f} tok/s, wall "
                  f"{r['wall_s']:.1f} s; roofline {r['roofline_tok_s']:.0f} tok/s -> "
                  f"{r['roofline_fraction']:.2f} (roofs before, after: read {r['roofs']['read_gbps']} "
                  f"GB/s, peak {r['roofs']['peak_gflops']} GFLOP/s); time {r['time']}", flush=True)
    last = rows[-1]
    ratio = float("nan")
    if not args.no_baseline:
        base = run(model_dir, last["n"], args, "float32", "torch")
        ratio = last["new_tok_s"] / base["new_tok_s"]
        print(f"baseline N={base['n']} {base['gemm']}: new {base['new_tok_s']:.1f} tok/s, prefill "
              f"{base['prefill_tok_s']:.0f}, decode {base['decode_tok_s']:.0f}; packed / baseline "
              f"= {ratio:.2f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "spec"}
                                         for r in rows], indent=2))
    print(f"RESULT new_tok_s={last['new_tok_s']:.1f} decode_tok_s={last['decode_tok_s']:.1f} "
          f"prefill_tok_s={last['prefill_tok_s']:.1f} roofline_fraction={last['roofline_fraction']:.2f} "
          f"vs_baseline={ratio:.2f}"
          + (f" vs_{precisions[1]}={last['new_tok_s'] / last_of[precisions[1]]['new_tok_s']:.2f}"
             if len(precisions) > 1 else ""))


if __name__ == "__main__":
    main()
