"""The profiler's timers: batched calls, several batches, because the VM is noisy."""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence


def batch_times(fn: Callable[[], Any], min_batch_s: float, trials: int,
                sync: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds per call of `trials` batches: calls are batched until a batch lasts min_batch_s."""
    fn()
    sync()
    reps = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        dt = time.perf_counter() - t0
        if dt >= min_batch_s or reps >= 1 << 16:
            break
        reps = max(reps * 2, int(reps * min_batch_s / max(dt, 1e-9)))
    times = [dt / reps]
    for _ in range(trials - 1):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / reps)
    return times


def rotation_copies(nbytes: int, cache_bytes: int, max_copies: int, max_total: float = 1.5e9) -> int:
    """How many copies of `nbytes` of weights a timed call rotates through so that each call
    reads its weights from DRAM, as the engine's calls do (its weights together exceed the
    cache; one hot copy would measure the cache): enough to fill twice the last-level cache
    (`cache_bytes`), at most `max_copies` and `max_total` bytes in all."""
    nbytes = max(1, nbytes)
    return max(1, min(max_copies, math.ceil(2 * cache_bytes / nbytes), int(max_total // nbytes)))


def median_time(fn: Callable[[], Any], min_batch_s: float, trials: int,
                sync: Callable[[], None] = lambda: None) -> float:
    """Median seconds per call over `trials` batches."""
    return statistics.median(batch_times(fn, min_batch_s, trials, sync))


def interleaved_best_times(makers: Sequence[Callable[[], Callable[[], Any]]], min_batch_s: float,
                           rounds: int) -> list[float]:
    """Seconds per call of the fastest batch of each of several measurements, taken in turn one
    batch each per round. For work made of many short parallel regions, which a neighbour's
    process can only slow down (a descheduled OpenMP thread holds up every region by a scheduler
    quantum): the fastest batch is the machine's own figure, and spreading each figure's batches
    over the whole measurement lets a burst of the neighbour's work spoil a few of them rather
    than all. `makers` build their call (and its tensors) anew each round, so only one
    measurement's tensors are alive at a time."""
    best = [float("inf")] * len(makers)
    for _ in range(rounds):
        for i, make in enumerate(makers):
            best[i] = min(best[i], batch_times(make(), min_batch_s, 1)[0])
    return best
