"""Workflow overhead: `snakemake --cores all` end to end vs the engine alone on the same rows.

Both run in this process's machine, side by side, on the same resolved config (default: the
built-in tiny model and the sample corpus). The engine-only figure loads the model once and
generates every runnable row of the corpus in one `LLMEngine.generate` call, which is the least
any workflow could spend; the workflow figure includes Snakemake's start-up, the shard, policy,
per-shard generate (a process each), merge and report jobs. A built-in checkpoint is built once
before the timed runs (a one-time cost, not a run's).

    .venv/bin/python bench/workflow_overhead.py [--repeats 3] [--overrides "..."]

Last line: RESULT workflow_s=<x> engine_s=<y> overhead=<x/y>
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_workflow(workdir: Path, overrides: str, target: str = "all") -> float:
    cmd = [str(Path(sys.executable).parent / "snakemake"), target, "-s", str(REPO / "Snakefile"),
           "--directory", str(workdir), "--cores", "all", "--quiet", "all",
           "--config", f"overrides={overrides}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    return elapsed


def run_engine_only(workdir: Path, overrides: str) -> tuple[float, int]:
    import polars as pl

    from moe_engine.config import compose
    from moe_engine.stages.corpus import read_corpus
    from moe_engine.engine.llm_engine import LLMEngine
    from moe_engine.stages.generate import build_requests
    from moe_engine.stages.policy import engine_config_for
    from moe_engine.stages.shard import tokenize_frame
    from moe_engine.engine.tokenizer import load_tokenizer
    import json

    cfg = compose(overrides)
    model_dir = workdir / cfg.model_dir
    policy_path = workdir / cfg.results_dir / "policy.json"
    policy = json.loads(policy_path.read_text()) if policy_path.exists() else None
    frame = read_corpus(cfg.workload, base_dir=REPO)
    frame = tokenize_frame(frame, load_tokenizer(model_dir), cfg.workload.max_prompt_tokens)
    frame = frame.filter(pl.col("status") == "pending")
    start = time.perf_counter()
    engine = LLMEngine(model_dir, engine_config_for(cfg, policy), dtype=cfg.model.dtype.value)
    tokens = sum(r.completion_tokens for r in engine.generate(build_requests(frame, cfg)))
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--overrides", default="")
    args = parser.parse_args()
    corpus = REPO / "data" / "sample_prompts.jsonl"
    overrides = f"workload.inputs=[{corpus}] {args.overrides}".strip()
    from moe_engine.config import compose
    from moe_engine.tools import machine_info

    threads = compose(overrides).engine.threads  # what the runs' engines get (0: every core)
    print(machine_info.header(threads or os.cpu_count() or 1), flush=True)

    workflow_s, engine_s = [], []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        # The bench measures a run, not the one-time build of a built-in checkpoint: build it
        # once, untimed, and give every run a copy with its resolved config. copytree keeps the
        # mtimes (config older than the model), so Snakemake sees the model as up to date.
        prebuilt = base / "prebuilt"
        prebuilt.mkdir()
        run_workflow(prebuilt, overrides, target="prepare_model")
        for i in range(args.repeats):
            workdir = base / f"run{i}"
            shutil.copytree(prebuilt, workdir, ignore=shutil.ignore_patterns(".snakemake", "logs"))
            w = run_workflow(workdir, overrides)
            e, tokens = run_engine_only(workdir, overrides)
            workflow_s.append(w)
            engine_s.append(e)
            print(f"run {i}: workflow {w:.1f} s, engine alone {e:.1f} s ({tokens} tokens), "
                  f"ratio {w / e:.2f}", flush=True)
    w, e = statistics.median(workflow_s), statistics.median(engine_s)
    print(f"median workflow {w:.1f} s, engine alone {e:.1f} s, overhead {w / e:.2f}x")
    print(f"RESULT workflow_s={w:.2f} engine_s={e:.2f} overhead={w / e:.3f}")


if __name__ == "__main__":
    main()
