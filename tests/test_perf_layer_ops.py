"""The profiled element-wise layer work and prefill attention in the performance model: they
replace the launch counts for the layout they were measured on, and only there."""
from __future__ import annotations

import dataclasses

import pytest

from moe_engine.perf import ModelSpec, Policy, load_preset, workload_spec_from_lengths
from moe_engine.perf.cost import decode_step_times, prefill_time
from moe_engine.perf.hardware import spec_from_figures
from moe_engine.perf.roofline import (cpu_attention_time, cpu_processor, device_processor, o_proj_router_time,
                                      pre_attention_time, prefill_attention_time)
from moe_engine.perf.specs import DecodeAttentionPoint, LayerOpsPoint, PrefillAttentionPoint, layer_layout
from moe_engine.tools.presets import PRESETS, hf_config


def _spec(preset: str, **overrides) -> ModelSpec:
    return ModelSpec.from_hf_config({**hf_config(PRESETS[preset]), **overrides})


TINY = _spec("tiny-mixtral")


def _ops(layout: str) -> tuple[LayerOpsPoint, ...]:
    # pre: 50 us + 1 us/token, post: 20 us + 0.5 us/token (exactly affine: interpolation is exact)
    return tuple(LayerOpsPoint(layout, n, 50e-6 + 1e-6 * n, 20e-6 + 0.5e-6 * n) for n in (1, 64, 1024))


def _prefill(layout: str, per_prompt: float) -> tuple[PrefillAttentionPoint, ...]:
    return tuple(PrefillAttentionPoint(layout, p, per_prompt) for p in (8, 32, 128, 512, 1024))


def _cpu(**fields):
    return dataclasses.replace(load_preset("cpu"), op_overhead_s=2e-6, **fields)


def test_layer_layout_ignores_the_name_and_separates_what_changes_the_work():
    assert layer_layout(TINY) == layer_layout(dataclasses.replace(TINY, name="other-checkpoint"))
    assert layer_layout(TINY) != layer_layout(_spec("tiny-mixtral", hidden_size=256))
    assert layer_layout(TINY) != layer_layout(dataclasses.replace(TINY, qk_norm="head"))
    assert layer_layout(TINY) != layer_layout(dataclasses.replace(TINY, router_scoring="sigmoid"))
    assert layer_layout(TINY) != layer_layout(dataclasses.replace(TINY, torch_dtype="bfloat16"))
    # the routed experts' call (moe_ffn points) depends on their width and storage too
    assert layer_layout(TINY) != layer_layout(_spec("tiny-mixtral", intermediate_size=512))
    assert layer_layout(TINY) != layer_layout(TINY.with_expert_storage("int8"))


def test_profiled_element_wise_time_replaces_the_launch_count_of_its_layout():
    bare = cpu_processor(_cpu())
    profiled = cpu_processor(_cpu(layer_ops_points=_ops(layer_layout(TINY))))
    for n in (1, 300, 1024):
        assert pre_attention_time(TINY, profiled, n) - pre_attention_time(TINY, bare, n) == pytest.approx(
            (50e-6 + 1e-6 * n) - 34 * 2e-6)
        assert o_proj_router_time(TINY, profiled, n) - o_proj_router_time(TINY, bare, n) == pytest.approx(
            (20e-6 + 0.5e-6 * n) - 28 * 2e-6)
    # Another layout's points say nothing about this model: it keeps its launches.
    elsewhere = cpu_processor(_cpu(layer_ops_points=_ops("some-other-layout")))
    assert pre_attention_time(TINY, elsewhere, 300) == pre_attention_time(TINY, bare, 300)


def test_cpu_points_do_not_describe_an_accelerator():
    points = _ops(layer_layout(TINY))
    gpu = dataclasses.replace(load_preset("l4"), layer_ops_points=points,
                              prefill_attention_points=_prefill(layer_layout(TINY), 1e-5))
    assert device_processor(gpu).layer_ops(TINY, 64) is None
    assert device_processor(gpu).prefill_attention_curve(TINY) is None
    assert cpu_processor(gpu).layer_ops(TINY, 64) == pytest.approx((114e-6, 52e-6))
    cpu = _cpu(layer_ops_points=points)
    assert device_processor(cpu).layer_ops(TINY, 64) == pytest.approx((114e-6, 52e-6))


def test_prefill_attention_is_the_per_prompt_time_at_each_length_averaged_over_the_workload():
    # 1 us per token up to 100 tokens, 3 us per token beyond (the step-like SDPA cost)
    points = tuple(PrefillAttentionPoint(layer_layout(TINY), p, t * 1e-6)
                   for p, t in ((10, 10.0), (100, 100.0), (200, 400.0)))
    proc = cpu_processor(_cpu(prefill_attention_points=points))
    # Read off by hand: below the first point its time, beyond the last the last slope.
    by_hand = {5: 10.0, 40: 40.0, 90: 90.0, 113: 139.0, 160: 280.0, 250: 550.0}
    wl = workload_spec_from_lengths(list(by_hand) + [40], 8)
    expected = (sum(by_hand.values()) + 40.0) / 7 * 1e-6
    assert prefill_attention_time(TINY, proc, wl, 17) == pytest.approx(17 * expected)
    # The mean length alone (a workload without per-prompt lengths) reads the curve there.
    steady = dataclasses.replace(wl, prompt_lengths=())
    assert wl.mean_prompt == pytest.approx(698 / 7)  # on the 1 us/token segment
    assert prefill_attention_time(TINY, proc, steady, 2) == pytest.approx(2 * 1e-6 * 698 / 7)


def test_prefill_pass_costs_the_profiled_attention_of_its_prompts_in_every_layer():
    """Two profiles that differ only in prefill attention per prompt: the prefill of K prompts
    differs by K x layers x the difference, however they fall into passes."""
    layout = layer_layout(TINY)
    slow = _cpu(prefill_attention_points=_prefill(layout, 200e-6))
    fast = _cpu(prefill_attention_points=_prefill(layout, 50e-6))
    wl = workload_spec_from_lengths([100] * 320, 32)
    pol = Policy(320, 320, False, True, 1.0, prefill_tokens=2048)
    gap = prefill_time(TINY, slow, pol, wl, 320, True) - prefill_time(TINY, fast, pol, wl, 320, True)
    assert gap == pytest.approx(320 * TINY.num_layers * 150e-6, rel=1e-6)


def test_decode_step_uses_the_profiled_element_wise_time_at_its_micro_batch():
    points = _ops(layer_layout(TINY))
    bare, profiled = _cpu(), _cpu(layer_ops_points=points)
    pol = Policy(64, 32, False, True, 1.0)  # two micro-batches of 32
    gap = (decode_step_times(TINY, profiled, pol, 64, 100.0, True).total
           - decode_step_times(TINY, bare, pol, 64, 100.0, True).total)
    per_mb = (50e-6 + 32e-6) + (20e-6 + 16e-6) - (34 + 28) * 2e-6
    assert gap == pytest.approx(TINY.num_layers * 2 * per_mb)


def test_decode_attention_call_cost_replaces_its_launches_and_the_cache_read_stays():
    """Profiled per call at a one-block context, read at the step's batch (interpolated), and the
    cache's bytes at the KV rate on top; another layout keeps the launch count."""
    layout = layer_layout(TINY)
    points = tuple(DecodeAttentionPoint(layout, b, 40e-6 + 0.5e-6 * b) for b in (1, 16, 256))
    bare, profiled = _cpu(cpu_attention_bw=20e9), _cpu(cpu_attention_bw=20e9, decode_attention_points=points)
    for batch, ctx in ((1, 16), (7, 300), (100, 1000)):
        reads = batch * ctx * TINY.kv_bytes_per_token_layer / 20e9
        assert cpu_attention_time(TINY, profiled, batch, ctx) == pytest.approx(40e-6 + 0.5e-6 * batch + reads, rel=1e-3)
        assert cpu_attention_time(TINY, bare, batch, ctx) == pytest.approx(16 * 2e-6 + reads, rel=1e-3)
    other = tuple(DecodeAttentionPoint("another-layout", b, 1.0) for b in (1, 16))
    assert cpu_attention_time(TINY, _cpu(cpu_attention_bw=20e9, decode_attention_points=other), 7, 300) == \
        cpu_attention_time(TINY, bare, 7, 300)


def test_host_cost_per_sequence_grows_with_the_vocabulary():
    hw = _cpu(host_seq_s=4e-6, host_logit_s=0.5e-9)
    assert hw.host_seq_cost(8192) == pytest.approx(4e-6 + 8192 * 0.5e-9)
    big_vocab = dataclasses.replace(TINY, vocab_size=65536)
    pol = Policy(64, 64, False, True, 1.0)
    gap = (decode_step_times(big_vocab, hw, pol, 64, 100.0, True).t_host
           - decode_step_times(TINY, hw, pol, 64, 100.0, True).t_host)
    assert gap == pytest.approx(64 * (65536 - TINY.vocab_size) * 0.5e-9)


def test_profile_yaml_rows_become_points():
    figures = {"device_memory_gb": 1, "host_memory_gb": 1, "link_gbps": 1, "device_bw_gbps": 1,
               "cpu_bw_gbps": 1, "device_tflops": 1, "cpu_tflops": 1,
               "layer_ops": [{"layout": "L", "tokens": 8, "pre_attention_us": 3.0, "post_attention_us": 2.0}],
               "prefill_attention": [{"layout": "L", "prompt": 64, "us_per_prompt": 40.0}],
               "decode_attention": [{"layout": "L", "batch": 16, "context": 16, "us_per_call": 50.0}],
               "moe_ffn": [{"layout": "L", "tokens": 8, "us_per_call": 70.0}],
               "host_seq_us": 4.0, "host_logit_ns": 0.5}
    hw = spec_from_figures(figures)
    (ops,), (attention,) = hw.layer_ops_points, hw.prefill_attention_points
    assert (ops.layout, ops.tokens) == ("L", 8)
    assert (ops.pre_attention_s, ops.post_attention_s) == pytest.approx((3e-6, 2e-6))
    assert (attention.layout, attention.size, attention.seconds) == ("L", 64, pytest.approx(40e-6))
    (decode,) = hw.decode_attention_points
    assert (decode.layout, decode.size, decode.seconds) == ("L", 16, pytest.approx(50e-6))
    (experts,) = hw.moe_ffn_points
    assert (experts.layout, experts.size, experts.seconds) == ("L", 8, pytest.approx(70e-6))
    assert hw.host_seq_cost(1000) == pytest.approx(4e-6 + 1000 * 0.5e-9)
    assert spec_from_figures({k: v for k, v in figures.items()
                              if k not in ("layer_ops", "prefill_attention")}).layer_ops_points == ()


def test_profiled_expert_call_replaces_the_per_expert_gemms_of_its_layout():
    """The routed experts of a profiled layout cost the fused call read off its curve at the
    micro-batch's tokens (a shared expert's GEMMs still added); elsewhere, and on an
    accelerator, each touched expert is priced as its own GEMMs."""
    from moe_engine.perf.roofline import expert_ffn_time
    from moe_engine.perf.specs import MoeFfnPoint

    layout = layer_layout(TINY)
    points = tuple(MoeFfnPoint(layout, n, 30e-6 + 2e-6 * n) for n in (1, 8, 64, 512))
    bare, profiled = cpu_processor(_cpu()), cpu_processor(_cpu(moe_ffn_points=points))
    for n in (1, 5, 64, 300):
        assert expert_ffn_time(TINY, profiled, n) == pytest.approx(30e-6 + 2e-6 * n)
        assert expert_ffn_time(TINY, bare, n) != pytest.approx(30e-6 + 2e-6 * n)
    elsewhere = cpu_processor(_cpu(moe_ffn_points=(MoeFfnPoint("another", 8, 1.0),)))
    assert expert_ffn_time(TINY, elsewhere, 8) == expert_ffn_time(TINY, bare, 8)
    gpu = dataclasses.replace(load_preset("l4"), moe_ffn_points=points)
    assert device_processor(gpu).routed_experts(TINY, 8) is None
    assert cpu_processor(gpu).routed_experts(TINY, 8) == pytest.approx(46e-6)
    shared = _spec("tiny-qwen2-moe")
    shared_points = tuple(MoeFfnPoint(layer_layout(shared), n, 1e-6 * n) for n in (1, 64))
    with_points = cpu_processor(_cpu(moe_ffn_points=shared_points))
    # routed from the curve, the shared expert's two GEMMs on top (priced as before)
    from moe_engine.perf.roofline import _swiglu_time
    assert expert_ffn_time(shared, with_points, 32) == pytest.approx(
        32e-6 + _swiglu_time(with_points, 32, shared.hidden_size, shared.shared_expert_intermediate_size,
                             shared.dtype_bytes))
