"""Disk-tier benchmark (issue 14): small-mixtral with its experts on disk, read with O_DIRECT.

Runs one workload (N prompts of random token ids, EOS ignored, small-mixtral bf16, 2 threads)
with r_host (experts per layer in host memory) in {1, 0.5, 0.25, 0}, interleaved round by round
(the VM is noisy), and reports per r_host:
  tok/s      generated tokens / generate wall time (load excluded);
  disk GB/s  bytes read / time the reader was busy (page cache bypassed: O_DIRECT);
  hidden     D - W: the reader's busy time D less the time compute blocked on reads W, i.e.
             C + D - S with C = S - W this run's compute (serial execution hides nothing,
             perfect overlap min(C, D)); overlap = hidden / min(C, D);
  predicted  the performance model's tok/s for the same policy and workload, on this machine's
             cached hardware profile, whose disk rate is the median of the rates the tier's
             reader achieved in earlier generate jobs (each records it, stages/generate.py;
             here at least the warm-up run, recorded before the timed runs);
  bound      tokens / max(C1, bytes read / the disk rate), C1 the r_host=1 run's wall time
             (compute with every expert in memory): the slower resource alone.
The disk rate of the bound is measured in the same run: the whole expert file read with the
tier's own reader (O_DIRECT, 16 MiB reads) right before each run that reads the disk, median over
that r_host's rounds (it moves between 1.0 and 2.2 GB/s from one minute to the next on this VM).
The prediction at that back-to-back rate is printed too: on this VM such a sweep reads slower
(1.1-1.7 GB/s) than the same reads spread through a run (1.9-2.1 GB/s), which is why the model
plans with the learnt rate.
Then a fresh process runs under engine.host_memory_gb=0.3 and reports its peak RSS growth over
its runtime (interpreter, torch, tokenizer) against host_memory_gb + kv_cache_gb.
A timeline of disk reads against compute (two decode steps of the last r_host=0 run) goes to
docs/img/disk_tier_timeline.png.

  .venv/bin/python bench/disk_tier.py                 # 64 prompts x 128 tokens, 32 new tokens
  .venv/bin/python bench/disk_tier.py --requests 128 --rounds 3
  python bench/disk_tier.py --backend cuda --threads 16   # on a GPU machine: three tiers

With --backend cuda the device holds no expert (resident_ratio 0, torch GEMMs on the GPU): the
host tier's experts cross the host link and disk experts go disk -> host slot -> device ring.
The prediction (the CPU model) and the RSS check (CUDA's own host allocations) are skipped there.

Last line: RESULT tok_s_ratio=<r_host 0 vs 1> overlap_fraction=<hidden / min(compute, disk)>
prediction_accuracy=<1-|pred-meas|/meas at r_host 0> rss_over_budget=<peak growth / budget>
bound_fraction=<r_host 0 tok/s / bound>
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from engine_throughput import bench_checkpoint, workload  # noqa: E402  (bench/ is sys.path[0])
from moe_engine.config import EngineConfig  # noqa: E402
from moe_engine.engine.llm_engine import LLMEngine  # noqa: E402
from moe_engine.offload.trace import Span, Trace  # noqa: E402
from moe_engine.tools import machine_info  # noqa: E402
from moe_engine.tools.rss_check import rss_check  # noqa: E402
from offload import plot, window as decode_window  # noqa: E402  (bench/offload.py)

REPO = Path(__file__).resolve().parent.parent
RATIOS = (1.0, 0.5, 0.25, 0.0)


def run(path: Path, config: EngineConfig, reqs, trace: Trace | None = None) -> dict:
    with LLMEngine(path, config, dtype="bfloat16", trace=trace) as engine:
        if trace is not None:
            trace.clear()
        t0 = time.perf_counter()
        results = list(engine.generate(reqs))
        wall = time.perf_counter() - t0
        tokens = sum(len(r.token_ids) for r in results)
        out = dict(wall=wall, tokens=tokens, ok=all(r.status == "ok" for r in results),
                   disk_bytes=0, disk_busy=0.0, mode="-", slots=0)
        if engine.offload is not None and engine.offload.pager.disk is not None:
            disk = engine.offload.pager.disk
            totals = engine.offload.totals
            out.update(disk_bytes=totals.disk_bytes_read, disk_busy=totals.disk_busy_time_s,
                       mode=disk.reader.mode, slots=disk.num_slots,
                       wait=totals.transfer_wait_time_s)
    return out


def machine_profile(path: Path):
    """(the checkpoint's ModelSpec, this machine's cached profile covering it: measured first if
    missing, the path generate jobs record their disk rates in)."""
    from moe_engine.io import hardware_cache_dir
    from moe_engine.perf import ModelSpec
    from moe_engine.perf.hardware import cached_profile_path
    from moe_engine.tools.profile_hardware import ensure_profile

    model = ModelSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    profile_path = cached_profile_path(hardware_cache_dir())
    return model, ensure_profile(profile_path, model), profile_path


def predicted_tok_s(path: Path, config: EngineConfig, reqs, r_host: float,
                    disk_gbps: float | None = None) -> tuple[float, float]:
    """(the model's tok/s for this run's policy at `disk_gbps`, default the profile's own
    rate (the learnt one when generate jobs recorded any), the profile's disk GB/s)."""
    import dataclasses

    from moe_engine.perf import Policy, predict, workload_spec_from_lengths
    from moe_engine.perf.hardware import spec_from_figures

    model, profile, _ = machine_profile(path)

    profiled = spec_from_figures(profile)
    hw = profiled if disk_gbps is None else dataclasses.replace(profiled, disk_bw=disk_gbps * 1e9)
    wl = workload_spec_from_lengths([len(r.prompt_token_ids) for r in reqs],
                                    reqs[0].sampling.max_new_tokens)
    n = config.max_num_seqs
    policy = Policy(n, max(1, n // config.num_micro_batches), False, True, 1.0,
                    prefill_tokens=config.max_prefill_tokens, host_resident_ratio=r_host)
    return predict(model, hw, wl, policy, cpu_backend=True).throughput_tok_s, profiled.disk_bw / 1e9


def expert_file_read_gbps(path: Path, passes: int = 1) -> float:
    """The disk rate of the run: the expert file the disk tier reads, read whole with its own
    reader (O_DIRECT, 16 MiB reads into one aligned buffer), median of `passes`."""
    from moe_engine.model import packed
    from moe_engine.model.spec import load_spec
    from moe_engine.offload.build import expert_source
    from moe_engine.offload.disk import sweep_read_rate

    source = expert_source(path, load_spec(path), torch.bfloat16, packed.storage_name(torch.bfloat16))
    reads = [p for key in source.keys() for p in source.read(*key).split(16 << 20)]
    return sweep_read_rate(reads, passes) / 1e9


DISK_LANES = ["disk", "device", "wait", "cpu"]
DISK_LANE_NAMES = {"disk": "disk reads", "device": "compute", "wait": "blocked on reads",
                   "cpu": "CPU attention"}
DISK_LEGEND = [("tab:blue", "expert read (16 MiB packets)"), ("tab:orange", "expert FFN"),
               ("tab:gray", "norm/QKV/O/router/head"), ("tab:red", "blocked on a read"),
               ("tab:green", "attention (CPU worker)")]


def disk_colour(span: Span) -> str:
    if span.lane == "device":
        return "tab:orange" if span.label.startswith("expert") else "tab:gray"
    return {"disk": "tab:blue", "wait": "tab:red", "cpu": "tab:green"}[span.lane]


def plot_timeline(spans: list[Span], out: Path, title: str) -> None:
    plot(spans, out, title, DISK_LANES, DISK_LANE_NAMES, disk_colour, DISK_LEGEND)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: small-mixtral)")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-gb", type=float, default=0.3)
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--figure", default=str(REPO / "docs" / "img" / "disk_tier_timeline.png"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    path = bench_checkpoint(args.model)
    print(machine_info.header(args.threads))
    cuda = args.backend == "cuda"
    if cuda:
        print(f"# device: {torch.cuda.get_device_name(0)}, torch CUDA {torch.version.cuda}")
    print(f"date {_dt.date.today()}  model {path}  requests {args.requests} x {args.prompt_len} "
          f"tokens, {args.new_tokens} new (EOS ignored), bf16")
    reqs = workload(args.requests, args.prompt_len, args.new_tokens, 8000)
    base = EngineConfig(threads=args.threads, kv_cache_gb=0.25, max_num_seqs=args.requests,
                        max_prefill_tokens=2048, num_micro_batches=2,
                        **(dict(backend="cuda", gemm="torch", resident_ratio=0.0,
                                cpu_experts=False) if cuda else {}))

    def config(r: float) -> EngineConfig:
        return base if r >= 1.0 else EngineConfig(**{**base.__dict__, "host_resident_ratio": r})

    # Warm-up: builds the expert file and the routing profile once, outside the timed runs,
    # and records the rate its reader achieved in the machine profile, as every generate job
    # does (stages/generate.py): the model's disk rate is the median of those learnt rates.
    from moe_engine.tools.profile_hardware import learn_disk_rate

    warm = run(path, config(0.0), reqs[:2])
    if not cuda:
        learnt = learn_disk_rate(machine_profile(path)[2],
                                 dict(disk_bytes_read=warm["disk_bytes"],
                                      disk_busy_time_s=warm["disk_busy"]))
        print(f"warm-up run: its reader achieved {learnt} GB/s, recorded in the machine profile")
    runs: dict[float, list[dict]] = {r: [] for r in RATIOS}
    # The disk rate of a run is measured right before it: this VM's disk moves between 1.0 and
    # 2.2 GB/s from one minute to the next, so a rate taken a round earlier says little.
    rates: dict[float, list[float]] = {r: [] for r in RATIOS if r < 1.0}
    trace = Trace()
    for _ in range(args.rounds):
        for r in RATIOS:
            if r < 1.0:
                rates[r].append(expert_file_read_gbps(path, passes=1))
            runs[r].append(run(path, config(r), reqs, trace=trace if r == 0.0 else None))
    for r, xs in rates.items():
        print(f"r_host {r}: expert file read at {', '.join(f'{x:.2f}' for x in xs)} GB/s right "
              f"before its runs (O_DIRECT, 16 MiB reads)")
    disk_gbps = statistics.median(x for xs in rates.values() for x in xs)
    c = statistics.median(x["wall"] for x in runs[1.0])
    tokens = runs[1.0][0]["tokens"]
    rows = {}
    print(f"\n{'r_host':>6} {'tok/s':>8} {'wall s':>7} {'disk GB':>8} {'disk GB/s':>9} "
          f"{'busy s':>7} {'wait s':>7} {'hidden s':>8} {'overlap':>7} {'pred tok/s':>10} "
          f"{'bound tok/s':>11} {'slots':>5} mode")
    for r in RATIOS:
        s = statistics.median(x["wall"] for x in runs[r])
        d = statistics.median(x["disk_busy"] for x in runs[r])
        w = statistics.median(x.get("wait", 0.0) for x in runs[r])
        nbytes = statistics.median(x["disk_bytes"] for x in runs[r])
        rate = statistics.median(rates[r]) if r in rates else disk_gbps
        pred, profiled_gbps = ((float("nan"), float("nan")) if cuda else
                               predicted_tok_s(path, config(r), reqs, r))
        pred_sweep = (float("nan") if cuda or r >= 1.0 else
                      predicted_tok_s(path, config(r), reqs, r, rate)[0])
        hidden = d - w
        compute = s - w
        overlap = hidden / min(compute, d) if d > 0 else float("nan")
        bound = tokens / max(c, nbytes / (rate * 1e9))
        rows[r] = dict(tok_s=tokens / s, wall=s, disk_busy=d, disk_bytes=nbytes, hidden=hidden,
                       overlap=overlap, pred=pred, bound=bound, compute=compute, wait=w,
                       pred_sweep=pred_sweep)
        last = runs[r][-1]
        assert all(x["ok"] for x in runs[r]), f"r_host {r}: rows failed"
        print(f"{r:>6.2f} {tokens / s:>8.1f} {s:>7.2f} {nbytes / 1e9:>8.2f} "
              f"{(nbytes / d / 1e9) if d else 0:>9.2f} {d:>7.2f} {w:>7.2f} {hidden if d else 0:>8.2f} "
              f"{overlap if d else 0:>7.2f} {pred:>10.1f} {bound:>11.1f} {last['slots']:>5} "
              f"{last['mode']}")
    zero = rows[0.0]
    accuracy = 1.0 - abs(zero["pred"] - zero["tok_s"]) / zero["tok_s"]
    if not cuda:
        print(f"at the back-to-back sweep's rate instead of the learnt one the model predicts "
              f"{zero['pred_sweep']:.1f} tok/s at r_host 0 (accuracy "
              f"{1.0 - abs(zero['pred_sweep'] - zero['tok_s']) / zero['tok_s']:.3f})")
    print(f"\ndisk rate {disk_gbps:.2f} GB/s by sweep, median; the model's (learnt) "
          f"{profiled_gbps:.2f} GB/s; C (r_host 1) = {c:.2f} s")
    rss = dict(ratio=float("nan"))
    if not cuda:
        rss = rss_check(path, args.budget_gb, 0.05, requests=16, prompt_len=128,
                        new_tokens=16, max_prefill_tokens=512)
        print(f"RSS under host_memory_gb={args.budget_gb} kv_cache_gb=0.05: growth "
              f"{rss['growth'] / 1e6:.0f} MB over a {rss['base'] / 1e6:.0f} MB runtime, ring "
              f"{rss['slots']} slots, {rss['ratio']:.3f} of the budget")
    # Two decode steps of the last round's r_host=0 run (its last steps: every sequence is
    # still in the batch, EOS being ignored); the trace holds that run only.
    steps = len([x for x in trace.spans("device") if x.label == "embed"])
    spans = decode_window(trace, max(0, steps - 3), 2)
    if spans:
        plot_timeline(spans, Path(args.figure),
                      f"small-mixtral bf16 on {args.backend}, r_host=0 (every expert read from "
                      f"disk with O_DIRECT), "
                      f"{args.requests} sequences: two decode steps")
        print(f"figure: {args.figure}")
    print(f"RESULT tok_s_ratio={zero['tok_s'] / rows[1.0]['tok_s']:.3f} "
          f"overlap_fraction={zero['overlap']:.3f} prediction_accuracy={accuracy:.3f} "
          f"rss_over_budget={rss['ratio']:.3f} bound_fraction={zero['tok_s'] / zero['bound']:.3f}")


if __name__ == "__main__":
    main()
