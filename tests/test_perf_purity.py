"""The performance model is pure: importing and running it loads neither torch nor the engine,
the offload runtime, the tools (the profiler) nor the workflow stages."""
from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("torch", "moe_engine.engine", "moe_engine.offload", "moe_engine.tools", "moe_engine.stages",
             "moe_engine._kernels")

_PROBE = """
import sys
import moe_engine.perf as perf
from moe_engine.perf.hardware import cached_profile_path, machine_fingerprint
from moe_engine.perf.reference_models import reference_model
import moe_engine.model.spec

model = reference_model("olmoe-1b-7b")
result = perf.choose_policy(model, perf.load_preset("cpu"), perf.workload_spec_from_lengths([50, 80, 120], 16),
                            backend="cpu")
assert result.throughput_tok_s > 0
machine_fingerprint()
cached_profile_path("/nonexistent")
print("\\n".join(sorted(sys.modules)))
"""


def test_perf_runs_without_torch_engine_tools_or_stages():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout
    loaded = set(out.split())
    bad = sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
    assert not bad, f"the performance model imported {bad}"


def test_fingerprint_sees_the_built_kernel_as_the_engine_does():
    from moe_engine.model.paged_attention import HAS_CYTHON_KERNELS
    from moe_engine.perf.hardware import cython_kernel_built

    assert cython_kernel_built() == HAS_CYTHON_KERNELS


def test_auto_profile_without_a_cached_profile_asks_for_the_profiler(tmp_path):
    """Measuring is the profiler's job (the policy stage runs it): perf only reads the cache."""
    import pytest

    from moe_engine.config import HardwareConfig
    from moe_engine.perf.hardware import ProfileMissing, hardware_spec_from_config

    with pytest.raises(ProfileMissing, match="profile_hardware"):
        hardware_spec_from_config(HardwareConfig(profile="auto"), tmp_path)
