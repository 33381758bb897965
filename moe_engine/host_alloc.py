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

The KV cache is allocated apart (`huge_page_zeros`): in 2 MiB transparent huge pages where the
kernel offers them (a madvise, as Linux's default "madvise" mode asks), since decode attention
reads it in scattered 4 KiB runs (a block of 16 tokens x 128 dims x bf16 per KV head), each a
page of its own on 4 KiB pages: a TLB miss and a hardware prefetcher stopping at every block.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os
import platform
import sys
from functools import lru_cache
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # torch is imported where a tensor is made: the fingerprint needs none
    import torch

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


@lru_cache(maxsize=1)
def _libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def libc_function(name: str):
    """The C library's function `name` through ctypes, or None where the library or the
    function is missing (mallopt and malloc_trim are glibc's)."""
    return getattr(_libc(), name, None)


def release_pages(t: "torch.Tensor") -> None:
    """Hand the whole pages inside t's bytes back to the kernel (MADV_DONTNEED), for a tensor
    about to be dropped whose values were copied: a view of a checkpoint file's private mapping
    (model/loader.py), whose pages would otherwise stay resident while the mapping lives.
    Pages t shares with a neighbour stay; were t anonymous memory, only its own bytes would read
    as zeros afterwards. Linux only; elsewhere nothing happens."""
    madvise = libc_function("madvise") if sys.platform.startswith("linux") else None
    if madvise is None or not hasattr(mmap, "MADV_DONTNEED") or t.numel() == 0:
        return
    start, page = t.data_ptr(), mmap.PAGESIZE
    lo, hi = -(-start // page) * page, (start + t.numel() * t.element_size()) // page * page
    if hi > lo:
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise(lo, hi - lo, mmap.MADV_DONTNEED)


def tune_host_allocator() -> str:
    """Apply the settings above where glibc's malloc serves the process; returns what the
    allocator now is, e.g. 'glibc (mmap >= 256 MiB, trim >= 512 MiB)', or its name untouched
    ('jemalloc (LD_PRELOAD)'). Idempotent."""
    name = allocator_name()
    if name != "glibc":
        return name
    mallopt = libc_function("mallopt")
    if mallopt is None:
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


# Transparent huge pages on x86-64 Linux.
HUGE_PAGE = 2 << 20


def huge_page_zeros(shape: tuple[int, ...], dtype: "torch.dtype") -> "torch.Tensor":
    """A zero tensor in its own anonymous mapping, 2 MiB aligned and advised into transparent
    huge pages (MADV_HUGEPAGE), for large tensors read in scattered page-sized runs (the KV
    cache). Decode attention over a 512 MiB cache of shuffled blocks read 1.08x (bf16) and
    1.09x (fp32) the GB/s of 4 KiB pages (docs/benchmarks.md). The pages are written here, as
    torch.zeros writes its own, not left to fault in on first use: on the KVM guest of
    2026-12-06 first touch ran at ~0.5 GB/s, and the default run's first prefill steps paid
    0.13-0.17 s of its 1.5 s for the cache's pages inside attention (a first run 10-15% slower
    than the next on the same engine, which the performance model, timing warm kernels, does
    not price); a host short of the memory also fails at load, not hours into a run. Falls
    back to torch.zeros below one huge page, where madvise is missing or refused, and under
    MOE_BATCH_MALLOC=system (the system's defaults, to measure what this buys)."""
    import torch

    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if (nbytes < HUGE_PAGE or advise is None or not hasattr(mmap, "MAP_ANONYMOUS")
            or os.environ.get("MOE_BATCH_MALLOC") == "system"):
        return torch.zeros(shape, dtype=dtype)
    # private: a shared anonymous mapping is shmem, which follows shmem_enabled, not THP's mode
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advise)
    except OSError:  # a kernel built without THP
        region.close()
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).view(shape).zero_()  # resident from here
