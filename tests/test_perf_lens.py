"""MoE-Lens stage 1 / stage 2 and Klotski's planner against the papers' numbers and algebra."""
from __future__ import annotations

import math

import pytest

from moe_engine.perf import load_preset
from moe_engine.perf.lens import (gemm_intensity_per_token, kv_bytes_to_saturate, klotski_min_batches,
                                  overlap_capacity_gain, pme, stage1_bound, stage2_throughput,
                                  tokens_to_saturate, tokens_to_saturate_exact)
from moe_engine.perf.reference_models import reference_model

MIXTRAL = reference_model("mixtral-8x7b")

# MoE-Lens Table 2: (BF16 TFLOP/s, tokens to saturate, KV GB at seq 256, KV GB at seq 512), 32 GB/s.
TABLE2 = {"A40": (150, 19.2e3, 614, 1228), "L40": (181, 23.2e3, 741, 1482), "A100": (312, 40.0e3, 1277, 2554)}


@pytest.mark.parametrize("gpu", sorted(TABLE2))
def test_tokens_to_saturate_reproduces_lens_table2(gpu):
    tflops, tokens, _, _ = TABLE2[gpu]
    n = tokens_to_saturate(tflops * 1e12, 32e9, MIXTRAL.num_experts, MIXTRAL.top_k)
    assert n == pytest.approx(tokens, rel=0.03)


@pytest.mark.parametrize("gpu", sorted(TABLE2))
@pytest.mark.parametrize("seq_len,column", [(256, 2), (512, 3)])
def test_kv_bytes_to_saturate_reproduces_lens_table2(gpu, seq_len, column):
    tflops = TABLE2[gpu][0]
    kv = kv_bytes_to_saturate(MIXTRAL, tflops * 1e12, 32e9, seq_len)
    assert kv / 1e9 == pytest.approx(TABLE2[gpu][column], rel=0.03)


def test_mixtral_kv_slot_is_128_kib():
    # 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes.
    assert MIXTRAL.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 128 * 1024


def test_exact_intensity_needs_more_tokens_than_the_sparsity_approximation():
    # Eq. 1 includes attention weights every token uses, so intensity per token exceeds k/E.
    assert gemm_intensity_per_token(MIXTRAL) > MIXTRAL.top_k / MIXTRAL.num_experts
    assert tokens_to_saturate_exact(MIXTRAL, 150e12, 32e9) < tokens_to_saturate(150e12, 32e9, 8, 2)


@pytest.mark.parametrize("p,g,expected", [(1, 1, 4 / 3), (100, 128, 2 * 228 / (328 * 128)),
                                          (512, 512, 2 * 1024 / (1536 * 512)), (0, 10, 0.2)])
def test_pme_spot_values(p, g, expected):
    assert pme(p, g) == pytest.approx(expected)


@pytest.mark.parametrize("p,g", [(77, 128), (242, 50), (1693, 64)])
def test_pme_closed_form_against_its_sum(p, g):
    # Eq. 3's sum over j = 0..g has g+1 terms; its closed form (used here) counts g of them.
    by_sum = (p + g) / sum(p + j for j in range(g + 1))
    assert pme(p, g) == pytest.approx(by_sum * (g + 1) / g, rel=1e-12)


def test_overlap_gain_is_eq7():
    assert overlap_capacity_gain(100, 128) == pytest.approx(228 / 164)
    assert overlap_capacity_gain(100, 0) == 1.0
    # Pure decode workloads gain up to 2x.
    assert overlap_capacity_gain(0, 100) == pytest.approx(2.0)


def test_longer_generation_at_fixed_kv_lowers_stage1_bound():
    hw = load_preset("a40")
    gens = (16, 32, 64, 128, 256, 512)
    for kv in (20e9, 100e9, 1e12):
        bounds = [stage1_bound(MIXTRAL, hw, 100, g, kv) for g in gens]
        for b1, b2 in zip(bounds, bounds[1:]):
            assert b2.t_max_tok_s <= b1.t_max_tok_s
            if b2.memory_bound:  # strictly lower while the KV capacity is what binds
                assert b2.t_max_tok_s < b1.t_max_tok_s
    assert all(b.memory_bound for b in (stage1_bound(MIXTRAL, hw, 100, g, 20e9) for g in gens))


def test_stage1_bound_switches_from_kv_bound_to_compute_bound():
    hw = load_preset("a40")
    small = stage1_bound(MIXTRAL, hw, 100, 128, 10e9)
    huge = stage1_bound(MIXTRAL, hw, 100, 128, 10e15)
    assert small.memory_bound and not huge.memory_bound
    assert huge.t_max_tok_s == pytest.approx(huge.t_gpu_tok_s)
    # delta: Mixtral's ~93 GB at 32 GB/s.
    assert small.delta_s == pytest.approx(MIXTRAL.total_bytes / 32e9)


def test_stage2_converges_to_stage1_for_unbounded_batch_and_unit_blocks():
    hw = load_preset("a40")
    p, g, kv_tokens = 100, 128, 200_000
    s1 = stage1_bound(MIXTRAL, hw, p, g, kv_tokens * MIXTRAL.kv_bytes_per_token)
    s2 = stage2_throughput(10 ** 12, p, g, kv_blocks=kv_tokens, block_size=1, delta_s=s1.delta_s,
                           t_gpu_tok_s=1e12)
    # Stage 2 counts the g+1 steps of eq. 8's sum; stage 1 the g of eq. 3.
    assert s2.t1_tok_s == pytest.approx(s1.t_max_gen_tok_s * g / (g + 1), rel=1e-6)


def test_stage2_paging_and_bounded_batch_lower_throughput():
    delta, tgpu = 2.9, 1e12
    ideal = stage2_throughput(10 ** 9, 100, 128, 10_000, 1, delta, tgpu).throughput_tok_s
    paged = stage2_throughput(10 ** 9, 100, 128, 10_000 // 16, 16, delta, tgpu).throughput_tok_s
    bounded = stage2_throughput(2_000, 100, 128, 10_000, 1, delta, tgpu).throughput_tok_s
    assert paged < ideal and bounded < ideal


def test_stage2_compute_bound_regime_uses_eq_13():
    # Tiny T_GPU: the prologue/steady-state iteration count of eq. 12 governs.
    pred = stage2_throughput(1000, 100, 10, 10 ** 9, 16, 1.0, t_gpu_tok_s=50.0)
    t_pf = 50.0 * 100 / 110
    it = 2 * 10 + (1000 * 100 - (t_pf + 50.0) / 2 * 10) / t_pf
    assert pred.t2_tok_s == pytest.approx(1000 * 10 / it)
    assert pred.throughput_tok_s == pytest.approx(min(pred.t1_tok_s, pred.t2_tok_s))


def test_klotski_min_batches_hand_computed():
    # Attention 1 ms + gate 0.5 ms per batch; gate I/O 2 ms, expert I/O 10 ms, 2 hot experts,
    # hot compute 3 ms, two queued cold experts of 4 ms each, attention I/O 6 ms.
    n = klotski_min_batches(t_attn=1.0, t_gate=0.5, t_hot=3.0, t_cold=(4.0, 4.0), io_gate=2.0, io_expert=10.0,
                            io_attn=6.0, num_hot=2)
    # ineq 4: n >= 2; 5: n >= 22/1.5 = 14.67; 6: (2+30-3)/1.5 = 19.33; 7: (2+40+6-3-8)/1.5 = 24.67
    assert n == 25
    assert klotski_min_batches(1.0, 0.5, 100.0, (), 0.1, 0.1, 0.1, 0) == 1


def test_klotski_needs_more_batches_when_io_slower():
    fast = klotski_min_batches(1.0, 0.5, 3.0, (4.0,), 2.0, 5.0, 6.0, 2)
    slow = klotski_min_batches(1.0, 0.5, 3.0, (4.0,), 2.0, 20.0, 6.0, 2)
    assert slow > fast
    assert math.isfinite(slow)
