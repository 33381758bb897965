"""The engine's offload knobs (engine.resident_ratio, cpu_experts, emulated link, ...) reach the
offload pipeline when the engine is built from its config, and leave the tokens unchanged."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from moe_engine.config import EngineConfig
from moe_engine.engine.llm_engine import LLMEngine
from moe_engine.offload.build import offload_settings
from moe_engine.engine.request import Request, SamplingParams
from moe_engine.offload.routing import PROFILE_NAME, find_profile

CONFIG = EngineConfig(threads=2, kv_cache_gb=0.02, num_micro_batches=2)
PROMPTS = ["Explain how a mixture of experts layer routes tokens.", "hi",
           "List three uses of a paged key value cache.", "Why is the sky blue?"]


def _tokens(engine) -> dict[str, list[int]]:
    requests = [Request(f"r{i}", prompt=p, sampling=SamplingParams(max_new_tokens=8))
                for i, p in enumerate(PROMPTS)]
    results = list(engine.generate(requests))
    assert all(r.status == "ok" for r in results), [(r.status, r.error) for r in results]
    return {r.request_id: r.token_ids for r in results}


@pytest.fixture(scope="module")
def reference(tiny_mixtral_dir):
    engine = LLMEngine(tiny_mixtral_dir, CONFIG, dtype="float32")
    assert engine.offload is None  # fully resident on the CPU: the plain runner
    return _tokens(engine)


def test_fully_resident_cpu_run_keeps_the_plain_runner():
    assert offload_settings(CONFIG) is None
    assert offload_settings(dataclasses.replace(CONFIG, offload_pipeline=True)) is not None
    assert offload_settings(dataclasses.replace(CONFIG, emulated_link_gbps=5.0)) is not None
    s = offload_settings(dataclasses.replace(CONFIG, resident_ratio=0.25, packet_mb=0.5,
                                             device_memory_gb=2.0, group_ffn="micro_batch"))
    assert (s.resident_ratio, s.packet_bytes, s.device_memory_bytes, s.group_ffn) == (
        0.25, 512 << 10, 2_000_000_000, "micro_batch")


def test_resident_ratio_from_config_streams_experts_with_identical_tokens(tiny_mixtral_dir,
                                                                          tmp_path, reference):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_mixtral_dir, model_dir)
    assert find_profile(model_dir) is None
    config = dataclasses.replace(CONFIG, resident_ratio=0.5, cpu_experts=False, packet_mb=0.05)
    with LLMEngine(model_dir, config, dtype="float32") as engine:
        # No profile yet: the engine recorded one on the bundled prompts and saved it.
        assert (model_dir / PROFILE_NAME).exists()
        profile = find_profile(model_dir)
        assert sum(profile.counts[0]) > 0
        pager = engine.offload.pager
        for layer in range(profile.num_layers):
            assert pager.resident[layer] == frozenset(profile.ranking(layer)[:4])
        assert _tokens(engine) == reference
        stats = engine.stats
        assert stats.bytes_moved > 0 and stats.offload["experts_streamed"] > 0
        assert stats.offload["experts_on_cpu"] == 0
        # Stats are per generate call, not cumulative over the engine's life.
        first = stats.bytes_moved
        _tokens(engine)
        assert engine.stats.bytes_moved == first
    assert engine.offload is None


def test_cpu_experts_from_config_run_streamed_experts_on_the_cpu(tiny_mixtral_dir, reference):
    config = dataclasses.replace(CONFIG, resident_ratio=0.0, group_ffn="micro_batch")
    with LLMEngine(tiny_mixtral_dir, config, dtype="float32") as engine:
        assert _tokens(engine) == reference
        assert engine.stats.offload["experts_on_cpu"] > 0


def test_emulated_link_from_config_moves_bytes_and_keeps_tokens(tiny_mixtral_dir, reference):
    config = dataclasses.replace(CONFIG, resident_ratio=0.0, cpu_experts=False,
                                 emulated_link_gbps=20.0)
    with LLMEngine(tiny_mixtral_dir, config, dtype="float32") as engine:
        assert engine.offload.backend.name == "cpu"
        assert _tokens(engine) == reference
        # Every expert of every layer is streamed at least once per step.
        assert engine.stats.bytes_moved >= engine.offload.pager.expert_bytes * 8 * 2


def test_device_budget_too_small_fails_at_construction(tiny_mixtral_dir):
    from moe_engine.offload.pager import DeviceBudgetError

    config = dataclasses.replace(CONFIG, offload_pipeline=True, device_memory_gb=1e-6)
    with pytest.raises(DeviceBudgetError, match="budget"):
        LLMEngine(tiny_mixtral_dir, config, dtype="float32")


@pytest.mark.gpu
def test_cuda_backend_from_config_streams_experts(tiny_mixtral_dir):
    config = dataclasses.replace(CONFIG, backend="cuda", resident_ratio=0.5, cpu_experts=False)
    with LLMEngine(tiny_mixtral_dir, config, dtype="float32") as engine:
        results = _tokens(engine)
        assert all(len(t) == 8 for t in results.values())
        assert engine.stats.bytes_moved > 0


def test_fully_resident_pipeline_measures_no_expert_latency(tiny_mixtral_dir, reference,
                                                            monkeypatch):
    """Only streamed experts are placed by latency, so r_w = 1 (and the calibration run that
    records a routing profile) skips the seconds-long measurement."""
    import moe_engine.offload.build as offload
    from moe_engine.offload.placement import ExpertPlacer

    def never(*args, **kwargs):
        raise AssertionError("expert latency measured for a fully resident pipeline")

    monkeypatch.setattr(offload, "measure_expert_profile", never)
    with LLMEngine(tiny_mixtral_dir, dataclasses.replace(CONFIG, offload_pipeline=True),
                   dtype="float32") as engine:
        assert engine.offload.placer.profile is None
        assert _tokens(engine) == reference
    with pytest.raises(ValueError, match="latency profile"):
        ExpertPlacer(None).decide(4, resident=False, bytes_to_move=1)


def test_profile_is_looked_up_recorded_on_the_plain_runner_and_saved_once(tiny_mixtral_dir,
                                                                          tmp_path, monkeypatch):
    import moe_engine.engine.calibrate as calibrate

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_mixtral_dir, model_dir)
    # Earlier engines with r_w < 1 on the shared fixture may have saved one there.
    (model_dir / PROFILE_NAME).unlink(missing_ok=True)
    calls = {"find": 0, "save": 0, "runners": []}
    real_find, real_save, real_record = (calibrate.find_profile, calibrate.save_routing_profile,
                                         calibrate.record_routing)

    def find(*args, **kwargs):
        calls["find"] += 1
        return real_find(*args, **kwargs)

    def save(*args, **kwargs):
        calls["save"] += 1
        return real_save(*args, **kwargs)

    def record(engine, requests):
        calls["runners"].append(type(engine.runner).__name__)
        return real_record(engine, requests)

    monkeypatch.setattr(calibrate, "find_profile", find)
    monkeypatch.setattr(calibrate, "save_routing_profile", save)
    monkeypatch.setattr(calibrate, "record_routing", record)
    config = dataclasses.replace(CONFIG, resident_ratio=0.5)
    with LLMEngine(model_dir, config, dtype="float32") as engine:
        assert calls == {"find": 1, "save": 1, "runners": ["ModelRunner"]}
        assert engine.runner is engine.offload
        assert engine.offload.runner.routing_observer is None  # recording ended with calibration
        assert engine.offload.pager.profile == find_profile(model_dir)
    # The saved profile is found next time: nothing is recorded or saved again.
    with LLMEngine(model_dir, config, dtype="float32"):
        assert calls == {"find": 2, "save": 1, "runners": ["ModelRunner"]}
