"""Peak RSS of a disk-tier generate job, measured by the kernel in a fresh process.

The budgets of issue 14 (host_memory_gb + kv_cache_gb, +10%) are checked against the growth of
the process's RSS high-water mark (VmHWM) over its runtime: the interpreter, torch and the
tokenizer, loaded before the baseline is taken, are not the engine's to budget. A fresh process,
because a test or benchmark process has already touched far more memory than the job would.

  python -m moe_engine.tools.rss_check MODEL_DIR --budget-gb 0.3 --kv-gb 0.05
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def rss_check(model_dir: str | Path, budget_gb: float, kv_gb: float, requests: int = 16,
              prompt_len: int = 96, new_tokens: int = 6, max_prefill_tokens: int = 256,
              timeout_s: float = 900) -> dict:
    """Run the job in a fresh process; its figures plus `growth` (bytes) and `ratio` (growth
    over the budget). Raises RuntimeError with the job's stderr if it fails."""
    cmd = [sys.executable, "-m", "moe_engine.tools.rss_check", str(model_dir),
           "--budget-gb", str(budget_gb), "--kv-gb", str(kv_gb), "--requests", str(requests),
           "--prompt-len", str(prompt_len), "--new-tokens", str(new_tokens),
           "--max-prefill-tokens", str(max_prefill_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                         cwd=Path(__file__).resolve().parents[2])
    if out.returncode != 0:
        raise RuntimeError(f"RSS job failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["growth"] = got["peak"] - got["base"]
    got["ratio"] = got["growth"] / ((budget_gb + kv_gb) * 1e9)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--budget-gb", type=float, required=True)
    ap.add_argument("--kv-gb", type=float, required=True)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--max-prefill-tokens", type=int, default=256)
    args = ap.parse_args()

    import torch

    from moe_engine.config import EngineConfig
    from moe_engine.engine.llm_engine import LLMEngine
    from moe_engine.engine.memory import peak_rss_bytes, rss_bytes
    from moe_engine.engine.request import Request, SamplingParams
    from moe_engine.engine.tokenizer import load_tokenizer

    load_tokenizer(args.model_dir)  # the runtime the budgets do not cover
    base = rss_bytes()
    config = EngineConfig(threads=2, kv_cache_gb=args.kv_gb, max_num_seqs=args.requests,
                          max_prefill_tokens=args.max_prefill_tokens,
                          host_memory_gb=args.budget_gb)
    g = torch.Generator().manual_seed(0)
    reqs = [Request(f"r{i}", prompt_token_ids=torch.randint(10, 8000, (args.prompt_len,),
                                                            generator=g).tolist(),
                    sampling=SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True))
            for i in range(args.requests)]
    with LLMEngine(args.model_dir, config, dtype="bfloat16") as engine:
        # The KV cache is resident from allocation (host_alloc.huge_page_zeros writes its
        # pages), so the check charges the whole kv_cache_gb, as a long job will use it.
        results = list(engine.generate(reqs))
        disk = engine.offload.pager.disk
        info = dict(slots=disk.num_slots, read=disk.bytes_read, mode=disk.reader.mode)
    print(json.dumps(dict(base=base, peak=peak_rss_bytes(),
                          ok=sum(r.status == "ok" for r in results), **info)))


if __name__ == "__main__":
    main()
