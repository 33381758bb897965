"""config.json fields that would change the math but the engine does not compute: refused at load.

Audited field by field against transformers' configuration and modeling files of the ten
families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5-MoE, DeepSeek-V3, DeepSeek-V2, GPT-OSS,
ERNIE-4.5-MoE, Llama-4). A field is in one of three groups:
  honoured: spec.py reads it into ModelSpec and the layers compute it (shapes, rms_norm_eps,
      RoPE default/dynamic/linear/llama3/yarn, biases, q/k norms, clip_qkv, norm_topk_prob, shared
      experts, dense layers, tied embeddings, dtype; GLM-4.5's partial_rotary_factor,
      use_qk_norm, n_shared_experts, first_k_dense_replace, n_group, topk_group,
      routed_scaling_factor; DeepSeek's MLA ranks and head dims, rope_interleave, V2's
      topk_method, YaRN's mscale_all_dim in the softmax scale; GPT-OSS's layer_types with
      sliding_window, swiglu_alpha, swiglu_limit, attention_bias and its YaRN with truncate;
      ERNIE-4.5's moe_num_experts, moe_k, moe_intermediate_size, moe_num_shared_experts,
      moe_layer_start_index/end_index/interval, moe_norm_min, default theta 500000;
      Llama-4's interleave_moe_layer_step, moe_layers, intermediate_size_mlp, its router
      (sigmoid of the top-k logits scaling the experts' inputs, any num_experts_per_tok),
      no_rope_layers / no_rope_layer_interval, use_qk_norm (L2 on RoPE layers),
      attn_temperature_tuning with floor_scale and attn_scale, attention_bias, default theta
      500000, and its text_config under Llama4ForConditionalGeneration; attention_chunk_size
      and layer_types (chunked_attention on RoPE layers) by capping the context at the chunk,
      within which chunked attention is causal attention);
  inert at inference: initializer_range, use_cache, pad/bos/eos_token_id, output_router_logits,
      router_aux_loss_coef, attention_dropout and router_jitter_noise (transformers applies both
      only in training), attention_bias on Mixtral and Qwen2-MoE (their attention never reads
      it), a sliding window no sequence can outgrow, GLM-4.5's num_nextn_predict_layers (the
      multi-token-prediction layer only drafts tokens for speculative decoding; generate does
      not run it by default) and DeepSeek-V3's; keys transformers' DeepSeek code never reads
      (scoring_func, topk_method on V3, ep_size, aux_loss_alpha, seq_aux; norm_topk_prob on
      V2); hidden_act on GPT-OSS (its experts always compute the clamped SwiGLU, whatever the
      key says); ERNIE-4.5 keys of the hub's configs transformers never reads (moe_capacity,
      moe_gate, moe_use_aux_free: its router always adds the moe_statics bias;
      num_nextn_predict_layers and multi_token_pred_lambda: the MTP weights are not loaded);
      Llama4ForConditionalGeneration's vision_config and image keys (text-only generation);
  refused here: everything else that transformers computes, each naming the field and value
      (ERNIE-4.5's use_bias=True among them; Llama-4's layer kinds other than full and
      chunked, a chunked layer without a chunk size, a short no_rope_layers).
It never opens a file: spec.py reads config.json and hands over the dict, and reads the RoPE
parameters and the effective window through the helpers here, so reader and judge agree.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

# transformers' ACT2FN maps both names to F.silu, the only activation swiglu computes.
SILU_NAMES = ("silu", "swish")
# rope types layers.rope_inv_freq computes (transformers' ROPE_INIT_FUNCTIONS has more).
ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "yarn")


class UnhonouredFieldError(ValueError):
    """config.json sets a field that changes the model's output and the engine does not
    compute it; the message names the field, its value and why."""


# Architectures whose layers are windowed per layer_types, and the engine windows them too.
WINDOWED_TYPES = ("gpt_oss",)
LAYER_KINDS = ("full_attention", "sliding_attention")


def layer_types(cfg: Mapping[str, Any], model_type: str) -> tuple[str, ...]:
    """Each layer's attention kind where the engine windows per layer (WINDOWED_TYPES), as
    GptOssConfig fills it: explicit layer_types, else even layers sliding and odd ones full;
    () for the other architectures (their window is all or nothing, see sliding_window)."""
    if model_type not in WINDOWED_TYPES:
        return ()
    explicit = cfg.get("layer_types")
    if explicit:
        return tuple(str(t) for t in explicit)
    return tuple("sliding_attention" if (i + 1) % 2 else "full_attention"
                 for i in range(int(cfg.get("num_hidden_layers", 0))))


def sliding_window(cfg: Mapping[str, Any], model_type: str) -> tuple[str, Optional[int]]:
    """(field, window): the attention window transformers applies to at least one layer of a
    `model_type` model (None when no layer is windowed) and the config field that sets it;
    each family switches it differently."""
    window = cfg.get("sliding_window")
    if model_type == "gpt_oss":
        # GptOssConfig's default window is 128; layer_types says which layers it covers.
        window = cfg.get("sliding_window", 128)
        return ("sliding_window",
                window if "sliding_attention" in layer_types(cfg, model_type) else None)
    if model_type == "qwen3_moe":
        return ("sliding_window", window if cfg.get("use_sliding_window", False) else None)
    if model_type == "qwen2_moe":
        use = bool(cfg.get("use_sliding_window", False))
        layers = int(cfg.get("num_hidden_layers", 0))
        # Qwen2MoeConfig: window 0 when use_sliding_window is off; explicit layer_types win,
        # else every even layer below max_window_layers is windowed.
        types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 and i < int(cfg.get("max_window_layers", 28)) and use
            else "full_attention" for i in range(layers)]
        if "sliding_attention" not in types:
            return ("sliding_window", None)
        field = "sliding_window" if use else "layer_types"
        return (field, window if use else 0)
    # Mixtral windows every layer whenever the key is set (it has no use_sliding_window);
    # OLMoE hands the key to the attention kernels, and flash attention applies it; GLM-4.5's
    # attention has no window, but transformers' generate builds its masks from the config
    # (masking_utils.create_masks_for_generate windows them when the key is set).
    return ("sliding_window", window)


def _check_sliding_window(cfg: Mapping[str, Any], model_type: str) -> Optional[str]:
    if model_type in WINDOWED_TYPES:
        unknown = sorted(set(layer_types(cfg, model_type)) - set(LAYER_KINDS))
        if unknown:
            return f"layer_types has {unknown}: the engine computes {', '.join(LAYER_KINDS)}"
        window = sliding_window(cfg, model_type)[1]
        if window is not None and int(window) < 1:
            return f"sliding_window={window!r}: a windowed layer needs a window of 1 or more"
        return None
    field, window = sliding_window(cfg, model_type)
    positions = int(cfg.get("max_position_embeddings", 4096))
    # The engine never runs a sequence past max_position_embeddings, so a window at least that
    # long never hides a token: the attention is the full causal one either way.
    if window is None or int(window) >= positions:
        return None
    value = cfg.get(field)
    return (f"{field}={value!r}: sliding-window attention (window {window} < "
            f"max_position_embeddings={positions}) is not implemented; the engine attends to the "
            "whole context and would diverge from the model after the window's length")


# Architectures whose experts compute a fixed activation that hidden_act does not select.
FIXED_ACTIVATION_TYPES = ("gpt_oss",)


def _check_activation(cfg: Mapping[str, Any], model_type: str) -> Optional[str]:
    if model_type in FIXED_ACTIVATION_TYPES:
        return None
    act = cfg.get("hidden_act", "silu")
    if act in SILU_NAMES:
        return None
    return f"hidden_act={act!r}: the expert MLPs compute SwiGLU with silu only"


def rope_parameters(cfg: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(key, parameters): the RoPE parameters of `cfg` and the key naming them. transformers 5
    writes `rope_parameters` (theta inside); older checkpoints write `rope_theta` + optional
    `rope_scaling` (`type` for `rope_type`). Both are read, the newer winning."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    return key, {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}


def rope_type(params: Mapping[str, Any]) -> str:
    """The RoPE type of merged `rope_parameters` ("default" when unset)."""
    return str(params.get("rope_type", params.get("type", "default")) or "default")


def _check_rope_type(cfg: Mapping[str, Any], model_type: str) -> Optional[str]:
    key, params = rope_parameters(cfg)
    kind = rope_type(params)
    if kind in ROPE_TYPES:
        return None
    return f"{key}.rope_type={kind!r}: supported RoPE types are {', '.join(ROPE_TYPES)}"


# Architectures whose RoPE rotates the first int(head_dim * partial_rotary_factor) dims.
PARTIAL_ROTARY_TYPES = ("glm4_moe",)


def _check_partial_rotary(cfg: Mapping[str, Any], model_type: str) -> Optional[str]:
    if model_type in PARTIAL_ROTARY_TYPES:
        return None
    key, params = rope_parameters(cfg)
    for field, factor in ((f"{key}.partial_rotary_factor", params.get("partial_rotary_factor")),
                          ("partial_rotary_factor", cfg.get("partial_rotary_factor"))):
        if factor is not None and float(factor) != 1.0:
            return f"{field}={factor!r}: RoPE rotates the whole head here (factor 1.0 only)"
    return None


# quantization_config methods the loader reads, by the architectures that ship them: the
# released GPT-OSS checkpoints keep their experts as *_blocks (packed E2M1) + *_scales (E8M0),
# everything else in bf16.
QUANTIZED_EXPERTS = {("gpt_oss", "mxfp4"): "mxfp4"}


def _quant_method(cfg: Mapping[str, Any]) -> Optional[str]:
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
    return str(method).lower()


def checkpoint_expert_storage(cfg: Mapping[str, Any], model_type: str) -> Optional[str]:
    """The storage of the checkpoint's routed experts when its quantization_config is one the
    loader reads (see QUANTIZED_EXPERTS), else None."""
    return QUANTIZED_EXPERTS.get((model_type, _quant_method(cfg)))


def _check_quantization(cfg: Mapping[str, Any], model_type: str) -> Optional[str]:
    method = _quant_method(cfg)
    if method is None or (model_type, method) in QUANTIZED_EXPERTS:
        return None
    readable = ", ".join(f"{m} ({t})" for t, m in QUANTIZED_EXPERTS)
    return (f"quantization_config (quant_method={method!r}): not supported on {model_type} "
            f"(quantized checkpoints read: {readable}); load a bf16/fp16/fp32 checkpoint")


DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
# transformers' DeepSeek-V2 router knows these two; any other leaves it without weights.
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _check_deepseek(cfg: Mapping[str, Any], model_type: str) -> Optional[str]:
    if model_type not in DEEPSEEK_TYPES:
        return None
    problems = []
    if cfg.get("attention_bias"):
        problems.append("attention_bias=True: biases on the MLA projections are not implemented")
    if model_type == "deepseek_v2" and cfg.get("mlp_bias"):
        problems.append("mlp_bias=True: the MLPs compute SwiGLU without biases")
    method = cfg.get("topk_method", "greedy")
    if model_type == "deepseek_v2" and method not in V2_TOPK_METHODS:
        problems.append(f"topk_method={method!r}: DeepSeek-V2's router has "
                        f"{', '.join(V2_TOPK_METHODS)}")
    # transformers places MoE layers by first_k_dense_replace alone; DeepSeek's own code also
    # by moe_layer_freq, so a value other than 1 has no reference to match.
    freq = cfg.get("moe_layer_freq", 1)
    if freq not in (1, None):
        problems.append(f"moe_layer_freq={freq!r}: only every layer from first_k_dense_replace "
                        "on is a MoE layer here, as transformers builds it")
    return "; ".join(problems) or None


def _check_ernie(cfg: Mapping[str, Any], model_type: str) -> Optional[str]:
    if model_type != "ernie4_5_moe" or not cfg.get("use_bias"):
        return None
    # One switch for biases on q/k/v/o, the dense and shared MLPs and the LM head; the released
    # ERNIE-4.5 MoE checkpoints have none.
    return (f"use_bias={cfg['use_bias']!r}: biases on the attention projections, MLPs and LM "
            "head are not implemented for ERNIE-4.5")


# Llama4ForCausalLM's config, and the multimodal one's text_config (read as a text config).
LLAMA4_TYPES = ("llama4_text", "llama4")
LLAMA4_LAYER_KINDS = ("full_attention", "chunked_attention")


def llama4_rope_layers(cfg: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Whether each layer applies RoPE, as Llama4TextConfig fills no_rope_layers (1: RoPE): the
    config's list, else every no_rope_layer_interval-th layer without."""
    flags = cfg.get("no_rope_layers") or [
        int((i + 1) % int(cfg.get("no_rope_layer_interval") or 4) != 0) for i in range(num_layers)]
    return [bool(flags[i]) for i in range(num_layers)]


def llama4_layer_types(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Each layer's attention kind: the config's layer_types, else RoPE layers chunked and NoPE
    layers full, as Llama4TextConfig fills them."""
    explicit = cfg.get("layer_types")
    if explicit:
        return [str(t) for t in explicit]
    return ["chunked_attention" if rope else "full_attention"
            for rope in llama4_rope_layers(cfg, num_layers)]


def _check_llama4(cfg: Mapping[str, Any], model_type: str) -> Optional[str]:
    if model_type not in LLAMA4_TYPES:
        return None
    layers = int(cfg.get("num_hidden_layers", 0))
    flags = cfg.get("no_rope_layers")
    if flags and len(flags) < layers:  # transformers fails indexing it
        return f"no_rope_layers has {len(flags)} entries for {layers} layers"
    problems = []
    kinds = llama4_layer_types(cfg, layers)
    unknown = sorted(set(kinds) - set(LLAMA4_LAYER_KINDS))
    if unknown:
        problems.append(f"layer_types has {unknown}: Llama-4 layers are "
                        f"{', '.join(LLAMA4_LAYER_KINDS)}")
    # Llama4TextConfig's default chunk is 8192; transformers fails on a chunked layer without.
    if "chunked_attention" in kinds and cfg.get("attention_chunk_size", 8192) is None:
        problems.append("attention_chunk_size=None with chunked_attention layers: transformers "
                        "builds no mask for them")
    return "; ".join(problems) or None


CHECKS: tuple[Callable[[Mapping[str, Any], str], Optional[str]], ...] = (
    _check_sliding_window, _check_activation, _check_rope_type, _check_partial_rotary,
    _check_quantization, _check_deepseek, _check_ernie, _check_llama4)


def refuse_unhonoured_fields(cfg: Mapping[str, Any], model_type: str) -> None:
    """Raise UnhonouredFieldError naming every field of `cfg` (a config.json of the engine's
    architecture `model_type`) that would change the output and is not computed."""
    problems = [p for p in (check(cfg, model_type) for check in CHECKS) if p]
    if problems:
        raise UnhonouredFieldError(
            f"config.json of a {model_type} model: " + "; ".join(problems)
            + " (refused at load instead of generating tokens that differ from the model's)")
