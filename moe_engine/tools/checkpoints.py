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
from dataclasses import asdict
from pathlib import Path


import torch
from safetensors.torch import save_file

from moe_engine.model import mxfp4
from moe_engine.io import atomic_path
from moe_engine.tools.build_tokenizer import write_tokenizer
from moe_engine.tools.presets import (LLAMA_MLP, PRESETS, MoePreset, builtin_model_key, get_preset,
                                     hf_config)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
STAMP_NAME = "builtin.json"  # written last: what was built, from which preset and seed
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _swiglu_shapes(prefix: str, names: tuple[str, str, str], h: int, width: int
                   ) -> list[tuple[str, tuple[int, ...], str]]:
    gate, down, up = names
    return [(f"{prefix}.{gate}.weight", (width, h), "linear"),
            (f"{prefix}.{down}.weight", (h, width), "residual"),
            (f"{prefix}.{up}.weight", (width, h), "linear")]


def _mla_shapes(p: MoePreset, pre: str) -> list[tuple[str, tuple[int, ...], str]]:
    h, heads, attn = p.hidden_size, p.num_attention_heads, f"{pre}.self_attn"
    q = heads * (p.qk_nope_head_dim + p.qk_rope_head_dim)
    if p.q_lora_rank:
        shapes = [(f"{attn}.q_a_proj.weight", (p.q_lora_rank, h), "linear"),
                  (f"{attn}.q_a_layernorm.weight", (p.q_lora_rank,), "norm"),
                  (f"{attn}.q_b_proj.weight", (q, p.q_lora_rank), "linear")]
    else:
        shapes = [(f"{attn}.q_proj.weight", (q, h), "linear")]
    rank = p.kv_lora_rank
    return shapes + [
        (f"{attn}.kv_a_proj_with_mqa.weight", (rank + p.qk_rope_head_dim, h), "linear"),
        (f"{attn}.kv_a_layernorm.weight", (rank,), "norm"),
        (f"{attn}.kv_b_proj.weight", (heads * (p.qk_nope_head_dim + p.v_head_dim), rank), "linear"),
        (f"{attn}.o_proj.weight", (h, heads * p.v_head_dim), "residual")]


def _attention_shapes(p: MoePreset, pre: str) -> list[tuple[str, tuple[int, ...], str]]:
    h, d, fam = p.hidden_size, p.head_dim, p.family
    if fam.mla:
        return _mla_shapes(p, pre)
    q, kv = p.num_attention_heads * d, p.num_key_value_heads * d
    shapes = []
    for proj, (out, inp), kind in (("q", (q, h), "linear"), ("k", (kv, h), "linear"),
                                   ("v", (kv, h), "linear"), ("o", (h, q), "residual")):
        shapes.append((f"{pre}.self_attn.{proj}_proj.weight", (out, inp), kind))
        if p.attention_bias and proj in fam.biased:
            shapes.append((f"{pre}.self_attn.{proj}_proj.bias", (out,), "bias"))
    if fam.sinks:
        shapes.append((f"{pre}.self_attn.sinks", (p.num_attention_heads,), "sink"))
    if fam.qk_norm is not None and p.qk_norm:
        per_head = fam.qk_norm == "head"
        shapes += [(f"{pre}.self_attn.q_norm.weight", (d if per_head else q,), "norm"),
                   (f"{pre}.self_attn.k_norm.weight", (d if per_head else kv,), "norm")]
    return shapes


def _fused_expert_shapes(p: MoePreset, block: str) -> list[tuple[str, tuple[int, ...], str]]:
    """GPT-OSS: router bias, then the experts as transformers holds them: gate_up [E, H, 2I]
    (gate and up interleaved in the columns) and down [E, I, H], each with a bias."""
    e, h, i = p.num_experts, p.hidden_size, p.intermediate_size
    return [(f"{block}.router.bias", (e,), "bias"),
            (f"{block}.experts.gate_up_proj", (e, h, 2 * i), "fused_linear"),
            (f"{block}.experts.gate_up_proj_bias", (e, 2 * i), "bias"),
            (f"{block}.experts.down_proj", (e, i, h), "fused_residual"),
            (f"{block}.experts.down_proj_bias", (e, h), "bias")]


def _transposed_expert_shapes(p: MoePreset, block: str) -> list[tuple[str, tuple[int, ...], str]]:
    """Llama-4: the experts as transformers holds them, gate_up [E, H, 2I] (gate then up in
    the columns) and down [E, I, H], no biases."""
    e, h, i = p.num_experts, p.hidden_size, p.intermediate_size
    return [(f"{block}.experts.gate_up_proj", (e, h, 2 * i), "fused_linear"),
            (f"{block}.experts.down_proj", (e, i, h), "fused_residual")]


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
            shapes += _swiglu_shapes(f"{pre}.{fam.dense_block}", LLAMA_MLP, h,
                                     p.dense_intermediate_size)
            continue
        block = f"{pre}.{fam.moe_block}"
        shapes.append((f"{block}.{fam.router_name}.weight", (p.num_experts, h), "router"))
        if fam.fused_experts == "interleaved":
            shapes += _fused_expert_shapes(p, block)
            continue
        if fam.fused_experts == "transposed":
            shapes += _transposed_expert_shapes(p, block)
        if fam.score_correction:
            shapes.append((f"{block}.moe_statics.e_score_correction_bias", (1, p.num_experts),
                           "score_bias") if fam.moe_statics else
                          (f"{block}.gate.e_score_correction_bias", (p.num_experts,),
                           "score_bias"))
        for e in range(p.num_experts if not fam.fused_experts else 0):
            shapes += _swiglu_shapes(f"{block}.experts.{e}", fam.expert_names, h,
                                     p.intermediate_size)
        if p.shared_expert_intermediate_size:
            shapes += _swiglu_shapes(f"{block}.{fam.shared_block}", LLAMA_MLP, h,
                                     p.shared_expert_intermediate_size)
            if fam.shared_gate:
                shapes.append((f"{block}.shared_expert_gate.weight", (1, h), "linear"))
    shapes.append(("model.norm.weight", (h,), "norm"))
    if not p.tie_word_embeddings:  # tied: the hub's checkpoints have no lm_head tensor
        shapes.append(("lm_head.weight", (p.vocab_size, h), "lm_head"))
    return shapes


def _init_tensor(kind: str, shape: tuple[int, ...], p: MoePreset, g: torch.Generator,
                 text_vocab: int) -> torch.Tensor:
    # Scales are chosen so that every layer visibly changes the residual stream (a wrong weight
    # mapping then changes the logits), router logits are spread (few near-ties in top-k, so
    # implementations agree on the experts), and output logits are peaked (greedy parity does not
    # hinge on near-ties, and sampling stays on the tokenizer's real tokens, see lm_head below).
    # Fused experts multiply x @ W: their inputs are the second-to-last dim.
    fan_in = shape[-2] if kind.startswith("fused_") else shape[-1]
    kind = kind.removeprefix("fused_")
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
    elif kind == "score_bias":
        # Of the size of the spread of the sigmoid scores, so the bias changes which experts
        # and groups are chosen (a zero bias would leave that path untested).
        t = 0.2 * torch.randn(shape, generator=g)
    elif kind == "sink":
        # Of the size of the attention logits, so the sink visibly takes part of the mass.
        t = torch.randn(shape, generator=g)
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
    # The score-correction bias is fp32 in every dtype, as the hub's GLM-4.5/DeepSeek-V3 store it,
    # and ERNIE-4.5's router weight as transformers saves it.
    fp32 = {"score_bias"} | ({"router"} if preset.family.fp32_router else set())
    state = {name: _init_tensor(kind, shape, preset, g, text_vocab)
             .to(torch.float32 if kind in fp32 else dtype).contiguous()
             for name, shape, kind in _tensor_shapes(preset)}
    if preset.expert_quantization == "mxfp4":
        state = _mxfp4_experts(state)
    return state


def _mxfp4_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-OSS's fused experts as its released checkpoints store them: each x @ W weight
    ([E, in, out]) as `_blocks` [E, out, in/32, 16] (two E2M1 codes a byte, the even input in the
    low nibble) and `_scales` [E, out, in/32] (E8M0), quantized from the drawn values."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = t
            continue
        rows = t.float().transpose(1, 2)  # [E, out, in]
        e, n, k = rows.shape
        codes, scales = mxfp4.quantize(rows.reshape(e * n, k))
        out[name + "_blocks"] = mxfp4.pack_codes(codes).reshape(e, n, k // 32, 16)
        out[name + "_scales"] = scales.reshape(e, n, k // 32)
    return out


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
                     corpus_files: list[Path] | None = None, keep_existing: bool = False) -> Path:
    """Write the built-in checkpoint `preset` to out_dir (replaced atomically) and return it.

    Deterministic: the same (preset, seed, num_shards, corpus) gives byte-identical files.
    keep_existing: a checkpoint another process renamed into out_dir meanwhile is kept (it is
    the same bytes) instead of being replaced while a reader may be loading it.
    """
    spec = get_preset(preset)
    if num_shards < 1:
        raise ValueError(f"model.num_shards={num_shards!r}: must be >= 1")
    out_dir = Path(out_dir)
    with atomic_path(out_dir, keep_existing=keep_existing) as tmp:
        tmp.mkdir()
        _write_checkpoint(tmp, preset, spec, seed, num_shards, corpus_files)
    return out_dir


def _write_checkpoint(tmp: Path, preset: str, spec: MoePreset, seed: int, num_shards: int,
                      corpus_files) -> None:
    config = hf_config(spec)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "do_sample": False}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    text_vocab = write_tokenizer(tmp, spec.tokenizer_vocab_size, spec.max_position_embeddings,
                                 corpus_files)
    _write_weights(generate_state_dict(spec, seed, text_vocab), tmp, num_shards,
                   spec.num_hidden_layers)
    (tmp / STAMP_NAME).write_text(json.dumps(
        {"preset": preset, "seed": seed, "num_shards": num_shards, "shapes": asdict(spec)},
        indent=2, sort_keys=True) + "\n")


def ensure_checkpoint(preset: str, out_dir: Path | str, seed: int = 0, num_shards: int = 1) -> Path:
    """out_dir holding the built-in checkpoint, built only when no complete build is there.

    A build is renamed into place whole, so a folder with its builtin.json stamp is complete.
    Concurrent builders of the same out_dir all succeed: the first rename wins and the others
    discard their identical copy. The caller keys out_dir by what defines the checkpoint
    (presets.builtin_model_key), so an existing build never has other parameters.
    """
    out_dir = Path(out_dir)
    if (out_dir / STAMP_NAME).exists():
        return out_dir
    # A folder without the stamp is no build of ours (or a foreign leftover): replace it.
    return build_checkpoint(preset, out_dir, seed=seed, num_shards=num_shards,
                            keep_existing=not out_dir.exists())


def ensure_builtin(preset: str, resources_dir: Path | str, seed: int = 0, num_shards: int = 1) -> Path:
    """Path of resources/models/<builtin_model_key>, built if missing."""
    key = builtin_model_key(preset, seed, num_shards)
    return ensure_checkpoint(preset, Path(resources_dir) / "models" / key, seed, num_shards)


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
