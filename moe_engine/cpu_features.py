"""What the CPU reports in /proc/cpuinfo, read without torch or the kernels.

The policy stage and the performance model must stay light (no torch, no compiled kernels),
yet they must price the storage the engine will hold, and where that depends on the CPU
(engine.matmul_precision=high) both sides ask the same question here.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

# The flags that say the CPU has AMX tiles with bf16 and int8 products, which the amx build
# requires (Linux lists them only when the kernel supports the tile state).
TILE_FLAGS = ("amx_tile", "amx_bf16", "amx_int8")
# The packed kernels' ISA build that runs bf16 pair GEMMs on those tiles.
TILE_ISA = "amx"


def cpuinfo_field(name: str) -> Optional[str]:
    """The first /proc/cpuinfo line starting with `name`, its value; None off Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> frozenset[str]:
    return frozenset((cpuinfo_field("flags") or "").split())


def bf16_tiles(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether engine.matmul_precision=high holds bf16x3 here: the CPU reports what the amx
    build needs (AMX tiles with bf16 and int8 products, TILE_FLAGS) and MOE_BATCH_ISA does not
    force another build (bf16x3 GEMMs beat fp32 FMAs only on tiles). The one place it is
    decided, so the engine and the policy stage hold and price the same storage. It reads the
    CPU, not the kernel build: a build without the amx path (an old compiler) or an OS refusing
    the tile state leaves bf16x3 emulated, and the engine warns."""
    env = os.environ if environ is None else environ
    forced = env.get("MOE_BATCH_ISA")
    return (not forced or forced == TILE_ISA) and set(TILE_FLAGS) <= cpu_flags()
