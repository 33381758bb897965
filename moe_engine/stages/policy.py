"""The `policy` rule: choose the engine's execution policy for a shard.

With engine.policy=search the performance model picks batch size, micro-batches, placements and
the resident expert ratio for the largest shard (each generate job runs one shard alone, and the
largest has the highest batch bound and memory need), from every row's own prompt and
generation length. With engine.policy=config the configured knobs are recorded as they are.
The generate rule applies the result with `engine_config_for`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import polars as pl

from moe_engine.config import AppConfig, DeviceKind, EngineConfig, ExpertDType, GemmImpl
from moe_engine.cpu_features import bf16_tiles
from moe_engine.io import hardware_cache_dir, write_text_atomic
from moe_engine.model.spec import (EXPERT_STORAGE_BITS, FLOAT_STORAGE, MODEL_DTYPE_STORAGE,
                                    TORCH_GEMM_STORAGE, precision_storage)
from moe_engine.stages.tables import STATUS_PENDING


def _knobs(engine: EngineConfig) -> dict[str, Any]:
    return {k: (v.value if hasattr(v, "value") else v) for k, v in engine.__dict__.items()}


def shard_lengths(cfg: AppConfig, shards: list[Path]) -> tuple[list[int], list[int] | int]:
    """Prompt and generation lengths of the largest shard's runnable rows (rejected rows
    generate nothing); one token and the workload's default when no row can run."""
    frames = [pl.read_parquet(p).filter(pl.col("status") == STATUS_PENDING) for p in shards]
    frame = max(frames, key=lambda f: f.height, default=None)
    if frame is not None and frame.height:
        return frame["prompt_tokens"].to_list(), frame["max_new_tokens"].to_list()
    return [1], cfg.workload.max_new_tokens


def choose_policy(cfg: AppConfig, model_dir: Path, shards: list[Path]) -> dict[str, Any]:
    """The policy record the generate jobs read: its source, the search's figures, the knobs."""
    if cfg.engine.policy.value == "config":
        return {"source": "config", "engine": _knobs(cfg.engine)}
    from moe_engine import perf

    lengths, gen_len = shard_lengths(cfg, shards)
    dtype = cfg.model.dtype.value
    model = perf.ModelSpec.from_hf_config(model_dir, dtype=dtype)
    model = model.with_expert_storage(held_expert_storage(cfg.engine, model.expert_storage,
                                                          model.torch_dtype))
    model = model.with_weight_storage(held_weight_storage(cfg.engine, model.torch_dtype))
    if cfg.hardware.profile == "auto":
        ensure_machine_profile(model, model_dir, dtype)
    hw = perf.hardware_spec_from_config(cfg.hardware, hardware_cache_dir(), model=model)
    wl = perf.workload_spec_from_lengths(lengths, gen_len)
    result = perf.choose_policy(model, hw, wl, backend=cfg.engine.backend.value)
    chosen = perf.apply_policy(cfg.engine, result)
    return {"source": "search", **result.to_json(), "engine": _knobs(chosen)}


def _packed_path(engine) -> bool:
    """Whether the engine runs on the packed CPU kernels (LLMEngine's gemm choice, the kernels
    built): the CPU backend with engine.gemm auto or packed."""
    return engine.backend is DeviceKind.cpu and engine.gemm is not GemmImpl.torch


def held_expert_storage(engine, checkpoint_storage: Optional[str],
                        model_dtype: str = "bfloat16", tiles: Optional[bool] = None) -> Optional[str]:
    """The storage the engine will hold routed experts in when it is not `model_dtype` (None:
    the model dtype), as LLMEngine decides it: a quantized engine.expert_dtype; with auto, the
    checkpoint's own (MXFP4) on the packed CPU kernels, widened on torch's GEMMs (engine.gemm=
    torch, a device backend); a float expert_dtype widens; and on the packed kernels under
    engine.matmul_precision=medium, bf16 or fp32 experts become bf16 pairs (bf16p) and int8
    ones int8 quads (int8q), under
    high bf16 experts become bf16x3 where the kernels have AMX tiles (`tiles`; None: this
    machine's, cpu_features.bf16_tiles)."""
    choice = engine.expert_dtype
    if choice.quantized:
        return (precision_storage(choice.value, engine.matmul_precision.value, False)
                if _packed_path(engine) else choice.value)
    if choice is ExpertDType.auto and _packed_path(engine) and checkpoint_storage is not None:
        return checkpoint_storage
    if _packed_path(engine):
        floats = FLOAT_STORAGE.get(model_dtype) if choice is ExpertDType.auto else choice.value
        held = (precision_storage(floats, engine.matmul_precision.value, _tiles(tiles))
                if floats else None)
        return held if held in EXPERT_STORAGE_BITS else None
    return None


def held_weight_storage(engine, model_dtype: str = "bfloat16",
                        tiles: Optional[bool] = None) -> Optional[str]:
    """The storage the engine holds the dense projections and the LM head in when it is not
    `model_dtype` on the packed kernels (None), as LLMEngine decides it: bf16 pairs on the
    packed CPU kernels under engine.matmul_precision=medium, for bf16 and fp32 models (bf16x3
    under high, for bf16 models, where the kernels have AMX tiles: `tiles`, None for this
    machine's); the model dtype on torch's GEMMs (TORCH_GEMM_STORAGE) for engine.gemm=torch on the CPU, whose
    GEMMs and element-wise work (in the model dtype, not fp32) are another path to profile."""
    if engine.backend is DeviceKind.cpu and engine.gemm is GemmImpl.torch:
        return TORCH_GEMM_STORAGE
    floats = FLOAT_STORAGE.get(model_dtype)
    if not _packed_path(engine) or floats is None:
        return None
    held = precision_storage(floats, engine.matmul_precision.value, _tiles(tiles))
    return held if held != floats else None


def _tiles(tiles: Optional[bool]) -> bool:
    return bf16_tiles() if tiles is None else tiles


def ensure_machine_profile(model, model_dir: Path, dtype: str) -> None:
    """Measure this machine (hardware.profile=auto) if its cached profile is missing or lacks the
    model's GEMM shapes, layer layout or in-run factors (measured on `model_dir`). The profiler
    runs as its own process: it needs torch and the kernels, which the performance model must
    not import."""
    from moe_engine.perf.hardware import cached_profile_path, engine_calibrated, load_profile, profile_serves

    # MOE_BATCH_PROFILE=fast: fewer token counts and shorter timings (~10 s instead of ~45 s;
    # the test suite's choice, whose workflows need a profile and not its precision)
    mode = os.environ.get("MOE_BATCH_PROFILE") or "full"
    if mode not in ("full", "fast"):
        raise ValueError(f"MOE_BATCH_PROFILE={mode!r}: expected 'full' or 'fast'")
    path = cached_profile_path(hardware_cache_dir())
    if path.exists():
        data = load_profile(path)
        if profile_serves(data, [model], fast=mode == "fast") and engine_calibrated(data, model):
            return
    cmd = [sys.executable, "-m", "moe_engine.tools.profile_hardware", "--ensure", "--out", str(path),
           "--model", str(model_dir)]
    if dtype != "auto":
        cmd += ["--dtype", dtype]
    # The held experts' layout (held_expert_storage), always named: the profiler reads the
    # checkpoint, whose own storage (MXFP4) the engine may widen to the model dtype (torch's
    # GEMMs), and a profile of the checkpoint's layout would never cover what is held.
    cmd += ["--expert-storage", model.expert_storage or MODEL_DTYPE_STORAGE]
    if model.weight_storage is not None:  # the dense weights' GEMMs (held_weight_storage)
        cmd += ["--weight-storage", model.weight_storage]
    if mode == "fast":
        cmd.append("--fast")
    print(f"policy: measuring what this machine's profile at {path} lacks for {model.name} "
          f"({mode}; a whole profile takes ~1 minute, once per machine and kernel build)",
          file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def write_policy(policy: dict[str, Any], out: Path) -> None:
    write_text_atomic(out, json.dumps(policy, indent=2, default=str) + "\n")


def engine_config_for(cfg: AppConfig, policy: dict | None) -> EngineConfig:
    """The engine knobs for this run: the policy's choice when the config asks for search."""
    engine = cfg.engine
    if policy is not None and engine.policy.value == "search" and "engine" in policy:
        allowed = set(EngineConfig.__dataclass_fields__)
        engine = replace(engine, **{k: v for k, v in policy["engine"].items() if k in allowed})
    return engine
