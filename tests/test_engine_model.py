"""Model pieces against transformers: RoPE variants and per-architecture flags from config,
dense-layer rules, dtype handling, unsupported architectures."""
from __future__ import annotations

import gc
import json
import sys

import pytest
import torch

from moe_engine.config import EngineConfig
from moe_engine.engine.llm_engine import LLMEngine
from moe_engine.model.arch import ARCHITECTURES, UnsupportedArchitectureError
from moe_engine.model.layers import rope_inv_freq
from moe_engine.model.loader import load_weights
from moe_engine.model.spec import load_spec
from moe_engine.engine.request import Request, SamplingParams


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    # Honoured since the config audit: transformers' defaults and yarn's optional keys.
    {"rope_type": "dynamic", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
     "truncate": False, "beta_fast": 16.0},
])
def test_rope_frequencies_match_transformers(tmp_path, scaling):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # Written by hand, as a hub checkpoint may be: keys transformers fills in stay missing.
    params = {"rope_theta": 500000.0, "rope_type": "default", **(scaling or {})}
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
        "num_hidden_layers": 1, "vocab_size": 32, "head_dim": 64, "num_local_experts": 4,
        "num_experts_per_tok": 2, "max_position_embeddings": 16384, "rope_parameters": params}))
    spec = load_spec(tmp_path)
    mine, mine_scale = rope_inv_freq(spec.rope, spec.head_dim)
    if scaling is None:
        ref = 1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](AutoConfig.from_pretrained(tmp_path))
    torch.testing.assert_close(mine, ref.float(), rtol=1e-6, atol=0)
    assert mine_scale == pytest.approx(ref_scale)


def test_legacy_rope_theta_and_scaling_keys_are_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 10,
        "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "rope_theta": 1e6,
        "rope_scaling": {"type": "linear", "factor": 2.0}}))
    spec = load_spec(tmp_path)
    assert spec.rope.theta == 1e6 and spec.rope.rope_type == "linear" and spec.rope.factor == 2.0
    assert spec.head_dim == 16


def test_bfloat16_engine_tracks_float32_logits(tiny_mixtral_dir):
    logits = {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(tiny_mixtral_dir, EngineConfig(threads=2, kv_cache_gb=0.01), dtype=dtype)
        assert engine.runner.cache.key[0].dtype == getattr(torch, dtype)
        engine.logits_observer = lambda seqs, lg, d=dtype: logits.setdefault(d, lg.clone())
        [r] = engine.generate([Request("a", prompt="Explain the router.",
                                       sampling=SamplingParams(max_new_tokens=3))])
        assert r.status == "ok"
    diff = (logits["float32"] - logits["bfloat16"]).abs().max().item()
    assert diff < 0.1 * logits["float32"].abs().max().item()


def test_unsupported_architecture_is_named_before_anything_loads(tmp_path):
    # Only a config.json: the error must come from the architecture check, not a missing file.
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["DbrxForCausalLM"], "model_type": "dbrx",
        "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_experts_per_tok": 2}))
    with pytest.raises(UnsupportedArchitectureError) as err:
        LLMEngine(tmp_path, EngineConfig(threads=1, kv_cache_gb=0.01))
    message = str(err.value)
    assert "DbrxForCausalLM" in message
    assert all(name in message for name in ARCHITECTURES)


@pytest.mark.parametrize("model_type,sparse_step,mlp_only", [
    ("qwen2_moe", 1, [1]), ("qwen2_moe", 2, []), ("qwen3_moe", 3, [0, 4]), ("qwen3_moe", 1, [])])
def test_dense_layers_are_the_ones_transformers_builds_as_mlp(tmp_path, model_type, sparse_step,
                                                              mlp_only):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=16, hidden_size=16, intermediate_size=8,
                               moe_intermediate_size=4, shared_expert_intermediate_size=8,
                               num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                               num_experts=4, num_experts_per_tok=2,
                               decoder_sparse_step=sparse_step, mlp_only_layers=mlp_only)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path)
    spec = load_spec(tmp_path)
    mlp_layers = tuple(i for i, layer in enumerate(model.model.layers)
                       if not hasattr(layer.mlp, "experts"))
    assert spec.dense_layers == mlp_layers
    assert spec.dense_intermediate_size == 8 and spec.intermediate_size == 4
    # Only Qwen2-MoE reads shared_expert_intermediate_size (the Qwen3 config carries it too).
    assert spec.shared_expert_intermediate_size == (8 if model_type == "qwen2_moe" else 0)
    # The saved checkpoint (per-expert names, dense MLPs, shared experts) loads completely.
    weights = load_weights(tmp_path, spec, torch.float32)
    assert [len(layer.experts) for layer in weights.layers] == [
        0 if i in mlp_layers else 4 for i in range(6)]


def test_glm4_moe_checkpoint_saved_by_transformers_loads_completely(tmp_path):
    """What transformers' save_pretrained writes for glm4_moe (per-expert tensor names, the fp32
    score-correction bias, n_shared_experts wide shared experts, first_k_dense_replace dense
    layers, partial_rotary_factor inside rope_parameters) reads back as transformers built it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("glm4_moe", vocab_size=16, hidden_size=16, intermediate_size=24,
                               moe_intermediate_size=4, n_shared_experts=2, n_routed_experts=8,
                               num_experts_per_tok=2, n_group=2, topk_group=1,
                               first_k_dense_replace=2, num_hidden_layers=4, head_dim=8,
                               num_attention_heads=2, num_key_value_heads=1, use_qk_norm=True,
                               attention_bias=True)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    biases = {}
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):  # fp32 beside bf16 weights, as the hub's checkpoints
            biases[i] = torch.randn(8, dtype=torch.float32)
            layer.mlp.gate.e_score_correction_bias = biases[i].clone()
    model.save_pretrained(tmp_path)
    spec = load_spec(tmp_path)
    mlp_layers = tuple(i for i, layer in enumerate(model.model.layers)
                       if not hasattr(layer.mlp, "experts"))
    assert spec.dense_layers == mlp_layers == (0, 1)
    assert spec.shared_expert_intermediate_size == 8 and spec.dense_intermediate_size == 24
    assert spec.rotary_dim == 2 * model.model.rotary_emb.inv_freq.numel() == 4
    assert (spec.router_groups, spec.router_topk_groups, spec.qk_norm) == (2, 1, "head")
    weights = load_weights(tmp_path, spec, torch.bfloat16)
    assert [len(layer.experts) for layer in weights.layers] == [0, 0, 8, 8]
    for i, bias in biases.items():
        dense = weights.layers[i].dense
        assert bias.dtype == torch.float32 and torch.equal(dense.score_correction_bias, bias)
        assert dense.shared_expert is not None and dense.shared_expert_gate is None
        assert dense.router.dtype == torch.float32  # fp32 router logits, as transformers


def test_ernie4_5_moe_checkpoint_saved_by_transformers_loads_completely(tmp_path):
    """What transformers' save_pretrained writes for ernie4_5_moe (per-expert tensor names, the
    moe_statics bias [1, E] and the router weight in fp32 beside bf16 weights, no lm_head as the
    head is tied, moe_k / moe_num_experts / moe_layer_* keys) reads back as transformers built
    it; so do the names of transformers' module (mlp.gate.moe_statics, fused experts)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("ernie4_5_moe", vocab_size=16, hidden_size=16,
                               intermediate_size=24, moe_intermediate_size=4, moe_num_experts=8,
                               moe_k=2, moe_num_shared_experts=2, moe_layer_start_index=1,
                               moe_layer_end_index=2, num_hidden_layers=4, head_dim=8,
                               num_attention_heads=2, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    biases, routers = {}, {}
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            biases[i] = torch.randn(1, 8, dtype=torch.float32)
            routers[i] = torch.randn(8, 16, dtype=torch.float32)  # not bf16-representable
            layer.mlp.gate.moe_statics.e_score_correction_bias.data = biases[i].clone()
            layer.mlp.gate.weight.data = routers[i].clone()
    model.save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in stored
    assert stored["model.layers.1.mlp.moe_statics.e_score_correction_bias"].shape == (1, 8)
    spec = load_spec(tmp_path)
    mlp_layers = tuple(i for i, layer in enumerate(model.model.layers)
                       if not hasattr(layer.mlp, "experts"))
    assert spec.dense_layers == mlp_layers == (0, 3)
    assert (spec.num_experts, spec.top_k, spec.tie_word_embeddings) == (8, 2, True)
    assert spec.shared_expert_intermediate_size == 8 and spec.dense_intermediate_size == 24
    assert spec.rope.theta == 500000.0 and spec.torch_dtype == "bfloat16"

    def check(weights):
        assert [len(layer.experts) for layer in weights.layers] == [0, 8, 8, 0]
        assert weights.head_tied
        for i, bias in biases.items():
            dense = weights.layers[i].dense
            assert torch.equal(dense.score_correction_bias, bias[0])
            assert torch.equal(dense.router, routers[i])  # fp32 as stored, never rounded
            assert dense.shared_expert is not None and dense.shared_expert_gate is None
        return weights

    hub = check(load_weights(tmp_path, spec, torch.bfloat16))
    fused = {}
    for name, t in stored.items():
        name = name.replace(".mlp.moe_statics.", ".mlp.gate.moe_statics.")
        if ".mlp.experts." not in name:
            fused[name] = t
    for i in biases:
        experts = model.model.layers[i].mlp.experts
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = experts.gate_up_proj.data
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = experts.down_proj.data
    in_memory = tmp_path / "in_memory"
    in_memory.mkdir()
    save_file(fused, str(in_memory / "model.safetensors"))
    (in_memory / "config.json").write_text((tmp_path / "config.json").read_text())
    module = check(load_weights(in_memory, spec, torch.bfloat16))
    for a, b in zip(hub.layers, module.layers):
        assert all(torch.equal(x.w13, y.w13) and torch.equal(x.w2, y.w2)
                   for x, y in zip(a.experts, b.experts))


def test_gpt_oss_checkpoint_saved_by_transformers_loads_as_its_experts_compute(tmp_path):
    """What transformers' save_pretrained writes for gpt_oss (fused experts [E, H, 2I] with gate
    and up interleaved in the columns, down [E, I, H], biases, router bias, sinks) loads into
    experts that compute what transformers' GptOssExperts computes, expert by expert."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moe_engine.model.layers import swiglu

    cfg = AutoConfig.for_model("gpt_oss", vocab_size=16, hidden_size=16, intermediate_size=24,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                               swiglu_limit=0.5)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # transformers initialises the biases to zero: make them count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(tmp_path)
    spec = load_spec(tmp_path)
    assert spec.layer_types == ("sliding_attention", "full_attention") and spec.sliding_window == 128
    assert (spec.rope.rope_type, spec.rope.factor, spec.rope.truncate) == ("yarn", 32.0, False)
    weights = load_weights(tmp_path, spec, torch.float32)
    x = torch.randn(5, 16)
    for i, layer in enumerate(model.model.layers):
        ex, dense = layer.mlp.experts, weights.layers[i].dense
        assert torch.equal(dense.sinks, layer.self_attn.sinks.detach())
        assert torch.equal(dense.router_bias, layer.mlp.router.bias.detach())
        for e, mine in enumerate(weights.layers[i].experts):
            with torch.no_grad():
                gate_up = x @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
                ref = ex._apply_gate(gate_up) @ ex.down_proj[e] + ex.down_proj_bias[e]
            torch.testing.assert_close(swiglu(mine, x), ref, rtol=1e-5, atol=1e-5)


def test_qwen2_moe_config_without_qkv_bias_key_has_biases(tmp_path):
    # Hub Qwen1.5-MoE configs omit qkv_bias; transformers defaults it to true.
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 10,
        "hidden_size": 64, "intermediate_size": 32, "moe_intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "use_sliding_window": False, "sliding_window": 4096}))
    spec = load_spec(tmp_path)
    assert spec.qkv_bias and not spec.o_bias and not spec.norm_topk_prob
    assert spec.sliding_window is None
    assert spec.shared_expert_intermediate_size == 5632  # transformers' default, as for the bias


# transformers' vision rotary table is complex; casting the model to bf16 warns about it.
@pytest.mark.filterwarnings("ignore:Casting complex values")
def test_llama4_multimodal_checkpoint_saved_by_transformers_loads_its_text_model(tmp_path):
    """What transformers' save_pretrained writes for Llama4ForConditionalGeneration (as Scout
    and Maverick are released: the text config under text_config, the dtype only at the top,
    language_model.* tensors beside vision_model.* and multi_modal_projector.*) loads as the
    text model, whose experts compute what transformers' Llama4TextExperts computes: fused
    gate_up [E, H, 2I] (gate then up) and down [E, I, H], x @ W."""
    from safetensors.torch import load_file
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from moe_engine.model.layers import swiglu

    text = dict(vocab_size=32, hidden_size=16, intermediate_size=8, intermediate_size_mlp=24,
                num_hidden_layers=4, head_dim=8, num_attention_heads=2, num_key_value_heads=1,
                num_local_experts=4, interleave_moe_layer_step=2)
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, image_size=28, patch_size=14, vision_output_dim=16,
                  projector_input_dim=16, projector_output_dim=16, pixel_shuffle_ratio=0.5)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision))
    model = model.to(torch.bfloat16)
    with torch.no_grad():  # the experts are initialised to zeros
        for layer in model.language_model.model.layers:
            if layer.is_moe_layer:
                experts = layer.feed_forward.experts
                for p in (experts.gate_up_proj, experts.down_proj):
                    p.copy_(torch.randn(p.shape))
    model.save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert any(name.startswith("vision_model.") for name in stored)
    spec = load_spec(tmp_path)
    assert spec.architecture == "Llama4ForConditionalGeneration" and spec.torch_dtype == "bfloat16"
    assert spec.dense_layers == (0, 2) and spec.dense_intermediate_size == 24
    assert (spec.num_experts, spec.top_k, spec.shared_expert_intermediate_size) == (4, 1, 8)
    assert spec.nope_layers == (3,) and spec.qk_l2_norm and spec.rope.theta == 500000.0
    # transformers' default 131072 positions capped at its default chunk
    assert spec.attention_chunk_size == 8192 and spec.max_position_embeddings == 8192
    weights = load_weights(tmp_path, spec, torch.float32)
    assert [len(layer.experts) for layer in weights.layers] == [0, 4, 0, 4]
    x = torch.randn(5, 16)
    for i in (1, 3):
        ref = model.language_model.model.layers[i].feed_forward.experts
        assert weights.layers[i].dense.shared_expert is not None
        for e in range(4):
            gate, up = (x @ ref.gate_up_proj[e].float()).chunk(2, dim=-1)
            expected = (up * torch.nn.functional.silu(gate)) @ ref.down_proj[e].float()
            torch.testing.assert_close(swiglu(weights.layers[i].experts[e], x), expected)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_loaded_weights_keep_no_mapping_of_the_checkpoint_file(tiny_mixtral_dir):
    """safetensors hands out views of the file's mapping; weights held in the checkpoint's own
    dtype (no cast to copy them) used to keep the whole mapping, and every page reading faulted
    in, resident beside the engine's own copies. Loaded, they are memory of their own, with the
    checkpoint's values."""
    from safetensors.torch import load_file

    shard = str((tiny_mixtral_dir / "model.safetensors").resolve())
    embed = next(t for name, t in load_file(shard).items() if "embed_tokens" in name).clone()
    spec = load_spec(tiny_mixtral_dir)
    weights = load_weights(tiny_mixtral_dir, spec, embed.dtype)  # the checkpoint's dtype: no cast
    gc.collect()  # load_file's own views of the file
    assert not [line for line in open("/proc/self/maps") if line.rstrip().endswith(shard)]
    assert torch.equal(weights.embed, embed)
