"""cpu_features: where engine.matmul_precision=high holds bf16x3, decided from /proc/cpuinfo
and MOE_BATCH_ISA alone, so the policy stage (no torch, no kernels) and the engine agree."""
from __future__ import annotations

import pytest

from moe_engine import cpu_features
from moe_engine.cpu_features import bf16_tiles


def test_bf16_tiles_need_the_cpu_flags_and_no_other_forced_build(monkeypatch):
    monkeypatch.setattr(cpu_features, "cpu_flags",
                        lambda: frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}))
    assert bf16_tiles({}) and bf16_tiles({"MOE_BATCH_ISA": "amx"})
    assert not bf16_tiles({"MOE_BATCH_ISA": "avx512"})
    assert not bf16_tiles({"MOE_BATCH_ISA": "avx512bf16"})
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma", "amx_tile"}))
    assert not bf16_tiles({}) and not bf16_tiles({"MOE_BATCH_ISA": "amx"})


def test_the_kernels_run_tiles_where_bf16_tiles_says_so():
    packed = pytest.importorskip("moe_engine.model.packed")
    if not packed.HAS_PACKED_KERNELS or "amx" not in packed.supported_isas():
        pytest.skip("no amx kernel build on this machine")
    # the rule reads /proc/cpuinfo and MOE_BATCH_ISA; the kernels chose by CPUID (and the
    # OS's grant of the tile state): on a machine with an amx build the two agree
    assert bf16_tiles() == (packed.ISA in packed.TILE_ISAS)
