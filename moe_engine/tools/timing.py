"""The profiler's timer: medians of batched calls, because the VM is noisy."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def median_time(fn: Callable[[], Any], min_batch_s: float, trials: int,
                sync: Callable[[], None] = lambda: None) -> float:
    """Median seconds per call: calls are batched until a batch lasts min_batch_s, `trials` batches."""
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
    return statistics.median(times)
