"""config.json fields of public MoE checkpoints, written from their published configs (no hub
access needed). Used for what-if policies on hardware this machine is not, and as test fixtures.
Only the fields the performance model reads are kept.
"""
from __future__ import annotations

from typing import Any

from .specs import ModelSpec

def _gpt_oss(**sizes: Any) -> dict[str, Any]:
    """GPT-OSS-20B/120B: the same per-layer shapes, windowed (128) and full layers alternating."""
    layers = sizes["num_hidden_layers"]
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_experts_per_tok": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(layers)],
        "attention_bias": True, "swiglu_limit": 7.0, "max_position_embeddings": 131072,
        "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 4096},
        "vocab_size": 201088, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        # as released: the routed experts in MXFP4, the rest (biases included) in bf16
        "quantization_config": {"quant_method": "mxfp4",
                                "modules_to_not_convert": ["model.layers.*.self_attn",
                                                           "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"]},
        **sizes,
    }


def _llama4(**text: Any) -> dict[str, Any]:
    """Llama-4 Scout/Maverick as released: Llama4ForConditionalGeneration, the text model's keys
    under text_config (the vision encoder, ~0.8B, is not part of the spec). The two share
    their per-layer shapes: 5120 wide, 48 layers, GQA 40/8 heads of 128, experts of 8192 and
    one shared expert as wide, dense MLPs of 16384, chunks of 8192, NoPE every fourth layer."""
    return {
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
        "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
            "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
            "num_key_value_heads": 8, "head_dim": 128, "num_experts_per_tok": 1,
            "vocab_size": 202048, "rope_theta": 500000.0, "attention_chunk_size": 8192,
            "no_rope_layer_interval": 4, "attn_temperature_tuning": True, "floor_scale": 8192,
            "attn_scale": 0.1, "attention_bias": False, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", **text},
        "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 1408,
                          "num_hidden_layers": 34},
    }


REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": {
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "mixtral-8x22b": {
        "model_type": "mixtral", "hidden_size": 6144, "intermediate_size": 16384, "num_hidden_layers": 56,
        "num_attention_heads": 48, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "qwen1.5-moe-a2.7b": {
        "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
        "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "olmoe-1b-7b": {
        "model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "vocab_size": 50304, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 102400, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    # DeepSeek-V3 (deepseek-ai's config.json; its one multi-token-prediction layer is left
    # out, as the published 671B total / 37B activated leave it out).
    "deepseek-v3": {
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "first_k_dense_replace": 3, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        "rope_theta": 10000, "vocab_size": 129280, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    # GLM-4.5 and GLM-4.5-Air (zai-org's config.json). Both checkpoints also hold one
    # multi-token-prediction layer (num_nextn_predict_layers: 1) that generation does not run;
    # it is not a decoder layer here, and the published 355B/32B and 106B/12B leave it out too.
    "glm-4.5": {
        "model_type": "glm4_moe", "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 92, "first_k_dense_replace": 3, "num_attention_heads": 96, "num_key_value_heads": 8,
        "head_dim": 128, "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1,
        "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "attention_bias": True,
        "use_qk_norm": True, "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 1,
        "max_position_embeddings": 131072, "rope_theta": 1000000, "vocab_size": 151552,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "glm-4.5-air": {
        "model_type": "glm4_moe", "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 46, "first_k_dense_replace": 1, "num_attention_heads": 96, "num_key_value_heads": 8,
        "head_dim": 128, "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1,
        "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "attention_bias": True,
        "use_qk_norm": False, "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 1,
        "max_position_embeddings": 131072, "rope_theta": 1000000, "vocab_size": 151552,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    # ERNIE-4.5-21B-A3B (baidu's -PT config.json; the model card's 28 layers, 20/4 heads,
    # 64 experts top-6, 2 shared; Ernie4_5_MoeConfig's defaults are this model). Its key names:
    # moe_k, moe_num_experts, ... The LM head is tied to the embedding. The MTP module the
    # checkpoints carry (mtp_* tensors) is not a decoder layer here.
    "ernie-4.5-21b-a3b": {
        "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", "hidden_size": 2560,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 28,
        "num_attention_heads": 20, "num_key_value_heads": 4, "moe_num_experts": 64, "moe_k": 6,
        "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_interval": 1,
        "use_bias": False, "max_position_embeddings": 131072, "rope_theta": 500000, "vocab_size": 103424,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    },
    # Llama-4-Scout-17B-16E: 16 experts on every layer, L2 q/k norm, llama3 RoPE scaling.
    "llama-4-scout-17b-16e": _llama4(
        num_local_experts=16, interleave_moe_layer_step=1, use_qk_norm=True,
        max_position_embeddings=10485760,
        rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
    # Llama-4-Maverick-17B-128E: 128 experts on every second layer, no q/k norm, plain RoPE.
    "llama-4-maverick-17b-128e": _llama4(
        num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False,
        max_position_embeddings=1048576),
    "gpt-oss-20b": _gpt_oss(num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": _gpt_oss(num_hidden_layers=36, num_local_experts=128),
}


def reference_model(name: str) -> ModelSpec:
    """ModelSpec of a public checkpoint listed in REFERENCE_CONFIGS."""
    if name not in REFERENCE_CONFIGS:
        raise KeyError(f"unknown reference model {name!r}; known: {sorted(REFERENCE_CONFIGS)}")
    return ModelSpec.from_hf_config(REFERENCE_CONFIGS[name], name=name)
