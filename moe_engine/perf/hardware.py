"""HardwareSpec from the Hydra hardware group, from a profiled YAML, or from the profile cache.

A profile YAML carries the same figures as a hardware group file (GB, GB/s, TFLOP/s) plus what
only measurement gives: GEMM times per shape and token count, the decode-attention kernel's KV
streaming rate and the per-operator launch overhead. It is not a Hydra group file (it has keys
the schema does not know); `hardware.profile` points at it.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import os
import platform
import statistics
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import yaml

from moe_engine.cpu_features import cpuinfo_field
from moe_engine.host_alloc import allocator_fingerprint
from .specs import (ENGINE_COMPONENTS, GB, TFLOPS, DecodeAttentionPoint, EngineFactors, GemmPoint, HardwareSpec,
                    LayerOpsPoint, ModelSpec, MoeFfnPoint, PrefillAttentionPoint, layer_layout)

PRESET_DIR = Path(__file__).resolve().parents[2] / "config" / "hardware"
# The compiled decode-attention kernel that model/paged_attention imports when it is built.
CYTHON_KERNEL_DIR = Path(__file__).resolve().parents[1] / "_kernels"
CYTHON_KERNEL_NAME = "paged_attention"
PACKED_KERNEL_NAME = "packed_gemm"
# Figures every profile must have besides GEMM rates: the engine loop's and the disk tier's
# (profiles from before they existed lack them).
HOST_KEYS = ("host_step_us", "host_seq_us", "host_token_us", "host_logit_ns", "disk_read_gbps")


# The profiler's measuring method, part of the machine fingerprint: bumped when what a figure
# measures changes, so cached profiles are measured again rather than mixed with new figures.
# 2: the experts' call with GPT-OSS's biases and clamped SwiGLU (bare experts before; its call
# at 8 tokens read 141 us where it takes 276), GEMMs in the model's own dtype (2026-11-27).
# 3: decode attention over a KV cache in the model's dtype (an fp16 model's was timed on bf16).
# 4: prefill attention writes its K/V into a cache in the model's dtype (it wrote fp32); the
# KV rate is read from a cache in huge pages, as the engine's now is (host_alloc).
# 5: the engine is run on the model's checkpoint to measure its in-run factors (EngineFactors).
PROFILE_METHOD = 5

# An NVMe SSD's sequential O_DIRECT reads at queue depth 1 with 16 MiB requests (1.1-2.9 GB/s
# measured on the CI machines); profiles measure the machine's own (disk_read_gbps).
DEFAULT_DISK_READ_GBPS = 2.0


def spec_from_figures(fig: Mapping[str, Any], gemm_storage: Optional[str] = None) -> HardwareSpec:
    """HardwareSpec from a mapping with the HardwareConfig field names and units; profile-only
    keys (gemm, cpu_gemm, cpu_attention_gbps, op_overhead_us, host_*_us, layer_ops,
    prefill_attention, decode_attention, moe_ffn) are read when present. The GEMM points are
    those of the packed storage `gemm_storage` (ModelSpec.weight_storage; None: the dtype's)."""
    device = fig.get("device", "cpu")
    device = getattr(device, "value", device)
    return HardwareSpec(
        name=str(fig.get("name", "unnamed")), device_kind=str(device),
        device_memory=float(fig["device_memory_gb"]) * GB, host_memory=float(fig["host_memory_gb"]) * GB,
        link_bw=float(fig["link_gbps"]) * GB, device_bw=float(fig["device_bw_gbps"]) * GB,
        cpu_bw=float(fig["cpu_bw_gbps"]) * GB, device_flops=float(fig["device_tflops"]) * TFLOPS,
        cpu_flops=float(fig["cpu_tflops"]) * TFLOPS, cpu_cores=int(fig.get("cpu_cores", 1)),
        gemm_points=_points(fig.get("gemm") or (), gemm_storage),
        cpu_gemm_points=_points(fig.get("cpu_gemm") or (), gemm_storage),
        cpu_attention_bw=float(fig["cpu_attention_gbps"]) * GB if fig.get("cpu_attention_gbps") else None,
        op_overhead_s=float(fig.get("op_overhead_us", 0.0)) * 1e-6,
        host_step_s=float(fig.get("host_step_us", 0.0)) * 1e-6,
        host_seq_s=float(fig.get("host_seq_us", 0.0)) * 1e-6,
        host_token_s=float(fig.get("host_token_us", 0.0)) * 1e-6,
        host_logit_s=float(fig.get("host_logit_ns", 0.0)) * 1e-9,
        disk_bw=disk_read_gbps(fig) * GB,
        layer_ops_points=tuple(
            LayerOpsPoint(str(r["layout"]), int(r["tokens"]), float(r["pre_attention_us"]) * 1e-6,
                          float(r["post_attention_us"]) * 1e-6) for r in fig.get("layer_ops") or ()),
        prefill_attention_points=tuple(
            PrefillAttentionPoint(str(r["layout"]), int(r["prompt"]), float(r["us_per_prompt"]) * 1e-6)
            for r in fig.get("prefill_attention") or ()),
        decode_attention_points=tuple(
            DecodeAttentionPoint(str(r["layout"]), int(r["batch"]), float(r["us_per_call"]) * 1e-6)
            for r in fig.get("decode_attention") or ()),
        moe_ffn_points=tuple(
            MoeFfnPoint(str(r["layout"]), int(r["tokens"]), float(r["us_per_call"]) * 1e-6)
            for r in fig.get("moe_ffn") or ()),
        engine_factors=tuple(
            EngineFactors(str(r["layout"]), **{c: float(r.get(c, 1.0)) for c in ENGINE_COMPONENTS})
            for r in fig.get(CALIBRATION_KEY) or ()),
        notes=str(fig.get("attention_kernel", "")),
    )


def disk_read_gbps(fig: Mapping[str, Any]) -> float:
    """The disk rate the model uses: the median of the rates the disk tier's reader achieved
    in recent generate jobs (`disk_read_gbps_runs`, learnt as they run), else the profiler's
    back-to-back sweep (`disk_read_gbps`), else a default.

    Learnt rates come first because a sweep does not describe the reads of a run on every
    machine: on the CI's virtual disk the sweep reads 1.1-1.7 GB/s and the same reads spread
    through a run 1.9-2.1 GB/s (docs/benchmarks.md, disk tier)."""
    runs = [float(x) for x in fig.get("disk_read_gbps_runs") or () if x]
    if runs:
        return statistics.median(runs)
    return float(fig.get("disk_read_gbps") or DEFAULT_DISK_READ_GBPS)


def gemm_storage_of(row: Mapping[str, Any]) -> Optional[str]:
    """The packed storage a profiled GEMM row was measured in (None: its dtype's)."""
    return row.get("storage") or None


def _points(rows, storage: Optional[str] = None) -> tuple[GemmPoint, ...]:
    """The GEMM points measured in `storage`; a profile with none (one written before storages
    were tagged, or a hand-made one) gives its untagged points, the dtype's, as it always did,
    rather than none (which would price every GEMM at the compute roof)."""
    rows = list(rows)
    chosen = [r for r in rows if gemm_storage_of(r) == storage]
    if not chosen and storage is not None:
        chosen = [r for r in rows if gemm_storage_of(r) is None]
    return tuple(GemmPoint(int(r["inp"]), int(r["out"]), int(r["tokens"]), int(r["dtype_bytes"]),
                           float(r["gflops"]) * 1e9) for r in chosen)


def load_preset(name: str, preset_dir: Path | str = PRESET_DIR) -> HardwareSpec:
    """A datasheet preset from config/hardware/<name>.yaml (t4, l4, a40, l40, a100, h100, h200, cpu)."""
    path = Path(preset_dir) / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in Path(preset_dir).glob("*.yaml"))
        raise FileNotFoundError(f"no hardware preset {name!r}; known: {known}")
    data = yaml.safe_load(path.read_text())
    data.pop("defaults", None)
    return spec_from_figures(data)


def load_profile(path: Path | str) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or "device_tflops" not in data:
        raise ValueError(f"{path} is not a hardware profile (no device_tflops)")
    return data


def machine_fingerprint() -> str:
    """Short hash of what decides the measured rates: CPU model, usable cores, memory size,
    torch version, accelerator name and whether the Cython attention kernel is built.

    Read from package metadata and /proc, not by importing torch or the kernels, so the
    performance model stays importable (and fast) without them."""
    cpu_model = cpuinfo_field("model name") or platform.processor()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem_gb = round(total_memory_bytes() / GB)
    parts = [cpu_model, str(cores), str(mem_gb), platform.machine()]
    try:
        parts.append(importlib.metadata.version("torch"))
        parts.append(gpu_name())
    except importlib.metadata.PackageNotFoundError:
        parts.append("no-torch")
    parts.append(f"cython={cython_kernel_built()}")
    # GEMM rates are measured on the packed kernels when they are built (the engine's default):
    # a rebuild that adds an ISA path (or changes a kernel) and a forced build (MOE_BATCH_ISA)
    # measure other kernels, so neither reuses the profile (a checkout built in another folder
    # measures once too: the extension embeds its build path)
    parts.append(f"packed={kernel_digest(PACKED_KERNEL_NAME)}")
    parts.append(f"isa={os.environ.get('MOE_BATCH_ISA') or 'cpuid'}")
    # The engine's steps run under a tuned malloc (moe_engine/host_alloc.py); small steps' times
    # depend on it, so a profile measured under other settings is not reused.
    parts.append(f"malloc={allocator_fingerprint()}")
    # How the profiler measures: a profile taken by an older method is not reused.
    parts.append(f"method={PROFILE_METHOD}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def kernel_built(name: str) -> bool:
    """Whether a compiled kernel extension exists, looked up as a file: find_spec would import
    its package, and the performance model imports no kernel code."""
    return any((CYTHON_KERNEL_DIR / f"{name}{suffix}").exists()
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def kernel_digest(name: str) -> str:
    """A short hash of a compiled kernel extension's file ("none" when it is not built)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = CYTHON_KERNEL_DIR / f"{name}{suffix}"
        if path.exists():
            return hashlib.sha1(path.read_bytes()).hexdigest()[:12]
    return "none"


def cython_kernel_built() -> bool:
    """Whether the compiled attention kernel exists."""
    return kernel_built(CYTHON_KERNEL_NAME)


def gpu_name() -> str:
    """The first NVIDIA GPU's model name from the driver's /proc files, else "no-cuda"."""
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            continue
    return "no-cuda"


def total_memory_bytes() -> float:
    """Physical memory of this machine in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def cached_profile_path(cache_dir: Path | str) -> Path:
    return Path(cache_dir) / f"{machine_fingerprint()}.yaml"


def gemm_shapes(m: ModelSpec) -> list[tuple[int, int]]:
    """(in_features, out_features) of every weight matrix a decode step multiplies by (gate and
    up projections fused into one h -> 2*h_i GEMM, as the engine stores them)."""
    shapes = [(m.hidden_size, m.qkv_out_features), (m.num_heads * m.v_head_dim, m.hidden_size),
              (m.hidden_size, m.num_experts), (m.hidden_size, 2 * m.intermediate_size),
              (m.intermediate_size, m.hidden_size), (m.hidden_size, m.vocab_size)]
    if m.shared_expert_intermediate_size:
        s = m.shared_expert_intermediate_size
        shapes += [(m.hidden_size, 2 * s), (s, m.hidden_size)]
    if m.num_dense_layers and m.dense_intermediate_size:
        d = m.dense_intermediate_size
        shapes += [(m.hidden_size, 2 * d), (d, m.hidden_size)]
    if m.mla is not None:  # q_b_proj and the per-head latent maps (W_UK, W_UV)
        a = m.mla
        shapes += [(a.q_lora_rank, m.q_size)] if a.q_lora_rank else []
        shapes += [(a.qk_nope_head_dim, a.kv_lora_rank), (a.kv_lora_rank, a.v_head_dim)]
    return list(dict.fromkeys(shapes))


def layer_ops_profiled(m: ModelSpec) -> bool:
    """Whether the profiler times the model's element-wise layer work and prefill and decode
    attention (`layer_layout` points, LAYOUT_KEYS): not for MLA, whose latent projections are per-head GEMMs the
    model counts by themselves; its layers keep the launch counts."""
    return m.mla is None


# The per-layout figures of a profile, measured together (profile_hardware.measure_layers).
LAYOUT_KEYS = ("layer_ops", "prefill_attention", "decode_attention", "moe_ffn")


def layouts_profiled(data: Mapping[str, Any]) -> set[str]:
    """Layer layouts a profile has every kind of per-layout point of (LAYOUT_KEYS)."""
    sets = [{r["layout"] for r in data.get(key) or ()} for key in LAYOUT_KEYS]
    return set.intersection(*sets)


def layouts_missing(data: Mapping[str, Any], models: Sequence[ModelSpec]) -> list[ModelSpec]:
    """The models whose layer layout a profile lacks (profiled ones only, once per layout)."""
    have = layouts_profiled(data)
    missing = {layer_layout(m): m for m in models if layer_ops_profiled(m) and layer_layout(m) not in have}
    return list(missing.values())


def gemms_covered(data: Mapping[str, Any], models: Sequence[ModelSpec]) -> bool:
    """Whether a profile has the engine-loop figures, the disk tier's read bandwidth and the
    GEMM rates of each model's weight shapes in its dtype and weight storage."""
    # a CUDA machine's profile keeps the packed kernels' rows in cpu_gemm, the device's in gemm
    rows = [*(data.get("gemm") or ()), *(data.get("cpu_gemm") or ())]
    have = {(r["inp"], r["out"], r["dtype_bytes"], gemm_storage_of(r)) for r in rows}
    return (all(k in data for k in HOST_KEYS)
            and all((i, o, m.dtype_bytes, m.weight_storage) in have
                    for m in models for i, o in gemm_shapes(m)))


# The in-run factors per layout (EngineFactors), measured by running the engine on a checkpoint.
CALIBRATION_KEY = "engine_calibration"


# The calibration run holds every weight in host memory: only models within this share of it.
CALIBRATION_MEMORY_SHARE = 0.5


def calibration_applies(m: ModelSpec, host_memory: float) -> bool:
    """Whether the profiler runs the engine on the model to measure its in-run factors: for a
    profiled layout (`layer_ops_profiled`), in whatever storage the model holds its weights
    (the run is configured to hold the same: profile_engine.engine_knobs), whose weights fit
    in CALIBRATION_MEMORY_SHARE of `host_memory` bytes (the run keeps them all resident; a
    model for the disk tier would not fit); other models keep the micro-benchmarks' figures
    (factor 1). Until the run held what the model prices, held storages (medium's, quantized
    experts) kept factor 1, and the tiny model's medium runs reported 53-80% over the engine."""
    return layer_ops_profiled(m) and m.total_bytes <= CALIBRATION_MEMORY_SHARE * host_memory


def profile_host_memory(data: Mapping[str, Any]) -> float:
    """The host memory in bytes a profile was measured with (this machine's when it has none)."""
    return float(data.get("host_memory_gb") or total_memory_bytes() / GB) * GB


# The calibration run's method, written into each calibration row ("method"; rows without one
# are method 1): a row measured, refused or failed under an older method is measured again,
# once, since what the run measures has changed; under the current method it stands (the job
# itself meets the same checkpoint). 2: the run holds the storage the model prices
# (profile_engine.engine_knobs), where method 1 ran a default engine, which refused every held
# storage (medium's, quantized experts, ...) and left them at factor 1. 3: host is the run's
# wall time less its dense, attention, ffn and head parts (admission, results and whatever
# else the loop does besides sampling and scheduling: 4-5% of the default run's 1.4 s, which
# no part priced), where method 2 measured sampling and scheduling alone.
CALIBRATION_METHOD = 3


def calibration_outdated(row: Mapping[str, Any]) -> bool:
    """Whether a calibration row was measured, refused or failed under an older
    CALIBRATION_METHOD."""
    return int(row.get("method", 1)) < CALIBRATION_METHOD


def engine_calibrated(data: Mapping[str, Any], m: ModelSpec) -> bool:
    """Whether a profile has the in-run factors of m's layout (a row not calibration_outdated),
    or m gets none (a CUDA machine's profile: the run calibrates the CPU backend's parts; not
    yet measured on the device's)."""
    return (data.get("device", "cpu") != "cpu" or not calibration_applies(m, profile_host_memory(data))
            or any(r["layout"] == layer_layout(m) and not calibration_outdated(r)
                   for r in data.get(CALIBRATION_KEY) or ()))


def profile_covers(data: Mapping[str, Any], models: Sequence[ModelSpec]) -> bool:
    """Whether a profile has every figure the models need: `gemms_covered`, and every kind of
    per-layout point (LAYOUT_KEYS) of each model's layer layout."""
    return gemms_covered(data, models) and not layouts_missing(data, models)


def profile_mode_serves(data: Mapping[str, Any], fast: bool) -> bool:
    """Whether a profile was measured finely enough for a run: one taken in the profiler's fast
    mode (MOE_BATCH_PROFILE=fast) serves only fast runs; a run without it measures the machine
    fully once, instead of keeping the fast figures."""
    return fast or data.get("mode") != "fast"


def profile_serves(data: Mapping[str, Any], models: Sequence[ModelSpec], fast: bool) -> bool:
    """Whether a cached profile can be used as it is: it covers the models and its mode serves
    the run (profile_mode_serves)."""
    return profile_covers(data, models) and profile_mode_serves(data, fast)


class ProfileMissing(FileNotFoundError):
    """hardware.profile=auto and the machine's cached profile is absent or lacks the model."""


def config_figures(hw) -> dict[str, Any]:
    """A HardwareConfig's figures in spec_from_figures' keys: what a profile's figures replace
    and what they fall back on where a profile lacks one."""
    figures = {k: getattr(hw, k) for k in ("name", "device", "device_memory_gb", "host_memory_gb", "link_gbps",
                                           "device_bw_gbps", "cpu_bw_gbps", "device_tflops", "cpu_tflops",
                                           "cpu_cores", "disk_read_gbps")}
    figures["device"] = getattr(figures["device"], "value", figures["device"])
    return figures


def hardware_spec_from_config(hw, cache_dir: Path | str, model: ModelSpec | None = None) -> HardwareSpec:
    """HardwareSpec for a HardwareConfig (the `hardware` group of the Hydra config).

    profile None: the config's figures. profile "auto": the profile cached under
    cache_dir/<machine fingerprint>.yaml; raises ProfileMissing if it is absent or (given `model`)
    lacks that model's figures: measuring is the profiler's job (the policy stage runs it first),
    never the performance model's. Any other value: a path to a profile YAML. Profiled figures
    replace the config's; capacities the profile did not measure (device memory on a CUDA machine
    is measured, host memory always) come from the profile too.
    """
    figures = config_figures(hw)
    profile = getattr(hw, "profile", None)
    if profile is None:
        return spec_from_figures(figures)
    if profile == "auto":
        path = cached_profile_path(cache_dir)
        data = load_profile(path) if path.exists() else None
        if data is None or not profile_covers(data, [model] if model is not None else []):
            raise ProfileMissing(
                f"no hardware profile of this machine{' for ' + model.name if model else ''} at {path}; "
                f"measure it with: python -m moe_engine.tools.profile_hardware --ensure --out {path}"
                + (" --model <checkpoint dir>" if model else ""))
    else:
        data = load_profile(profile)
    merged = dict(figures)
    merged.update(data)
    return spec_from_figures(merged, model.weight_storage if model is not None else None)
