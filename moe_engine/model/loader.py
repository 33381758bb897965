"""Load a HF MoE checkpoint (one or sharded safetensors) into ModelWeights."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from moe_engine.host_alloc import release_pages
from moe_engine.model import mxfp4
from moe_engine.model.arch import NameTable, architecture
from moe_engine.model.spec import ModelSpec
from moe_engine.model.weights import (DenseLayerWeights, ExpertWeights, LayerWeights, MlaWeights,
                                      ModelWeights, SwigluClamp)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, spec: ModelSpec) -> torch.dtype:
    """`auto` takes the checkpoint's dtype from config.json."""
    name = spec.torch_dtype if dtype in ("auto", None) else dtype
    name = str(name).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: from the shard index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {model_dir}")
    return files


def _owned(t: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """`held` (t as the engine holds it: cast, or t itself) in memory of its own, t's file
    pages given back. safetensors' tensors are views of the file's mapping: one that stayed
    (the embedding, kept as read) kept the whole mapping alive, and with it every page that
    reading and packing the other weights had faulted in, resident beside the packed copies
    (a disk-tier job on small-mixtral: 98 MiB of them). Copied as they are read, the pages
    go back one tensor at a time and the mapping closes with the file."""
    if held.data_ptr() == t.data_ptr():
        held = held.clone()
    release_pages(t)
    return held


def load_weights(model_dir: str | Path, spec: ModelSpec, dtype: torch.dtype,
                 experts: bool = True, keep_quantized: bool = False) -> ModelWeights:
    """Read every tensor through the architecture's name table, cast to `dtype`, fuse projections.

    experts=False leaves every routed expert on disk (None in its layer, never read): the disk
    tier (offload/disk_tier.py) reads them itself, so a model larger than memory loads.
    Experts a checkpoint stores quantized (spec.expert_storage: MXFP4) stay so with
    keep_quantized (the packed kernels compute on them, model/packed.py); without it they are
    dequantized to `dtype` (torch's GEMMs have no MXFP4), one expert at a time.
    """
    model_dir = Path(model_dir)
    table = NameTable(spec.architecture)
    # transformers keeps the score-correction bias in fp32 in every dtype, and ERNIE-4.5's
    # router weight too (as stored, never rounded to the model dtype).
    fp32_slots = {"score_correction_bias"} | (
        {"router"} if architecture(spec.architecture).router_weight_fp32 else set())
    glob: dict[str, torch.Tensor] = {}
    layer: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    expert: dict[tuple[int, int], dict[str, torch.Tensor]] = defaultdict(dict)
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                m = table.match(name)
                # Layers past the last decoder layer are GLM-4.5's multi-token-prediction
                # module (ERNIE-4.5's mtp_* tensors match no rule), which generation does not
                # run: never read them. Without experts, the disk tier reads those itself.
                if m is None or (m.layer is not None and m.layer >= spec.num_layers) or \
                        (not experts and m.scope in ("expert", "fused")):
                    continue
                read = f.get_tensor(name)
                # MXFP4 codes and scales are bytes, not values.
                t = _owned(read, read.to(torch.float32 if m.slot in fp32_slots else dtype)
                           if read.is_floating_point() else read)
                del read
                if m.scope == "global":
                    glob[m.slot] = t
                elif m.scope == "layer":
                    layer[m.layer][m.slot] = t
                elif m.scope == "expert":
                    expert[(m.layer, m.expert)][m.slot] = t
                else:
                    _split_fused(m.slot, t, m.layer, expert)

    if "embed" not in glob:
        raise ValueError(f"{model_dir}: no embedding tensor found")
    lm_head = glob.get("lm_head")
    if lm_head is None:
        if not spec.tie_word_embeddings:
            raise ValueError(f"{model_dir}: no lm_head and embeddings are not tied")
        lm_head = glob["embed"]
    clamp = expert_clamp(spec)
    expert_slots = {"w1", "w2", "w3"} | ({"b1", "b2", "b3"} if spec.expert_bias else set())
    if spec.expert_storage == "mxfp4":
        expert_slots |= {"s1", "s2", "s3"}
    layers = []
    for i in range(spec.num_layers):
        dense = _dense_layer(layer[i], spec, i, model_dir)
        routed: list[Optional[ExpertWeights]] = []
        for e in range(spec.num_experts if spec.is_moe_layer(i) else 0):
            if not experts:
                routed.append(None)
                continue
            x = expert.get((i, e), {})
            if not expert_slots <= x.keys():
                raise ValueError(f"{model_dir}: layer {i} expert {e} incomplete")
            mlp = swiglu_weights(x, clamp=clamp)
            routed.append(mlp if keep_quantized else dequantized(mlp, dtype))
            expert.pop((i, e), None)  # the codes of one expert at a time, not two copies
        layers.append(LayerWeights(dense, routed))
    return ModelWeights(embed=glob["embed"], final_norm=glob["final_norm"], lm_head=lm_head,
                        layers=layers)


def expert_clamp(spec: ModelSpec) -> Optional[SwigluClamp]:
    """The clamp of the spec's experts' activation (None: plain SwiGLU)."""
    if spec.expert_activation != "clamped_swiglu":
        return None
    return SwigluClamp(spec.swiglu_alpha, spec.swiglu_limit)


def _required_slots(spec: ModelSpec, layer: int) -> set[str]:
    """Slots layer `layer` must have under the spec's flags."""
    need = {"input_norm", "post_norm", "o"}
    if spec.mla is None:
        need |= {"q", "k", "v"}
    else:
        need |= {"kv_a", "kv_a_norm", "kv_b"}
        need |= {"q_a", "q_a_norm", "q_b"} if spec.mla.q_lora_rank else {"q"}
    if spec.qkv_bias:
        need |= {"q_bias", "k_bias", "v_bias"}
    if spec.o_bias:
        need.add("o_bias")
    if spec.qk_norm is not None:
        need |= {"q_norm", "k_norm"}
    if spec.attention_sinks:
        need.add("sinks")
    if not spec.is_moe_layer(layer):
        return need | {"mlp_w1", "mlp_w2", "mlp_w3"}
    need.add("router")
    if spec.router_score_correction:
        need.add("score_correction_bias")
    if spec.shared_expert_intermediate_size:
        need |= {"shared_w1", "shared_w2", "shared_w3"}
    if spec.shared_expert_gate:
        need.add("shared_expert_gate")
    if spec.router_bias:
        need.add("router_bias")
    return need


def _dense_layer(d: dict[str, torch.Tensor], spec: ModelSpec, i: int,
                 model_dir: Path) -> DenseLayerWeights:
    missing = _required_slots(spec, i) - d.keys()
    if missing:
        raise ValueError(f"{model_dir}: layer {i} lacks {sorted(missing)}")
    moe = spec.is_moe_layer(i)
    shared = moe and spec.shared_expert_intermediate_size > 0
    gated = shared and spec.shared_expert_gate
    router = None
    if moe:
        # Upcast once here rather than per step where the router GEMM runs in fp32 (the
        # weight is first rounded to the model dtype, as transformers loads it).
        router = (d["router"].float() if spec.router_logits_fp32 else d["router"]).contiguous()
    mla = _mla(d, spec) if spec.mla is not None else None
    first = [d["q_a" if mla and mla.q_a_norm is not None else "q"]] + (
        [d["kv_a"]] if mla else [d["k"], d["v"]])
    return DenseLayerWeights(
        input_norm=d["input_norm"], post_norm=d["post_norm"],
        wqkv=torch.cat(first, dim=0).contiguous(),
        wo=d["o"].contiguous(),
        router=router,
        bqkv=torch.cat([d["q_bias"], d["k_bias"], d["v_bias"]]) if spec.qkv_bias else None,
        bo=d["o_bias"] if spec.o_bias else None,
        q_norm=d["q_norm"] if spec.qk_norm else None,
        k_norm=d["k_norm"] if spec.qk_norm else None,
        mlp=None if moe else swiglu_weights(d, "mlp_"),
        shared_expert=swiglu_weights(d, "shared_") if shared else None,
        shared_expert_gate=d["shared_expert_gate"].contiguous() if gated else None,
        # [E] (ERNIE-4.5 stores it [1, E])
        score_correction_bias=(d["score_correction_bias"].reshape(-1).contiguous()
                               if moe and spec.router_score_correction else None),
        sinks=d["sinks"].contiguous() if spec.attention_sinks else None,
        router_bias=d["router_bias"].contiguous() if moe and spec.router_bias else None,
        mla=mla)


def _mla(d: dict[str, torch.Tensor], spec: ModelSpec) -> MlaWeights:
    """kv_b_proj [heads * (nope + v), rank] split per head into its key and value parts."""
    a = spec.mla
    kv_b = d["kv_b"].view(spec.num_heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
    w_uk, w_uv = kv_b.split([a.qk_nope_head_dim, a.v_head_dim], dim=1)
    low_rank_q = a.q_lora_rank is not None
    return MlaWeights(kv_a_norm=d["kv_a_norm"], w_uk=w_uk.contiguous(),
                      w_uv=w_uv.transpose(1, 2).contiguous(),
                      q_a_norm=d["q_a_norm"] if low_rank_q else None,
                      wq_b=d["q_b"].contiguous() if low_rank_q else None)


def swiglu_weights(d: dict[str, torch.Tensor], prefix: str = "",
                   clamp: Optional[SwigluClamp] = None) -> ExpertWeights:
    """Fuse gate (w1) and up (w3) of the MLP whose slots start with `prefix`, and their
    biases (b1, b3) where it has them; MXFP4 codes with their scales (s1, s3, s2)."""
    def cat(a: str, b: str) -> Optional[torch.Tensor]:
        if prefix + a not in d:
            return None
        return torch.cat([d[prefix + a], d[prefix + b]]).contiguous()

    def one(a: str) -> Optional[torch.Tensor]:
        return d[prefix + a].contiguous() if prefix + a in d else None

    return ExpertWeights(w13=cat("w1", "w3"), w2=one("w2"), s13=cat("s1", "s3"), s2=one("s2"),
                         b13=cat("b1", "b3"), b2=one("b2"), clamp=clamp)


def dequantized(mlp: ExpertWeights, dtype: torch.dtype) -> ExpertWeights:
    """An expert as loaded, with MXFP4 weights (uint8 codes + scales) widened to `dtype`."""
    if mlp.w13.dtype != torch.uint8:
        return mlp
    return ExpertWeights(mxfp4.dequantize(mlp.w13, mlp.s13, dtype),
                         mxfp4.dequantize(mlp.w2, mlp.s2, dtype),
                         b13=mlp.b13, b2=mlp.b2, clamp=mlp.clamp)


def _split_fused(slot: str, t: torch.Tensor, layer: int,
                 expert: dict[tuple[int, int], dict[str, torch.Tensor]]) -> None:
    for e in range(t.shape[0]):
        expert[(layer, e)].update(fused_expert_parts(slot, t[e]))


# The fused slots of GPT-OSS's experts, all of which an expert needs (bf16 or MXFP4).
INTERLEAVED_SLOTS = frozenset({"gate_up_interleaved", "gate_up_bias_interleaved", "down_t",
                               "down_bias"})
MXFP4_SLOTS = frozenset({"gate_up_blocks", "gate_up_scales", "gate_up_bias_interleaved",
                         "down_blocks", "down_scales", "down_bias"})
# Llama-4's fused experts, x @ W without biases.
TRANSPOSED_SLOTS = frozenset({"gate_up_t", "down_t"})
# Fused layouts whose experts are converted on reading (not [gate; up] rows as stored).
CONVERTED_LAYOUTS = (INTERLEAVED_SLOTS, MXFP4_SLOTS, TRANSPOSED_SLOTS)


def fused_expert_parts(slot: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One expert's slice `t` of the fused tensor in `slot` as per-expert slots (w1, w3, w2 and
    biases b1, b3, b2), copied out of the fused tensor.

    transformers 5 layout: gate_up [2I, H] = cat(w1, w3); down [H, I]. GPT-OSS's: gate_up
    [H, 2I] with gate in the even columns and up in the odd ones (its _apply_gate slices
    [..., ::2] and [..., 1::2]), its bias [2I] alike, down [I, H] (x @ W, so transposed to
    the [out, in] rows F.linear takes), its bias [H]. Llama-4's: gate_up_t [H, 2I] with gate in
    the first I columns and up in the last (its experts chunk(2) the product), down_t as
    GPT-OSS's.
    """
    if slot == "gate_up":
        w1, w3 = t.chunk(2, dim=0)
        return {"w1": w1.clone(), "w3": w3.clone()}
    if slot == "gate_up_interleaved":
        return {"w1": t[:, ::2].T.contiguous(), "w3": t[:, 1::2].T.contiguous()}
    if slot == "gate_up_t":
        w1, w3 = t.T.chunk(2, dim=0)
        return {"w1": w1.contiguous(), "w3": w3.contiguous()}
    if slot == "gate_up_bias_interleaved":
        return {"b1": t[::2].contiguous(), "b3": t[1::2].contiguous()}
    if slot == "down_t":
        return {"w2": t.T.contiguous()}
    if slot == "down_bias":
        return {"b2": t.clone()}
    # MXFP4 (GPT-OSS as released): rows are output channels, gate in the even ones; blocks
    # [rows, k/32, 16] flatten to the row-major [rows, k/2] bytes model/mxfp4.py reads.
    if slot == "gate_up_blocks":
        return {"w1": t[0::2].reshape(t.shape[0] // 2, -1).contiguous(),
                "w3": t[1::2].reshape(t.shape[0] // 2, -1).contiguous()}
    if slot == "gate_up_scales":
        return {"s1": t[0::2].contiguous(), "s3": t[1::2].contiguous()}
    if slot == "down_blocks":
        return {"w2": t.reshape(t.shape[0], -1).contiguous()}
    if slot == "down_scales":
        return {"s2": t.clone()}
    return {"w2": t.clone()}
