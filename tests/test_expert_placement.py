"""Twiddler's CPU-or-device rule at its thresholds, the latency curves behind it, and that a
real pipeline step places every expert as the rule says for the tokens it actually routed."""
from __future__ import annotations

import pytest
import torch

from moe_engine.model.weights import ExpertWeights
from moe_engine.offload.backend import CpuBackend
from moe_engine.offload.placement import (ExpertLatencyProfile, ExpertPlacer, LatencyCurve, Place,
                                         crossover_tokens, measure_expert_profile, place_expert)

EXPERT_BYTES = 1_000_000


def _profile(link_bytes_per_s: float = 1e8) -> ExpertLatencyProfile:
    # CPU: 1 ms + 1 ms/token; device: 0.2 ms + 0.1 ms/token; transfer of one expert: 10 ms.
    return ExpertLatencyProfile(LatencyCurve.linear(1e-3, 1e-3), LatencyCurve.linear(2e-4, 1e-4),
                                link_bytes_per_s=link_bytes_per_s, expert_bytes=EXPERT_BYTES)


def test_latency_curve_interpolates_and_extrapolates():
    c = LatencyCurve((1, 10, 100), (1.0, 10.0, 40.0))
    assert c(1) == 1.0 and c(10) == 10.0
    assert c(55) == pytest.approx(25.0)
    assert c(200) == pytest.approx(40.0 + 100 * 30.0 / 90)  # past the last point: last slope
    assert c(0) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        LatencyCurve((4, 2), (1.0, 2.0))


def test_streamed_expert_switches_to_device_exactly_at_the_crossover():
    p = _profile()
    # 1e-3 + 1e-3 s > 1e-2 + 2e-4 + 1e-4 s  <=>  0.9e-3 s > 9.2e-3  <=>  s > 10.2 -> 11 tokens.
    assert crossover_tokens(p) == 11
    assert place_expert(10, False, EXPERT_BYTES, p) is Place.cpu
    assert place_expert(11, False, EXPERT_BYTES, p) is Place.device


def test_the_threshold_uses_only_the_bytes_still_to_move():
    p = _profile()
    # Half the pages landed: 5 ms left -> 0.9e-3 s > 4.2e-3 -> s > 4.67 -> 5 tokens.
    assert crossover_tokens(p, EXPERT_BYTES // 2) == 5
    assert place_expert(4, False, EXPERT_BYTES // 2, p) is Place.cpu
    assert place_expert(5, False, EXPERT_BYTES // 2, p) is Place.device
    # Fully landed: the device wins whenever its compute is faster.
    assert place_expert(1, False, 0, p) is Place.device


def test_resident_experts_stay_on_device_and_idle_experts_are_skipped():
    p = _profile()
    assert place_expert(1, True, 0, p) is Place.device
    assert place_expert(0, False, EXPERT_BYTES, p) is Place.skip
    assert place_expert(0, True, 0, p) is Place.skip


def test_a_slow_link_moves_the_threshold_and_can_rule_out_the_device():
    slow = _profile(link_bytes_per_s=1e7)  # 100 ms per expert: s > 99.2 / 0.9 = 110.2 -> 111
    assert crossover_tokens(slow) == 111
    equal = ExpertLatencyProfile(LatencyCurve.linear(0, 1e-3), LatencyCurve.linear(0, 1e-3),
                                 1e8, EXPERT_BYTES)
    assert crossover_tokens(equal) is None  # same silicon: streaming never pays
    assert place_expert(10_000, False, EXPERT_BYTES, equal) is Place.cpu


def test_placer_follows_the_policy_and_prefetches_from_the_crossover():
    p = _profile()
    placer = ExpertPlacer(p, ffn_on_device=True)
    assert not placer.should_prefetch(10.9) and placer.should_prefetch(11)
    assert placer.decide(30, False, EXPERT_BYTES) is Place.device
    cpu_ffn = ExpertPlacer(p, ffn_on_device=False)
    assert cpu_ffn.decide(30, True, 0) is Place.cpu
    assert not cpu_ffn.should_prefetch(1e6)


def test_profile_round_trips_through_json():
    p = _profile()
    assert ExpertLatencyProfile.from_json(p.to_json()) == p


@pytest.mark.timing  # times the expert at 1 and 512 tokens: a busy core can swap them
def test_measured_profile_has_growing_cpu_latency_and_a_real_link():
    backend = CpuBackend()
    try:
        w13, w2 = torch.randn(448, 128), torch.randn(128, 224)
        p = measure_expert_profile(backend, ExpertWeights(w13, w2), token_counts=(1, 64, 512),
                                   repeats=5)
        assert p.expert_bytes == w13.nbytes + w2.nbytes
        assert p.cpu(512) > p.cpu(1) > 0
        assert p.device(512) > 0
        assert p.link_bytes_per_s > 1e7  # a memcpy on this machine, not a placeholder
    finally:
        backend.close()


def test_pipeline_places_each_expert_as_the_rule_says(tiny_mixtral_dir):
    from moe_engine.config import EngineConfig
    from moe_engine.engine.llm_engine import LLMEngine
    from moe_engine.offload.build import OffloadSettings, build_offload_pipeline
    from moe_engine.engine.request import Request, SamplingParams

    engine = LLMEngine(tiny_mixtral_dir, EngineConfig(threads=2, kv_cache_gb=0.02,
                                                      num_micro_batches=2), dtype="float32")
    expert_bytes = sum(t.nbytes for t in (engine.runner.weights.layers[0].experts[0].w13,
                                          engine.runner.weights.layers[0].experts[0].w2))
    # Crossover at a few tokens: prefill steps stream most experts, decode steps keep some on
    # the CPU, so both branches are taken.
    latency = ExpertLatencyProfile(LatencyCurve.linear(0, 1e-3), LatencyCurve.linear(0, 1e-4),
                                   link_bytes_per_s=expert_bytes / 4e-3, expert_bytes=expert_bytes)
    pipe = build_offload_pipeline(engine.runner, OffloadSettings(resident_ratio=0.25),
                                  latency=latency)
    engine.runner = pipe
    seen = {Place.cpu: 0, Place.device: 0}
    decided = []

    def observe(_seqs, _logits):
        decided.extend(pipe.last_decisions)

    engine.logits_observer = observe
    prompts = ["Explain how a mixture of experts layer routes tokens.", "hi",
               "Why is the sky blue?", "a b c d e f g h i j k l m n o p"]
    list(engine.generate([Request(f"r{i}", prompt=p, sampling=SamplingParams(max_new_tokens=6))
                          for i, p in enumerate(prompts)]))
    assert decided
    for layer, e, tokens, to_move, place in decided:
        resident = pipe.pager.is_resident(layer, e)
        assert place is place_expert(tokens, resident, to_move, latency), (layer, e, tokens)
        seen[place] += 1
    assert seen[Place.cpu] > 0 and seen[Place.device] > 0
    assert pipe.totals.experts_on_cpu == seen[Place.cpu]
    pipe.close()
