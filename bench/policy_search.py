"""Policy search: CPU seconds over a fixed set of searches, and whether another tree's search
chooses the same, bit for bit.

The cases: every hardware preset (GPU presets with four reference MoE models, the `cpu` preset
with three built-in ones), seeded random workloads (fixed lengths, bounded or not; per-row
prompt lengths with one or per-row generation lengths; about 40% prefill-only), each at three
host-memory sizes. `--against DIR` runs the same cases with DIR's `moe_engine` (a checkout of
another commit: `git worktree add /tmp/base <rev>`) in alternating processes and compares every
chosen policy and figure of `PolicyResult.to_json()` (all but the search's own time and
candidate count): a change meant to make the search faster must choose the same.

    .venv/bin/python bench/policy_search.py [--seed 0] [--rounds 2] [--against /tmp/base] [--limit N]

Last line: RESULT cpu_s=<x> candidates=<n> [base_cpu_s=<y> speedup=<y/x> same=<0|1>]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

GPU_PRESETS = ("t4", "l4", "a40", "a100", "h100")
GPU_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite", "olmoe-1b-7b")
CPU_MODELS = ("tiny-mixtral", "small-mixtral", "olmoe-1b-7b")
WORKLOADS_EACH = 6
HOST_MEMORY_SCALES = (0.7, 1.0, 1.6)


def cases(seed: int, limit: int | None = None) -> list[tuple[str, str, str, float]]:
    """(hardware preset, model, workload as JSON, host-memory scale), the same for every tree;
    the first `limit` of them when given."""
    rng = random.Random(seed)
    out = []
    for hw in (*GPU_PRESETS, "cpu"):
        for model in CPU_MODELS if hw == "cpu" else GPU_MODELS:
            for _ in range(WORKLOADS_EACH):
                kind = rng.choice(["fixed", "rows", "rows_mixed"])
                if kind == "fixed":
                    p = rng.randint(16, 2000)
                    wl = {"fixed": [p, p + 50, rng.choice([1, 1, 16, 128]), rng.choice([0, 64, 1000])]}
                else:
                    lengths = [rng.randint(1, 2000) for _ in range(rng.randint(1, 60))]
                    gens = (rng.choice([1, 1, 16]) if kind == "rows"
                            else [rng.choice([1, 1, 1, 8]) for _ in lengths])
                    wl = {"rows": [lengths, gens]}
                out += [(hw, model, json.dumps(wl), scale) for scale in HOST_MEMORY_SCALES]
    return out[:limit]


def run_cases(seed: int, limit: int | None, out_path: str) -> None:
    """Search every case with the `moe_engine` first on sys.path; write the results and the CPU
    seconds the searches took (model and spec building excluded)."""
    from moe_engine.perf import ModelSpec, NoFeasiblePolicy, WorkloadSpec, choose_policy, load_preset
    from moe_engine.perf.reference_models import reference_model
    from moe_engine.perf.specs import workload_spec_from_lengths
    from moe_engine.tools.presets import PRESETS, hf_config

    def model(name: str) -> ModelSpec:
        return (ModelSpec.from_hf_config(hf_config(PRESETS[name]), name=name) if name in PRESETS
                else reference_model(name))

    results, cpu_s, candidates = [], 0.0, 0
    for hw_name, model_name, wl_json, scale in cases(seed, limit):
        spec = json.loads(wl_json)
        wl = (WorkloadSpec(*spec["fixed"][:3], num_requests=spec["fixed"][3]) if "fixed" in spec
              else workload_spec_from_lengths(*spec["rows"]))
        hw = load_preset(hw_name)
        hw = dataclasses.replace(hw, host_memory=hw.host_memory * scale)
        m = model(model_name)
        start = time.process_time()
        try:
            r = choose_policy(m, hw, wl, backend="cpu" if hw_name == "cpu" else "cuda")
        except NoFeasiblePolicy as e:
            r = e
        cpu_s += time.process_time() - start
        if isinstance(r, NoFeasiblePolicy):
            results.append({"error": str(r)})
            continue
        candidates += r.candidates
        chosen = r.to_json()
        chosen.pop("search")
        results.append(chosen)
    Path(out_path).write_text(json.dumps({"cpu_s": cpu_s, "candidates": candidates, "results": results},
                                         default=repr))


def measure(tree: Path, seed: int, limit: int | None, tmp: Path, tag: str) -> dict:
    out = tmp / f"{tag}.json"
    code = (f"import sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(1, {str(REPO / 'bench')!r}); "
            f"import policy_search; policy_search.run_cases({seed}, {limit}, {str(out)!r})")
    env = dict(os.environ, PYTHONPATH="")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tree)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the trees (medians)")
    ap.add_argument("--against", type=Path, help="another checkout to compare with (its moe_engine)")
    ap.add_argument("--limit", type=int, help="only the first LIMIT searches")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from moe_engine.tools import machine_info

    print(machine_info.header(threads=1))
    searched = cases(args.seed, args.limit)
    n_cases = len(searched)
    print(f"# {n_cases} searches (seed {args.seed}), {args.rounds} round(s)"
          + (f", against {args.against}" if args.against else ""))
    trees = [("this", REPO)] + ([("base", args.against.resolve())] if args.against else [])
    runs: dict[str, list[dict]] = {tag: [] for tag, _ in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for tag, tree in (trees if i % 2 == 0 else trees[::-1]):
                r = measure(tree, args.seed, args.limit, Path(tmp), f"{tag}{i}")
                runs[tag].append(r)
                print(f"round {i + 1} {tag:4s}: {r['cpu_s']:7.2f} CPU s, {r['candidates']} candidates")
    mine = statistics.median(r["cpu_s"] for r in runs["this"])
    line = f"RESULT cpu_s={mine:.2f} candidates={runs['this'][0]['candidates']}"
    if args.against:
        base = statistics.median(r["cpu_s"] for r in runs["base"])
        differ = [i for i, (a, b) in enumerate(zip(runs["this"][0]["results"], runs["base"][0]["results"]))
                  if a != b]
        print(f"median CPU s: this {mine:.2f}, base {base:.2f}, speedup x{base / mine:.2f}; "
              f"{len(differ)} of {n_cases} searches chose differently"
              + (f" (first: case {differ[0]}, {searched[differ[0]][:2]})" if differ else ""))
        line += f" base_cpu_s={base:.2f} speedup={base / mine:.3f} same={int(not differ)}"
    print(line)


if __name__ == "__main__":
    main()
