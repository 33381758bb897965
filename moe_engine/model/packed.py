"""Weights packed for the CPU kernels, and the GEMMs that run on them.

The kernels (kernels_cy/packed_gemm_impl.h, built once per ISA) keep weights in the checkpoint's
dtype, or quantized to int8 / int4, in panels of 32 output columns, widen them to fp32 in
registers and accumulate in fp32, so a bf16 checkpoint runs without torch's bf16 GEMM (8x slower
than fp32 on CPUs without native bf16) and without an fp32 copy of its weights. Each output is
one FMA chain over k in order: a row's result does not depend on the rows beside it.

Layouts are described in kernels_cy/moe_isa.h; this module builds them with torch ops:
- `pack_linear(w)` -> PackedLinear for a dense projection or the LM head (y = x @ w.T + b);
- `pack_expert(mlp)` -> ExpertWeights whose w13/w2 are packed tensors [P, K, 32] (3-D: that
  shape is how the layers tell a packed expert from a row-major one), gate and up interleaved
  per panel so that the kernel applies SiLU(gate) * up (or GPT-OSS's clamped form, with its
  biases) on its register tile. An MXFP4 expert as loaded (model/mxfp4.py) is packed from its
  codes, never widened.
The ISA build is chosen once, at import, from CPUID (`ISA`);
`MOE_BATCH_ISA=avx2|avxvnni|avx512|avx512vnni|avx512bf16|amx|generic` forces one the CPU
supports (benchmarks and tests; `avxvnni` is the AVX2 build plus the VEX vpdpbusd for int8q
weights, `avx512vnni` the AVX-512 build plus the EVEX vpdpbusd, `avx512bf16` that build plus
vdpbf16ps for bf16p weights, `amx` that build with bf16p weights on AMX tiles), and every
function takes `isa=` too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from moe_engine.cpu_features import TILE_ISA
from moe_engine.model import mxfp4
from moe_engine.model.kernel_import import import_kernel
from moe_engine.model.spec import BF16X3_STORAGE, PAIR_STORAGE, QUAD_STORAGE
from moe_engine.model.weights import ExpertWeights, LayerWeights, MlaWeights, ModelWeights

# None when not built: the engine keeps torch's GEMMs
_ext = import_kernel("moe_engine._kernels.packed_gemm")

HAS_PACKED_KERNELS: bool = _ext is not None
NR = 32  # output columns per panel (moe_isa.h MOE_NR)
I4_GROUP = 32  # inputs per int4 scale group (MOE_I4_GROUP); MXFP4's blocks are as wide
I8Q_MAX_K = 65536  # int8q's most inputs (MOE_I8Q_MAX_K): its int32 sums must not overflow
STORAGE_DTYPES = ("fp32", "bf16", "fp16", "int8", "int4", "mxfp4", "bf16p", "bf16x3", "int8q")
NIBBLE_STORAGE = ("int4", "mxfp4")  # two columns a byte, a scale per group of 32 inputs
# PAIR_STORAGE (bf16p): bf16 weights whose GEMMs round the activations to bf16
# (engine.matmul_precision=medium): k in pairs, one 32-bit word a column and pair, so
# AVX512-BF16's vdpbf16ps does two multiply-adds a lane and AMX's tdpbf16ps takes the panels
# as they are; other CPUs compute the same products in fp32 FMAs
# BF16X3_STORAGE (bf16x3): the same panels, as uint32 words (the dtype tells the kernels the
# storage), whose GEMMs split each activation into three bf16 terms summing to it exactly:
# fp32 results at 3x bf16p's multiply-adds, which AMX tiles still do faster than fp32 FMAs
PAIR_STORAGES = (PAIR_STORAGE, BF16X3_STORAGE)
# QUAD_STORAGE (int8q): int8's values and per-channel scales with k in quads, whose GEMMs
# quantize each activation row to int8 (engine.matmul_precision=medium on int8 experts):
# vpdpbusd (AVX512-VNNI, AVX-VNNI) does four multiply-adds a lane into exact int32 sums, AMX
# tiles' tdpbusd 16 x 16 x 64 an instruction; other CPUs compute the same sums with vpmaddwd
# (same bits, no faster than int8's FMAs)
QUAD_BYTES = 4 * NR  # bytes of a quad-row: 32 columns x 4 inputs
# ISA builds with native int8 quad products: vpdpbusd, and on amx tdpbusd for whole tile steps
# (elsewhere int8q is emulated: no faster)
NATIVE_INT8_DOT_ISAS = ("avxvnni", "avx512vnni", "avx512bf16", "amx")
# ISA builds that multiply bf16 pairs natively (elsewhere bf16p is emulated: no faster)
NATIVE_BF16_ISAS = ("avx512bf16", "amx")
# ISA builds that run bf16p, bf16x3 and int8q on AMX tiles (bf16x3 pays only there)
TILE_ISAS = (TILE_ISA,)

_TORCH_STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                  "int8": torch.int8, "int4": torch.uint8, "mxfp4": torch.uint8,
                  "bf16p": torch.bfloat16, "bf16x3": torch.bfloat16, "int8q": torch.int8}
_CODES = ({"fp32": _ext.W_F32, "bf16": _ext.W_BF16, "fp16": _ext.W_F16, "int8": _ext.W_I8,
           "int4": _ext.W_I4, "mxfp4": _ext.W_FP4, "bf16p": _ext.W_BF16P,
           "bf16x3": _ext.W_BF16X3, "int8q": _ext.W_I8Q}
          if _ext is not None else {})
_ISA_CODES = {name: code for code, name in _ext.ISA_NAMES.items()} if _ext is not None else {}


def supported_isas() -> list[str]:
    """ISA builds this CPU can run, best last ([] when the kernels are not built)."""
    return [_ext.ISA_NAMES[c] for c in _ext.supported_isas()] if _ext is not None else []


def built_isas() -> list[str]:
    """ISA builds the compiler produced, whatever the CPU ([] when the kernels are not built)."""
    return [_ext.ISA_NAMES[c] for c in _ext.built_isas()] if _ext is not None else []


def _default_isa() -> Optional[str]:
    if _ext is None:
        return None
    forced = os.environ.get("MOE_BATCH_ISA")
    if forced:
        if forced not in supported_isas():
            raise RuntimeError(f"MOE_BATCH_ISA={forced!r} is not supported by this CPU "
                               f"(supported: {supported_isas()})")
        return forced
    return _ext.ISA_NAMES[_ext.best_isa()]


ISA: Optional[str] = _default_isa()


def storage_name(dtype: torch.dtype) -> str:
    """The packed storage name of a float dtype (what `auto` keeps)."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if dtype not in names:
        raise ValueError(f"no packed storage for {dtype}")
    return names[dtype]


@dataclass(frozen=True)
class PackedLinear:
    """A [n, k] weight in panel layout: `data` [P, k, 32] (int4, mxfp4: [P, k, 16] bytes; bf16p:
    [P, ceil(k/2), 32] int32 words of bf16 pairs; int8q: [P, ceil(k/4), 128] bytes of quads),
    `scale` for int8 ([P*32] fp32), int8q ([P*32] fp32 scales, then [P*32] int32 column
    corrections stored as the tensor's fp32 bits), int4 ([P, k/32, 32] fp32) and mxfp4
    ([P, k/32, 32] E8M0 bytes), None for float storage."""

    data: torch.Tensor
    scale: Optional[torch.Tensor]
    n: int
    k: int
    storage: str

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.data,) if self.scale is None else (self.data, self.scale)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "PackedLinear":
        return replace(self, data=fn(self.data),
                       scale=fn(self.scale) if self.scale is not None else None)


def _quantize(w: torch.Tensor, storage: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Row-major [n, k] weight in its storage dtype plus scales (per output row for int8, per
    row and group of 32 inputs for int4 and mxfp4), symmetric, from the fp32 values; int4 and
    mxfp4 give one code a byte."""
    if storage in ("fp32", "bf16", "fp16") + PAIR_STORAGES:
        return w.to(_TORCH_STORAGE[storage]), None
    if storage == "mxfp4":
        return mxfp4.quantize(w)
    wf = w.float()
    if storage in ("int8", QUAD_STORAGE):
        scale = wf.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        return torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8), scale
    if storage == "int4":
        n, k = wf.shape
        if k % I4_GROUP:
            raise ValueError(f"int4 needs an input size that is a multiple of {I4_GROUP}, got {k}")
        groups = wf.reshape(n, k // I4_GROUP, I4_GROUP)
        scale = groups.abs().amax(dim=2).clamp_min(1e-12) / 7.0  # [n, k/32]; q - 8 in [-8, 7]
        q = torch.round(groups / scale[:, :, None]).clamp(-8, 7) + 8
        return q.reshape(n, k).to(torch.uint8), scale
    raise ValueError(f"unknown packed storage {storage!r}; choose one of {STORAGE_DTYPES}")


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])


def _panels(q: torch.Tensor, scale: Optional[torch.Tensor], storage: str
            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Panel layout of a row-major [n_pad, k] (n_pad a multiple of 32) storage tensor."""
    n, k = q.shape
    p = n // NR
    panels = q.reshape(p, NR, k).transpose(1, 2)  # [P, k, 32], column c = row 32p + c
    if storage == "bf16":
        # word i of a k-row = (column i, column 16+i): interleave the two halves
        panels = torch.stack([panels[..., :16], panels[..., 16:]], dim=-1).reshape(p, k, NR)
    elif storage in NIBBLE_STORAGE:
        lo, hi = panels[..., :16], panels[..., 16:]
        panels = lo | (hi << 4)  # [P, k, 16] bytes
    elif storage in PAIR_STORAGES:
        # word c of pair-row j = (W[32p + c, 2j], W[32p + c, 2j + 1]); an odd k gets a zero input
        if k % 2:
            panels = torch.cat([panels, panels.new_zeros(p, 1, NR)], dim=1)
        pairs = panels.reshape(p, -1, 2, NR).transpose(2, 3).contiguous()  # [P, k/2, 32, 2]
        words = torch.int32 if storage == PAIR_STORAGE else torch.uint32
        panels = pairs.view(words).reshape(p, -1, NR)
    elif storage == QUAD_STORAGE:
        # byte i of word c of quad-row j = W[32p + c, 4j + i]; k padded with zero inputs
        if k % 4:
            panels = torch.cat([panels, panels.new_zeros(p, 4 - k % 4, NR)], dim=1)
        panels = panels.reshape(p, -1, 4, NR).transpose(2, 3).reshape(p, -1, QUAD_BYTES)
    if scale is not None and storage in NIBBLE_STORAGE:
        scale = scale.reshape(p, NR, k // I4_GROUP).transpose(1, 2)  # [P, k/32, 32]
    if scale is not None and storage != "mxfp4":  # MXFP4 keeps its E8M0 bytes
        scale = scale.float()
    return panels.contiguous(), (scale.contiguous() if scale is not None else None)


def _pack_rows(q: torch.Tensor, scale: Optional[torch.Tensor], storage: str
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Pad a quantized row-major [n, k] weight (and its per-row scales) to whole panels and
    lay it out; int8 scales come back flat in packed column order, int8q's followed by its
    column corrections (128 * the column's sum of codes, int32 bits in the fp32 tensor)."""
    padded = -(-q.shape[0] // NR) * NR
    if storage == QUAD_STORAGE and q.shape[1] > I8Q_MAX_K:
        raise ValueError(f"int8q takes at most {I8Q_MAX_K} inputs (int32 sums), got "
                         f"{q.shape[1]}")
    q = _pad_rows(q, padded)
    data, scale = _panels(q, _pad_rows(scale, padded) if scale is not None else None, storage)
    if scale is not None and storage in ("int8", QUAD_STORAGE):
        scale = scale.reshape(-1)
    if storage == QUAD_STORAGE:
        corr = (q.to(torch.int32).sum(dim=1, dtype=torch.int32) * 128).view(torch.float32)
        scale = torch.cat([scale, corr]).contiguous()
    return data, scale


def pack_linear(w: torch.Tensor, storage: str) -> PackedLinear:
    """Pack a row-major weight [n, k] (y = x @ w.T) in `storage`."""
    n, k = w.shape
    data, scale = _pack_rows(*_quantize(w, storage), storage)
    return PackedLinear(data=data, scale=scale, n=n, k=k, storage=storage)


def _gate_up_rows(w13: torch.Tensor) -> torch.Tensor:
    """Rows of [gate; up] (or their per-row scales) reordered so that panel p holds gate rows
    16p.. then up rows 16p.. (I padded to a multiple of 16)."""
    flat = w13.dim() == 1
    rows = w13[:, None] if flat else w13
    inter, width = rows.shape[0] // 2, rows.shape[1]
    padded = -(-inter // 16) * 16
    gate, up = _pad_rows(rows[:inter], padded), _pad_rows(rows[inter:], padded)
    out = torch.stack([gate.reshape(-1, 16, width), up.reshape(-1, 16, width)],
                      dim=1).reshape(2 * padded, width)
    return out.reshape(-1) if flat else out


def is_mxfp4_rows(mlp: ExpertWeights) -> bool:
    """Whether `mlp` is an MXFP4 expert as loaded: row-major byte-packed codes (w13 [2I, H/2],
    w2 [H, I/2] uint8) with E8M0 scales (s13 [2I, H/32], s2 [H, I/32])."""
    return mlp.w13.dtype == torch.uint8 and mlp.w13.dim() == 2


def _quantized_rows(w: torch.Tensor, s: Optional[torch.Tensor], mxfp4_rows: bool,
                    storage: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One projection of an expert as `storage` codes/values plus scales, row-major. MXFP4
    rows go to mxfp4 storage as they are (unpacked to a code a byte, one projection at a time),
    and to any other storage through their fp32 values."""
    if not mxfp4_rows:
        return _quantize(w, storage)
    codes = mxfp4.unpack_codes(w)
    if storage == "mxfp4":
        return codes, s
    return _quantize(mxfp4.decode(codes, s), storage)


def _padded(v: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([v, v.new_zeros(n - v.numel())]) if v.numel() < n else v


def pack_expert(mlp: ExpertWeights, storage: str) -> ExpertWeights:
    """A SwiGLU MLP (w13 = [gate; up] [2I, H], w2 = down [H, I], or MXFP4 rows) packed for
    `packed_moe_ffn`, biases (fp32, in packed column order, padded to whole panels) and clamp
    kept. Quantized storage scales each row as a whole, before the gate/up reorder. bf16p
    needs even H and I (a packed expert's shape says its pair-rows, not an odd k), int8q
    multiples of 4 (its quad-rows)."""
    rows = is_mxfp4_rows(mlp)
    # the expert's sizes, not its tensors' (MXFP4 rows hold two inputs a byte)
    hidden, inter = mlp.w2.shape[0], mlp.w13.shape[0] // 2
    if storage in PAIR_STORAGES and (hidden % 2 or inter % 2):
        raise ValueError(f"{storage} experts need an even hidden and intermediate size, got "
                         f"{(hidden, inter)}")
    if storage == QUAD_STORAGE and (hidden % 4 or inter % 4):
        raise ValueError(f"{storage} experts need a hidden and intermediate size that are "
                         f"multiples of 4, got {(hidden, inter)}")
    q13, s13 = _quantized_rows(mlp.w13, mlp.s13, rows, storage)
    p13, s13 = _pack_rows(_gate_up_rows(q13), _gate_up_rows(s13) if s13 is not None else None,
                          storage)
    p2, s2 = _pack_rows(*_quantized_rows(mlp.w2, mlp.s2, rows, storage), storage)
    b13 = b2 = None
    if mlp.b13 is not None:
        b13 = _padded(_gate_up_rows(mlp.b13.float()), p13.shape[0] * NR).contiguous()
    if mlp.b2 is not None:
        b2 = _padded(mlp.b2.float(), p2.shape[0] * NR).contiguous()
    return ExpertWeights(p13, p2, s13=s13, s2=s2, b13=b13, b2=b2, clamp=mlp.clamp)


def pack_model(weights: ModelWeights, storage: str, expert_storage: str) -> ModelWeights:
    """The packed-kernel form of a loaded model: projections, dense MLPs, shared experts and
    the LM head packed in `storage`, routed experts in `expert_storage`, the router and the
    shared-expert gate packed in fp32 (tiny, and every GEMM of a row must run on the kernels for
    its result not to depend on its batch), and the tensors applied element-wise (norms, biases)
    in fp32. The embedding stays as loaded (rows are gathered, then widened). Layers are
    converted one at a time and dropped from `weights`, so peak memory is the model plus one
    layer."""
    def small(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return t.float() if t is not None else None

    def fp32(t: Optional[torch.Tensor]) -> Optional[PackedLinear]:
        return pack_linear(t.float(), "fp32") if t is not None else None

    def mlp(x: Optional[ExpertWeights]) -> Optional[ExpertWeights]:
        return pack_expert(x, storage) if x is not None else None

    layers = []
    for i, layer in enumerate(weights.layers):
        d = layer.dense
        # replace(): a field added to DenseLayerWeights and not listed here is kept, not lost
        dense = replace(
            d, input_norm=small(d.input_norm), post_norm=small(d.post_norm),
            wqkv=pack_linear(d.wqkv, storage), wo=pack_linear(d.wo, storage),
            router=fp32(d.router), bqkv=small(d.bqkv), bo=small(d.bo), q_norm=small(d.q_norm),
            k_norm=small(d.k_norm), mlp=mlp(d.mlp), shared_expert=mlp(d.shared_expert),
            shared_expert_gate=fp32(d.shared_expert_gate),
            score_correction_bias=small(d.score_correction_bias), sinks=small(d.sinks),
            router_bias=small(d.router_bias),
            mla=_pack_mla(d.mla, storage) if d.mla is not None else None)
        layers.append(LayerWeights(dense, [pack_expert(x, expert_storage)
                                           if x is not None else None  # on disk
                                           for x in layer.experts]))
        weights.layers[i] = None  # the unpacked layer can go now
    return ModelWeights(embed=weights.embed, final_norm=small(weights.final_norm),
                        lm_head=pack_linear(weights.lm_head, storage), layers=layers)


def _pack_mla(m: MlaWeights, storage: str) -> MlaWeights:
    """q_b_proj packed, and the per-head latent maps as one packed projection per head (a
    batched matmul over the heads in torch would make a row's result depend on its batch)."""
    def per_head(w: torch.Tensor) -> tuple[PackedLinear, ...]:  # w [heads, k, n]: x @ w[h]
        return tuple(pack_linear(w_h.t().contiguous(), storage) for w_h in w)

    return MlaWeights(kv_a_norm=m.kv_a_norm.float(), w_uk=per_head(m.w_uk), w_uv=per_head(m.w_uv),
                      q_a_norm=m.q_a_norm.float() if m.q_a_norm is not None else None,
                      wq_b=pack_linear(m.wq_b, storage) if m.wq_b is not None else None)


def is_packed(expert: ExpertWeights) -> bool:
    return expert.w13.dim() == 3


def packed_inputs(panels: torch.Tensor) -> int:
    """The input size k of a packed expert projection [P, rows, 32|16|128]: its rows, twice
    them for bf16p's pair-rows (an expert's k is even there, see pack_expert), four times
    int8q's quad-rows (a multiple of 4 there)."""
    storage = _storage_of(panels, None)
    return panels.shape[1] * (2 if storage in PAIR_STORAGES else 4 if storage == QUAD_STORAGE
                              else 1)


def _storage_of(data: torch.Tensor, scale: Optional[torch.Tensor]) -> str:
    if data.dtype == torch.int32:
        return PAIR_STORAGE
    if data.dtype == torch.uint32:
        return BF16X3_STORAGE
    if data.dtype == torch.uint8:
        return "mxfp4" if scale is not None and scale.dtype == torch.uint8 else "int4"
    if data.dtype == torch.int8:
        return QUAD_STORAGE if data.shape[-1] == QUAD_BYTES else "int8"
    return storage_name(data.dtype)


def _threads(threads: Optional[int]) -> int:
    return threads if threads is not None else torch.get_num_threads()


def isa_code(isa: Optional[str] = None) -> int:
    """The kernels' code of ISA name `isa` (default: ISA), shared by every kernel extension."""
    name = isa or ISA
    if name not in _ISA_CODES:
        raise ValueError(f"unknown ISA {name!r}; built: {sorted(_ISA_CODES)}")
    return _ISA_CODES[name]


def _require_kernels() -> None:
    if _ext is None:
        raise RuntimeError("the packed CPU kernels are not built "
                           "(python setup.py build_ext --inplace)")


def _ptr(t: Optional[torch.Tensor]) -> int:
    return t.data_ptr() if t is not None else 0


def _as_fp32_rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"packed kernels take fp32 CPU activations, got {x.dtype} on {x.device}")
    return x if x.stride(-1) == 1 else x.contiguous()


def packed_linear(x: torch.Tensor, w: PackedLinear, bias: Optional[torch.Tensor] = None, *,
                  activation: Optional[str] = None, isa: Optional[str] = None,
                  threads: Optional[int] = None) -> torch.Tensor:
    """activation(x [..., k] fp32 @ W.T (+ bias)) -> [..., n] fp32; activation None or
    "sigmoid" (computed per element in the kernel, so it does not depend on the batch)."""
    _require_kernels()
    if x.shape[-1] != w.k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight takes {w.k}")
    lead = x.shape[:-1]
    x2 = _as_fp32_rows(x.reshape(-1, w.k))
    if x2.dim() != 2 or x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], w.n, dtype=torch.float32)
    if bias is not None:
        bias = bias.float().contiguous()
    if activation not in _ext.ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of "
                         f"{sorted(a for a in _ext.ACTIVATIONS if a)} or None")
    _ext.linear(x2.data_ptr(), x2.stride(0), x2.shape[0], w.data.data_ptr(), _ptr(w.scale), w.n,
                w.k, _CODES[w.storage], _ptr(bias), _ext.ACTIVATIONS[activation], y.data_ptr(),
                w.n, _threads(threads), isa_code(isa))
    return y.reshape(*lead, w.n)


def _expert_table(experts: list[Optional[ExpertWeights]]) -> torch.Tensor:
    rows = []
    for x in experts:
        if x is None:
            rows.append([0] * _ext.TABLE_COLUMNS)
            continue
        if not is_packed(x):
            raise ValueError("moe_ffn on the packed kernels needs every expert packed")
        p13, k13, p2, k2 = x.w13.shape[0], packed_inputs(x.w13), x.w2.shape[0], packed_inputs(x.w2)
        for bias, width in ((x.b13, p13 * NR), (x.b2, p2 * NR)):
            if bias is not None and (bias.dtype != torch.float32 or bias.numel() != width
                                     or not bias.is_contiguous()):
                raise ValueError("packed expert biases must be fp32 [panels * 32] (pack_expert)")
        rows.append([x.w13.data_ptr(), _ptr(x.s13), p13 * NR, k13,
                     _CODES[_storage_of(x.w13, x.s13)],
                     x.w2.data_ptr(), _ptr(x.s2), p2 * NR, k2, _CODES[_storage_of(x.w2, x.s2)],
                     _ptr(x.b13), _ptr(x.b2)])
    return torch.tensor(rows, dtype=torch.int64)


def packed_moe_ffn(experts: list[Optional[ExpertWeights]], h: torch.Tensor,
                   weights: torch.Tensor, indices: torch.Tensor, *, isa: Optional[str] = None,
                   threads: Optional[int] = None) -> torch.Tensor:
    """sum over s of weights[t, s] * SwiGLU_{indices[t, s]}(h[t]) for packed experts: h [T, H]
    fp32, weights [T, k], indices [T, k] -> [T, H] fp32 (slots summed in s order)."""
    _require_kernels()
    h = _as_fp32_rows(h).contiguous()
    t, hidden = h.shape
    top_k = indices.shape[1]
    present = next(x for x in experts if x is not None)
    inter = packed_inputs(present.w2)
    if packed_inputs(present.w13) != hidden:
        raise ValueError(f"experts take {packed_inputs(present.w13)} features, h has {hidden}")
    idx = indices.to(torch.int64).contiguous()
    rw = weights.float().contiguous()
    nwork, niwork = _ext.work_sizes(t, top_k, hidden, inter, len(experts),
                                    _CODES[_storage_of(present.w13, present.s13)],
                                    _CODES[_storage_of(present.w2, present.s2)])
    work = torch.empty(max(nwork, 1), dtype=torch.float32)
    iwork = torch.empty(max(niwork, 1), dtype=torch.int32)
    out = torch.empty(t, hidden, dtype=torch.float32)
    table = _expert_table(experts)
    clamp = present.clamp
    glu = _ext.GLU_CLAMPED if clamp is not None else _ext.GLU_SILU
    _ext.moe_ffn(h.data_ptr(), t, hidden, idx.data_ptr(), rw.data_ptr(), top_k, table.data_ptr(),
                 len(experts), glu, clamp.alpha if clamp else 0.0, clamp.limit if clamp else 0.0,
                 out.data_ptr(), work.data_ptr(), iwork.data_ptr(), _threads(threads),
                 isa_code(isa))
    return out


def gemm_k_block(rows: int, k: int, storage: str, isa: Optional[str] = None) -> int:
    """The inputs of the k-blocks in which the kernels walk `rows` activation rows against
    weights of k inputs stored as `storage` (k: walked whole, the activations fit in L2).
    Results do not depend on it; tests use it to know their shapes take the blocked path."""
    _require_kernels()
    return _ext.gemm_k_block(rows, k, _CODES[storage], isa_code(isa))


def fma_peak_flops(seconds: float = 0.3, threads: Optional[int] = None,
                   isa: Optional[str] = None, kind: str = "fma") -> float:
    """Achieved FLOP/s of a register-blocked loop on `threads` threads (the compute roof): fp32
    FMAs (kind "fma"), or bf16 pair dot products ("bf16_dot": bf16p weights' roof, tdpbf16ps
    on AMX tiles on the amx build, vdpbf16ps on avx512bf16, two FMAs a pair elsewhere), or int8
    quad dot products ("int8_dot": int8q weights' roof, tdpbusd on AMX tiles on the amx build,
    vpdpbusd on avxvnni, avx512vnni and avx512bf16, vpmaddwd elsewhere; each of the four
    multiply-adds a lane counted as two operations)."""
    import time
    _require_kernels()
    kinds = {"fma": _ext.PROBE_FMA, "bf16_dot": _ext.PROBE_BF16_DOT, "int8_dot": _ext.PROBE_I8_DOT}
    if kind not in kinds:
        raise ValueError(f"unknown probe {kind!r}; choose one of {sorted(kinds)}")
    probe = kinds[kind]
    code, nthreads = isa_code(isa), _threads(threads)
    per_iter = _ext.probe_flops(code, probe) * nthreads
    n = 1 << 16
    while True:
        t0 = time.perf_counter()
        _ext.fma_probe(n, nthreads, code, probe)
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n * per_iter / dt
        n *= 2
