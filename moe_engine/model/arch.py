"""Per-architecture facts: tensor name tables and what config.json leaves implicit.

A table is data, not code: checkpoint tensor name -> engine slot. Where the math differs, a
flag on ModelSpec says so; the flag is read from config.json, and an `Architecture` only
supplies what the config cannot (the kind of q/k norm, transformers' defaults for keys a hub
config may omit). Slots:
  global: embed, final_norm, lm_head
  layer:  input_norm, post_norm, q, k, v, o, router; q_bias, k_bias, v_bias, o_bias;
          q_norm, k_norm; mlp_w1/w3/w2 (a dense layer's MLP); shared_w1/w3/w2 and
          shared_expert_gate (Qwen2-MoE's shared expert; GLM-4.5's shared experts have no
          gate); score_correction_bias (the router's e_score_correction_bias, GLM-4.5;
          ERNIE-4.5's under moe_statics, [1, E]);
          sinks (per-head attention sink logits) and router_bias (GPT-OSS)
          MLA (DeepSeek): q or q_a/q_a_norm/q_b, kv_a, kv_a_norm, kv_b (and o)
  expert: w1 (gate), w3 (up), w2 (down), one tensor per expert
  fused:  gate_up [E, 2*I, H] and down [E, H, I], the layout transformers 5 uses in memory;
          GPT-OSS's: gate_up_interleaved [E, H, 2*I] (gate in the even columns, up in the
          odd ones) with gate_up_bias_interleaved [E, 2*I], down_t [E, I, H] with down_bias [E, H];
          its released MXFP4 checkpoints: gate_up_blocks [E, 2*I, H/32, 16] (gate in the even
          rows) and gate_up_scales [E, 2*I, H/32], down_blocks [E, H, I/32, 16] and down_scales
          [E, H, I/32] (model/mxfp4.py); Llama-4's: gate_up_t [E, H, 2*I] (x @ W: gate in the
          first I columns, up in the last) and down_t [E, I, H]
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

Rule = tuple[str, str, str]  # (regex, scope, slot)


@dataclass(frozen=True)
class NameMatch:
    """Where a checkpoint tensor goes: `scope` is global/layer/expert/fused."""

    scope: str
    slot: str
    layer: Optional[int] = None
    expert: Optional[int] = None


_L = r"model\.layers\.(?P<layer>\d+)\."
_E = r"(?P<expert>\d+)"

_GLOBAL: tuple[Rule, ...] = (
    (r"model\.embed_tokens\.weight", "global", "embed"),
    (r"model\.norm\.weight", "global", "final_norm"),
    (r"lm_head\.weight", "global", "lm_head"),
)
_NORMS: tuple[Rule, ...] = (
    (_L + r"input_layernorm\.weight", "layer", "input_norm"),
    (_L + r"post_attention_layernorm\.weight", "layer", "post_norm"),
)
_NORMS_AND_ATTENTION: tuple[Rule, ...] = _NORMS + (
    (_L + r"self_attn\.q_proj\.weight", "layer", "q"),
    (_L + r"self_attn\.k_proj\.weight", "layer", "k"),
    (_L + r"self_attn\.v_proj\.weight", "layer", "v"),
    (_L + r"self_attn\.o_proj\.weight", "layer", "o"),
)
_ATTENTION_BIAS: tuple[Rule, ...] = tuple(
    (_L + rf"self_attn\.{p}_proj\.bias", "layer", f"{p}_bias") for p in "qkvo")
_QK_NORM: tuple[Rule, ...] = (
    (_L + r"self_attn\.q_norm\.weight", "layer", "q_norm"),
    (_L + r"self_attn\.k_norm\.weight", "layer", "k_norm"),
)


def _swiglu(prefix: str, slot: str) -> tuple[Rule, ...]:
    """gate/up/down projections of a SwiGLU MLP module named `prefix` (Llama-style names)."""
    return ((_L + prefix + r"\.gate_proj\.weight", "layer", f"{slot}_w1"),
            (_L + prefix + r"\.up_proj\.weight", "layer", f"{slot}_w3"),
            (_L + prefix + r"\.down_proj\.weight", "layer", f"{slot}_w2"))


_DENSE_MLP = _swiglu("mlp", "mlp")
_SHARED_EXPERT = _swiglu(r"mlp\.shared_expert", "shared") + (
    (_L + r"mlp\.shared_expert_gate\.weight", "layer", "shared_expert_gate"),)
# DeepSeek-style: n_shared_experts fused into one ungated MLP named in the plural.
_SHARED_EXPERTS = _swiglu(r"mlp\.shared_experts", "shared")
_SCORE_CORRECTION = ((_L + r"mlp\.gate\.e_score_correction_bias", "layer", "score_correction_bias"),)


def _routed_experts(block: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """Router and experts: the hub's per-expert names under `block` and the transformers 5
    in-memory names (mlp.experts.gate_up_proj), so both kinds of saved checkpoints load."""
    either = rf"(?:{block}|mlp)"
    return (
        (_L + either + r"\.gate\.weight", "layer", "router"),
        (_L + rf"{block}\.experts\.{_E}\.{gate}\.weight", "expert", "w1"),
        (_L + rf"{block}\.experts\.{_E}\.{down}\.weight", "expert", "w2"),
        (_L + rf"{block}\.experts\.{_E}\.{up}\.weight", "expert", "w3"),
        (_L + either + r"\.experts\.gate_up_proj", "fused", "gate_up"),
        (_L + either + r"\.experts\.down_proj", "fused", "down"),
    )


_QWEN_EXPERTS = _routed_experts("mlp", "gate_proj", "up_proj", "down_proj")

_COMMON = _GLOBAL + _NORMS_AND_ATTENTION

MIXTRAL_TABLE = _COMMON + _routed_experts("block_sparse_moe", "w1", "w3", "w2")
QWEN2_MOE_TABLE = _COMMON + _ATTENTION_BIAS + _QWEN_EXPERTS + _SHARED_EXPERT + _DENSE_MLP
QWEN3_MOE_TABLE = _COMMON + _ATTENTION_BIAS + _QK_NORM + _QWEN_EXPERTS + _DENSE_MLP
OLMOE_TABLE = _COMMON + _ATTENTION_BIAS + _QK_NORM + _QWEN_EXPERTS
# The same names in hub checkpoints and in transformers' save_pretrained (per-expert names;
# the fused in-memory ones load too). The MTP layer GLM-4.5 checkpoints carry past the last
# decoder layer (model.layers.<num_hidden_layers>.*) is skipped by the loader.
GLM4_MOE_TABLE = (_COMMON + _ATTENTION_BIAS + _QK_NORM + _QWEN_EXPERTS + _SCORE_CORRECTION
                  + _SHARED_EXPERTS + _DENSE_MLP)
# Multi-head latent attention (DeepSeek-V2/V3): q is q_proj (no q_lora_rank) or q_a_proj,
# q_a_layernorm, q_b_proj; kv_a_proj_with_mqa gives the latent and the rope key,
# kv_b_proj up-projects the latent to each head's nope key and value.
_MLA: tuple[Rule, ...] = _NORMS + (
    (_L + r"self_attn\.q_proj\.weight", "layer", "q"),
    (_L + r"self_attn\.q_a_proj\.weight", "layer", "q_a"),
    (_L + r"self_attn\.q_a_layernorm\.weight", "layer", "q_a_norm"),
    (_L + r"self_attn\.q_b_proj\.weight", "layer", "q_b"),
    (_L + r"self_attn\.kv_a_proj_with_mqa\.weight", "layer", "kv_a"),
    (_L + r"self_attn\.kv_a_layernorm\.weight", "layer", "kv_a_norm"),
    (_L + r"self_attn\.kv_b_proj\.weight", "layer", "kv_b"),
    (_L + r"self_attn\.o_proj\.weight", "layer", "o"),
)
# The MTP layer DeepSeek-V3 checkpoints carry past the last decoder layer is skipped as GLM's.
DEEPSEEK_V3_TABLE = _GLOBAL + _MLA + _QWEN_EXPERTS + _SCORE_CORRECTION + _SHARED_EXPERTS + _DENSE_MLP
DEEPSEEK_V2_TABLE = _GLOBAL + _MLA + _QWEN_EXPERTS + _SHARED_EXPERTS + _DENSE_MLP
# ERNIE-4.5: the hub and save_pretrained keep the bias in mlp.moe_statics, transformers' module
# (the fused in-memory names) in mlp.gate.moe_statics. The MTP weights (mtp_* keys) match no rule.
_ERNIE_SCORE_CORRECTION = ((_L + r"mlp\.(?:gate\.)?moe_statics\.e_score_correction_bias", "layer",
                            "score_correction_bias"),)
ERNIE4_5_MOE_TABLE = (_COMMON + _QWEN_EXPERTS + _ERNIE_SCORE_CORRECTION + _SHARED_EXPERTS
                      + _DENSE_MLP)


_GPT_OSS_BLOCK = (
    (_L + r"self_attn\.sinks", "layer", "sinks"),
    (_L + r"mlp\.router\.weight", "layer", "router"),
    (_L + r"mlp\.router\.bias", "layer", "router_bias"),
    (_L + r"mlp\.experts\.gate_up_proj", "fused", "gate_up_interleaved"),
    (_L + r"mlp\.experts\.gate_up_proj_bias", "fused", "gate_up_bias_interleaved"),
    (_L + r"mlp\.experts\.down_proj", "fused", "down_t"),
    (_L + r"mlp\.experts\.down_proj_bias", "fused", "down_bias"),
    (_L + r"mlp\.experts\.gate_up_proj_blocks", "fused", "gate_up_blocks"),
    (_L + r"mlp\.experts\.gate_up_proj_scales", "fused", "gate_up_scales"),
    (_L + r"mlp\.experts\.down_proj_blocks", "fused", "down_blocks"),
    (_L + r"mlp\.experts\.down_proj_scales", "fused", "down_scales"),
)
# The hub's bf16 checkpoints and transformers' save_pretrained use the in-memory names.
GPT_OSS_TABLE = _COMMON + _ATTENTION_BIAS + _GPT_OSS_BLOCK

# Llama-4: Llama4ForCausalLM's names, and the same under language_model. as the released
# Llama4ForConditionalGeneration checkpoints hold the text model (its vision_model.* and
# multi_modal_projector.* tensors match no rule). The FFN is feed_forward: a dense MLP, or a
# router, fused experts (x @ W layout) and an ungated shared_expert.
_LM = r"(?:language_model\.)?"
_L4 = _LM + _L
_LLAMA4_FFN = r"feed_forward"
LLAMA4_TABLE = tuple((_LM + p, scope, slot) for p, scope, slot in _COMMON + _ATTENTION_BIAS) + (
    (_L4 + _LLAMA4_FFN + r"\.router\.weight", "layer", "router"),
    (_L4 + _LLAMA4_FFN + r"\.experts\.gate_up_proj", "fused", "gate_up_t"),
    (_L4 + _LLAMA4_FFN + r"\.experts\.down_proj", "fused", "down_t"),
) + tuple((_LM + p, scope, slot) for p, scope, slot in
          _swiglu(_LLAMA4_FFN + r"\.shared_expert", "shared") + _swiglu(_LLAMA4_FFN, "mlp"))


@dataclass(frozen=True)
class Architecture:
    """An architecture's name table plus what its config.json does not say.

    config_keys: the architecture's own config keys the engine reads, each with transformers'
    default for a config that omits it; keys not listed are ignored, as transformers ignores
    them (a Qwen3 config carrying shared_expert_intermediate_size has no shared expert).
    fixed: values of such keys the architecture implies without reading a key.
    qk_norm: None, "head" (RMSNorm of each q/k head, Qwen3) or "projection" (one RMSNorm over
    the whole q and k projections, OLMoE); `use_qk_norm` in the config switches it where the
    architecture reads that key (GLM-4.5). router_weights_fp32: Mixtral and GLM-4.5 scale expert
    outputs by the fp32 router weights; the others cast them to the model dtype first.
    router_scoring: "softmax" or "sigmoid" (DeepSeek-V3 / GLM-4.5: sigmoid scores, a
    score-correction bias for choosing, group-limited top-k; see layers.route);
    router_logits_fp32: the router GEMM runs in fp32 whatever the model dtype (GLM-4.5,
    DeepSeek) instead of in the model dtype (Mixtral, Qwen, OLMoE).
    o_bias: whether `attention_bias` covers the O projection too (GLM-4.5's covers q/k/v only).
    shared_expert_gate: the shared expert is scaled by sigmoid(gate(h)) (Qwen2-MoE).
    attention_sinks, router_bias, expert_bias, expert_activation: see ModelSpec (GPT-OSS).
    default_rope_parameters / default_rope_theta: RoPE of a config with no RoPE keys, where
    the config class fills one in (GPT-OSS's YaRN).
    mla: multi-head latent attention (DeepSeek-V2/V3; ModelSpec.mla from the config's ranks).
    key_map: (engine's key, the architecture's config key) pairs, as transformers'
    attribute_map: ERNIE-4.5 names its MoE keys its own way (moe_k for num_experts_per_tok);
    spec.py reads the value under the engine's name.
    router_weight_fp32: the router weight is kept as the checkpoint stores it (fp32 in
    ERNIE-4.5's _keep_in_fp32_modules_strict), not rounded to the model dtype on load.
    router_scales_input: the routing weights scale each expert's input, not its output
    (Llama-4; see layers.input_scaled_routing). text_config: the text model's keys sit under
    this key of config.json (a multimodal checkpoint's, Llama4ForConditionalGeneration);
    spec.py reads them as a text model's config. llama4_attention: Llama4TextConfig's
    attention keys are read (NoPE layers, L2 q/k norm, attention temperature, chunked
    attention; see ModelSpec).
    """

    model_type: str
    names: tuple[Rule, ...]
    config_keys: tuple[tuple[str, Any], ...] = ()
    fixed: tuple[tuple[str, Any], ...] = ()
    qk_norm: Optional[str] = None
    router_weights_fp32: bool = False
    router_scoring: str = "softmax"
    router_logits_fp32: bool = False
    o_bias: bool = True
    shared_expert_gate: bool = False
    attention_sinks: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    expert_activation: str = "silu"
    default_rope_parameters: tuple[tuple[str, Any], ...] = ()
    default_rope_theta: float = 10000.0
    mla: bool = False
    key_map: tuple[tuple[str, str], ...] = ()
    router_weight_fp32: bool = False
    router_scales_input: bool = False
    text_config: Optional[str] = None
    llama4_attention: bool = False

    def text_model_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """`cfg` as a text model's config: the keys under text_config (where the architecture
        nests them) with the checkpoint's architectures and dtype, else `cfg` itself."""
        if self.text_config is None or not isinstance(cfg.get(self.text_config), dict):
            return cfg
        outer = {k: cfg[k] for k in ("architectures", "dtype", "torch_dtype") if k in cfg}
        return {**cfg[self.text_config], **outer}

    def canonical_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """`cfg` with the values of key_map's own keys also under the engine's names."""
        return {**cfg, **{ours: cfg[theirs] for ours, theirs in self.key_map if theirs in cfg}}

    def own_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """The architecture-specific settings of `cfg`, defaults filled in."""
        return {**dict(self.fixed), **{k: cfg.get(k, default) for k, default in self.config_keys}}


_QWEN_SPARSITY = (("norm_topk_prob", False), ("decoder_sparse_step", 1), ("mlp_only_layers", []))
# Both DeepSeek configs' MLA shapes and defaults.
_MLA_KEYS = (("q_lora_rank", 1536), ("kv_lora_rank", 512), ("qk_nope_head_dim", 128),
             ("qk_rope_head_dim", 64), ("v_head_dim", 128))

ARCHITECTURES: dict[str, Architecture] = {
    "MixtralForCausalLM": Architecture("mixtral", MIXTRAL_TABLE, fixed=(("norm_topk_prob", True),),
                                       router_weights_fp32=True),
    "Qwen2MoeForCausalLM": Architecture(
        "qwen2_moe", QWEN2_MOE_TABLE,
        # Hub Qwen1.5-MoE configs omit qkv_bias; the checkpoints have the biases.
        config_keys=(("qkv_bias", True), ("shared_expert_intermediate_size", 5632))
        + _QWEN_SPARSITY, shared_expert_gate=True),
    "Qwen3MoeForCausalLM": Architecture(
        "qwen3_moe", QWEN3_MOE_TABLE, config_keys=(("attention_bias", False),) + _QWEN_SPARSITY,
        qk_norm="head"),
    "OlmoeForCausalLM": Architecture(
        "olmoe", OLMOE_TABLE,
        config_keys=(("attention_bias", False), ("clip_qkv", None), ("norm_topk_prob", False)),
        qk_norm="projection"),
    # Defaults from transformers' Glm4MoeConfig (partial_rotary_factor: set to 0.5 in its
    # __post_init__ when config.json has none; a value in rope_parameters wins, see spec.py).
    "Glm4MoeForCausalLM": Architecture(
        "glm4_moe", GLM4_MOE_TABLE,
        config_keys=(("attention_bias", False), ("use_qk_norm", False), ("norm_topk_prob", True),
                     ("n_shared_experts", 1), ("first_k_dense_replace", 1), ("n_group", 1),
                     ("topk_group", 1), ("routed_scaling_factor", 1.0),
                     ("partial_rotary_factor", 0.5)),
        fixed=(("e_score_correction_bias", True), ("group_score", "top2_sum")),
        qk_norm="head", router_weights_fp32=True, router_scoring="sigmoid",
        router_logits_fp32=True, o_bias=False),
    # Defaults from transformers' GptOssConfig; its layer_types and sliding_window are read by
    # config_audit.layer_types / sliding_window.
    "GptOssForCausalLM": Architecture(
        "gpt_oss", GPT_OSS_TABLE,
        config_keys=(("attention_bias", True), ("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)),
        # The softmax over the chosen k logits sums to 1 already.
        fixed=(("norm_topk_prob", False),),
        router_scoring="topk_softmax", attention_sinks=True, router_bias=True,
        expert_bias=True, expert_activation="clamped_swiglu",
        default_rope_parameters=(("rope_type", "yarn"), ("factor", 32.0), ("beta_fast", 32.0),
                                 ("beta_slow", 1.0), ("truncate", False),
                                 ("original_max_position_embeddings", 4096)),
        default_rope_theta=150000.0),
    # Defaults from transformers' DeepseekV3Config. Its router always limits to the best groups
    # (topk_method and scoring_func of hub configs are not read); it renormalises with
    # norm_topk_prob; RoPE pairs dims as rope_interleave says.
    "DeepseekV3ForCausalLM": Architecture(
        "deepseek_v3", DEEPSEEK_V3_TABLE,
        config_keys=(("attention_bias", False), ("norm_topk_prob", True), ("n_shared_experts", 1),
                     ("first_k_dense_replace", 3), ("n_group", 8), ("topk_group", 4),
                     ("routed_scaling_factor", 2.5), ("rope_interleave", True))
        + _MLA_KEYS,
        fixed=(("e_score_correction_bias", True), ("group_score", "top2_sum")),
        router_weights_fp32=True, router_scoring="sigmoid", router_logits_fp32=True, mla=True),
    # DeepseekV2Config's defaults. transformers' V2 router never renormalises the top-k weights
    # (norm_topk_prob is not read), limits to groups by their best score only with
    # topk_method group_limited_greedy, and rotates RoPE pairs as complex numbers.
    "DeepseekV2ForCausalLM": Architecture(
        "deepseek_v2", DEEPSEEK_V2_TABLE,
        config_keys=(("attention_bias", False), ("n_shared_experts", 2),
                     ("first_k_dense_replace", 0), ("n_group", None), ("topk_group", None),
                     ("routed_scaling_factor", 1.0), ("topk_method", "greedy")) + _MLA_KEYS,
        fixed=(("norm_topk_prob", False), ("group_score", "max"), ("rope_interleave", True)),
        router_weights_fp32=True, router_logits_fp32=True, mla=True),
    # Defaults from transformers' Ernie4_5_MoeConfig. Its router softmaxes fp32 logits of an
    # fp32 weight, chooses on the scores plus the moe_statics bias, divides the chosen scores by
    # max(sum, moe_norm_min) and casts them to the model dtype; RoPE rotates pairs (2i, 2i+1)
    # (ernie4_5's apply_rotary_pos_emb: cos/sin repeat_interleaved, GLM's rotate_half). A layer
    # is MoE when (i + 1) % moe_layer_interval == 0 and start <= i <= end (-1: the last layer).
    "Ernie4_5_MoeForCausalLM": Architecture(
        "ernie4_5_moe", ERNIE4_5_MOE_TABLE,
        key_map=(("num_experts", "moe_num_experts"), ("num_experts_per_tok", "moe_k"),
                 ("n_shared_experts", "moe_num_shared_experts"),
                 ("decoder_sparse_step", "moe_layer_interval"),
                 ("first_k_dense_replace", "moe_layer_start_index"),
                 ("last_moe_layer", "moe_layer_end_index"), ("router_norm_min", "moe_norm_min")),
        config_keys=(("n_shared_experts", 2), ("decoder_sparse_step", 1),
                     ("first_k_dense_replace", 1), ("last_moe_layer", -1),
                     ("router_norm_min", 1e-12)),
        fixed=(("norm_topk_prob", True), ("e_score_correction_bias", True),
               ("rope_interleave", True)),
        router_logits_fp32=True, default_rope_theta=500000.0, router_weight_fp32=True),
}

# Defaults from transformers' Llama4TextConfig. MoE layers: moe_layers, else every
# interleave_moe_layer_step-th; dense layers' MLP is intermediate_size_mlp wide, the shared
# expert intermediate_size (one expert's). The router sigmoids the top-k logits (in the model
# dtype) and the weights scale the experts' inputs. RoPE rotates complex pairs (2i, 2i+1)
# (apply_rotary_emb's view_as_complex) on the layers no_rope_layers marks 1; the others (NoPE)
# get the attention temperature instead; see spec.py for the chunked attention.
_LLAMA4 = dict(
    names=LLAMA4_TABLE,
    key_map=(("decoder_sparse_step", "interleave_moe_layer_step"),),
    config_keys=(("attention_bias", False), ("decoder_sparse_step", 1), ("moe_layers", None),
                 ("intermediate_size_mlp", 16384), ("use_qk_norm", True),
                 ("no_rope_layers", None), ("no_rope_layer_interval", 4),
                 ("attention_chunk_size", 8192), ("layer_types", None),
                 ("attn_temperature_tuning", True), ("floor_scale", 8192), ("attn_scale", 0.1)),
    fixed=(("norm_topk_prob", False), ("n_shared_experts", 1), ("rope_interleave", True)),
    router_scoring="topk_sigmoid", router_weights_fp32=False, default_rope_theta=500000.0,
    router_scales_input=True, llama4_attention=True)
ARCHITECTURES["Llama4ForCausalLM"] = Architecture("llama4_text", **_LLAMA4)
# The released checkpoints: the text model of the multimodal one (vision left unread).
ARCHITECTURES["Llama4ForConditionalGeneration"] = Architecture("llama4", text_config="text_config",
                                                               **_LLAMA4)


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's `architectures` names a model the engine has no table for."""


def architecture(name: str) -> Architecture:
    """The facts of architecture `name`; raises naming it and the supported ones otherwise."""
    if name not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {name!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def architecture_name(cfg: dict[str, Any]) -> str:
    """A config's architecture: `architectures[0]`, else the one of its model_type (a config
    saved without its model has no `architectures`)."""
    if cfg.get("architectures"):
        return str(cfg["architectures"][0])
    model_type = cfg.get("model_type")
    for name, arch in ARCHITECTURES.items():
        if arch.model_type == model_type:
            return name
    return str(model_type)


class NameTable:
    """Compiled name table of one architecture."""

    def __init__(self, name: str):
        self.architecture = name
        self._rules = [(re.compile(p + r"$"), scope, slot)
                       for p, scope, slot in architecture(name).names]

    def match(self, name: str) -> Optional[NameMatch]:
        """Map a checkpoint tensor name to its slot, or None for tensors the engine ignores."""
        for rx, scope, slot in self._rules:
            m = rx.match(name)
            if m:
                groups = m.groupdict()
                layer = int(groups["layer"]) if groups.get("layer") is not None else None
                expert = int(groups["expert"]) if groups.get("expert") is not None else None
                return NameMatch(scope, slot, layer, expert)
        return None
