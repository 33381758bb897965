"""Benchmark (issue 12): the packed kernels' register tiles alone, as a fraction of the FMA peak.

Compiles bench/tile_loop.c once per ISA build the CPU runs (AVX2, AVX-512), with the flags and
source setup.py gives that build, so the loops are the extension's own; each run times the
build's FMA probe and then the tiles over weight panels that sit in L2 (256 KB), in L3 (4 MB)
or in DRAM (256 MB), and reports the tiles' rate over the probe's. Configurations alternate
round by round (a noisy host's swings land on all of them), medians of --rounds.

Beside bench/peak_fraction.py (the extension's calls against the same probe) it splits a call's
loss into the loop's own (here) and the work around it (item set-up, gathers, epilogues):
  .venv/bin/python bench/tile_loop.py                 # ~2 minutes on 2 cores
  .venv/bin/python bench/tile_loop.py --isa avx2 --rounds 9
  .venv/bin/python bench/tile_loop.py --cflags -DPANEL_AHEAD=8192   # a variant of the loops

Rows: the build's register tile (MOE_MR: AVX2 6, AVX-512 14), one tile per panel, bf16 weights (fp32
with --dtype fp32); "stream" adds the next-panel prefetches run_item gives decode-sized items.
The last line printed is (the first ISA):
  RESULT l2_fraction=<1 thread, L2> dram_fraction=<2 threads, DRAM> stream_ratio=<2 threads,
         DRAM, two tiles a panel: with the stream / without> isa=<isa>
"""
from __future__ import annotations

import argparse
import ast
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from moe_engine.model import packed  # noqa: E402
from moe_engine.tools import machine_info  # noqa: E402

SETS = {"L2": 4, "L3": 64, "DRAM": 4096}  # panels of 64 KB (bf16, K 1024)


def isa_flags() -> dict[str, list[str]]:
    """setup.py's compiler flags per ISA build source (its ISA_BUILDS), read without running it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    wanted = [n for n in tree.body if isinstance(n, ast.Assign)
              and any(getattr(t, "id", None) in ("AVX512_FLAGS", "ISA_BUILDS") for t in n.targets)]
    scope: dict = {}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "setup.py", "exec"), scope)  # list literals only
    return {src: flags for src, flags, _ in scope["ISA_BUILDS"]}


def build(isa: str, out_dir: Path, opt: str = "-O3", extra: tuple[str, ...] = ()) -> Path:
    """The harness for one ISA build, at setup.py's -O3 (tests take -O1: half the compile);
    `extra` compiler flags after the build's own (e.g. -DPANEL_AHEAD=8192)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler (set CC)")
    src = f"isa_{isa}.c"
    exe = out_dir / f"tile_loop_{isa}"
    cmd = [cc, opt, "-fno-math-errno", "-fopenmp", *isa_flags()[src], f"-I{REPO / 'kernels_cy'}",
           f'-DISA_SOURCE="{src}"', *extra, str(REPO / "bench" / "tile_loop.c"), "-o", str(exe), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return exe


def run(exe: Path, dtype: str, panels: int, stream: int, threads: int, tiles: int,
        rows: int = 0) -> tuple[float, int]:
    """(tiles' FLOP/s over the probe's, rows a tile); rows 0: the build's register tile."""
    out = subprocess.run([str(exe), dtype, str(rows), str(panels), str(stream), str(threads), str(tiles)],
                         check=True, capture_output=True, text=True).stdout
    fields = dict(f.split("=") for f in out.split())
    return float(fields["fraction"]), int(fields["rows"])


def configs() -> list[tuple[str, int, int, int, int]]:
    """(label, panels, stream, threads, tiles)."""
    out = [(f"{where} {th}t", SETS[where], 0, th, 1) for where in SETS for th in (1, 2)]
    out += [(f"DRAM 2t {tiles} tiles{' stream' if s else ''}", SETS["DRAM"], s, 2, tiles)
            for tiles in (1, 2) for s in (0, 1) if (tiles, s) != (1, 0)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", default=None, help="comma-separated (default: avx512 and avx2, where the CPU runs them)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cflags", default="", help="extra compiler flags, e.g. -DPANEL_AHEAD=8192 "
                    "(the tiles' prefetch distance), to try a variant of the loops")
    args = ap.parse_args()
    supported = packed.supported_isas() if packed.HAS_PACKED_KERNELS else []
    isas = args.isa.split(",") if args.isa else [i for i in ("avx512", "avx2") if i in supported]
    if not isas:
        raise SystemExit("no AVX2 or AVX-512 build runs on this CPU")
    print(machine_info.header(2), flush=True)
    print(f"# tiles alone ({args.dtype} weights, K 1024, 32 columns a panel) over the FMA probe of "
          f"their build, {args.rounds} rounds alternated: median (min-max)", flush=True)
    first = None
    with tempfile.TemporaryDirectory() as tmp:
        for isa in isas:
            exe = build(isa, Path(tmp), extra=tuple(args.cflags.split()))
            cases = configs()
            got: dict[str, list[float]] = {c[0]: [] for c in cases}
            for _ in range(args.rounds):
                for label, panels, stream, threads, tiles in cases:
                    fraction, rows = run(exe, args.dtype, panels, stream, threads, tiles)
                    got[label].append(fraction)
            for label, v in got.items():
                print(f"{isa:7s} {rows} rows  {label:28s} {statistics.median(v):.3f} "
                      f"({min(v):.3f}-{max(v):.3f})", flush=True)
            if first is None:
                med = {k: statistics.median(v) for k, v in got.items()}
                first = (isa, med)
    isa, med = first
    print(f"RESULT l2_fraction={med['L2 1t']:.3f} dram_fraction={med['DRAM 2t']:.3f} "
          f"stream_ratio={med['DRAM 2t 2 tiles stream'] / med['DRAM 2t 2 tiles']:.3f} isa={isa}")


if __name__ == "__main__":
    main()
