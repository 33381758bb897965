"""bench/tile_loop.c compiles from the extension's own sources (packed_gemm_impl.h and an ISA
build's file): a change to the tiles' signatures or the epilogue breaks it here, not in the next
session that needs the measurement. One build (the best of AVX-512 and AVX2 this CPU runs, at
-O1 to halve the compile), run on a small set; checks what it prints, not speed."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from moe_engine.model import packed

REPO = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("tile_loop_bench", REPO / "bench" / "tile_loop.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_tile_loop_builds_from_the_extension_sources_and_runs(tmp_path):
    isa = next((i for i in ("avx512", "avx2") if i in packed.supported_isas()), None)
    if isa is None:
        pytest.skip("this CPU runs neither the AVX-512 nor the AVX2 build")
    bench = _bench()
    assert "-mfma" in bench.isa_flags()[f"isa_{isa}.c"]  # setup.py's flags, from its ISA_BUILDS
    exe = bench.build(isa, tmp_path, opt="-O1")
    for dtype in ("bf16", "fp32"):
        for stream, tiles in ((0, 1), (1, 2)):
            fraction, rows = bench.run(exe, dtype, 2, stream, 1, tiles)
            assert 0.0 < fraction < 10.0, (dtype, stream, tiles)
            assert rows == {"avx2": 6, "avx512": 14}[isa]  # the build's MOE_MR by default
