"""What the process holds in RAM, as the kernel counts it (/proc/self/status).

Budgets are checked against real residency, not against the bytes of the tensors the engine
knows about: packing leaves allocator slack, the KV cache and ring slots are only resident once
touched, and a budget that holds on paper but not in RSS is no budget. Linux only; elsewhere the
functions return None and callers fall back to tensor sizes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

_STATUS = Path("/proc/self/status")


def _status_kb(key: str) -> Optional[int]:
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def rss_bytes() -> Optional[int]:
    """Resident set size now."""
    return _status_kb("VmRSS")


def peak_rss_bytes() -> Optional[int]:
    """The process's RSS high-water mark so far."""
    return _status_kb("VmHWM")
