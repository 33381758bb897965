"""cpu_features: where engine.matmul_precision=high holds bf16x3, decided from /proc/cpuinfo
and MOE_BATCH_ISA alone, so the policy stage (no torch, no kernels) and the engine agree; and
the kernel builds the dispatcher offers against the flags /proc/cpuinfo reports."""
from __future__ import annotations

import os
import re

import pytest

from moe_engine import cpu_features
from moe_engine.cpu_features import bf16_tiles


def test_bf16_tiles_need_the_cpu_flags_and_no_other_forced_build(monkeypatch):
    tiles = {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(tiles))
    assert bf16_tiles({}) and bf16_tiles({"MOE_BATCH_ISA": "amx"})
    assert not bf16_tiles({"MOE_BATCH_ISA": "avx512"})
    assert not bf16_tiles({"MOE_BATCH_ISA": "avx512bf16"})
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma", "amx_tile"}))
    assert not bf16_tiles({}) and not bf16_tiles({"MOE_BATCH_ISA": "amx"})
    # the amx build needs int8 tiles too (i8q runs on them): without them it is not offered
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(tiles - {"amx_int8"}))
    assert not bf16_tiles({})


def test_the_kernels_run_tiles_where_bf16_tiles_says_so():
    packed = pytest.importorskip("moe_engine.model.packed")
    if not packed.HAS_PACKED_KERNELS or "amx" not in packed.supported_isas():
        pytest.skip("no amx kernel build on this machine")
    # the rule reads /proc/cpuinfo and MOE_BATCH_ISA; the kernels chose by CPUID (and the
    # OS's grant of the tile state): on a machine with an amx build the two agree
    assert bf16_tiles() == (packed.ISA in packed.TILE_ISAS)


# What each kernel build needs of /proc/cpuinfo's flags; isa_dispatch.c asks CPUID the same.
_AVX2 = {"avx2", "fma", "f16c"}
_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"}
BUILD_FLAGS = {
    "avx2": _AVX2,
    "avxvnni": _AVX2 | {"avx_vnni"},
    "avx512": _AVX512,
    "avx512vnni": _AVX512 | {"avx512_vnni"},
    "avx512bf16": _AVX512 | {"avx512_vnni", "avx512_bf16"},
    "amx": _AVX512 | {"avx512_vnni", "avx512_bf16", *cpu_features.TILE_FLAGS},
}
# The flags among them that Linux named late (5.3 to 5.16)
LATE_FLAGS = {"avx512_bf16", "avx_vnni", *cpu_features.TILE_FLAGS}


def test_the_kernels_offer_every_build_the_cpu_flags_allow_and_no_other():
    """On whichever machine runs it (the CPU changes between machines, and a VM can hide
    extensions, as one hid AVX512-BF16 but not VNNI): the dispatcher's CPUID checks agree with
    the flags the OS reports, and the build chosen at import is the best one offered."""
    packed = pytest.importorskip("moe_engine.model.packed")
    flags = cpu_features.cpu_flags()
    if not packed.HAS_PACKED_KERNELS or not flags:
        pytest.skip("no kernels built, or no /proc/cpuinfo flags")
    allowed = {isa for isa, need in BUILD_FLAGS.items() if need <= flags} | {"generic"}
    built, offered = set(packed.built_isas()), packed.supported_isas()
    assert set(BUILD_FLAGS) | {"generic"} >= built >= {"generic"}
    # Linux lists a flag only from the release that names it (avx512_bf16, avx_vnni and the
    # amx ones all by 5.16): on an older kernel CPUID can rightly offer a build whose newer
    # flags the file lacks
    release = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    unnamed = set() if release >= (5, 16) else {
        isa for isa, need in BUILD_FLAGS.items() if need - flags <= LATE_FLAGS}
    assert set(offered) - unnamed <= allowed & built
    # amx also needs the OS to grant the process the tile state, which no flag shows
    assert (allowed & built) - {"amx"} <= set(offered)
    if not os.environ.get("MOE_BATCH_ISA"):
        assert packed.ISA == offered[-1]
