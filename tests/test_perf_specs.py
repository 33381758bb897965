"""ModelSpec from HF configs, hardware presets and specs from config, workload statistics."""
from __future__ import annotations

import json
import math

import pytest

from moe_engine.config import HardwareConfig
from moe_engine.perf import (ModelSpec, UnsupportedModelError, hardware_spec_from_config, load_preset,
                             workload_spec_from_lengths)
from moe_engine.perf.reference_models import REFERENCE_CONFIGS, reference_model

# Published total parameter counts (billions).
PUBLISHED_PARAMS = {"mixtral-8x7b": 46.7, "mixtral-8x22b": 140.6, "qwen1.5-moe-a2.7b": 14.3,
                    "qwen3-30b-a3b": 30.5, "olmoe-1b-7b": 6.9, "deepseek-v2-lite": 15.7,
                    "glm-4.5": 355, "glm-4.5-air": 106, "deepseek-v3": 671,
                    "gpt-oss-20b": 20.9, "gpt-oss-120b": 116.8,
                    # the hub's count of the -PT checkpoint; the model card says "21B"
                    "ernie-4.5-21b-a3b": 21.8,
                    # Meta's totals count the vision encoder (~0.8B) the spec leaves out
                    "llama-4-scout-17b-16e": 109, "llama-4-maverick-17b-128e": 400}


@pytest.mark.parametrize("name", sorted(REFERENCE_CONFIGS))
def test_parameter_count_matches_published_size(name):
    assert reference_model(name).total_params / 1e9 == pytest.approx(PUBLISHED_PARAMS[name], rel=0.02)


def test_mixtral_fields():
    m = reference_model("mixtral-8x7b")
    assert (m.num_layers, m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim,
            m.num_experts, m.top_k, m.shared_expert_intermediate_size, m.dtype_bytes) == (32, 4096, 14336, 32, 8, 128, 8, 2, 0, 2)
    # Per layer: 8 experts x 3 x 4096 x 14336 + attention 4096 x (4096 + 2 x 1024) + 4096 x 4096.
    assert m.experts_params_per_layer == 8 * 3 * 4096 * 14336
    assert m.attn_params_per_layer == 4096 * 6144 + 4096 * 4096


def test_qwen2_moe_shared_expert_and_sparse_layers():
    cfg = dict(REFERENCE_CONFIGS["qwen1.5-moe-a2.7b"], decoder_sparse_step=2, mlp_only_layers=[1])
    m = ModelSpec.from_hf_config(cfg)
    assert m.shared_expert_intermediate_size == 5632 and m.intermediate_size == 1408
    # Sparse iff (i+1) % 2 == 0 and i not in mlp_only: layers 3, 5, ..., 23 -> 11 of 24.
    assert m.num_moe_layers == 11 and m.num_dense_layers == 13
    assert m.dense_intermediate_size == 5632


def test_deepseek_v2_dense_first_layer_and_mla_cache():
    m = reference_model("deepseek-v2-lite")
    assert m.num_moe_layers == 26 and m.num_dense_layers == 1
    assert m.shared_expert_intermediate_size == 2 * 1408
    # The latent cache holds the 512-dim latent and the 64-dim rope key, not per-head K/V.
    assert m.kv_bytes_per_token_layer == (512 + 64) * 2
    assert m.kv_bytes_per_token == 27 * (512 + 64) * 2
    # V2-Lite's greedy router ignores groups and never renormalises.
    assert (m.router_scoring, m.router_groups, m.norm_topk_prob) == ("softmax", 1, False)


# DeepSeek-V3 report: 671B total, 37B activated per token (two significant figures), both
# without the multi-token-prediction module. The decoder layers a token runs through hold
# 35.70B; with the LM head every token multiplies by (the embedding is one row read) 36.63B.
def test_deepseek_v3_reference_config_matches_published_total_and_activated_counts():
    m = reference_model("deepseek-v3")
    assert m.total_params / 1e9 == pytest.approx(671, rel=0.01)
    activated = m.active_params + m.vocab_size * m.hidden_size
    assert activated / 1e9 == pytest.approx(37, rel=0.015)
    assert round(activated / 1e9) == 37
    assert m.dense_layers == (0, 1, 2) and m.num_moe_layers == 58
    assert (m.router_scoring, m.router_groups, m.router_topk_groups) == ("sigmoid", 8, 4)
    assert m.kv_bytes_per_token == 61 * (512 + 64) * 2
    # YaRN factor 40 with mscale_all_dim 1 scales the softmax by mscale^2 (transformers).
    mscale = 0.1 * math.log(40) + 1.0
    assert m.attention_scale == pytest.approx(192 ** -0.5 * mscale ** 2)


# GLM-4.5 report / model cards: total and activated parameters (billions). "Activated" counts
# the decoder layers a token runs through (no embedding, no LM head): that reading puts GLM-4.5
# at 32.08B. Both totals and GLM-4.5's activated count are within 1%; GLM-4.5-Air's activated
# count is 12.18B, which the card gives as "12B" (two significant figures, 1.5% off), so it is
# checked to that precision. The one multi-token-prediction layer of each checkpoint is in
# neither figure (counting it would put GLM-4.5-Air at 109.2B total).
@pytest.mark.parametrize("name, total, active, active_rel", [
    ("glm-4.5", 355, 32, 0.01), ("glm-4.5-air", 106, 12, 0.02)])
def test_glm_reference_configs_match_published_total_and_activated_counts(name, total, active,
                                                                            active_rel):
    m = reference_model(name)
    assert m.total_params / 1e9 == pytest.approx(total, rel=0.01)
    assert m.active_params / 1e9 == pytest.approx(active, rel=active_rel)
    assert round(m.active_params / 1e9) == active


def test_glm_4_5_air_dense_first_layer_shared_expert_and_router():
    m = reference_model("glm-4.5-air")
    assert m.dense_layers == (0,) and m.num_moe_layers == 45
    assert m.dense_intermediate_size == 10944 and m.intermediate_size == 1408
    assert m.shared_expert_intermediate_size == 1408 and not m.shared_expert_gate
    assert m.qkv_bias and not m.o_bias and m.qk_norm is None and m.rotary_dim == 64
    assert (m.router_scoring, m.router_score_correction, m.router_groups) == ("sigmoid", True, 1)
    # router weight plus its score-correction bias; the shared expert is in every token's path
    assert m.router_params == 4096 * 128 + 128
    assert m.dense_params_per_layer == m.attn_params_per_layer + m.router_params + 3 * 4096 * 1408 + 2 * 4096
    # GQA with 8 KV heads of 128 (partial RoPE does not change what is cached)
    assert m.kv_bytes_per_token == 46 * 8 * 2 * 128 * 2
    full = reference_model("glm-4.5")
    assert full.dense_layers == (0, 1, 2) and full.qk_norm == "head" and full.routed_scaling_factor == 2.5


# GPT-OSS model card: total and active parameters (billions). Its "active" count takes in the
# unembedding (the LM head) besides the decoder layers a token runs through, so that is added
# to active_params (which leaves both embedding tables out, as the GLM figures do): 3.61B and
# 5.13B. Biases, attention sinks and router biases are counted.
@pytest.mark.parametrize("name, total, active", [("gpt-oss-20b", 20.9, 3.6),
                                                 ("gpt-oss-120b", 116.8, 5.1)])
def test_gpt_oss_reference_configs_match_published_total_and_active_counts(name, total, active):
    m = reference_model(name)
    assert m.total_params / 1e9 == pytest.approx(total, rel=0.01)
    unembedding = m.vocab_size * m.hidden_size
    assert (m.active_params + unembedding) / 1e9 == pytest.approx(active, rel=0.01)


@pytest.mark.parametrize("name, lo_gb, hi_gb", [("gpt-oss-20b", 12, 16), ("gpt-oss-120b", 60, 80)])
def test_gpt_oss_reference_configs_are_sized_in_mxfp4_as_released(name, lo_gb, hi_gb):
    """The released checkpoints keep the experts in MXFP4 (4-bit codes and an E8M0 byte per 32)
    and the rest in bf16: the model card's 20b runs within 16 GB, the 120b fits one 80 GB GPU."""
    m = reference_model(name)
    assert m.expert_storage == "mxfp4"
    assert m.expert_bytes == 3 * 2880 * 2880 * 17 // 32 + (2 * 2880 + 2880) * 2
    assert lo_gb < m.total_bytes / 1e9 < hi_gb
    widened = m.with_expert_storage(None)
    assert widened.total_params == m.total_params
    # bf16 experts: 16 bits a weight against 4.25
    assert widened.experts_bytes_per_layer / m.experts_bytes_per_layer == pytest.approx(16 / 4.25,
                                                                                         rel=0.01)


def test_gpt_oss_biases_sinks_and_windowed_layers():
    m = reference_model("gpt-oss-20b")
    assert m.num_windowed_layers == 12 and m.attention_window(0) == 128
    assert m.attention_window(1) is None
    # one expert: gate|up and down with their biases
    assert m.expert_params == 3 * 2880 * 2880 + 2 * 2880 + 2880
    # q/k/v/o and their biases, plus one sink per query head
    assert m.attn_params_per_layer == 2880 * (4096 + 2 * 512) + 4096 * 2880 + 4096 + 2 * 512 + 2880 + 64
    assert m.router_params == 2880 * 32 + 32
    # KV: the 12 full layers hold every token, the 12 sliding ones a window of 128 in whole
    # blocks (9 of 16 tokens), as the engine's window pool does.
    per_layer = 8 * 2 * 64 * 2
    assert m.kv_bytes_per_sequence(4096, 16) == per_layer * (12 * 4096 + 12 * 144)
    assert m.kv_bytes_per_sequence(100, 16) == 100 * m.kv_bytes_per_token


def test_ernie_4_5_reference_config_counts_every_weight_once():
    """ERNIE-4.5-21B-A3B counted by hand: 27 MoE layers (64 experts of 1536, two shared ones,
    the router and its [1, 64] statics bias), one dense layer of 12288, GQA 20/4 heads of 128,
    one embedding table (tied head). The model card's "21B / 3B" are two figures: the total is
    21.83B (the hub lists 21.8B) and a token's decoder layers hold 3.09B (3.35B with the
    embedding row), so "3B" is checked to that precision (3%), not to 1%."""
    m = reference_model("ernie-4.5-21b-a3b")
    h, attn = 2560, 2560 * (2560 + 2 * 512) + 2560 * 2560
    moe = attn + 64 * h + 64 + 3 * h * 1536 * 2 + 2 * h
    dense = attn + 3 * h * 12288 + 2 * h
    assert m.dense_layers == (0,) and m.num_moe_layers == 27 and m.tie_word_embeddings
    assert m.total_params == 27 * (moe + 64 * 3 * h * 1536) + dense + 103424 * h + h
    assert m.active_params == 27 * (moe + 6 * 3 * h * 1536) + dense
    assert m.total_params / 1e9 == pytest.approx(21.8, rel=0.002)
    assert round(m.active_params / 1e9) == 3
    assert m.active_params / 1e9 == pytest.approx(3, rel=0.03)
    assert (m.router_scoring, m.router_score_correction, m.rope_interleave) == ("softmax", True, True)
    assert m.kv_bytes_per_token == 28 * 4 * 2 * 128 * 2
    assert m.rope.theta == 500000


LLAMA4_ATTENTION = 5120 * (5120 + 2 * 1024) + 5120 * 5120  # GQA 40/8 heads of 128, no bias


@pytest.mark.parametrize("name,experts,moe_layers", [("llama-4-scout-17b-16e", 16, 48),
                                                     ("llama-4-maverick-17b-128e", 128, 24)])
def test_llama4_reference_configs_count_every_weight_once(name, experts, moe_layers):
    """Llama-4 Scout and Maverick, text model counted by hand: MoE layers hold the router,
    `experts` experts of 8192 and one shared expert as wide (3 x 5120 x 8192 each); Maverick's
    other 24 layers a dense MLP of 16384; two 202048-row tables. Scout 107.77B and Maverick
    400.71B against Meta's 109B / 400B (Scout's with its ~0.8B vision encoder). "17B active":
    a token's decoder layers hold 15.1B in both, 17.2B with the embedding and LM head, which
    is how that figure counts (checked to 2%)."""
    m = reference_model(name)
    h, expert = 5120, 3 * 5120 * 8192
    moe = LLAMA4_ATTENTION + experts * h + expert + 2 * h  # router, shared expert, norms
    dense = LLAMA4_ATTENTION + 3 * h * 16384 + 2 * h
    tables = 2 * 202048 * h
    assert m.architecture == "Llama4ForConditionalGeneration" and m.model_type == "llama4_text"
    assert m.num_moe_layers == moe_layers and m.num_dense_layers == 48 - moe_layers
    assert m.total_params == moe_layers * (moe + experts * expert) + (48 - moe_layers) * dense \
        + tables + h
    assert m.active_params == moe_layers * (moe + expert) + (48 - moe_layers) * dense
    assert (m.active_params + tables) / 1e9 == pytest.approx(17, rel=0.02)
    assert m.nope_layers == tuple(range(3, 48, 4)) and m.attention_chunk_size == 8192
    # chunked attention is honoured by the context cap, so the context is one chunk
    assert m.max_position_embeddings == 8192
    assert m.kv_bytes_per_token == 48 * 8 * 2 * 128 * 2
    assert (m.router_scoring, m.router_scales_input, m.top_k) == ("topk_sigmoid", True, 1)


def test_qwen3_moe_explicit_head_dim():
    m = reference_model("qwen3-30b-a3b")
    assert m.head_dim == 128 and m.hidden_size == 2048 and m.num_heads * m.head_dim == 4096


def test_unsupported_model_type_is_named():
    with pytest.raises(UnsupportedModelError, match="llama"):
        ModelSpec.from_hf_config({"model_type": "llama", "hidden_size": 8})


def test_dtype_override_and_config_file(tmp_path):
    from moe_engine.tools.presets import PRESETS, hf_config

    (tmp_path / "config.json").write_text(json.dumps(hf_config(PRESETS["small-mixtral"])))
    m = ModelSpec.from_hf_config(tmp_path)
    assert m.dtype_bytes == 2 and m.hidden_size == 1024 and m.num_layers == 4
    assert ModelSpec.from_hf_config(tmp_path / "config.json", dtype="float32").dtype_bytes == 4
    # ~428M parameters (the preset's documented size).
    assert m.total_params / 1e6 == pytest.approx(428, rel=0.02)


def test_workload_from_lengths():
    wl = workload_spec_from_lengths([10, 20, 30], 64)
    assert (wl.mean_prompt, wl.max_prompt, wl.gen_len, wl.num_requests) == (20, 30, 64, 3)
    assert wl.sum_prompt_sq == pytest.approx((100 + 400 + 900) / 3)
    with pytest.raises(ValueError):
        workload_spec_from_lengths([], 8)


@pytest.mark.parametrize("name,tflops,mem", [("t4", 65, 16), ("l4", 121, 24), ("a40", 149.7, 48), ("l40", 181, 48),
                                             ("a100", 312, 80), ("h100", 989, 80), ("h200", 989, 141)])
def test_presets_load_with_datasheet_figures(name, tflops, mem):
    hw = load_preset(name)
    assert hw.device_kind == "cuda"
    assert hw.device_flops == pytest.approx(tflops * 1e12)
    assert hw.device_memory == pytest.approx(mem * 1e9)


def test_presets_compose_through_hydra():
    from moe_engine.config import compose

    cfg = compose(["hardware=l4"])
    assert cfg.hardware.device_tflops == 121.0 and cfg.hardware.link_gbps == 32.0


def test_hardware_spec_from_config_uses_figures_or_profile(tmp_path):
    hw = HardwareConfig()
    spec = hardware_spec_from_config(hw, tmp_path)
    assert spec.is_cpu_only and spec.device_flops == pytest.approx(hw.device_tflops * 1e12)
    profile = tmp_path / "p.yaml"
    profile.write_text("name: measured\ndevice: cpu\ndevice_memory_gb: 8\nhost_memory_gb: 8\nlink_gbps: 5\n"
                       "device_bw_gbps: 11\ncpu_bw_gbps: 11\ndevice_tflops: 0.1\ncpu_tflops: 0.1\n"
                       "cpu_attention_gbps: 9\nop_overhead_us: 3\n"
                       "gemm: [{inp: 8, out: 8, tokens: 1, dtype_bytes: 2, gflops: 1.0}]\n")
    hw.profile = str(profile)
    spec = hardware_spec_from_config(hw, tmp_path)
    assert spec.name == "measured" and spec.cpu_bw == pytest.approx(11e9)
    assert spec.cpu_attention_bw == pytest.approx(9e9) and spec.op_overhead_s == pytest.approx(3e-6)
    assert len(spec.gemm_points) == 1


def test_resaved_qwen3_config_with_num_local_experts_parses():
    """transformers 5 re-saves a Qwen3-MoE config with `num_local_experts`, not `num_experts`."""
    from moe_engine.perf.reference_models import REFERENCE_CONFIGS

    cfg = dict(REFERENCE_CONFIGS["qwen3-30b-a3b"])
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert ModelSpec.from_hf_config(cfg).num_experts == 128


def test_sliding_layers_attend_their_window_in_the_decode_cost():
    """GPT-OSS-20B: half its layers attend 128 tokens, whatever the context."""
    from moe_engine.perf.roofline import decode_attention_cost

    m = reference_model("gpt-oss-20b")
    assert m.attended_context(100) == 100
    assert m.attended_context(4096) == pytest.approx((12 * 4096 + 12 * 128) / 24)
    long, short = decode_attention_cost(m, 8, 4096), decode_attention_cost(m, 8, 128)
    assert long.local_bytes == pytest.approx(short.local_bytes * (4096 + 128) / 256)
    mixtral = reference_model("mixtral-8x7b")
    assert mixtral.attended_context(4096) == 4096 and m.num_windowed_layers == 12


def test_hardware_spec_hashes_by_its_fields_once_and_shares_its_processors():
    """The cost model keys its processors (and their GEMM memo) by the spec: equal specs share
    them, a changed field gets its own, and the memo answers what the roofline computes."""
    import copy
    import dataclasses
    import pickle

    from moe_engine.perf.roofline import cpu_processor, device_processor, gemm_time

    hw = load_preset("l4")
    twin = dataclasses.replace(hw)
    faster = dataclasses.replace(hw, device_flops=hw.device_flops * 2)
    assert hw == twin and hash(hw) == hash(twin)
    assert hash(faster) != hash(hw)
    assert device_processor(hw) is device_processor(twin)
    assert device_processor(faster) is not device_processor(hw)
    assert cpu_processor(hw) is cpu_processor(twin)
    for clone in (pickle.loads(pickle.dumps(hw)), copy.copy(hw)):  # the cached hash stays behind
        assert clone == hw and "_fields_hash" not in clone.__dict__ and hash(clone) == hash(hw)
        # ... and so do the processors the spec keeps (with their memos); the clone, equal,
        # finds the same ones.
        assert not any(k.endswith("_processor") for k in clone.__dict__)
        assert cpu_processor(clone) is cpu_processor(hw)
    proc = device_processor(faster)
    for tokens in (1, 7.5, 4096):
        want = gemm_time(tokens, 4096, 14336, 2, faster.device_flops, faster.device_bw)
        assert proc.gemm(tokens, 4096, 14336, 2) == want
        assert proc.gemm(tokens, 4096, 14336, 2) == want  # from the memo


def test_remembered_layer_prices_follow_every_policy_field_they_read():
    """A processor remembers a decode layer's micro-batches under the policy's placement, and
    the step's link time outside it: policies that differ in any one field get the prices a
    spec with no memo yet computes, and no two of them share one."""
    import dataclasses

    from moe_engine.perf.cost import Policy, layer_decode_times, layer_step_times
    from moe_engine.perf.schedule import step_trace

    m, hw = reference_model("olmoe-1b-7b"), load_preset("a40")
    base = Policy(256, 64, True, True, 0.6, 0.5)
    variants = [base, dataclasses.replace(base, kv_read_ratio=0.0), dataclasses.replace(base, kv_device_ratio=0.8),
                dataclasses.replace(base, resident_ratio=0.9), dataclasses.replace(base, micro_batch_size=128),
                dataclasses.replace(base, attention_on_device=False), dataclasses.replace(base, ffn_on_device=False)]
    wl = workload_spec_from_lengths([40, 300, 17, 512, 90, 256] * 40, 24)
    (step,) = [s for s in step_trace(wl.prompt_lengths, wl.request_gen_lengths, 256, 2048)
               if s.carries_prefill and s.decode_seqs][:1]
    warm = [(layer_decode_times(m, hw, p, 256, 300.0, False), layer_step_times(m, hw, p, wl, step, False))
            for p in variants]
    for i, p in enumerate(variants):
        fresh = dataclasses.replace(hw, name=f"{hw.name}-{i}")  # not equal: processors of its own
        assert (layer_decode_times(m, fresh, p, 256, 300.0, False),
                layer_step_times(m, fresh, p, wl, step, False)) == warm[i]
    assert len({d for d, _ in warm}) == len(variants)
