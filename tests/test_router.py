"""layers.route against transformers' own routers: GLM-4.5's and DeepSeek-V3's (sigmoid scores,
a score-correction bias for choosing, group-limited top-k by the sum of each group's two best
scores, routed scaling) and DeepSeek-V2's group_limited_greedy (softmax scores, groups scored by
their best expert), ERNIE-4.5's (softmax scores, its moe_statics bias for choosing, the sum
floored at moe_norm_min), on tokens whose routing the bias and the group limit both change;
Llama-4's whole MoE block (the sigmoid of the top-k logits scaling the experts' inputs)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_engine.model.layers import (ffn_output, input_scaled_routing, limit_to_top_groups,
                                     moe_ffn, route, sum_routed_rows)
from moe_engine.model.spec import ModelSpec

H, E, TOP_K, GROUPS, KEPT = 64, 16, 4, 4, 2


def _spec(**router) -> ModelSpec:
    return ModelSpec(architecture="test", model_type="test", vocab_size=32, hidden_size=H,
                     intermediate_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                     num_experts=E, top_k=TOP_K, **router)


V3_ROUTER = dict(router_scoring="sigmoid", router_logits_fp32=True, router_score_correction=True,
                 router_groups=GROUPS, router_topk_groups=KEPT, router_group_score="top2_sum",
                 routed_scaling_factor=2.5, norm_topk_prob=True, router_weights_fp32=True)
V2_ROUTER = dict(router_scoring="softmax", router_logits_fp32=True, router_groups=GROUPS,
                 router_topk_groups=KEPT, router_group_score="max", routed_scaling_factor=1.5,
                 norm_topk_prob=False, router_weights_fp32=True)


def _inputs(seed: int = 0, tokens: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, H, generator=g)
    weight = 2.0 * torch.randn(E, H, generator=g) / H ** 0.5
    bias = 0.2 * torch.randn(E, generator=g)
    return h, weight, bias


def _as_dicts(weights: torch.Tensor, experts: torch.Tensor) -> list[dict[int, float]]:
    """Per token, expert -> weight (transformers returns the k slots unsorted)."""
    return [dict(zip(e.tolist(), w.tolist())) for w, e in zip(weights, experts)]


def _assert_same_routing(mine, ref) -> None:
    mine, ref = _as_dicts(*mine), _as_dicts(*ref)
    assert [sorted(m) for m in mine] == [sorted(r) for r in ref]
    for m, r in zip(mine, ref):
        for e in m:
            assert m[e] == pytest.approx(r[e], rel=1e-6, abs=1e-7)


def _glm_router(weight, bias, routed_scaling_factor=2.5, dtype=torch.float32):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = Glm4MoeConfig(hidden_size=H, n_routed_experts=E, num_experts_per_tok=TOP_K,
                           n_group=GROUPS, topk_group=KEPT, norm_topk_prob=True,
                           routed_scaling_factor=routed_scaling_factor)
    router = Glm4MoeTopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
    router.weight.data = router.weight.data.to(dtype)  # the bias stays fp32, as transformers keeps it
    return router


def test_sigmoid_router_matches_glm4_moe_router_of_transformers():
    h, weight, bias = _inputs()
    ref = _glm_router(weight, bias)(h)[1:]
    _assert_same_routing(route(weight, h, _spec(**V3_ROUTER), bias), ref)


def test_sigmoid_router_matches_deepseek_v3_router_of_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    h, weight, bias = _inputs(seed=1)
    config = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=TOP_K,
                              n_group=GROUPS, topk_group=KEPT, norm_topk_prob=True,
                              routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
    ref = router(h)[1:]
    _assert_same_routing(route(weight, h, _spec(**V3_ROUTER), bias), ref)


def test_group_limited_greedy_matches_deepseek_v2_router_of_transformers():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    h, weight, _ = _inputs(seed=2)
    config = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=TOP_K,
                              n_group=GROUPS, topk_group=KEPT, topk_method="group_limited_greedy",
                              routed_scaling_factor=1.5)
    router = DeepseekV2TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(weight)
    ref = router(h)[1:]
    spec = _spec(**V2_ROUTER)
    _assert_same_routing(route(weight, h, spec), ref)
    # the group limit changes the choice of some tokens here (else this test would not test it)
    ungrouped = route(weight, h, dataclasses.replace(spec, router_groups=1, router_topk_groups=1))
    assert [sorted(x) for x in _as_dicts(*ungrouped)] != [sorted(x) for x in _as_dicts(*ref)]


def test_bias_and_group_limit_change_the_choice_and_weights_are_unbiased_scores():
    h, weight, bias = _inputs()
    spec = _spec(**V3_ROUTER)
    weights, experts = route(weight, h, spec, bias)
    unbiased = route(weight, h, spec)[1]
    ungrouped = route(weight, h, dataclasses.replace(spec, router_groups=1, router_topk_groups=1),
                      bias)[1]
    chosen = [sorted(e) for e in experts.tolist()]
    assert chosen != [sorted(e) for e in unbiased.tolist()]
    assert chosen != [sorted(e) for e in ungrouped.tolist()]
    # every token's experts lie in at most topk_group groups
    assert max(len({e // (E // GROUPS) for e in row}) for row in chosen) <= KEPT
    # the weights: the chosen experts' sigmoid scores without the bias, renormalised, scaled
    scores = torch.sigmoid(h @ weight.T).gather(1, experts)
    expected = scores / scores.sum(-1, keepdim=True) * spec.routed_scaling_factor
    torch.testing.assert_close(weights, expected)
    assert weights.dtype == torch.float32


def test_bf16_activations_route_on_fp32_logits_like_transformers():
    """In a bf16 model transformers computes the router logits in fp32 from the bf16-rounded
    weight and keeps the bias and the weights in fp32; the loader upcasts the router once."""
    h, weight, bias = _inputs(seed=3)
    h16, w16 = h.to(torch.bfloat16), weight.to(torch.bfloat16)
    ref = _glm_router(w16.float(), bias, dtype=torch.bfloat16)(h16)[1:]
    weights, experts = route(w16.float(), h16, _spec(**V3_ROUTER), bias)
    assert weights.dtype == torch.float32
    _assert_same_routing((weights, experts), ref)


ERNIE_ROUTER = dict(router_scoring="softmax", router_logits_fp32=True,
                    router_score_correction=True, norm_topk_prob=True, router_norm_min=1e-12,
                    router_weights_fp32=False)


def _ernie_router(weight, bias, moe_norm_min=1e-12):
    from transformers import Ernie4_5_MoeConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    config = Ernie4_5_MoeConfig(hidden_size=H, moe_num_experts=E, moe_k=TOP_K,
                                moe_norm_min=moe_norm_min)
    router = Ernie4_5_MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.moe_statics.e_score_correction_bias.copy_(bias[None, :])
    return router


@pytest.mark.parametrize("moe_norm_min", [1e-12, 2.0])
def test_softmax_router_with_statics_bias_matches_ernie4_5_moe_router(moe_norm_min):
    """ERNIE-4.5: softmax scores of fp32 logits, top-k on scores + the moe_statics bias, the
    chosen scores over max(sum, moe_norm_min) (2.0 exceeds every sum: the floor divides)."""
    h, weight, bias = _inputs(seed=4)
    spec = _spec(**{**ERNIE_ROUTER, "router_norm_min": moe_norm_min})
    ref = _ernie_router(weight, bias, moe_norm_min)(h)[1:]
    mine = route(weight, h, spec, bias)
    _assert_same_routing(mine, ref)
    # the bias changes the choice of some tokens here (else this test would not test it)
    unbiased = route(weight, h, spec)[1]
    assert [sorted(e) for e in mine[1].tolist()] != [sorted(e) for e in unbiased.tolist()]


def test_ernie_router_casts_its_weights_to_the_activations_dtype():
    """transformers' ERNIE router computes in fp32 from its fp32 weight and hands bf16 weights
    to the experts of a bf16 model."""
    h, weight, bias = _inputs(seed=5)
    h16 = h.to(torch.bfloat16)
    ref = _ernie_router(weight, bias)(h16)[1:]
    weights, experts = route(weight, h16, _spec(**ERNIE_ROUTER), bias)
    assert weights.dtype == ref[0].dtype == torch.bfloat16
    _assert_same_routing((weights.float(), experts), (ref[0].float(), ref[1]))


LLAMA4_ROUTER = dict(router_scoring="topk_sigmoid", norm_topk_prob=False,
                     router_weights_fp32=False, router_scales_input=True)


def _llama4_moe(top_k: int, dtype: torch.dtype):
    """transformers' Llama4TextMoe with random weights (fused x @ W experts, shared expert)."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = Llama4TextConfig(hidden_size=H, intermediate_size=32, num_local_experts=E,
                              num_experts_per_tok=top_k)
    moe = Llama4TextMoe(config)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-2 if p.dim() == 3 else -1] ** 0.5)
        moe.router.weight.mul_(2.0)
    return moe.to(dtype).eval()


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_scaled_experts_match_llama4_moe_of_transformers(top_k, dtype):
    """Llama-4: top-k over the logits, their sigmoid scales each chosen expert's input (not its
    output), outputs summed with the ungated shared expert; the fused gate_up [E, H, 2I] is gate
    then up. The engine's rows of input_scaled_routing through moe_ffn give the same block."""
    from moe_engine.model.loader import fused_expert_parts, swiglu_weights
    from moe_engine.model.weights import DenseLayerWeights

    moe = _llama4_moe(top_k, dtype)
    h = torch.randn(64, H, generator=torch.Generator().manual_seed(7)).to(dtype)
    with torch.no_grad():
        ref_out, _ = moe(h)
        ref_scores, _ = moe.router(h)
    spec = dataclasses.replace(_spec(**LLAMA4_ROUTER), top_k=top_k)
    weights, experts = route(moe.router.weight.data, h, spec)
    assert weights.dtype == dtype
    scores = torch.zeros(h.shape[0], E, dtype=dtype).scatter_(1, experts, weights)
    assert torch.equal(scores, ref_scores)
    fused = moe.experts
    experts_w = [swiglu_weights({**fused_expert_parts("gate_up_t", fused.gate_up_proj.data[e]),
                                 **fused_expert_parts("down_t", fused.down_proj.data[e])})
                 for e in range(E)]
    shared = moe.shared_expert
    dense = DenseLayerWeights(input_norm=None, post_norm=None, wqkv=None, wo=None,
                              shared_expert=swiglu_weights({
                                  "w1": shared.gate_proj.weight.data,
                                  "w3": shared.up_proj.weight.data,
                                  "w2": shared.down_proj.weight.data}))
    rows, ones, idx = input_scaled_routing(h, weights, experts)
    with torch.no_grad():
        routed = sum_routed_rows(moe_ffn(experts_w, rows, ones, idx), h.shape[0])
        out = ffn_output(dense, h, routed)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)


def test_limit_to_top_groups_keeps_the_best_groups_by_each_score():
    scores = torch.tensor([[0.9, 0.0, 0.0, 0.0, 0.5, 0.5, 0.1, 0.1]])
    # groups of 4: top2_sum 0.9 vs 1.0 keeps the second; max 0.9 vs 0.5 the first
    top2 = limit_to_top_groups(scores, 2, 1, "top2_sum")
    best = limit_to_top_groups(scores, 2, 1, "max")
    assert torch.isinf(top2[0, :4]).all() and torch.equal(top2[0, 4:], scores[0, 4:])
    assert torch.isinf(best[0, 4:]).all() and torch.equal(best[0, :4], scores[0, :4])


@pytest.mark.parametrize("router, message", [
    (dict(router_groups=3), "n_group=3 must divide"),
    (dict(router_groups=4, router_topk_groups=5), "topk_group=5"),
    (dict(router_groups=8, router_topk_groups=1), "hold fewer than num_experts_per_tok"),
    (dict(router_groups=16, router_topk_groups=8), "at least two experts"),
    (dict(router_scoring="relu"), "router scoring"),
])
def test_impossible_router_configurations_are_refused(router, message):
    with pytest.raises(ValueError, match=message):
        _spec(**router)
