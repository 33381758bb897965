"""Performance model and policy search (DESIGN.md section 5).

Pure functions over frozen dataclasses: `specs` (HardwareSpec, WorkloadSpec; ModelSpec is the
engine's, from model/spec.py), `roofline` (operator costs), `cost` (per-layer decode latency,
prefill, memory), `search` (policy search), `lens` (MoE-Lens stage 1/2, Klotski's planner),
`hardware` (specs from config, presets and profile YAMLs), `plot`. Nothing here imports torch,
the engine or the tools: the profiler (`python -m moe_engine.tools.profile_hardware`) measures,
this package only reads what it wrote (tests/test_perf_purity.py).
"""
from .hardware import cached_profile_path, hardware_spec_from_config, load_preset, machine_fingerprint
from .lens import (Stage1Bound, Stage2Prediction, kv_bytes_to_saturate, klotski_min_batches,
                   overlap_capacity_gain, pme, stage1_bound, stage2_throughput, tokens_to_saturate,
                   tokens_to_saturate_exact)
from .cost import Policy, Prediction, decode_step_times, memory_use, predict, prefill_time
from .plot import plot_roofline
from .search import NoFeasiblePolicy, PolicyResult, apply_policy, choose_policy
from .specs import HardwareSpec, ModelSpec, UnsupportedModelError, WorkloadSpec, workload_spec_from_lengths

__all__ = [
    "HardwareSpec", "ModelSpec", "WorkloadSpec", "UnsupportedModelError", "workload_spec_from_lengths",
    "hardware_spec_from_config", "load_preset", "machine_fingerprint", "cached_profile_path",
    "Policy", "Prediction", "PolicyResult", "NoFeasiblePolicy", "choose_policy", "apply_policy",
    "predict", "prefill_time", "decode_step_times", "memory_use", "plot_roofline",
    "pme", "stage1_bound", "stage2_throughput", "tokens_to_saturate", "tokens_to_saturate_exact",
    "kv_bytes_to_saturate", "overlap_capacity_gain", "klotski_min_batches", "Stage1Bound", "Stage2Prediction",
]
