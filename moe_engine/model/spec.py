"""ModelSpec: the shapes and constants of a checkpoint, read from its HF config.json.

The one description of a model that the engine (shapes, flags) and the performance model (sizes
in bytes) both read; `ModelSpec.from_hf_config` is the only reader of config.json. Sizes are
bytes; `GB` (1e9 bytes, SI) is the unit of every `*_gb` knob, the KV budget included.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from moe_engine.model.arch import UnsupportedArchitectureError, architecture, architecture_name
from moe_engine.model.config_audit import (checkpoint_expert_storage, layer_types,
                                           llama4_layer_types, llama4_rope_layers,
                                           refuse_unhonoured_fields, rope_parameters, rope_type,
                                           sliding_window)

GB = 1e9

DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2,
               "half": 2, "fp16": 2, "float8_e4m3fn": 1, "int8": 1}
# The dtype `with_dtype_bytes` picks for a width (the sizes only depend on the width).
_DTYPE_OF_WIDTH = {4: "float32", 2: "bfloat16", 1: "float8_e4m3fn"}
# Bits per routed-expert weight in a quantized storage, scales included (model/packed.py):
# MXFP4 4-bit codes + an E8M0 byte per 32; int4 + an fp32 scale per 32; int8 + an fp32 scale
# per output row (~0 bits per weight at real widths).
# bf16p (PAIR_STORAGE): bf16 weights in pairs for bf16 activations (engine.matmul_precision=
# medium), another kernel path at 16 bits a weight, whatever the checkpoint's dtype
PAIR_STORAGE = "bf16p"
# bf16x3: the same panels, whose GEMMs split each fp32 activation into three bf16 terms that
# sum to it exactly, so the products add up to fp32 results (AMX tiles at 3x bf16p's work);
# a kernel path of its own for the performance model
BF16X3_STORAGE = "bf16x3"
# int8q: int8 experts (engine.expert_dtype=int8) under engine.matmul_precision=medium, with k in
# quads, whose GEMMs quantize each activation row to int8 (AVX512-VNNI's vpdpbusd); another
# kernel path at int8's 8 bits a weight
QUAD_STORAGE = "int8q"
EXPERT_STORAGE_BITS = {"mxfp4": 4 + 8 / 32, "int4": 4 + 32 / 32, "int8": 8.0, PAIR_STORAGE: 16.0,
                       BF16X3_STORAGE: 16.0, QUAD_STORAGE: 8.0}
# The profiler's name for routed experts held in the model dtype, not in the checkpoint's own
# storage (an MXFP4 checkpoint's experts, widened for torch's GEMMs): ModelSpec storage None
MODEL_DTYPE_STORAGE = "dtype"
# The weight storage of a model run on torch's GEMMs on the CPU (engine.gemm=torch): weights
# and activations in the model dtype, F.linear for every projection, the experts one GEMM pair
# each. Another kernel path for the performance model, whose profiled points name it.
TORCH_GEMM_STORAGE = "torch"
# packed storage of a float checkpoint dtype (torch's name)
FLOAT_STORAGE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def precision_storage(storage: str, precision: str, tiles: bool) -> str:
    """The packed storage of weights otherwise held in `storage` under engine.matmul_precision:
    medium holds bf16 and fp32 weights as bf16 pairs (bf16 activations) and int8 experts as
    int8 quads (int8 activations, quantized per row); high holds bf16
    weights as bf16x3 (three bf16 activation terms) where the kernels run bf16 pairs on AMX
    tiles (`tiles`, cpu_features.bf16_tiles), and is highest elsewhere, as torch's "high" takes
    the faster algorithm only where there is one (emulated, bf16x3 is 0.2-0.3x fp32 FMAs; fp32
    weights are not bf16s, so they keep highest's path too); fp16, int4 and MXFP4 storage, and
    everything under highest, stay as they are."""
    if precision == "medium" and storage in ("bf16", "fp32"):
        return PAIR_STORAGE
    if precision == "medium" and storage == "int8":
        return QUAD_STORAGE
    if precision == "high" and storage == "bf16" and tiles:
        return BF16X3_STORAGE
    return storage


class UnsupportedModelError(UnsupportedArchitectureError):
    """config.json describes a model neither the engine nor the performance model can size."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters (HF `rope_parameters`, or legacy `rope_theta`/`rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 / yarn extras; unused for the default type. transformers fills a missing
    # original_max_position_embeddings with max_position_embeddings; so does the reader.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: Optional[int] = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None  # yarn: with mscale_all_dim, sets the default attention_factor
    mscale_all_dim: Optional[float] = None
    truncate: bool = True  # yarn: round the correction range to whole dimensions


@dataclass(frozen=True)
class MlaSpec:
    """DeepSeek-V2/V3 multi-head latent attention (model/mla.py). A head's query and key are
    qk_nope_head_dim dims without position plus qk_rope_head_dim rotated ones; keys and values
    are up-projected from one kv_lora_rank latent per token, so the KV cache holds that latent
    (after kv_a_layernorm) and the rope key shared by every head: kv_lora_rank +
    qk_rope_head_dim values per token and layer. q is low-rank (q_lora_rank) or, without
    q_lora_rank (V2-Lite), one full projection."""

    kv_lora_rank: int
    q_lora_rank: Optional[int]
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_dim(self) -> int:
        """Values per token and layer in the latent cache: latent, then rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@lru_cache(maxsize=None)  # the policy search asks ~10^5 times per run
def dtype_bytes_of(dtype: str) -> int:
    """Bytes per element of a torch dtype name ("bfloat16", "torch.float32", ...)."""
    key = str(dtype).replace("torch.", "").lower()
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def is_sparse_layer(layer: int, decoder_sparse_step: int = 1, mlp_only_layers: Sequence[int] = (),
                    first_k_dense_replace: int = 0, last_sparse_layer: Optional[int] = None) -> bool:
    """Whether layer i has routed experts. Qwen-MoE's rule: i is not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0; GLM-4.5's: i >= first_k_dense_replace; ERNIE-4.5's
    both (moe_layer_interval, moe_layer_start_index) and i <= last_sparse_layer
    (moe_layer_end_index) (architectures without these keys: every layer)."""
    step = max(1, int(decoder_sparse_step or 1))
    return (layer not in mlp_only_layers and (layer + 1) % step == 0
            and layer >= int(first_k_dense_replace or 0)
            and (last_sparse_layer is None or layer <= last_sparse_layer))


# "topk_softmax" (GPT-OSS): top-k over the raw logits, softmax over the k chosen ones.
# "topk_sigmoid" (Llama-4): top-k over the raw logits, sigmoid of the k chosen ones.
ROUTER_SCORINGS = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid")
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")
LAYER_TYPES = ("full_attention", "sliding_attention")
GROUP_SCORES = ("top2_sum", "max")


class HashedOnce:
    """For frozen dataclasses that key memos: the hash of every field, computed once per
    instance. A subclass sets `__hash__ = HashedOnce.__hash__` in its body (the dataclass
    decorator replaces an inherited one). What the instance caches under a leading underscore
    stays behind when it is pickled or copied: another process hashes strings with another
    seed, and memos belong to the process that filled them."""

    @cached_property
    def _fields_hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def __hash__(self) -> int:
        return self._fields_hash

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


@dataclass(frozen=True)
class ModelSpec(HashedOnce):
    """Everything the engine and the performance model need to know about a model instance.

    `intermediate_size` is one routed expert's width; layers in `dense_layers` have a dense MLP
    of width `dense_intermediate_size` instead of experts. `shared_expert_intermediate_size` is
    the total width of the always-active shared experts (0 if none). `torch_dtype` is the dtype
    the weights are run in: the checkpoint's, or the `model.dtype` override.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    rope: RopeSpec = field(default_factory=RopeSpec)
    torch_dtype: str = "float32"
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    sliding_window: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Where architectures differ (see arch.py for the values each implies).
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: Optional[str] = None  # None, "head" (Qwen3) or "projection" (OLMoE)
    clip_qkv: Optional[float] = None
    norm_topk_prob: bool = True
    router_weights_fp32: bool = True
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(h -> 1) gate on the shared expert
    dense_intermediate_size: int = 0  # MLP width of the dense layers
    dense_layers: tuple[int, ...] = ()  # layers whose FFN is a dense MLP, not experts
    # RoPE rotates the first int(head_dim * partial_rotary_factor) dims of each head (GLM-4.5).
    partial_rotary_factor: float = 1.0
    # The router (layers.route): scores are softmax or sigmoid of the router logits, computed
    # in fp32 from fp32 logits when router_logits_fp32. With a score-correction bias
    # (e_score_correction_bias) the bias is added to the scores for choosing experts only.
    # router_groups > 1: experts form that many equal groups, each scored by the sum of its
    # two best scores ("top2_sum", DeepSeek-V3 / GLM-4.5) or its best one ("max", DeepSeek-V2's
    # group_limited_greedy), and only the router_topk_groups best groups may be chosen.
    # The chosen experts' weights are scaled by routed_scaling_factor after normalising.
    router_scoring: str = "softmax"
    router_logits_fp32: bool = False
    router_score_correction: bool = False
    router_groups: int = 1
    router_topk_groups: int = 1
    router_group_score: str = "top2_sum"
    routed_scaling_factor: float = 1.0
    # ERNIE-4.5 renormalises by max(sum, router_norm_min) (its moe_norm_min) instead of the sum
    # (+1e-20 for sigmoid scores); None: the sum.
    router_norm_min: Optional[float] = None
    mla: Optional[MlaSpec] = None
    # GPT-OSS. attention_sinks: a learned logit per query head joins each softmax's
    # denominator (it has no value). layer_types: one of LAYER_TYPES per layer (empty: every
    # layer full); a "sliding_attention" layer's query at position p sees the keys at
    # (p - sliding_window, p], as transformers' sliding_window_overlay masks them.
    # router_bias: the router GEMM has a bias. expert_bias: every expert's gate|up and down
    # GEMMs have biases. expert_activation "clamped_swiglu": gate clamped above at
    # swiglu_limit, up to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate).
    attention_sinks: bool = False
    layer_types: tuple[str, ...] = ()
    router_bias: bool = False
    expert_bias: bool = False
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # RoPE pairs dims (2i, 2i+1) (DeepSeek's rope_interleave, V2's complex rotation) instead of
    # (i, i + rotary_dim/2).
    rope_interleave: bool = False
    # Routed experts stored quantized (EXPERT_STORAGE_BITS: "mxfp4" from a checkpoint's
    # quantization_config, "int8"/"int4" from engine.expert_dtype); None: in torch_dtype.
    expert_storage: Optional[str] = None
    # The dense projections and the LM head held in another storage than torch_dtype by the
    # packed kernels (PAIR_STORAGE under engine.matmul_precision=medium), or the whole model on
    # torch's GEMMs (TORCH_GEMM_STORAGE): their GEMMs are priced on that path's profiled
    # points. None: torch_dtype on the packed kernels.
    weight_storage: Optional[str] = None
    # Llama-4. router_scales_input: each chosen expert runs on the token's hidden state times
    # its routing weight, and the outputs are summed unweighted (layers.input_scaled_routing).
    # nope_layers: layers without RoPE; on the others q and k are L2-normalised after RoPE
    # when qk_l2_norm (no weight, eps rms_norm_eps). attn_temperature_floor: on NoPE layers q
    # is scaled by 1 + attn_temperature_scale * log1p(floor((p + 1) / floor)) at position p
    # (None: off). attention_chunk_size: RoPE layers attend only within chunks of that many
    # positions; the engine computes no chunk mask, so max_position_embeddings is capped at
    # the chunk, where chunked and causal attention are the same (None: no chunked layer).
    router_scales_input: bool = False
    nope_layers: tuple[int, ...] = ()
    qk_l2_norm: bool = False
    attn_temperature_floor: Optional[float] = None
    attn_temperature_scale: float = 0.1
    attention_chunk_size: Optional[int] = None
    name: str = ""

    def __post_init__(self) -> None:
        if not (1 <= self.top_k <= self.num_experts):
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.router_scoring not in ROUTER_SCORINGS:
            raise ValueError(f"router scoring {self.router_scoring!r}: expected one of {ROUTER_SCORINGS}")
        if self.router_group_score not in GROUP_SCORES:
            raise ValueError(f"group score {self.router_group_score!r}: expected one of {GROUP_SCORES}")
        groups, chosen = self.router_groups, self.router_topk_groups
        if groups < 1 or self.num_experts % groups:
            raise ValueError(f"n_group={groups} must divide n_routed_experts={self.num_experts}")
        if not 1 <= chosen <= groups:
            raise ValueError(f"topk_group={chosen} must be in [1, n_group={groups}]")
        per_group = self.num_experts // groups
        if chosen * per_group < self.top_k:
            raise ValueError(f"topk_group={chosen} groups of {per_group} experts hold fewer than "
                             f"num_experts_per_tok={self.top_k}")
        if groups > 1 and self.router_group_score == "top2_sum" and per_group < 2:
            raise ValueError(f"n_group={groups}: a group scored by its two best experts needs "
                             "at least two experts")
        if self.expert_storage is not None and self.expert_storage not in EXPERT_STORAGE_BITS:
            raise ValueError(f"expert storage {self.expert_storage!r}: expected one of "
                             f"{sorted(EXPERT_STORAGE_BITS)} or None")
        if self.weight_storage not in (None, PAIR_STORAGE, BF16X3_STORAGE, TORCH_GEMM_STORAGE):
            raise ValueError(f"weight storage {self.weight_storage!r}: expected "
                             f"{PAIR_STORAGE!r}, {BF16X3_STORAGE!r}, {TORCH_GEMM_STORAGE!r} or None")
        if self.expert_activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation {self.expert_activation!r}: expected one of "
                             f"{EXPERT_ACTIVATIONS}")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise ValueError(f"layer_types {list(self.layer_types)} must name one of "
                             f"{LAYER_TYPES} for each of the {self.num_layers} layers")
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ValueError(f"sliding_attention layers need a positive sliding_window, got "
                             f"{self.sliding_window!r}")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must rotate an "
                             f"even number of the head's {self.head_dim} dims")

    # The performance model keys its memos by the spec (`perf.specs.layer_layout`, the
    # processors' part prices) ~10^5 times a search; the dataclass's hash walks ~50 fields.
    __hash__ = HashedOnce.__hash__

    @cached_property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @cached_property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @cached_property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @cached_property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates (the first ones, as transformers rounds it; MLA: its
        rope part, which model/mla.py hands over alone)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def attention_window(self, layer: int) -> Optional[int]:
        """Keys a query of layer `layer` sees, itself included (None: the whole context)."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @cached_property
    def attention_features(self) -> tuple[str, ...]:
        """What the attention adds to plain causal attention, by name (for the kernels to
        refuse or a fallback to report)."""
        return tuple(name for name, present in (
            ("attention sinks", self.attention_sinks),
            ("sliding-window layers", self.num_windowed_layers > 0)) if present)

    @cached_property
    def num_windowed_layers(self) -> int:
        return sum(t == "sliding_attention" for t in self.layer_types)

    @cached_property
    def attention_scale(self) -> float:
        """The softmax scale. MLA under a scaled RoPE multiplies 1/sqrt(head_dim) by the square
        of YaRN's mscale at mscale_all_dim, as transformers' DeepSeek attention does (whatever
        the RoPE type, as long as it is not the default)."""
        scale = self.head_dim ** -0.5
        rope = self.rope
        if self.mla is not None and rope.rope_type != "default" and rope.mscale_all_dim:
            m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @cached_property
    def num_moe_layers(self) -> int:
        return self.num_layers - len(self.dense_layers)

    @cached_property
    def num_dense_layers(self) -> int:
        return len(self.dense_layers)

    @cached_property
    def dtype_bytes(self) -> int:
        return dtype_bytes_of(self.torch_dtype)

    def with_dtype(self, dtype: str) -> "ModelSpec":
        """The same shapes run in another dtype (the engine's `model.dtype` override)."""
        dtype_bytes_of(dtype)  # fail on an unknown name here, not at the first size query
        return replace(self, torch_dtype=str(dtype).replace("torch.", ""))

    def with_dtype_bytes(self, dtype_bytes: int) -> "ModelSpec":
        """The same shapes stored at another width (what-if sizing)."""
        return self.with_dtype(_DTYPE_OF_WIDTH[dtype_bytes])

    def with_expert_storage(self, storage: Optional[str]) -> "ModelSpec":
        """The same model with its routed experts stored in `storage` (None: torch_dtype)."""
        return replace(self, expert_storage=storage)

    def with_weight_storage(self, storage: Optional[str]) -> "ModelSpec":
        """The same model with its dense weights held in `storage` (None: torch_dtype)."""
        return replace(self, weight_storage=storage)

    @cached_property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.mla else self.head_dim

    @cached_property
    def qkv_out_features(self) -> int:
        """Width of the fused projection of the normed input (MLA: q's first projection, the
        latent and the rope key)."""
        if self.mla is not None:
            return (self.mla.q_lora_rank or self.q_size) + self.mla.latent_dim
        return self.q_size + self.num_kv_heads * (self.head_dim + self.v_head_dim)

    @cached_property
    def attention_widths(self) -> tuple[int, int]:
        """(score, value) dims a query head attends with: head_dim and v_head_dim, or MLA's
        absorbed form (model/mla.py) over the latent entry, rank + rope and rank."""
        if self.mla is not None:
            return self.mla.latent_dim, self.mla.kv_lora_rank
        return self.head_dim, self.v_head_dim

    @cached_property
    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(heads, key dims, value dims) of one token's cache entry per layer; MLA caches one
        latent "head" whose values are its first kv_lora_rank dims, stored once (value dims 0)."""
        if self.mla is not None:
            return 1, self.mla.latent_dim, 0
        return self.num_kv_heads, self.head_dim, self.v_head_dim

    @cached_property
    def attn_params_per_layer(self) -> int:
        """q, k, v, o projections with their biases and q/k norms (MLA: its low-rank factors)."""
        h, n_q = self.hidden_size, self.num_heads
        if self.mla is not None:
            a = self.mla
            q_rank = a.q_lora_rank
            q = h * self.q_size if not q_rank else h * q_rank + q_rank * self.q_size
            kv = h * a.latent_dim + a.kv_lora_rank * n_q * (a.qk_nope_head_dim + a.v_head_dim)
            norms = a.kv_lora_rank + (q_rank or 0)  # kv_a_layernorm, q_a_layernorm
            return q + kv + n_q * a.v_head_dim * h + norms
        params = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            params += self.q_size + 2 * self.kv_size
        if self.o_bias:
            params += h
        if self.attention_sinks:
            params += n_q
        if self.qk_norm == "head":
            params += 2 * self.head_dim
        elif self.qk_norm == "projection":
            params += self.q_size + self.kv_size
        return params

    @cached_property
    def expert_params(self) -> int:
        """gate, up and down projections of one routed expert (SwiGLU), with their biases
        where the experts have them (GPT-OSS)."""
        bias = 2 * self.intermediate_size + self.hidden_size if self.expert_bias else 0
        return 3 * self.hidden_size * self.intermediate_size + bias

    @cached_property
    def expert_bytes(self) -> int:
        """One routed expert's bytes as the engine holds it: weights in expert_storage (or the
        dtype), biases in the dtype."""
        if self.expert_storage is None:
            return self.expert_params * self.dtype_bytes
        weights = 3 * self.hidden_size * self.intermediate_size
        bits = EXPERT_STORAGE_BITS[self.expert_storage]
        return int(weights * bits / 8) + (self.expert_params - weights) * self.dtype_bytes

    @cached_property
    def router_params(self) -> int:
        """Router weight, plus its score-correction bias (stored in fp32 by the checkpoints,
        counted at the model's width here) or its GEMM bias (GPT-OSS): E values per layer."""
        bias = self.num_experts if self.router_score_correction or self.router_bias else 0
        return self.hidden_size * self.num_experts + bias

    @cached_property
    def shared_params(self) -> int:
        gate = self.hidden_size if self.shared_expert_gate and self.shared_expert_intermediate_size else 0
        return 3 * self.hidden_size * self.shared_expert_intermediate_size + gate

    @cached_property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.dense_intermediate_size

    @cached_property
    def dense_params_per_layer(self) -> int:
        """Weights every token uses in a MoE layer: attention, router, shared experts, norms."""
        return self.attn_params_per_layer + self.router_params + self.shared_params + 2 * self.hidden_size

    @cached_property
    def experts_params_per_layer(self) -> int:
        return self.num_experts * self.expert_params

    @cached_property
    def experts_bytes_per_layer(self) -> int:
        return self.num_experts * self.expert_bytes

    @cached_property
    def moe_layer_bytes(self) -> int:
        return self.dense_params_per_layer * self.dtype_bytes + self.experts_bytes_per_layer

    @cached_property
    def dense_layer_params(self) -> int:
        """A layer without experts: attention, its dense MLP, the two norms."""
        return self.attn_params_per_layer + self.dense_mlp_params + 2 * self.hidden_size

    @cached_property
    def dense_layer_bytes(self) -> int:
        return self.dense_layer_params * self.dtype_bytes

    @cached_property
    def embedding_params(self) -> int:
        """The embedding, the LM head unless tied, the final norm."""
        tables = 1 if self.tie_word_embeddings else 2
        return tables * self.vocab_size * self.hidden_size + self.hidden_size

    @cached_property
    def embedding_bytes(self) -> int:
        return self.embedding_params * self.dtype_bytes

    @cached_property
    def active_params(self) -> int:
        """Decoder-layer weights one token uses (embeddings and LM head left out, as model cards
        count "activated" parameters): every dense layer, and per MoE layer all but the
        routed experts it is not sent to."""
        moe = self.dense_params_per_layer + self.top_k * self.expert_params
        return self.num_moe_layers * moe + self.num_dense_layers * self.dense_layer_params

    @cached_property
    def layers_bytes(self) -> int:
        return self.num_moe_layers * self.moe_layer_bytes + self.num_dense_layers * self.dense_layer_bytes

    @cached_property
    def total_bytes(self) -> int:
        return self.layers_bytes + self.embedding_bytes

    @cached_property
    def total_params(self) -> int:
        moe = self.dense_params_per_layer + self.experts_params_per_layer
        return (self.num_moe_layers * moe + self.num_dense_layers * self.dense_layer_params
                + self.embedding_params)

    @cached_property
    def kv_bytes_per_token_layer(self) -> int:
        heads, key, value = self.kv_cache_layout
        return heads * (key + value) * self.dtype_bytes

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """K and V (MLA: the latent and rope key) of one token across all layers (what one slot
        of the host KV cache holds)."""
        return self.num_layers * self.kv_bytes_per_token_layer

    @cached_property
    def pools_window_kv(self) -> bool:
        """Whether the engine keeps the sliding-window layers' K/V in a pool of their own, which
        holds only each sequence's window (a model with both kinds of layers, GPT-OSS)."""
        return 0 < self.num_windowed_layers < self.num_layers

    def window_blocks_per_sequence(self, block_size: int) -> int:
        """Most blocks a sequence holds on a sliding layer: its window of tokens straddles one
        block more than it fills."""
        return -(-int(self.sliding_window or 0) // block_size) + 1

    def attended_context(self, ctx: float) -> float:
        """Cached tokens a decode query attends per layer, averaged over the layers, at
        context `ctx`: the whole context on full layers, at most the window on sliding ones
        (GPT-OSS; the decode kernel reads only the window's keys there)."""
        windowed = self.num_windowed_layers
        if not windowed:
            return ctx
        span = min(ctx, float(self.sliding_window))
        return ((self.num_layers - windowed) * ctx + windowed * span) / self.num_layers

    def kv_bytes_per_sequence(self, tokens: float, block_size: int = 1) -> float:
        """K and V a sequence of `tokens` tokens holds across all layers: every token on the full
        layers, at most its window's blocks on the sliding ones where they are pooled apart."""
        if not self.pools_window_kv:
            return tokens * self.kv_bytes_per_token
        windowed = self.num_windowed_layers
        span = min(tokens, self.window_blocks_per_sequence(block_size) * block_size)
        return self.kv_bytes_per_token_layer * ((self.num_layers - windowed) * tokens
                                                + windowed * span)

    @classmethod
    def from_hf_config(cls, config: str | Path | Mapping[str, Any], *, dtype: Optional[str] = None,
                       name: Optional[str] = None) -> "ModelSpec":
        """Read a Hugging Face config.json (path to the file or its directory, or the parsed dict).

        Reads the engine's architectures (arch.ARCHITECTURES); any other raises
        UnsupportedModelError naming it. A field of the
        engine's architectures that changes the output and is not computed (a sliding window
        shorter than the context, another activation, ...) raises UnhonouredFieldError naming
        it (model/config_audit.py). `dtype`
        ("bfloat16", "float32", "auto", ...) overrides the checkpoint's, as `model.dtype` does.
        """
        if not isinstance(config, Mapping):
            name = name or _config_path(config).parent.name
            config = read_config(config)
        return spec_from_config(config, dtype=dtype, name=name)


def _config_path(path: str | Path) -> Path:
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory (or the file itself)."""
    return json.loads(_config_path(path).read_text())


def _rope_spec(cfg: Mapping[str, Any]) -> RopeSpec:
    # Defaults as transformers' standardize_rope_params and ROPE_INIT_FUNCTIONS fill them.
    _, params = rope_parameters(cfg)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    positions = int(cfg.get("max_position_embeddings", 4096))
    original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    original = int(original or positions)
    kind = rope_type(params)
    factor = params.get("factor")
    if factor is None:
        # yarn without a factor scales from the pretraining length to the configured one.
        factor = positions / original if kind == "yarn" else 1.0
    return RopeSpec(
        theta=float(theta),
        rope_type=kind,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _num_experts(cfg: Mapping[str, Any]) -> int:
    """Routed experts: `num_local_experts` (Mixtral), `num_experts` (hub Qwen/OLMoE configs;
    transformers 5 re-saves some of them as `num_local_experts`), `n_routed_experts` (DeepSeek)."""
    value = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if not value:
        raise UnsupportedModelError("config.json has neither num_experts nor num_local_experts")
    return int(value)


def _common(cfg: Mapping[str, Any], dtype: Optional[str], name: Optional[str]) -> dict[str, Any]:
    """Fields every architecture reads the same way."""
    heads = int(cfg["num_attention_heads"])
    eos = cfg.get("eos_token_id")
    chosen = dtype if dtype not in (None, "auto") else (cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    dtype_bytes_of(chosen)
    return dict(
        model_type=str(cfg.get("model_type", "")),
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_experts=_num_experts(cfg),
        top_k=int(cfg["num_experts_per_tok"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope=_rope_spec(cfg),
        torch_dtype=str(chosen).replace("torch.", ""),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        dense_intermediate_size=int(cfg.get("intermediate_size") or 0),
        name=str(name or cfg.get("_name_or_path") or cfg.get("model_type", "")),
    )


def spec_from_config(cfg: Mapping[str, Any], *, dtype: Optional[str] = None,
                     name: Optional[str] = None) -> ModelSpec:
    """ModelSpec from a parsed config.json (see ModelSpec.from_hf_config)."""
    arch_name = architecture_name(cfg)
    try:
        arch = architecture(arch_name)
    except UnsupportedArchitectureError as e:
        raise UnsupportedModelError(str(e)) from None
    cfg = arch.text_model_config(dict(cfg))
    refuse_unhonoured_fields(cfg, arch.model_type)
    cfg = arch.canonical_config(dict(cfg))
    _, params = rope_parameters(cfg)
    if "rope_theta" not in params and cfg.get("rope_theta") is None:
        # The config class's default theta (ERNIE-4.5: 500000), as transformers fills it in.
        cfg["rope_theta"] = arch.default_rope_theta
    if arch.default_rope_parameters and not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
        # GPT-OSS: a config without RoPE keys gets its config class's YaRN, as transformers'.
        cfg = {**cfg, "rope_parameters": {"rope_theta": cfg.get("rope_theta", arch.default_rope_theta),
                                          **dict(arch.default_rope_parameters)}}
    common = _common(cfg, dtype, name)
    own = arch.own_config(dict(cfg))
    heads = common["num_heads"]
    num_layers = common["num_layers"]
    # Qwen2-MoE gives the shared expert's width; DeepSeek-style configs (GLM-4.5) a count of
    # expert-wide shared experts, which transformers runs as one MLP of their summed width.
    shared = int(own.get("shared_expert_intermediate_size")
                 or int(own.get("n_shared_experts") or 0) * common["intermediate_size"])
    step, mlp_only = own.get("decoder_sparse_step") or 1, tuple(own.get("mlp_only_layers") or ())
    first_dense = int(own.get("first_k_dense_replace") or 0)
    last_sparse = own.get("last_moe_layer")
    if last_sparse is not None:
        # Ernie4_5_MoeConfig turns -1 (its default) into the last layer, no other value.
        last_sparse = num_layers - 1 if int(last_sparse) == -1 else int(last_sparse)
    sparse = [is_sparse_layer(i, step, mlp_only, first_dense, last_sparse)
              for i in range(num_layers)]
    if own.get("moe_layers") is not None:  # Llama-4's explicit list wins over the step
        sparse = [i in own["moe_layers"] for i in range(num_layers)]
    llama4 = _llama4_fields(own, num_layers, common) if arch.llama4_attention else {}
    mla = _mla_spec(own) if arch.mla else None
    # DeepSeek-V2's "greedy" top-k ignores n_group/topk_group; its group_limited_greedy and
    # DeepSeek-V3 / GLM-4.5 always limit to the best groups (n_group 1: no limit).
    grouped = own.get("topk_method") != "greedy"
    return ModelSpec(
        architecture=arch_name,
        **common,
        # MLA: every head has its own key and value (up-projected from the shared latent); a
        # saved config's head_dim is transformers' rope dim, not a head's width.
        num_kv_heads=heads if mla else int(cfg.get("num_key_value_heads") or heads),
        head_dim=(mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla
                  else int(cfg.get("head_dim") or common["hidden_size"] // heads)),
        # At least max_position_embeddings when set (shorter windows are refused above).
        sliding_window=sliding_window(cfg, arch.model_type)[1],
        # Qwen2-MoE switches q/k/v biases with qkv_bias; Qwen3 and OLMoE switch q/k/v/o biases
        # with attention_bias, GLM-4.5 q/k/v only.
        qkv_bias=bool(own.get("qkv_bias", own.get("attention_bias", False))),
        o_bias=arch.o_bias and bool(own.get("attention_bias", False)),
        qk_norm=arch.qk_norm if own.get("use_qk_norm", True) else None,
        clip_qkv=None if own.get("clip_qkv") is None else float(own["clip_qkv"]),
        norm_topk_prob=bool(own["norm_topk_prob"]),
        router_weights_fp32=arch.router_weights_fp32,
        shared_expert_intermediate_size=shared,
        shared_expert_gate=arch.shared_expert_gate and shared > 0,
        dense_layers=tuple(i for i in range(num_layers) if not sparse[i]),
        partial_rotary_factor=_partial_rotary_factor(cfg, own),
        router_scoring=arch.router_scoring,
        router_logits_fp32=arch.router_logits_fp32,
        router_score_correction=bool(own.get("e_score_correction_bias", False)),
        router_groups=int(own.get("n_group") or 1) if grouped else 1,
        router_topk_groups=int(own.get("topk_group") or 1) if grouped else 1,
        router_group_score=str(own.get("group_score", "top2_sum")),
        routed_scaling_factor=float(own.get("routed_scaling_factor", 1.0)),
        router_norm_min=(None if own.get("router_norm_min") is None
                         else float(own["router_norm_min"])),
        attention_sinks=arch.attention_sinks,
        layer_types=layer_types(cfg, arch.model_type),
        router_bias=arch.router_bias,
        expert_bias=arch.expert_bias,
        expert_activation=arch.expert_activation,
        swiglu_alpha=float(own.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(own.get("swiglu_limit", 7.0)),
        mla=mla,
        rope_interleave=bool(own.get("rope_interleave", False)),
        expert_storage=checkpoint_expert_storage(cfg, arch.model_type),
        router_scales_input=arch.router_scales_input,
        **llama4,
    )


def _llama4_fields(own: Mapping[str, Any], num_layers: int,
                   common: dict[str, Any]) -> dict[str, Any]:
    """Llama-4's attention fields; caps common's max_position_embeddings at the chunk size
    where a layer is chunked (config_audit refuses a chunked layer without a chunk size)."""
    rope = llama4_rope_layers(own, num_layers)
    nope = tuple(i for i in range(num_layers) if not rope[i])
    chunk = (int(own["attention_chunk_size"])
             if "chunked_attention" in llama4_layer_types(own, num_layers) else None)
    if chunk is not None:
        common["max_position_embeddings"] = min(common["max_position_embeddings"], chunk)
    if own.get("intermediate_size_mlp"):
        common["dense_intermediate_size"] = int(own["intermediate_size_mlp"])
    tuned = bool(own.get("attn_temperature_tuning")) and bool(nope)
    return dict(nope_layers=nope, qk_l2_norm=bool(own.get("use_qk_norm")),
                attn_temperature_floor=float(own["floor_scale"]) if tuned else None,
                attn_temperature_scale=float(own.get("attn_scale", 0.1)),
                attention_chunk_size=chunk)


def _mla_spec(own: Mapping[str, Any]) -> MlaSpec:
    q_rank = own.get("q_lora_rank")
    return MlaSpec(kv_lora_rank=int(own["kv_lora_rank"]),
                   q_lora_rank=int(q_rank) if q_rank else None,
                   qk_nope_head_dim=int(own["qk_nope_head_dim"]),
                   qk_rope_head_dim=int(own["qk_rope_head_dim"]), v_head_dim=int(own["v_head_dim"]))


def _partial_rotary_factor(cfg: Mapping[str, Any], own: Mapping[str, Any]) -> float:
    """transformers' order: rope_parameters' partial_rotary_factor, else the top-level key,
    else the architecture's default (own_config filled it: 0.5 for GLM-4.5; architectures that
    do not read the key rotate whole heads and config_audit refuses another value)."""
    _, params = rope_parameters(cfg)
    factor = params.get("partial_rotary_factor", own.get("partial_rotary_factor"))
    return float(factor) if factor is not None else 1.0


def load_spec(model_dir: str | Path, dtype: Optional[str] = None) -> ModelSpec:
    """The spec of the HF checkpoint in `model_dir`, for the engine to run.

    Raises UnsupportedArchitectureError, naming the architecture, for one without a name table.
    """
    cfg = read_config(model_dir)
    # Before parsing: the error should name the architecture, not a key the engine never reads.
    architecture(architecture_name(cfg))
    return ModelSpec.from_hf_config(cfg, dtype=dtype, name=_config_path(model_dir).parent.name)
