"""The profiler's timers: batched calls, several batches, because the VM is noisy."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable


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


def median_time(fn: Callable[[], Any], min_batch_s: float, trials: int,
                sync: Callable[[], None] = lambda: None) -> float:
    """Median seconds per call over `trials` batches."""
    return statistics.median(batch_times(fn, min_batch_s, trials, sync))


def best_time(fn: Callable[[], Any], min_batch_s: float, trials: int) -> float:
    """Fastest batch's seconds per call: for work made of many short parallel regions, which a
    neighbour's process can only slow down (a descheduled OpenMP thread holds up every region
    by a scheduler quantum), so the fastest batch is the machine's own figure."""
    return min(batch_times(fn, min_batch_s, trials))
