"""Frozen descriptions of the model, the machine and the workload that the performance model reads.

All sizes are in bytes, bandwidths in bytes/s and compute rates in FLOP/s (SI units, 1 GB = 1e9 B)
so that the formulas in `roofline` and `lens` need no unit conversions.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

GB = 1e9
TFLOPS = 1e12

_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2,
                "half": 2, "fp16": 2, "float8_e4m3fn": 1, "int8": 1}


class UnsupportedModelError(ValueError):
    """The config.json describes an architecture the performance model does not know."""


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only MoE transformer, enough to count FLOPs and bytes per operator.

    `num_moe_layers` of the `num_layers` layers have routed experts; the others have a dense MLP
    of width `dense_intermediate` (DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers).
    `shared_intermediate` is the total width of the always-active shared experts (0 if none).
    """

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    attn_params_per_layer: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int = 0
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(h -> 1) gate on the shared expert
    num_moe_layers: int = -1
    dense_intermediate: int = 0
    vocab_size: int = 32000
    tied_embeddings: bool = False
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        if self.num_moe_layers < 0:
            object.__setattr__(self, "num_moe_layers", self.num_layers)
        if not (1 <= self.top_k <= self.num_experts):
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def gqa_group(self) -> int:
        return max(1, self.num_heads // self.num_kv_heads)

    @property
    def qkv_out_features(self) -> int:
        return self.num_heads * self.head_dim + self.num_kv_heads * (self.head_dim + self.v_head_dim)

    @property
    def expert_params(self) -> int:
        """gate, up and down projections of one routed expert (SwiGLU)."""
        return 3 * self.hidden_size * self.expert_intermediate

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def shared_params(self) -> int:
        gate = self.hidden_size if self.shared_expert_gate and self.shared_intermediate else 0
        return 3 * self.hidden_size * self.shared_intermediate + gate

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.dense_intermediate

    @property
    def dense_params_per_layer(self) -> int:
        """Weights every token uses in a MoE layer: attention, router, shared experts, norms."""
        return self.attn_params_per_layer + self.router_params + self.shared_params + 2 * self.hidden_size

    @property
    def experts_params_per_layer(self) -> int:
        return self.num_experts * self.expert_params

    @property
    def moe_layer_bytes(self) -> int:
        return (self.dense_params_per_layer + self.experts_params_per_layer) * self.dtype_bytes

    @property
    def dense_layer_bytes(self) -> int:
        return (self.attn_params_per_layer + self.dense_mlp_params + 2 * self.hidden_size) * self.dtype_bytes

    @property
    def embedding_bytes(self) -> int:
        tables = 1 if self.tied_embeddings else 2
        return (tables * self.vocab_size * self.hidden_size + self.hidden_size) * self.dtype_bytes

    @property
    def layers_bytes(self) -> int:
        return self.num_moe_layers * self.moe_layer_bytes + self.num_dense_layers * self.dense_layer_bytes

    @property
    def total_bytes(self) -> int:
        return self.layers_bytes + self.embedding_bytes

    @property
    def total_params(self) -> int:
        return self.total_bytes // self.dtype_bytes

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers (what one slot of the host KV cache holds)."""
        return self.num_layers * self.kv_bytes_per_token_layer

    def with_dtype_bytes(self, dtype_bytes: int) -> "ModelSpec":
        """The same shapes stored in another precision (e.g. the engine's dtype override)."""
        from dataclasses import replace

        return replace(self, dtype_bytes=dtype_bytes)

    @classmethod
    def from_hf_config(cls, config: str | Path | Mapping[str, Any], *, dtype: str | None = None,
                       name: str | None = None) -> "ModelSpec":
        """Read a Hugging Face config.json (path to the file or its directory, or the dict).

        Supports model_type mixtral, qwen2_moe, qwen3_moe, olmoe and deepseek_v2; any other type
        raises UnsupportedModelError naming it. `dtype` ("bfloat16", "float32", ...) overrides the
        checkpoint's torch_dtype, as the engine's `model.dtype` does.
        """
        if not isinstance(config, Mapping):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            config = json.loads(path.read_text())
            name = name or path.parent.name
        return model_spec_from_dict(dict(config), dtype=dtype, name=name)


def dtype_bytes_of(dtype: str | None) -> int:
    """Bytes per element of a torch dtype name; unknown or missing names count as 2 (bf16)."""
    if dtype is None:
        return 2
    key = str(dtype).replace("torch.", "").lower()
    if key not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[key]


def _moe_layer_count(num_layers: int, sparse_step: int, mlp_only: Sequence[int]) -> int:
    """Qwen-MoE rule: layer i is sparse iff not in mlp_only_layers and (i + 1) % step == 0."""
    if sparse_step <= 0:
        return 0
    return sum(1 for i in range(num_layers) if i not in set(mlp_only) and (i + 1) % sparse_step == 0)


def _num_experts(cfg: dict[str, Any]) -> int:
    """Routed experts: `num_experts` in hub Qwen/OLMoE configs; transformers 5 re-saves some
    of them as `num_local_experts`."""
    value = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not value:
        raise UnsupportedModelError("config.json has neither num_experts nor num_local_experts")
    return int(value)


def model_spec_from_dict(cfg: dict[str, Any], *, dtype: str | None = None, name: str | None = None) -> ModelSpec:
    """Build a ModelSpec from a parsed config.json dict (see ModelSpec.from_hf_config)."""
    model_type = cfg.get("model_type")
    supported = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2")
    if model_type not in supported:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by the performance model; "
            f"supported: {', '.join(supported)}")
    chosen_dtype = dtype if dtype not in (None, "auto") else cfg.get("torch_dtype", cfg.get("dtype"))
    dbytes = dtype_bytes_of(chosen_dtype)
    h = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    n_q = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_q)
    common = dict(name=name or cfg.get("_name_or_path") or model_type, model_type=model_type,
                  num_layers=layers, hidden_size=h, num_heads=n_q, vocab_size=int(cfg.get("vocab_size", 32000)),
                  tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), dtype_bytes=dbytes)

    if model_type == "deepseek_v2":
        # Multi-head latent attention. The HF implementation caches the decompressed per-head K
        # (nope + rope parts) and V, so that is what a KV slot holds; weight count follows the
        # low-rank projections.
        rope, nope, v_dim = int(cfg["qk_rope_head_dim"]), int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
        kv_rank = int(cfg["kv_lora_rank"])
        q_rank = cfg.get("q_lora_rank")
        qk_dim = nope + rope
        q_params = h * n_q * qk_dim if not q_rank else h * int(q_rank) + int(q_rank) * n_q * qk_dim
        kv_params = h * (kv_rank + rope) + kv_rank * n_q * (nope + v_dim)
        attn = q_params + kv_params + n_q * v_dim * h
        first_dense = int(cfg.get("first_k_dense_replace", 0))
        freq = int(cfg.get("moe_layer_freq", 1))
        n_moe = sum(1 for i in range(layers) if i >= first_dense and i % freq == 0) if cfg.get("n_routed_experts") else 0
        n_shared = int(cfg.get("n_shared_experts") or 0)
        moe_i = int(cfg["moe_intermediate_size"])
        return ModelSpec(**common, num_kv_heads=n_q, head_dim=qk_dim, v_head_dim=v_dim, attn_params_per_layer=attn,
                         num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                         expert_intermediate=moe_i, shared_intermediate=n_shared * moe_i, num_moe_layers=n_moe,
                         dense_intermediate=int(cfg["intermediate_size"]))

    d = int(cfg.get("head_dim") or h // n_q)
    attn = h * (n_q + 2 * n_kv) * d + n_q * d * h
    if cfg.get("attention_bias") or cfg.get("qkv_bias") or model_type == "qwen2_moe":
        attn += (n_q + 2 * n_kv) * d
    if model_type == "mixtral":
        return ModelSpec(**common, num_kv_heads=n_kv, head_dim=d, v_head_dim=d, attn_params_per_layer=attn,
                         num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                         expert_intermediate=int(cfg["intermediate_size"]))
    if model_type == "olmoe":
        return ModelSpec(**common, num_kv_heads=n_kv, head_dim=d, v_head_dim=d,
                         attn_params_per_layer=attn + (n_q + n_kv) * d,  # q/k RMSNorm weights
                         num_experts=_num_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
                         expert_intermediate=int(cfg["intermediate_size"]))
    # qwen2_moe and qwen3_moe share the sparse-layer rule; qwen2_moe adds a gated shared expert.
    n_moe = _moe_layer_count(layers, int(cfg.get("decoder_sparse_step", 1)), cfg.get("mlp_only_layers") or [])
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    if model_type == "qwen3_moe":
        attn += 2 * d  # q_norm / k_norm
    return ModelSpec(**common, num_kv_heads=n_kv, head_dim=d, v_head_dim=d, attn_params_per_layer=attn,
                     num_experts=_num_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
                     expert_intermediate=int(cfg["moe_intermediate_size"]), shared_intermediate=shared,
                     shared_expert_gate=bool(shared),
                     num_moe_layers=n_moe, dense_intermediate=int(cfg.get("intermediate_size", 0)))


@dataclass(frozen=True)
class GemmPoint:
    """One profiled GEMM: y[tokens, out] = x[tokens, inp] @ W^T at `flops_per_s` achieved."""

    inp: int
    out: int
    tokens: int
    dtype_bytes: int
    flops_per_s: float


@dataclass(frozen=True)
class HardwareSpec:
    """Memory capacities, bandwidths and peak rates of the accelerator ("device"), the host CPU
    and the link between them; optional profiled figures refine the roofline per shape.

    device_kind "cpu" means there is no accelerator: the device is the CPU itself, device and
    host memory are one pool and resident weights cost no link traffic.
    """

    name: str
    device_kind: str
    device_memory: float
    host_memory: float
    link_bw: float
    device_bw: float
    cpu_bw: float
    device_flops: float
    cpu_flops: float
    cpu_cores: int = 1
    gemm_points: tuple[GemmPoint, ...] = ()
    cpu_attention_bw: float | None = None
    cpu_gemm_points: tuple[GemmPoint, ...] = ()
    op_overhead_s: float = 0.0
    # The engine loop's own host work (scheduling, packing inputs, sampling), profiled: per
    # step, per sequence in a decode step, per prompt token in a prefill pass.
    host_step_s: float = 0.0
    host_seq_s: float = 0.0
    host_token_s: float = 0.0
    notes: str = ""

    @property
    def is_cpu_only(self) -> bool:
        return self.device_kind == "cpu"

    def with_host_memory(self, host_memory: float) -> "HardwareSpec":
        from dataclasses import replace

        return replace(self, host_memory=host_memory)

    def with_link_bw(self, link_bw: float) -> "HardwareSpec":
        from dataclasses import replace

        return replace(self, link_bw=link_bw)


@dataclass(frozen=True)
class WorkloadSpec:
    """Token-length statistics of the requests to run (one shard or the whole corpus)."""

    mean_prompt: float
    max_prompt: int
    gen_len: int
    num_requests: int = 0  # 0 = unbounded (steady state); else the batch is bounded by it
    prompt_lengths: tuple[int, ...] = field(default=(), repr=False)
    # Per-request generation lengths when they differ (rows with their own max_new_tokens):
    # the batch then drains as short requests finish, which a mean length cannot show.
    gen_lengths: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.gen_len < 1:
            raise ValueError(f"gen_len={self.gen_len} must be >= 1")
        if self.gen_lengths and min(self.gen_lengths) < 1:
            raise ValueError("every generation length must be >= 1")
        if self.mean_prompt < 0 or self.max_prompt < self.mean_prompt - 1e-9:
            raise ValueError(f"bad prompt statistics mean={self.mean_prompt} max={self.max_prompt}")

    @property
    def mean_seq_len(self) -> float:
        return self.mean_prompt + self.gen_len

    @property
    def sum_prompt_sq(self) -> float:
        """Mean of prompt length squared (prefill attention is quadratic per sequence)."""
        if self.prompt_lengths:
            return sum(p * p for p in self.prompt_lengths) / len(self.prompt_lengths)
        return self.mean_prompt ** 2


def workload_spec_from_lengths(prompt_lengths: Sequence[int], gen_len: int | Sequence[int]) -> WorkloadSpec:
    """Summarize a shard's prompt token counts; the request count bounds the batch. `gen_len` is
    one generation length for all requests or one per request (in the same order)."""
    lengths = tuple(int(x) for x in prompt_lengths)
    if not lengths:
        raise ValueError("workload has no requests")
    if min(lengths) < 0:
        raise ValueError("prompt lengths must be >= 0")
    if isinstance(gen_len, (int, float)):
        return WorkloadSpec(mean_prompt=sum(lengths) / len(lengths), max_prompt=max(lengths),
                            gen_len=int(gen_len), num_requests=len(lengths), prompt_lengths=lengths)
    gens = tuple(int(g) for g in gen_len)
    if len(gens) != len(lengths):
        raise ValueError(f"{len(gens)} generation lengths for {len(lengths)} prompts")
    return WorkloadSpec(mean_prompt=sum(lengths) / len(lengths), max_prompt=max(lengths),
                        gen_len=max(1, round(sum(gens) / len(gens))), num_requests=len(lengths),
                        prompt_lengths=lengths, gen_lengths=gens)


def blocks_for(tokens: float, block_size: int) -> int:
    """Paged-KV blocks one sequence of `tokens` occupies."""
    return int(math.ceil(tokens / block_size))
