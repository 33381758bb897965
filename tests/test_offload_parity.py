"""The offloaded pipeline generates exactly the tokens of the non-offloaded engine, whatever is
resident, wherever attention and experts run, and however the FFN is grouped, for every
supported architecture (dense layers and shared experts stay resident)."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from moe_engine.tools.presets import PRESETS
from moe_engine.config import EngineConfig
from moe_engine.engine.llm_engine import LLMEngine
from moe_engine.model.spec import load_spec
from moe_engine.engine.calibrate import calibrate_routing
from moe_engine.offload.build import OffloadSettings, build_offload_pipeline
from moe_engine.engine.request import Request, SamplingParams
from moe_engine.offload.routing import PROFILE_NAME, RoutingProfile, find_profile

NEW_TOKENS = 10
PROMPTS = [
    "Explain how a mixture of experts layer routes tokens.",
    "hi",
    "Write a short story about a cat who learns to fly over the city at night.",
    "What is 2 + 2?",
    "List three uses of a paged key value cache in batch inference systems.",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "Why is the sky blue?",
]
CONFIG = EngineConfig(threads=2, kv_cache_gb=0.02, num_micro_batches=2)
TINY_PRESETS = sorted(p for p in PRESETS if p.startswith("tiny-"))  # one per architecture


def _requests():
    return [Request(f"r{i}", prompt=p, sampling=SamplingParams(max_new_tokens=NEW_TOKENS))
            for i, p in enumerate(PROMPTS)]


def _tokens(engine) -> dict[str, list[int]]:
    results = list(engine.generate(_requests()))
    # Rows that failed have no tokens: two failing runs must not compare equal.
    assert all(r.status == "ok" for r in results), [(r.status, r.error) for r in results]
    return {r.request_id: r.token_ids for r in results}


@pytest.fixture(scope="module", params=TINY_PRESETS)
def model_dir(request, builtin_dir):
    return builtin_dir(request.param)


@pytest.fixture(scope="module")
def reference(model_dir):
    return _tokens(LLMEngine(model_dir, CONFIG, dtype="float32"))


def _offloaded(model_dir, settings: OffloadSettings, **kwargs):
    # A GPU pipeline computes with torch GEMMs: its engine loads torch-layout weights.
    config = CONFIG if settings.backend == "cpu" else dataclasses.replace(CONFIG, gemm="torch")
    engine = LLMEngine(model_dir, config, dtype="float32")
    engine.runner = build_offload_pipeline(engine.runner, settings, routing=find_profile(model_dir),
                                           **kwargs)
    return engine


# Where attention runs depends on the architecture only through the cache: both places for
# Mixtral and for the latent cache of DeepSeek's MLA (read without a value cache on the device).
BOTH_PLACES = ("tiny-mixtral", "tiny-deepseek-v3", "tiny-deepseek-v2")
STREAMED_CASES = [(preset, ratio, on_device) for preset in TINY_PRESETS
                  for ratio in (1.0, 0.5, 0.0) for on_device in (False, True)
                  if preset in BOTH_PLACES or not on_device]


@pytest.mark.parametrize("model_dir,ratio,attention_on_device", STREAMED_CASES,
                         indirect=["model_dir"])
def test_streamed_experts_give_identical_tokens(model_dir, reference, ratio,
                                                attention_on_device):
    # cpu_experts=False: every non-resident expert crosses the (memcpy) link.
    settings = OffloadSettings(resident_ratio=ratio, attention_on_device=attention_on_device,
                               cpu_experts=False, packet_bytes=100_000)
    engine = _offloaded(model_dir, settings)
    assert _tokens(engine) == reference
    pipe = engine.runner
    if ratio == 1.0:
        assert pipe.totals.bytes_moved == 0 and pipe.totals.experts_streamed == 0
    else:
        assert pipe.totals.bytes_moved > 0 and pipe.totals.experts_on_cpu == 0
    if attention_on_device:
        assert pipe.totals.cpu_attention_time_s == 0
    else:
        assert pipe.totals.cpu_attention_time_s > 0
    pipe.close()


def test_experts_placed_on_the_cpu_give_identical_tokens(model_dir, reference):
    # On the CPU backend the measured profile keeps every streamed expert on the CPU.
    engine = _offloaded(model_dir, OffloadSettings(resident_ratio=0.25))
    assert _tokens(engine) == reference
    assert engine.runner.totals.experts_on_cpu > 0
    engine.runner.close()


def test_cpu_ffn_policy_and_per_micro_batch_grouping_give_identical_tokens(model_dir,
                                                                          reference):
    engine = _offloaded(model_dir, OffloadSettings(resident_ratio=0.5, ffn_on_device=False))
    assert _tokens(engine) == reference
    assert engine.runner.totals.experts_on_device == 0
    engine.runner.close()
    engine = _offloaded(model_dir, OffloadSettings(resident_ratio=0.0, cpu_experts=False,
                                                   group_ffn="micro_batch"))
    assert _tokens(engine) == reference
    engine.runner.close()


def test_calibrated_profile_is_saved_beside_the_model_and_drives_residency(model_dir,
                                                                         tmp_path, reference):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    profile = calibrate_routing(copy, _requests(), CONFIG, dtype="float32")
    assert (copy / PROFILE_NAME).exists()
    assert find_profile(copy) == profile
    # Every generated and prompt token was routed to top_k experts in every MoE layer; dense
    # layers route nothing and page nothing.
    spec = load_spec(copy)
    moe = [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]
    total = sum(profile.counts[moe[0]])
    assert total > 0 and all(sum(profile.counts[i]) == (total if i in moe else 0)
                             for i in range(spec.num_layers))
    engine = _offloaded(copy, OffloadSettings(resident_ratio=0.5, cpu_experts=False))
    pager = engine.runner.pager
    half = spec.num_experts // 2
    for layer in range(profile.num_layers):
        expected = profile.ranking(layer)[:half] if layer in moe else []
        assert pager.resident[layer] == frozenset(expected)
        assert layer in moe or not pager.streamed[layer]
    assert _tokens(engine) == reference
    engine.runner.close()


def test_read_only_model_dir_saves_the_profile_in_the_cache(tmp_path, monkeypatch):
    import moe_engine.offload.routing as rp

    model_dir = tmp_path / "ro-model"
    model_dir.mkdir()
    assert rp.profile_path(model_dir, tmp_path / "cache") == model_dir.resolve() / PROFILE_NAME
    # The check is os.access; root passes it even on a 0o555 dir, so answer as a normal user.
    monkeypatch.setattr(rp.os, "access", lambda path, mode: False)
    path = rp.profile_path(model_dir, tmp_path / "cache")
    assert path.is_relative_to(tmp_path / "cache") and path.name == PROFILE_NAME
    RoutingProfile.uniform(2, 8).save(path)
    assert rp.find_profile(model_dir, tmp_path / "cache") == RoutingProfile.uniform(2, 8)
    # A second model gets its own folder.
    other = tmp_path / "other"
    other.mkdir()
    assert rp.profile_path(other, tmp_path / "cache") != path


@pytest.fixture(scope="module")
def three_layer_reference(tiny_three_layer_dir):
    return _tokens(LLMEngine(tiny_three_layer_dir, CONFIG, dtype="float32"))


@pytest.mark.parametrize("fail_at", [2, 5])  # the 2nd and 5th attention call of the run
def test_a_failed_step_leaves_the_pipeline_usable(tiny_three_layer_dir, three_layer_reference,
                                                  fail_at, caplog):
    expected = three_layer_reference
    engine = _offloaded(tiny_three_layer_dir,
                        OffloadSettings(resident_ratio=0.0, cpu_experts=False))
    runner = engine.runner.runner
    attend = runner.attend
    calls = {"n": 0}

    def flaky(layer, mb, act):
        calls["n"] += 1
        if calls["n"] == fail_at:  # mid-step, with pages in flight and attention queued
            raise RuntimeError("injected attention failure")
        return attend(layer, mb, act)

    runner.attend = flaky
    with caplog.at_level("WARNING", logger="moe_engine.engine.llm_engine"):
        failed = list(engine.generate(_requests()))
    assert any(r.status == "error" and "injected" in r.error for r in failed)
    # The log keeps the traceback the rows' one-line error leaves out.
    assert any(rec.exc_info and "injected" in str(rec.exc_info[1]) for rec in caplog.records)
    runner.attend = attend
    assert _tokens(engine) == expected
    engine.runner.close()


@pytest.mark.gpu
@pytest.mark.parametrize("attention_on_device", [False, True])
def test_cuda_pipeline_matches_the_cpu_engine(model_dir, attention_on_device):
    """Same prefill logits as the CPU engine (GPU GEMMs round differently, so logits are
    compared with a tolerance rather than tokens over many steps)."""
    def first_logits(engine):
        seen = []
        engine.logits_observer = lambda seqs, logits: seen.append(
            {s.request_id: row for s, row in zip(seqs, logits.cpu())})
        list(engine.generate(_requests()))
        return seen[0]

    expected = first_logits(LLMEngine(model_dir, CONFIG, dtype="float32"))
    engine = _offloaded(model_dir, OffloadSettings(
        backend="cuda", resident_ratio=0.5, cpu_experts=False,
        attention_on_device=attention_on_device))
    got = first_logits(engine)
    assert engine.runner.totals.bytes_moved > 0
    for rid, row in expected.items():
        assert torch.allclose(got[rid], row, atol=1e-3, rtol=1e-3), rid
    engine.runner.close()


def test_a_gpu_pipeline_refuses_weights_packed_for_the_cpu_kernels(tiny_mixtral_dir):
    """The CPU kernels' panels mean nothing to torch GEMMs on a device apart from the host: the
    mistake is named before any backend starts (no CUDA needed to see it)."""
    from moe_engine.model import packed

    if not packed.HAS_PACKED_KERNELS:
        pytest.skip("kernels not built")
    engine = LLMEngine(tiny_mixtral_dir, CONFIG, dtype="float32")
    with pytest.raises(ValueError, match="engine.backend=cuda.*packed for the CPU kernels"):
        build_offload_pipeline(engine.runner, OffloadSettings(backend="cuda", resident_ratio=0.5))
