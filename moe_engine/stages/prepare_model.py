"""The `prepare_model` rule: build the built-in random-weight checkpoint the config names."""
from __future__ import annotations

from pathlib import Path


def prepare_model(preset: str, seed: int, num_shards: int, out: Path) -> Path:
    """The preset's checkpoint in `out`, built unless a complete build is there already.

    Takes what defines the checkpoint, not the run's config, so a new results dir never
    rebuilds it; concurrent runs building the same `out` both succeed (checkpoints.ensure_checkpoint).
    """
    from moe_engine.tools.checkpoints import ensure_checkpoint

    return ensure_checkpoint(preset, out, seed=seed, num_shards=num_shards)
