"""The `prepare_model` rule: build the built-in random-weight checkpoint the config names."""
from __future__ import annotations

from pathlib import Path

from moe_engine.config import AppConfig, ConfigError


def prepare_model(cfg: AppConfig, out: Path) -> Path:
    """Write the preset's checkpoint to `out` (deterministic for the configured seed)."""
    if cfg.model.builtin is None:
        raise ConfigError("model.builtin=None: prepare-model only builds built-in presets")
    from moe_engine.tools.checkpoints import build_checkpoint

    return build_checkpoint(cfg.model.builtin, out, seed=cfg.model.seed,
                            num_shards=cfg.model.num_shards)
