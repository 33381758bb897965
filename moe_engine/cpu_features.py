"""What the CPU reports in /proc/cpuinfo, read without torch or the kernels.

The policy stage and the performance model must stay light (no torch, no compiled kernels),
yet they must price the storage the engine will hold, and where that depends on the CPU
(engine.matmul_precision=high) both sides ask the same question here.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

# The flags that say the CPU has AMX tiles with bf16 products (Linux lists them only when the
# kernel supports the tile state).
TILE_FLAGS = ("amx_tile", "amx_bf16")
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
    """Whether the packed kernels run bf16 pair GEMMs on AMX tiles on this machine: the CPU
    has them and MOE_BATCH_ISA does not force another build. The one place
    engine.matmul_precision=high is decided (its bf16x3 GEMMs beat fp32 FMAs only on tiles),
    so the engine and the policy stage hold and price the same storage."""
    env = os.environ if environ is None else environ
    forced = env.get("MOE_BATCH_ISA")
    return (not forced or forced == TILE_ISA) and set(TILE_FLAGS) <= cpu_flags()
