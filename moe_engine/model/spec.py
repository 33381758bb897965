"""ModelSpec: the shapes and constants of a checkpoint, read from its HF config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from moe_engine.model.arch import architecture, architecture_name


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters (HF `rope_parameters`, or legacy `rope_theta`/`rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 / yarn extras; unused for the default type.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: Optional[int] = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about an architecture instance."""

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
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
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
    dense_intermediate_size: int = 0  # MLP width of the dense layers
    dense_layers: tuple[int, ...] = ()  # layers whose FFN is a dense MLP, not experts

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers


def _rope_spec(cfg: dict[str, Any]) -> RopeSpec:
    # transformers 5 writes `rope_parameters` (theta inside); older checkpoints write
    # `rope_theta` + optional `rope_scaling`. Accept both.
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    return RopeSpec(
        theta=float(theta),
        rope_type=str(rope_type),
        factor=float(params.get("factor", 1.0) or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        attention_factor=params.get("attention_factor"),
    )


def _dense_layers(own: dict[str, Any], num_layers: int, num_experts: int) -> tuple[int, ...]:
    # Qwen-MoE's rule: layer i has experts iff it is not in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0. Architectures without these keys are all MoE.
    step = int(own.get("decoder_sparse_step") or 1)
    mlp_only = set(own.get("mlp_only_layers") or ())
    return tuple(i for i in range(num_layers)
                 if i in mlp_only or num_experts == 0 or (i + 1) % step != 0)


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Parse `config.json` of a HF MoE checkpoint into a ModelSpec.

    Raises UnsupportedArchitectureError, naming the architecture, for one without a table.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    name = architecture_name(cfg)
    arch = architecture(name)
    own = arch.own_config(cfg)
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    num_layers = int(cfg["num_hidden_layers"])
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    return ModelSpec(
        architecture=name,
        model_type=str(cfg.get("model_type", "")),
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        num_experts=num_experts,
        top_k=int(cfg["num_experts_per_tok"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope=_rope_spec(cfg),
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        # Qwen configs carry a window size even when use_sliding_window is off.
        sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        # Qwen2-MoE switches q/k/v biases with qkv_bias; Qwen3 and OLMoE switch q/k/v/o biases
        # with attention_bias.
        qkv_bias=bool(own.get("qkv_bias", own.get("attention_bias", False))),
        o_bias=bool(own.get("attention_bias", False)),
        qk_norm=arch.qk_norm,
        clip_qkv=None if own.get("clip_qkv") is None else float(own["clip_qkv"]),
        norm_topk_prob=bool(own["norm_topk_prob"]),
        router_weights_fp32=arch.router_weights_fp32,
        shared_expert_intermediate_size=int(own.get("shared_expert_intermediate_size") or 0),
        dense_intermediate_size=int(cfg["intermediate_size"]),
        dense_layers=_dense_layers(own, num_layers, num_experts),
    )
