"""The host allocator's settings for an engine's run of short, repeated steps.

A step allocates and frees the same activation tensors over and over (a norm's output, the
QKV split, the expert scratch: hundreds of KiB to tens of MiB at a prefill pass). glibc's
malloc serves the larger ones with mmap, raises its mmap threshold to the size of a freed
chunk, and gives the top of the heap back to the kernel whenever more than twice that lies
free; the next step then faults the same pages in again. On the 2-core CPUs this project runs
on that costs more than the work: an RMSNorm over 2000 x 128 fp32 took 820 us instead of 67
and the default run's steps ~10% more wall time (docs/benchmarks.md, "Host allocator").
Keeping freed memory in the heap (fixed thresholds, far above any one activation) makes a
step's allocations reuse the previous step's pages. It is what tcmalloc and jemalloc do by
design, which is why CPU inference engines preload one; with one preloaded (LD_PRELOAD),
glibc's settings would not matter and nothing is changed. MOE_BATCH_MALLOC=system leaves
glibc's defaults too (to measure what the settings buy, with any benchmark).

The settings are process-wide by nature (mallopt has no scope): the engine applies them once
its weights are loaded (loading's own temporaries are returned to the system as before), the
hardware profiler before it measures, so both run under the same allocator. The machine's
profile fingerprint names them (perf.hardware.machine_fingerprint).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Allocations below this come from the heap and are reused; glibc before 2.35 caps the
# threshold at 32 MiB (HEAP_MAX_SIZE / 2), which is taken when the larger value is refused.
MMAP_THRESHOLD = 256 << 20
MMAP_THRESHOLD_CAPPED = 32 << 20
# Free memory the heap keeps at its top before giving it back: glibc's own rule, twice the
# mmap threshold.
TRIM_FACTOR = 2

_PRELOADED = ("tcmalloc", "jemalloc", "mimalloc")


def allocator_name() -> str:
    """Which allocator serves this process's mallocs: 'glibc', '<lib> (LD_PRELOAD)' or the C
    library's name when it is not glibc. Pure: reads the environment and the libc version."""
    if os.environ.get("MOE_BATCH_MALLOC") == "system":
        return "system malloc (MOE_BATCH_MALLOC=system)"
    preload = os.environ.get("LD_PRELOAD", "")
    for lib in _PRELOADED:
        if lib in preload:
            return f"{lib} (LD_PRELOAD)"
    libc, _ = platform.libc_ver()
    return libc or "unknown libc"


def tune_host_allocator() -> str:
    """Apply the settings above where glibc's malloc serves the process; returns what the
    allocator now is, e.g. 'glibc (mmap >= 256 MiB, trim >= 512 MiB)', or its name untouched
    ('jemalloc (LD_PRELOAD)'). Idempotent."""
    name = allocator_name()
    if name != "glibc":
        return name
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "glibc (untuned: mallopt not found)"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mmap = MMAP_THRESHOLD if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) else MMAP_THRESHOLD_CAPPED
    if mmap == MMAP_THRESHOLD_CAPPED and not mallopt(_M_MMAP_THRESHOLD, mmap):
        return "glibc (untuned: mallopt refused)"
    mallopt(_M_TRIM_THRESHOLD, TRIM_FACTOR * mmap)
    return f"glibc (mmap >= {mmap >> 20} MiB, trim >= {TRIM_FACTOR * mmap >> 20} MiB)"


def allocator_fingerprint() -> str:
    """What `tune_host_allocator` makes of this process's allocator, without applying it: a
    part of the machine fingerprint (profiles measured under other settings are not reused)."""
    name = allocator_name()
    return f"glibc-tuned-{MMAP_THRESHOLD >> 20}M" if name == "glibc" else name.split()[0]
