"""Benchmark (issues 12, 15): what int8, int4 and MXFP4 experts, and medium and high matmul
precision, cost in accuracy against bf16.

small-mixtral (bf16 checkpoint, random weights) over the bundled corpus (data/sample_prompts.jsonl,
chat rows through the chat template): every prompt's first-token logits with experts in bf16
(the reference), int8 (per output channel), int4 (per group of 32 inputs) and MXFP4 (E2M1
values, a power-of-two scale per 32 inputs: GPT-OSS's released format), everything else
identical (dense weights bf16, fp32 activations and KV); and "medium" (engine.matmul_precision=
medium: every GEMM's activations rounded to bf16, weights as bf16 pairs, experts bf16) and
"high" (bf16x3: every GEMM's activations as three bf16 terms summing to them exactly; expected
to differ from the reference by fp32 rounding only), and "int8q" (int8 experts under medium:
the experts' activation rows quantized to int8, integer sums on AVX512-VNNI; the dense
GEMMs as medium's bf16 pairs). Reported
per variant:
  max_abs     the largest |logit difference| over all prompts and the vocabulary
  kl          mean KL(softmax(bf16) || softmax(quantized)) over prompts, in nats
  top1        fraction of prompts whose greedy next token is the same
  seq_agree   greedy generation of --new-tokens tokens: fraction of positions equal to the bf16
              run's token before the first divergence of each row (a stricter figure: one early
              flip ends the row's agreement)
Random Gaussian weights are the worst case for quantization: trained checkpoints have larger
logit margins, so more of their greedy choices survive the same weight error.

  .venv/bin/python bench/quantized_experts.py            # ~5 minutes on 2 cores
  .venv/bin/python bench/quantized_experts.py --variants int8,int8q

The last line printed is:
  RESULT int8_top1=<x> int8_kl=<y> int4_top1=<z> int4_kl=<w> mxfp4_top1=<u> mxfp4_kl=<v>
         medium_top1=<a> medium_kl=<b> high_top1=<c> high_kl=<d> int8q_top1=<e> int8q_kl=<f>
(the variants run, in this order)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from engine_throughput import bench_checkpoint  # noqa: E402  (bench/ is sys.path[0])
from moe_engine.config import EngineConfig  # noqa: E402
from moe_engine.engine.llm_engine import LLMEngine  # noqa: E402
from moe_engine.engine.request import Request, SamplingParams  # noqa: E402
from moe_engine.tools import machine_info  # noqa: E402

# variant -> (engine.expert_dtype, engine.matmul_precision)
VARIANTS = {"int8": ("int8", "highest"), "int4": ("int4", "highest"),
            "mxfp4": ("mxfp4", "highest"), "medium": ("bf16", "medium"),
            "high": ("bf16", "high"), "int8q": ("int8", "medium")}


def corpus_requests(n: int, new_tokens: int) -> list[Request]:
    rows = [json.loads(line) for line in (REPO / "data" / "sample_prompts.jsonl").open()][:n]
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return [Request(r["id"], prompt=r.get("prompt"), messages=r.get("messages"), sampling=sp)
            for r in rows]


def run(model_dir: Path, expert_dtype: str, requests: list[Request], threads: int,
        precision: str = "highest"):
    """First-step logits per request id, and each request's generated tokens."""
    engine = LLMEngine(model_dir, EngineConfig(threads=threads, kv_cache_gb=2.0, kv_dtype="float32",
                                               max_num_seqs=len(requests), policy="config",
                                               expert_dtype=expert_dtype,
                                               matmul_precision=precision))
    first: dict[str, torch.Tensor] = {}

    def observe(seqs, logits):
        for seq, row in zip(seqs, logits):
            first.setdefault(seq.request_id, row.clone())

    engine.logits_observer = observe
    tokens = {r.request_id: r.token_ids for r in engine.generate(requests)}
    return first, tokens, engine.gemm_path


def compare(ref, quant) -> dict:
    ref_logits, ref_tokens = ref
    q_logits, q_tokens = quant
    ids = sorted(ref_logits)
    a = torch.stack([ref_logits[i] for i in ids]).double()
    b = torch.stack([q_logits[i] for i in ids]).double()
    kl = (torch.softmax(a, -1) * (torch.log_softmax(a, -1) - torch.log_softmax(b, -1))).sum(-1)
    agree = total = 0
    for i in ids:
        for x, y in zip(ref_tokens[i], q_tokens[i]):
            if x != y:
                break
            agree += 1
        total += len(ref_tokens[i])
    return {"max_abs": (a - b).abs().max().item(), "kl": kl.mean().item(),
            "top1": (a.argmax(-1) == b.argmax(-1)).double().mean().item(),
            "seq_agree": agree / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated, of " + ", ".join(VARIANTS))
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    torch.set_num_threads(args.threads)
    print(machine_info.header(args.threads), flush=True)
    model_dir = bench_checkpoint(args.model_dir)
    requests = corpus_requests(args.num_prompts, args.new_tokens)
    ref_logits, ref_tokens, path = run(model_dir, "bf16", requests, args.threads)
    print(f"reference: {path}; {len(requests)} prompts, {args.new_tokens} new tokens", flush=True)
    results = {}
    for dtype in variants:
        expert_dtype, precision = VARIANTS[dtype]
        logits, tokens, path = run(model_dir, expert_dtype, requests, args.threads, precision)
        results[dtype] = compare((ref_logits, ref_tokens), (logits, tokens))
        r = results[dtype]
        print(f"{dtype}: max |logit diff| {r['max_abs']:.4f}, mean KL {r['kl']:.2e} nats, "
              f"top-1 agreement {r['top1']:.3f}, greedy sequence agreement {r['seq_agree']:.3f} "
              f"({path})", flush=True)
    print("RESULT " + " ".join(f"{d}_top1={results[d]['top1']:.3f} {d}_kl={results[d]['kl']:.2e}"
                               for d in variants))


if __name__ == "__main__":
    main()
