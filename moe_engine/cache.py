"""Where moe-batch keeps what it measures or records about a machine or a model outside any one
run's results: hardware profiles (keyed by machine fingerprint) and routing profiles of
read-only model directories. Shared by every run and checkout on the machine."""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$MOE_BATCH_CACHE, else $XDG_CACHE_HOME/moe-batch, else ~/.cache/moe-batch."""
    env = os.environ.get("MOE_BATCH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moe-batch"


def hardware_cache_dir() -> Path:
    """Hardware profiles, one `<machine fingerprint>.yaml` each (`hardware.profile=auto`)."""
    return default_cache_dir() / "hardware"
