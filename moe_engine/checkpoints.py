"""Built-in random-weight checkpoints in Hugging Face format.

There is no model hub here, so the project generates its own checkpoints and runs the real
loading code on them. A checkpoint is a pure function of (preset, seed): the same inputs give the
same bytes, so tests can pin behaviour and the workflow can regenerate instead of storing models.

The directory looks like a hub download: config.json, generation_config.json, model.safetensors
(or shards + model.safetensors.index.json), tokenizer.json, tokenizer_config.json (chat template).
Tensor names and config keys are those the hub's checkpoints of each architecture use (legacy
per-expert names, which transformers 5 also writes on save_pretrained). Every preset shares the
generator and the tokenizer; presets differ in architecture and shapes only.
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors.torch import save_file

from moe_engine.tokenizer_builder import BOS_TOKEN, EOS_TOKEN, SPECIAL_TOKENS, write_tokenizer

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MoePreset:
    """Shapes of a built-in MoE checkpoint. vocab_size may exceed the tokenizer (padded rows,
    see below). Fields an architecture lacks keep their defaults (see FAMILIES)."""

    architecture: str
    hidden_size: int
    intermediate_size: int  # one routed expert's width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    vocab_size: int
    tokenizer_vocab_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-5
    dtype: str = "float32"
    explicit_head_dim: Optional[int] = None  # else hidden_size // num_attention_heads
    attention_bias: bool = False
    norm_topk_prob: bool = False
    clip_qkv: Optional[float] = None
    shared_expert_intermediate_size: int = 0
    dense_intermediate_size: int = 0  # MLP width of the dense layers
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def family(self) -> "Family":
        return FAMILIES[self.architecture]

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class Family:
    """How the hub's checkpoints of an architecture are written: model_type, the module holding
    router and experts, expert projection names (gate, down, up), the config key switching the
    attention biases and the projections it covers, the q/k norm ("head": one per head,
    "projection": over the whole projection) and the architecture's own config keys."""

    model_type: str
    moe_block: str
    expert_names: tuple[str, str, str]
    bias_key: Optional[str]
    biased: str
    qk_norm: Optional[str]
    config_keys: Callable[[MoePreset], dict[str, Any]]


def _mixtral_keys(p: MoePreset) -> dict[str, Any]:
    return {"intermediate_size": p.intermediate_size, "num_local_experts": p.num_experts,
            "router_aux_loss_coef": 0.02, "sliding_window": None}


def _qwen_moe_keys(p: MoePreset) -> dict[str, Any]:
    keys = {"intermediate_size": p.dense_intermediate_size,
            "moe_intermediate_size": p.intermediate_size, "num_experts": p.num_experts,
            "norm_topk_prob": p.norm_topk_prob, "decoder_sparse_step": p.decoder_sparse_step,
            "mlp_only_layers": list(p.mlp_only_layers), "router_aux_loss_coef": 0.001,
            "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": p.num_hidden_layers}
    if p.shared_expert_intermediate_size:
        keys["shared_expert_intermediate_size"] = p.shared_expert_intermediate_size
    return keys


def _olmoe_keys(p: MoePreset) -> dict[str, Any]:
    return {"intermediate_size": p.intermediate_size, "num_experts": p.num_experts,
            "norm_topk_prob": p.norm_topk_prob, "clip_qkv": p.clip_qkv,
            "router_aux_loss_coef": 0.01}


_LLAMA_MLP = ("gate_proj", "down_proj", "up_proj")
FAMILIES: dict[str, Family] = {
    "MixtralForCausalLM": Family(
        model_type="mixtral", moe_block="block_sparse_moe", expert_names=("w1", "w2", "w3"),
        bias_key=None, biased="", qk_norm=None, config_keys=_mixtral_keys),
    "Qwen2MoeForCausalLM": Family(
        model_type="qwen2_moe", moe_block="mlp", expert_names=_LLAMA_MLP,
        bias_key="qkv_bias", biased="qkv", qk_norm=None, config_keys=_qwen_moe_keys),
    "Qwen3MoeForCausalLM": Family(
        model_type="qwen3_moe", moe_block="mlp", expert_names=_LLAMA_MLP,
        bias_key="attention_bias", biased="qkvo", qk_norm="head", config_keys=_qwen_moe_keys),
    "OlmoeForCausalLM": Family(
        model_type="olmoe", moe_block="mlp", expert_names=_LLAMA_MLP,
        bias_key="attention_bias", biased="qkvo", qk_norm="projection",
        config_keys=_olmoe_keys),
}

PRESETS: dict[str, MoePreset] = {
    # CI-sized: every code path of a real Mixtral (GQA 2:1, 8 experts top-2), ~14 MB in fp32.
    # The tokenizer has 8192 tokens: with it the bundled corpus has MTBench-like lengths.
    "tiny-mixtral": MoePreset(
        "MixtralForCausalLM", hidden_size=128, intermediate_size=224, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        vocab_size=8192, tokenizer_vocab_size=8192, dtype="float32"),
    # Benchmark-sized: Mixtral-like per-layer shapes at 4 layers (~428M parameters, bf16).
    "small-mixtral": MoePreset(
        "MixtralForCausalLM", hidden_size=1024, intermediate_size=3584, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
        vocab_size=32000, tokenizer_vocab_size=8192, dtype="bfloat16"),
    # Qwen1.5-MoE's features: q/k/v biases, many small experts with unnormalised top-k weights,
    # a gated shared expert 4x an expert's width, and a dense layer (mlp_only_layers) between
    # two MoE layers. ~5 MB.
    "tiny-qwen2-moe": MoePreset(
        "Qwen2MoeForCausalLM", hidden_size=64, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_experts=16, num_experts_per_tok=4,
        vocab_size=8192, tokenizer_vocab_size=8192, rms_norm_eps=1e-6, attention_bias=True,
        norm_topk_prob=False, shared_expert_intermediate_size=128, dense_intermediate_size=176,
        mlp_only_layers=(1,)),
    # Qwen3-MoE's features: per-head q/k RMSNorm, head_dim from the config (q is wider than
    # the hidden size, as in Qwen3-30B-A3B), renormalised top-k weights. ~5 MB.
    "tiny-qwen3-moe": MoePreset(
        "Qwen3MoeForCausalLM", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=16, num_experts_per_tok=4,
        vocab_size=8192, tokenizer_vocab_size=8192, rms_norm_eps=1e-6, explicit_head_dim=32,
        norm_topk_prob=True, dense_intermediate_size=192),
    # OLMoE's features: q/k RMSNorm over the whole projections, 64 experts top-8 with
    # unnormalised weights. ~7 MB.
    "tiny-olmoe": MoePreset(
        "OlmoeForCausalLM", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=64, num_experts_per_tok=8,
        vocab_size=8192, tokenizer_vocab_size=8192, rope_theta=10000.0, norm_topk_prob=False),
}


def hf_config(preset: MoePreset) -> dict:
    """config.json contents, in the key style of the hub's checkpoints of the architecture."""
    family = preset.family
    config = {
        "architectures": [preset.architecture],
        "model_type": family.model_type,
        "attention_dropout": 0.0,
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "head_dim": preset.head_dim,
        "initializer_range": 0.02,
        "max_position_embeddings": preset.max_position_embeddings,
        "num_attention_heads": preset.num_attention_heads,
        "num_experts_per_tok": preset.num_experts_per_tok,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_key_value_heads": preset.num_key_value_heads,
        "output_router_logits": False,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_theta": preset.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": preset.dtype,
        "use_cache": True,
        "vocab_size": preset.vocab_size,
        **family.config_keys(preset),
    }
    if family.bias_key is not None:
        config[family.bias_key] = preset.attention_bias
    return config


def _swiglu_shapes(prefix: str, names: tuple[str, str, str], h: int, width: int
                   ) -> list[tuple[str, tuple[int, ...], str]]:
    gate, down, up = names
    return [(f"{prefix}.{gate}.weight", (width, h), "linear"),
            (f"{prefix}.{down}.weight", (h, width), "residual"),
            (f"{prefix}.{up}.weight", (width, h), "linear")]


def _attention_shapes(p: MoePreset, pre: str) -> list[tuple[str, tuple[int, ...], str]]:
    h, d, fam = p.hidden_size, p.head_dim, p.family
    q, kv = p.num_attention_heads * d, p.num_key_value_heads * d
    shapes = []
    for proj, (out, inp), kind in (("q", (q, h), "linear"), ("k", (kv, h), "linear"),
                                   ("v", (kv, h), "linear"), ("o", (h, q), "residual")):
        shapes.append((f"{pre}.self_attn.{proj}_proj.weight", (out, inp), kind))
        if p.attention_bias and proj in fam.biased:
            shapes.append((f"{pre}.self_attn.{proj}_proj.bias", (out,), "bias"))
    if fam.qk_norm is not None:
        per_head = fam.qk_norm == "head"
        shapes += [(f"{pre}.self_attn.q_norm.weight", (d if per_head else q,), "norm"),
                   (f"{pre}.self_attn.k_norm.weight", (d if per_head else kv,), "norm")]
    return shapes


def _tensor_shapes(p: MoePreset) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init kind) in a fixed order: the order random numbers are drawn in."""
    h, fam = p.hidden_size, p.family
    shapes: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (p.vocab_size, h), "embedding")]
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}"
        shapes.append((f"{pre}.input_layernorm.weight", (h,), "norm"))
        shapes += _attention_shapes(p, pre)
        shapes.append((f"{pre}.post_attention_layernorm.weight", (h,), "norm"))
        if not p.is_moe_layer(i):
            shapes += _swiglu_shapes(f"{pre}.mlp", _LLAMA_MLP, h, p.dense_intermediate_size)
            continue
        block = f"{pre}.{fam.moe_block}"
        shapes.append((f"{block}.gate.weight", (p.num_experts, h), "router"))
        for e in range(p.num_experts):
            shapes += _swiglu_shapes(f"{block}.experts.{e}", fam.expert_names, h,
                                     p.intermediate_size)
        if p.shared_expert_intermediate_size:
            shapes += _swiglu_shapes(f"{block}.shared_expert", _LLAMA_MLP, h,
                                     p.shared_expert_intermediate_size)
            shapes.append((f"{block}.shared_expert_gate.weight", (1, h), "linear"))
    shapes += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (p.vocab_size, h), "lm_head")]
    return shapes


def _init_tensor(kind: str, shape: tuple[int, ...], p: MoePreset, g: torch.Generator,
                 text_vocab: int) -> torch.Tensor:
    # Scales are chosen so that every layer visibly changes the residual stream (a wrong weight
    # mapping then changes the logits), router logits are spread (few near-ties in top-k, so
    # implementations agree on the experts), and output logits are peaked (greedy parity does not
    # hinge on near-ties, and sampling stays on the tokenizer's real tokens, see lm_head below).
    fan_in = shape[-1]
    if kind == "embedding":
        t = torch.randn(shape, generator=g)
    elif kind == "norm":
        t = 1.0 + 0.1 * torch.randn(shape, generator=g)
    elif kind == "linear":
        t = torch.randn(shape, generator=g) / math.sqrt(fan_in)
    elif kind == "residual":
        t = torch.randn(shape, generator=g) / math.sqrt(fan_in * 2 * p.num_hidden_layers)
    elif kind == "bias":
        t = 0.2 * torch.randn(shape, generator=g)
    elif kind == "router":
        t = 2.0 * torch.randn(shape, generator=g) / math.sqrt(fan_in)
    elif kind == "lm_head":
        t = 4.0 * torch.randn(shape, generator=g) / math.sqrt(fan_in)
    else:
        raise ValueError(f"unknown init kind {kind!r}")
    if kind in ("embedding", "lm_head") and p.vocab_size > text_vocab:
        # Vocabulary padding rows, as real checkpoints pad vocab for GEMM alignment: all-zero, so
        # their logit is 0 while real tokens' logits are peaked; no text maps to them.
        t[text_vocab:] = 0.0
    return t


def generate_state_dict(preset: MoePreset, seed: int, text_vocab: int) -> dict[str, torch.Tensor]:
    """All weights of a preset, drawn from one seeded generator in a fixed order.

    text_vocab is the tokenizer's size: embedding rows past it are vocabulary padding.
    """
    if text_vocab > preset.vocab_size:
        raise ValueError(f"tokenizer has {text_vocab} tokens, more than vocab_size {preset.vocab_size}")
    g = torch.Generator().manual_seed(seed)
    dtype = _DTYPES[preset.dtype]
    return {name: _init_tensor(kind, shape, preset, g, text_vocab).to(dtype).contiguous()
            for name, shape, kind in _tensor_shapes(preset)}


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else -1


def _write_weights(state: dict[str, torch.Tensor], out_dir: Path, num_shards: int, num_layers: int) -> None:
    meta = {"format": "pt"}
    if num_shards == 1:
        save_file(state, str(out_dir / WEIGHTS_NAME), metadata=meta)
        return
    # Split by decoder layer (embeddings in the first shard, final norm/lm_head in the last), as
    # hub checkpoints do, so a loader must follow the index rather than assume one file.
    shard_of_layer = lambda layer: min(num_shards - 1, max(0, layer) * num_shards // max(1, num_layers))
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    for name, tensor in state.items():
        layer = _layer_of(name)
        idx = 0 if name.startswith("model.embed_tokens") else (
            num_shards - 1 if layer < 0 else shard_of_layer(layer))
        shards[idx][name] = tensor
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata=meta)
        for name, tensor in shard.items():
            weight_map[name] = fname
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def build_checkpoint(preset: str, out_dir: Path | str, seed: int = 0, num_shards: int = 1,
                     corpus_files: list[Path] | None = None) -> Path:
    """Write the built-in checkpoint `preset` to out_dir (replaced atomically) and return it.

    Deterministic: the same (preset, seed, num_shards, corpus) gives byte-identical files.
    """
    if preset not in PRESETS:
        raise ValueError(f"model.builtin={preset!r}: unknown preset; choose one of {sorted(PRESETS)}")
    if num_shards < 1:
        raise ValueError(f"model.num_shards={num_shards!r}: must be >= 1")
    spec = PRESETS[preset]
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    config = hf_config(spec)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "do_sample": False}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    text_vocab = write_tokenizer(tmp, spec.tokenizer_vocab_size, spec.max_position_embeddings,
                                 corpus_files)
    _write_weights(generate_state_dict(spec, seed, text_vocab), tmp, num_shards,
                   spec.num_hidden_layers)
    (tmp / "builtin.json").write_text(json.dumps(
        {"preset": preset, "seed": seed, "num_shards": num_shards, "shapes": asdict(spec)},
        indent=2, sort_keys=True) + "\n")

    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)
    return out_dir


def ensure_builtin(preset: str, resources_dir: Path | str, seed: int = 0, num_shards: int = 1) -> Path:
    """Path of resources/models/<preset>, built if missing or built with other parameters."""
    out_dir = Path(resources_dir) / "models" / preset
    stamp = out_dir / "builtin.json"
    if stamp.exists():
        info = json.loads(stamp.read_text())
        if (info.get("preset"), info.get("seed"), info.get("num_shards")) == (preset, seed, num_shards):
            return out_dir
    return build_checkpoint(preset, out_dir, seed=seed, num_shards=num_shards)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Build a built-in random-weight HF checkpoint.")
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-shards", type=int, default=1)
    args = parser.parse_args(argv)
    path = build_checkpoint(args.preset, args.out_dir, seed=args.seed, num_shards=args.num_shards)
    print(path)


if __name__ == "__main__":
    main()
