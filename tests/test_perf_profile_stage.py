"""The policy stage, not the performance model, runs the profiler when the machine's cached
profile is missing or lacks the model; a covering cache is used as it is."""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import yaml

from moe_engine.perf import ModelSpec
from moe_engine.perf.hardware import CALIBRATION_KEY, CALIBRATION_METHOD, HOST_KEYS, cached_profile_path, gemm_shapes
from moe_engine.perf.specs import ENGINE_COMPONENTS, layer_layout
from moe_engine.stages import policy as stage


def _model(tmp_path):
    from moe_engine.tools.presets import PRESETS, hf_config

    model_dir = tmp_path / "tiny-mixtral"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config(PRESETS["tiny-mixtral"])))
    return model_dir, ModelSpec.from_hf_config(model_dir, dtype="bfloat16")


def test_missing_profile_runs_the_profiler_for_the_checkpoint(tmp_path, monkeypatch):
    model_dir, model = _model(tmp_path)
    monkeypatch.delenv("MOE_BATCH_PROFILE", raising=False)  # the suite's conftest sets it
    calls = []
    monkeypatch.setattr(stage, "hardware_cache_dir", lambda: tmp_path / "hw")
    monkeypatch.setattr(stage, "subprocess", SimpleNamespace(run=lambda cmd, check: calls.append(cmd)))
    stage.ensure_machine_profile(model, model_dir, "bfloat16")
    path = cached_profile_path(tmp_path / "hw")
    # the held experts' storage is always named: here the model dtype's (the checkpoint's own)
    assert calls == [[sys.executable, "-m", "moe_engine.tools.profile_hardware", "--ensure", "--out", str(path),
                      "--model", str(model_dir), "--dtype", "bfloat16", "--expert-storage", "dtype"]]


def test_moe_batch_profile_fast_asks_the_profiler_for_its_fast_mode(tmp_path, monkeypatch):
    model_dir, model = _model(tmp_path)
    calls = []
    monkeypatch.setattr(stage, "hardware_cache_dir", lambda: tmp_path / "hw")
    monkeypatch.setattr(stage, "subprocess", SimpleNamespace(run=lambda cmd, check: calls.append(cmd)))
    for value, fast in (("fast", True), ("full", False), ("", False)):
        monkeypatch.setenv("MOE_BATCH_PROFILE", value)
        stage.ensure_machine_profile(model, model_dir, "auto")
        assert ("--fast" in calls.pop()) == fast, value
    monkeypatch.setenv("MOE_BATCH_PROFILE", "quick")
    with pytest.raises(ValueError, match="MOE_BATCH_PROFILE='quick'"):
        stage.ensure_machine_profile(model, model_dir, "auto")


def _gemm_profile(model) -> dict:
    """A profile with every GEMM shape and engine-loop figure of `model`, no layer layout."""
    rows = [{"inp": i, "out": o, "tokens": 1, "dtype_bytes": 2, "gflops": 1.0} for i, o in gemm_shapes(model)]
    return {"device_tflops": 1.0, "gemm": rows, **{k: 1.0 for k in HOST_KEYS}}


def _covering_profile(model) -> dict:
    """_gemm_profile with every per-layout point of the model's layer layout: it covers it."""
    layout = layer_layout(model)
    return {
        **_gemm_profile(model),
        "layer_ops": [{"layout": layout, "tokens": 1, "pre_attention_us": 1.0, "post_attention_us": 1.0}],
        "prefill_attention": [{"layout": layout, "prompt": 8, "us_per_prompt": 1.0}],
        "decode_attention": [{"layout": layout, "batch": 1, "context": 16, "us_per_call": 1.0}],
        "moe_ffn": [{"layout": layout, "tokens": 1, "us_per_call": 1.0}],
        CALIBRATION_KEY: [{"layout": layout, **dict.fromkeys(ENGINE_COMPONENTS, 1.0),
                             "method": CALIBRATION_METHOD}]}


def test_covering_profile_is_used_without_measuring(tmp_path, monkeypatch):
    model_dir, model = _model(tmp_path)
    path = cached_profile_path(tmp_path / "hw")
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(_covering_profile(model)))
    monkeypatch.setattr(stage, "hardware_cache_dir", lambda: tmp_path / "hw")
    monkeypatch.setattr(stage, "subprocess", None)  # any measuring would fail
    stage.ensure_machine_profile(model, model_dir, "auto")


def test_profile_without_the_layer_layout_runs_the_profiler(tmp_path, monkeypatch):
    """A profile from before the element-wise and prefill-attention points covers the GEMMs
    but not the model: the profiler is run to add them."""
    model_dir, model = _model(tmp_path)
    path = cached_profile_path(tmp_path / "hw")
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(_gemm_profile(model)))
    calls = []
    monkeypatch.setattr(stage, "hardware_cache_dir", lambda: tmp_path / "hw")
    monkeypatch.setattr(stage, "subprocess", SimpleNamespace(run=lambda cmd, check: calls.append(cmd)))
    stage.ensure_machine_profile(model, model_dir, "auto")
    assert len(calls) == 1 and "--ensure" in calls[0]


def test_profile_without_the_in_run_factors_runs_the_profiler(tmp_path, monkeypatch):
    """A profile with every micro-benchmark of the model but not the engine's in-run factors
    of its layout: the profiler is run on the checkpoint to measure them."""
    model_dir, model = _model(tmp_path)
    path = cached_profile_path(tmp_path / "hw")
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({k: v for k, v in _covering_profile(model).items() if k != CALIBRATION_KEY}))
    calls = []
    monkeypatch.setattr(stage, "hardware_cache_dir", lambda: tmp_path / "hw")
    monkeypatch.setattr(stage, "subprocess", SimpleNamespace(run=lambda cmd, check: calls.append(cmd)))
    stage.ensure_machine_profile(model, model_dir, "auto")
    assert len(calls) == 1 and "--ensure" in calls[0] and str(model_dir) in calls[0]


def test_a_model_that_gets_no_in_run_factors_runs_no_profiler(tmp_path, monkeypatch):
    """A CUDA machine's profile, or a model held quantized, has no factors to measure: a
    profile without them is used as it is."""
    model_dir, model = _model(tmp_path)
    path = cached_profile_path(tmp_path / "hw")
    path.parent.mkdir()
    bare = {k: v for k, v in _covering_profile(model).items() if k != CALIBRATION_KEY}
    monkeypatch.setattr(stage, "hardware_cache_dir", lambda: tmp_path / "hw")
    monkeypatch.setattr(stage, "subprocess", None)  # any measuring would fail
    path.write_text(yaml.safe_dump({**bare, "device": "cuda"}))
    stage.ensure_machine_profile(model, model_dir, "auto")


def test_a_fast_profile_serves_fast_runs_and_is_measured_again_for_a_full_one(tmp_path, monkeypatch):
    """MOE_BATCH_PROFILE=fast leaves a fast profile in the cache; a run without it measures
    the machine fully once rather than keep the fast figures."""
    model_dir, model = _model(tmp_path)
    path = cached_profile_path(tmp_path / "hw")
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({**_covering_profile(model), "mode": "fast"}))
    calls = []
    monkeypatch.setattr(stage, "hardware_cache_dir", lambda: tmp_path / "hw")
    monkeypatch.setattr(stage, "subprocess", SimpleNamespace(run=lambda cmd, check: calls.append(cmd)))
    monkeypatch.setenv("MOE_BATCH_PROFILE", "fast")
    stage.ensure_machine_profile(model, model_dir, "auto")
    assert calls == []
    monkeypatch.delenv("MOE_BATCH_PROFILE")
    stage.ensure_machine_profile(model, model_dir, "auto")
    assert len(calls) == 1 and "--ensure" in calls[0] and "--fast" not in calls[0]
