"""config.json fields that change the math: refused at load naming the field (and transformers
shows that they do change its output), or honoured (the engine matches transformers with them
set). One case per field and family; the audit is in moe_engine/model/config_audit.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_engine.config import ConfigError, EngineConfig, compose
from moe_engine.engine.llm_engine import LLMEngine
from moe_engine.model.config_audit import UnhonouredFieldError
from moe_engine.model.spec import ModelSpec, load_spec

from test_engine_parity import PROMPTS, _assert_matches, _hf_generate, _hf_model, _requests

# Prompts 2 and 8 are 36 and 32 tokens long: past every window below.
LONG = [2, 8]


def _variant(base: Path, out: Path, changes: dict[str, Any]) -> Path:
    """A copy of checkpoint `base` whose config.json has `changes` (None deletes a key)."""
    out.mkdir()
    for f in base.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(changes)
    # Only the changes' Nones delete: a null in the base config (V2's q_lora_rank) is a value.
    deleted = {k for k, v in changes.items() if v is None}
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in deleted}))
    return out


def _hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return _hf_model(model_dir)(torch.tensor([ids])).logits[0]


# id: (preset, config changes, text the error must name, whether transformers can run it)
REFUSED: dict[str, tuple[str, dict[str, Any], str, bool]] = {
    # The case: Mixtral windows every layer when the key is set.
    "mixtral-sliding-window-32": ("tiny-mixtral", {"sliding_window": 32}, "sliding_window=32", True),
    # Mixtral has no use_sliding_window: transformers windows anyway.
    "mixtral-sliding-window-ignores-use-flag": (
        "tiny-mixtral", {"sliding_window": 16, "use_sliding_window": False}, "sliding_window=16", True),
    "qwen2-moe-use-sliding-window": (
        "tiny-qwen2-moe", {"use_sliding_window": True, "sliding_window": 16}, "sliding_window=16", True),
    "qwen3-moe-use-sliding-window": (
        "tiny-qwen3-moe", {"use_sliding_window": True, "sliding_window": 16}, "sliding_window=16", True),
    # Explicit layer_types win over use_sliding_window (window 0 then); transformers masks
    # every key of those layers, so there is no reference output to compare.
    "qwen2-moe-layer-types": (
        "tiny-qwen2-moe", {"layer_types": ["sliding_attention", "full_attention", "full_attention"],
                           "use_sliding_window": False, "sliding_window": 16}, "layer_types=", False),
    # OLMoE passes the key to the attention kernels (flash attention applies it); eager and
    # SDPA ignore it, so transformers' output on this machine is no reference either.
    "olmoe-sliding-window": ("tiny-olmoe", {"sliding_window": 16}, "sliding_window=16", False),
    "mixtral-hidden-act-gelu": ("tiny-mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu'", True),
    "qwen2-moe-hidden-act-relu": ("tiny-qwen2-moe", {"hidden_act": "relu"}, "hidden_act='relu'", True),
    "qwen3-moe-hidden-act-gelu": ("tiny-qwen3-moe", {"hidden_act": "gelu"}, "hidden_act='gelu'", True),
    "olmoe-hidden-act-gelu": ("tiny-olmoe", {"hidden_act": "gelu"}, "hidden_act='gelu'", True),
    "mixtral-rope-longrope": (
        "tiny-mixtral", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0,
                                          "original_max_position_embeddings": 1024,
                                          "short_factor": [2.0] * 16, "long_factor": [4.0] * 16}},
        "rope_scaling.rope_type='longrope'", True),
    # transformers' Mixtral/Qwen/OLMoE rotate whole heads, so they cannot run a partial factor.
    "qwen3-moe-partial-rotary": (
        "tiny-qwen3-moe", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5", False),
    # GLM-4.5's forward ignores the key, but transformers' generate windows its masks with it
    # (masking_utils.create_masks_for_generate), so generated tokens depend on it.
    "glm4-moe-sliding-window": ("tiny-glm4-moe", {"sliding_window": 16}, "sliding_window=16", False),
    "glm4-moe-hidden-act-gelu": ("tiny-glm4-moe", {"hidden_act": "gelu"}, "hidden_act='gelu'", True),
    "glm4-moe-quantization-config": (
        "tiny-glm4-moe", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config", False),
    "olmoe-quantization-config": (
        "tiny-olmoe", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config", False),
    # MXFP4 (the released checkpoints) loads (tiny-gpt-oss-mxfp4); another method does not.
    "gpt-oss-fp8": ("tiny-gpt-oss", {"quantization_config": {"quant_method": "fp8"}},
                    "quantization_config \\(quant_method='fp8'\\): not supported on gpt_oss", False),
    "gpt-oss-unknown-layer-type": (
        "tiny-gpt-oss", {"layer_types": ["chunked_attention", "full_attention", "full_attention"]},
        "layer_types has ['chunked_attention']", False),
    # The released DeepSeek-V3 is FP8 with block scales, as its config.json says.
    "deepseek-v3-fp8-quantization-config": (
        "tiny-deepseek-v3", {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                     "activation_scheme": "dynamic",
                                                     "weight_block_size": [128, 128]}},
        "quantization_config \\(quant_method='fp8'\\)", False),
    "deepseek-v3-hidden-act-gelu": ("tiny-deepseek-v3", {"hidden_act": "gelu"}, "hidden_act='gelu'", True),
    # The checkpoint has no bias tensors to compare against: transformers would draw them.
    "deepseek-v3-attention-bias": ("tiny-deepseek-v3", {"attention_bias": True},
                                   "attention_bias=True", False),
    "deepseek-v3-moe-layer-freq": ("tiny-deepseek-v3", {"moe_layer_freq": 2}, "moe_layer_freq=2",
                                   False),
    "deepseek-v2-mlp-bias": ("tiny-deepseek-v2", {"mlp_bias": True}, "mlp_bias=True", False),
    # One switch for biases on q/k/v/o, the MLPs and the LM head; the checkpoint has none.
    "ernie45-moe-use-bias": ("tiny-ernie45-moe", {"use_bias": True}, "use_bias=True", False),
    "ernie45-moe-partial-rotary": (
        "tiny-ernie45-moe", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5", False),
    "ernie45-moe-sliding-window": (
        "tiny-ernie45-moe", {"sliding_window": 16}, "sliding_window=16", False),
    # Llama-4's mask mapping has full and chunked layers only (another kind is a KeyError);
    # transformers indexes no_rope_layers by layer.
    "llama4-sliding-layer-type": (
        "tiny-llama4", {"layer_types": ["sliding_attention", "chunked_attention",
                                        "chunked_attention", "full_attention"]},
        "layer_types has ['sliding_attention']", False),
    "llama4-short-no-rope-layers": ("tiny-llama4", {"no_rope_layers": [1, 1]},
                                    "no_rope_layers has 2 entries for 4 layers", False),
    "llama4-hidden-act-gelu": ("tiny-llama4", {"hidden_act": "gelu"}, "hidden_act='gelu'", True),
    # transformers' V2 router has no such branch (it fails on its missing weights).
    "deepseek-v2-topk-method-noaux-tc": ("tiny-deepseek-v2", {"topk_method": "noaux_tc"},
                                         "topk_method='noaux_tc'", False),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_field_that_changes_the_math_is_refused_at_load(case, builtin_dir, tmp_path):
    preset, changes, named, transformers_runs = REFUSED[case]
    base = builtin_dir(preset)
    model_dir = _variant(base, tmp_path / case, changes)
    with pytest.raises(UnhonouredFieldError, match=named.replace("[", r"\[")):
        load_spec(model_dir)
    # The performance model reads the same spec: the policy stage refuses too.
    with pytest.raises(UnhonouredFieldError):
        ModelSpec.from_hf_config(model_dir)
    with pytest.raises(UnhonouredFieldError):
        LLMEngine(model_dir, EngineConfig(threads=1, kv_cache_gb=0.01), dtype="float32")
    if transformers_runs:
        # The refusal is needed: with the field set, transformers' logits change.
        from moe_engine.engine.tokenizer import load_tokenizer

        ids = load_tokenizer(base).encode_prompt(PROMPTS[LONG[0]])
        diff = (_hf_logits(base, ids) - _hf_logits(model_dir, ids)).abs().max().item()
        assert diff > 1e-3, f"{case}: transformers' output does not depend on {changes}"


# id: (preset, config changes); each must load and match transformers on prompts past 16 tokens.
HONOURED: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-sliding-window-null": ("tiny-mixtral", {"sliding_window": None}),
    "mixtral-sliding-window-at-max-positions": ("tiny-mixtral", {"sliding_window": 4096}),
    "qwen2-moe-window-size-without-use-flag": (
        "tiny-qwen2-moe", {"use_sliding_window": False, "sliding_window": 16}),
    "qwen2-moe-sliding-window-above-max-window-layers": (
        "tiny-qwen2-moe", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}),
    "qwen3-moe-window-size-without-use-flag": (
        "tiny-qwen3-moe", {"use_sliding_window": False, "sliding_window": 16}),
    "mixtral-training-only-fields": (
        "tiny-mixtral", {"router_jitter_noise": 0.5, "attention_dropout": 0.5,
                         "output_router_logits": True, "router_aux_loss_coef": 0.5}),
    "mixtral-attention-bias-not-read": ("tiny-mixtral", {"attention_bias": True}),
    "olmoe-hidden-act-swish": ("tiny-olmoe", {"hidden_act": "swish"}),
    # transformers does not tie when the checkpoint has its own lm_head; neither does the loader.
    "mixtral-tie-word-embeddings-with-own-lm-head": ("tiny-mixtral", {"tie_word_embeddings": True}),
    "qwen3-moe-rope-dynamic": (
        "tiny-qwen3-moe", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}),
    # GLM-4.5's multi-token-prediction layer is not run.
    "glm4-moe-mtp-layer-count": ("tiny-glm4-moe", {"num_nextn_predict_layers": 1}),
    # transformers' order: rope_parameters' factor over the top-level key (24 of 32 dims)...
    "glm4-moe-partial-rotary-in-rope-parameters": (
        "tiny-glm4-moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                              "partial_rotary_factor": 0.75}}),
    # ...and GLM's default 0.5 when config.json has neither (a 16-of-32 rotation).
    "glm4-moe-partial-rotary-default": ("tiny-glm4-moe", {"partial_rotary_factor": None}),
    # YaRN over the rotated part only: its frequencies and ramp are those of 16 dims.
    "glm4-moe-rope-yarn-partial": (
        "tiny-glm4-moe", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 64}}),
    # GPT-OSS: the window moves with sliding_window, hidden_act is never read, layer_types
    # absent means even layers windowed, and a config without RoPE keys runs GptOssConfig's YaRN.
    "gpt-oss-window-4": ("tiny-gpt-oss", {"sliding_window": 4}),
    "gpt-oss-hidden-act-not-read": ("tiny-gpt-oss", {"hidden_act": "gelu"}),
    "gpt-oss-default-layer-types": ("tiny-gpt-oss", {"layer_types": None}),
    "gpt-oss-default-rope": ("tiny-gpt-oss", {"rope_scaling": None, "rope_theta": None}),
    "gpt-oss-swiglu-alpha": ("tiny-gpt-oss", {"swiglu_alpha": 0.5}),
    # DeepSeek-V3 with rotate-half RoPE instead of interleaved pairs.
    "deepseek-v3-rope-not-interleaved": ("tiny-deepseek-v3", {"rope_interleave": False}),
    # The hub's V3 rope_scaling (legacy "type" key): YaRN on the rope dims, and mscale_all_dim
    # squared in the softmax scale.
    "deepseek-v3-rope-yarn-mscale-all-dim": (
        "tiny-deepseek-v3", {"rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 1.0,
                                              "mscale_all_dim": 1.0, "beta_fast": 32,
                                              "beta_slow": 1,
                                              "original_max_position_embeddings": 64}}),
    # The hub's V2 values: equal mscale and mscale_all_dim leave cos/sin unscaled.
    "deepseek-v2-rope-yarn-mscale-all-dim": (
        "tiny-deepseek-v2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                                              "mscale_all_dim": 0.707,
                                              "original_max_position_embeddings": 64}}),
    # V2-Lite's router: greedy top-k over every expert, groups ignored.
    "deepseek-v2-greedy-ignores-groups": ("tiny-deepseek-v2", {"topk_method": "greedy"}),
    # transformers' V2 router never renormalises, whatever norm_topk_prob says.
    "deepseek-v2-norm-topk-prob-not-read": ("tiny-deepseek-v2", {"norm_topk_prob": True}),
    # The hub's V3 keys transformers does not read, and its multi-token-prediction layer count.
    "deepseek-v3-hub-keys-not-read": (
        "tiny-deepseek-v3", {"num_nextn_predict_layers": 1, "ep_size": 1, "aux_loss_alpha": 0.001,
                             "seq_aux": True, "scoring_func": "softmax", "topk_method": "greedy"}),
    "deepseek-v3-one-group": ("tiny-deepseek-v3", {"n_group": 1, "topk_group": 1}),
    # Ernie4_5_MoeConfig's theta (500000) when config.json has none.
    "ernie45-moe-default-theta": ("tiny-ernie45-moe", {"rope_theta": None}),
    # Keys of the hub's ERNIE-4.5 configs transformers never reads (its router always adds the
    # moe_statics bias; the MTP weights are not loaded).
    "ernie45-moe-hub-keys-not-read": (
        "tiny-ernie45-moe", {"moe_capacity": [64, 64, 64], "moe_gate": "topk",
                             "moe_use_aux_free": False, "num_nextn_predict_layers": 1,
                             "multi_token_pred_lambda": 0.3}),
    # The transformers 5 spelling of RoPE, and YaRN on interleaved pairs.
    "ernie45-moe-rope-parameters-yarn": (
        "tiny-ernie45-moe", {"rope_theta": None,
                             "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                                 "factor": 4.0,
                                                 "original_max_position_embeddings": 64}}),
    # Llama-4: an explicit moe_layers list wins over interleave_moe_layer_step (1 would make
    # every layer MoE, and the checkpoint has no experts on layers 0 and 2); every layer full
    # (no chunked layer, so no cap on the context); the temperature off; Llama4TextConfig's
    # theta (500000) and default RoPE when config.json has neither, with keys of the hub's
    # configs that change nothing at inference.
    "llama4-explicit-moe-layers": ("tiny-llama4", {"moe_layers": [1, 3],
                                                   "interleave_moe_layer_step": 1}),
    "llama4-all-full-attention": ("tiny-llama4", {"layer_types": ["full_attention"] * 4}),
    "llama4-no-temperature-tuning": ("tiny-llama4", {"attn_temperature_tuning": False}),
    "llama4-default-theta-hub-keys": (
        "tiny-llama4", {"rope_theta": None, "rope_scaling": None, "router_jitter_noise": 0.0,
                        "cache_implementation": "hybrid", "attention_dropout": 0.0}),
    "qwen2-moe-rope-yarn-mscale": (
        "tiny-qwen2-moe", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                            "mscale_all_dim": 0.5,
                                            "original_max_position_embeddings": 64}}),
}


@pytest.mark.parametrize("case", sorted(HONOURED))
def test_field_that_loads_matches_transformers(case, builtin_dir, tmp_path):
    preset, changes = HONOURED[case]
    model_dir = _variant(builtin_dir(preset), tmp_path / case, changes)
    engine = LLMEngine(model_dir, EngineConfig(threads=2, kv_cache_gb=0.01), dtype="float32")
    spec = engine.spec
    # A window shorter than the context only where the engine windows per layer (GPT-OSS).
    assert spec.num_windowed_layers or spec.sliding_window is None or \
        spec.sliding_window >= spec.max_position_embeddings
    reference = _hf_generate(_hf_model(model_dir), engine.tokenizer, [PROMPTS[i] for i in LONG])
    reference = {str(i): reference[str(k)] for k, i in enumerate(LONG)}
    _assert_matches(engine, reference, _requests(LONG))


def test_compose_refuses_a_checkpoint_with_an_unhonoured_field(builtin_dir, tmp_path):
    model_dir = _variant(builtin_dir("tiny-mixtral"), tmp_path / "windowed", {"sliding_window": 32})
    with pytest.raises(ConfigError, match="sliding_window=32"):
        compose(f"model=hf model.path={model_dir}")


def test_llama4_chunked_layers_without_a_chunk_size_are_refused(builtin_dir):
    """attention_chunk_size null with chunked layers: transformers builds no mask (it raises);
    the engine refuses the config by name rather than guess a chunk."""
    cfg = json.loads((builtin_dir("tiny-llama4") / "config.json").read_text())
    with pytest.raises(UnhonouredFieldError, match="attention_chunk_size=None"):
        ModelSpec.from_hf_config({**cfg, "attention_chunk_size": None})
    spec = ModelSpec.from_hf_config({**cfg, "attention_chunk_size": None,
                                     "layer_types": ["full_attention"] * 4})
    assert spec.attention_chunk_size is None and spec.max_position_embeddings == 4096


def test_llama4_spec_reads_its_fields():
    """What tiny-llama4's config sets, as ModelSpec holds it: MoE on layers 1 and 3, dense
    layers intermediate_size_mlp wide, one expert-wide shared expert, layer 3 NoPE with the
    temperature, the context capped at the chunk."""
    from moe_engine.tools.presets import PRESETS, hf_config

    spec = ModelSpec.from_hf_config(hf_config(PRESETS["tiny-llama4"]))
    assert spec.dense_layers == (0, 2) and spec.dense_intermediate_size == 128
    assert spec.shared_expert_intermediate_size == 32 and not spec.shared_expert_gate
    assert spec.nope_layers == (3,) and spec.qk_l2_norm and spec.rope_interleave
    assert (spec.attn_temperature_floor, spec.attn_temperature_scale) == (4.0, 0.5)
    assert spec.attention_chunk_size == 2048 and spec.max_position_embeddings == 2048
    assert spec.router_scoring == "topk_sigmoid" and spec.router_scales_input
