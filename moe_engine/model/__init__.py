"""Model definition: spec from config.json, name tables, safetensors loading, layer math, runner."""
from moe_engine.model.loader import load_weights, resolve_dtype
from moe_engine.model.spec import ModelSpec, load_spec

__all__ = ["ModelSpec", "load_spec", "load_weights", "resolve_dtype"]
