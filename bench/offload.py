"""Offloading benchmark (issue 5): how much of the weight streaming the pipeline hides.

Runs the same batch three ways, interleaved round by round (the VM is noisy):
  resident   every expert resident, no link: the compute time C;
  offloaded  resident_ratio R, streamed experts over an emulated link of B GB/s: wall time S,
             with T = the time the link was busy;
and reports hidden = C + T - S (serial execution hides nothing; perfect overlap hides min(C, T)).
The last offloaded run's trace is saved (JSON) and drawn as a timeline (PNG) of a window of
decode steps: the figure of docs/offload.md.

On the CPU backend the link is emulated (CpuBackend sleeps bytes/bandwidth per packet in its
copy thread) and device compute and CPU attention are real work on the same cores. With
`--backend cuda` the device is the GPU and the link is its real PCIe/NVLink host link (pinned
host pages, copies on their own stream); `--link-gbps` is ignored there.

  .venv/bin/python bench/offload.py                        # small-mixtral, R=0.5
  .venv/bin/python bench/offload.py --model tiny --ratio 0.0 --link-gbps 0.5
  python bench/offload.py --backend cuda --ratio 0.0 --requests 128   # on a GPU machine
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from moe_engine.config import EngineConfig  # noqa: E402
from moe_engine.engine.llm_engine import LLMEngine  # noqa: E402
from moe_engine.offload.build import OffloadSettings, build_offload_pipeline  # noqa: E402
from moe_engine.offload.routing import find_profile  # noqa: E402
from moe_engine.engine.request import Request, SamplingParams  # noqa: E402
from moe_engine.offload.trace import Span, Trace  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def model_dir(name: str) -> Path:
    if Path(name).is_dir():
        return Path(name)
    from moe_engine.tools.presets import builtin_model_key

    local = REPO / "resources" / "models" / builtin_model_key(name, 0)
    if (local / "config.json").exists():
        return local
    from moe_engine.tools.checkpoints import build_checkpoint

    return build_checkpoint(name, Path(tempfile.mkdtemp()) / name, seed=0)


def requests(n: int, new_tokens: int) -> list[Request]:
    return [Request(f"r{i}", prompt_token_ids=[100 + i, 200 + i, 300 + i, 400 + i],
                    sampling=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
            for i in range(n)]


def run(path: Path, config: EngineConfig, settings: OffloadSettings, reqs, trace=None) -> dict:
    engine = LLMEngine(path, config)
    pipe = build_offload_pipeline(engine.runner, settings, routing=find_profile(path), trace=trace)
    engine.runner = pipe
    if trace is not None:
        trace.clear()
    t0 = time.perf_counter()
    list(engine.generate(reqs))
    wall = time.perf_counter() - t0
    pipe.close()
    pipe.backend.close()
    return dict(wall=wall, link_s=pipe.backend.link_busy_s, totals=pipe.totals)


LANES = ["copy", "device", "wait", "cpu"]
LANE_NAMES = {"copy": "link (weight pages)", "device": "device compute", "wait": "device waits",
              "cpu": "CPU attention / experts"}


def colour(span: Span) -> str:
    if span.lane == "copy":
        return "tab:blue"
    if span.lane == "wait":
        return "tab:red"
    if span.label.startswith("attn"):
        return "tab:green"
    if span.label.startswith("cpu-expert"):
        return "tab:olive"
    if span.label.startswith("expert"):
        return "tab:orange"
    return "tab:gray"


LEGEND = [("tab:blue", "weight packet"), ("tab:orange", "expert FFN (device)"),
          ("tab:gray", "norm/QKV/O/router/head"), ("tab:red", "blocked on pages"),
          ("tab:green", "attention (CPU)"), ("tab:olive", "expert FFN (CPU)")]


def plot(spans: list[Span], out: Path, title: str, lanes: list[str] = LANES,
         names: dict[str, str] = LANE_NAMES, colour_of=colour,
         legend: list[tuple[str, str]] = LEGEND) -> None:
    """A timeline of `spans`, one row per lane (bench/disk_tier.py draws its own lanes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(s.start for s in spans)
    fig, ax = plt.subplots(figsize=(12, 3.2))
    for row, lane in enumerate(lanes):
        bars = [((s.start - t0) * 1e3, max(s.duration * 1e3, 0.02)) for s in spans
                if s.lane == lane]
        cols = [colour_of(s) for s in spans if s.lane == lane]
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=cols, edgecolor="none")
    ax.set_yticks(range(len(lanes)), [names[lane] for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=c, label=label) for c, label in legend],
              loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=len(legend), fontsize=8,
              frameon=False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def window(trace: Trace, first_step: int, steps: int) -> list[Span]:
    """Spans between the start of decode step `first_step` and the end of `steps` steps later
    (steps are delimited by the 'embed' device span)."""
    starts = [s.start for s in trace.spans("device") if s.label == "embed"]
    lo = starts[min(first_step, len(starts) - 1)]
    hi = starts[first_step + steps] if first_step + steps < len(starts) else float("inf")
    return [s for s in trace.spans() if s.start >= lo and s.start < hi]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-mixtral")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--link-gbps", type=float, default=4.0)
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cpu-experts", action="store_true",
                    help="let Twiddler's rule put streamed experts on the CPU")
    ap.add_argument("--figure", default=str(REPO / "docs" / "img" / "offload_timeline.png"))
    ap.add_argument("--trace", default=str(REPO / "results" / "benchmarks" / "offload_trace.json"))
    args = ap.parse_args()

    from moe_engine.tools import machine_info

    print(machine_info.header(os.cpu_count()), flush=True)
    cuda = args.backend == "cuda"
    if cuda:
        import torch

        print(f"# device: {torch.cuda.get_device_name(0)}, torch CUDA {torch.version.cuda}",
              flush=True)
    path = model_dir(args.model)
    # A GPU pipeline computes with torch GEMMs on torch-layout weights.
    config = EngineConfig(threads=0, kv_cache_gb=0.25, num_micro_batches=args.micro_batches,
                          gemm="torch" if cuda else "auto")
    reqs = requests(args.requests, args.new_tokens)
    link = None if cuda else args.link_gbps
    link_name = "real host link" if cuda else f"emulated link {args.link_gbps} GB/s"
    resident = OffloadSettings(backend=args.backend, resident_ratio=1.0)
    offloaded = OffloadSettings(backend=args.backend, resident_ratio=args.ratio,
                                cpu_experts=args.cpu_experts, emulated_link_gbps=link)
    run(path, config, resident, reqs[:2])  # warm-up
    cs, ss, ts = [], [], []
    trace = Trace()
    last = None
    for _ in range(args.rounds):
        cs.append(run(path, config, resident, reqs)["wall"])
        last = run(path, config, offloaded, reqs, trace=trace)
        ss.append(last["wall"])
        ts.append(last["link_s"])
    c, s, t = statistics.median(cs), statistics.median(ss), statistics.median(ts)
    hidden = c + t - s
    totals = last["totals"]
    print(f"model={path.name} backend={args.backend} ratio={args.ratio} {link_name} "
          f"requests={args.requests} new_tokens={args.new_tokens}")
    moved = totals.bytes_moved
    print(f"link: {moved / 1e9:.2f} GB moved in the last run, {moved / 1e9 / t:.1f} GB/s while "
          f"busy; new tok/s resident {args.requests * args.new_tokens / c:.0f}, offloaded "
          f"{args.requests * args.new_tokens / s:.0f}")
    print(f"C (all resident)={c:.3f}s  T (link busy)={t:.3f}s  S (offloaded)={s:.3f}s  "
          f"C+T={c + t:.3f}s  hidden={hidden:.3f}s = {hidden / min(c, t):.0%} of min(C, T)")
    print(f"last run: {totals.to_dict()}")
    trace.save(args.trace)
    spans = window(trace, 2, 2)
    plot(spans, Path(args.figure),
         f"{path.name}, r_w={args.ratio}, {link_name}: two decode "
         f"steps (C={c:.2f}s, T={t:.2f}s, S={s:.2f}s for the run)")
    print(f"trace: {args.trace}\nfigure: {args.figure}")
    print(f"RESULT compute_s={c:.4f} link_s={t:.4f} offloaded_s={s:.4f} "
          f"hidden_fraction={hidden / min(c, t):.3f}")


if __name__ == "__main__":
    main()
