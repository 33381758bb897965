"""A timeline recorder: (lane, label, start, end) spans from any thread, for tests and figures.

Lanes are the three resources that run at once: `copy` (the link), `device` (the accelerator,
or the main thread on the CPU backend) and `cpu` (CPU attention and CPU-placed experts).
"""
from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional


@dataclass(frozen=True)
class Span:
    lane: str
    label: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


class Trace:
    """Thread-safe list of spans, times relative to when the trace was created."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.origin = time.perf_counter()
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def add(self, lane: str, label: str, start: float, end: float) -> None:
        """Record a span given perf_counter() start/end times."""
        if not self.enabled:
            return
        span = Span(lane, label, start - self.origin, end - self.origin)
        with self._lock:
            self._spans.append(span)

    @contextmanager
    def span(self, lane: str, label: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, label, t0, time.perf_counter())

    def spans(self, lane: Optional[str] = None) -> list[Span]:
        with self._lock:
            spans = list(self._spans)
        spans.sort(key=lambda s: s.start)
        return [s for s in spans if lane is None or s.lane == lane]

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
        self.origin = time.perf_counter()

    def busy_time(self, lane: str) -> float:
        """Union length of a lane's spans (overlapping spans of one lane counted once)."""
        total, cursor = 0.0, float("-inf")
        for s in self.spans(lane):
            start = max(s.start, cursor)
            if s.end > start:
                total += s.end - start
                cursor = s.end
        return total

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([asdict(s) for s in self.spans()]))
        return path
