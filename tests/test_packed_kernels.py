"""The packed CPU kernels (kernels_cy/packed_gemm_impl.h) against an fp64 torch reference, on
every ISA build this CPU can run, every weight storage, and the awkward sizes: token counts
around the register tiles (1, 2, 14, 15, 16, 17, 29, 64, 333), hidden sizes that are not multiples of
the panel width, experts that receive no token. Also: a row's result is bitwise the same
whatever rows share its call (batch invariance), and the same on every FMA-capable ISA.
bf16p (engine.matmul_precision=medium) rounds the activations to bf16 before its GEMMs; its
reference does the same, and AVX512-BF16's vdpbf16ps is compared with the FMA builds' emulation
of it. bf16x3 (matmul_precision=high) splits them into three bf16 terms summing to them exactly:
its reference takes x as it is, and its results are held to fp32's tolerance. int8q (medium on
int8 experts) quantizes each activation row to int8 and sums integer products exactly: its
linear is bitwise a torch formula of the same integers, on every ISA (AVX512-VNNI's vpdpbusd
and the other builds' vpmaddwd alike)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_engine.model import mxfp4, packed
from moe_engine.model.weights import ExpertWeights, SwigluClamp

pytestmark = pytest.mark.skipif(not packed.HAS_PACKED_KERNELS, reason="kernels not built")

ISAS = packed.supported_isas()
TOKENS = [1, 2, 14, 15, 16, 17, 29, 64, 333]
FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
         "bf16p": torch.bfloat16, "bf16x3": torch.bfloat16}


def q8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8q's activations written out: per row, q = rint(x * (127 / max|x|)) in fp32 and the
    scale max|x| / 127, as int64 codes and fp32 scales; a row whose 127 / max|x| is not a
    finite float (zeros, or max|x| below ~3.7e-37) has q = 0 and scale 0. The quotients are
    IEEE fp32 divisions, as the kernel's: torch divides a float tensor through a reciprocal,
    an ulp off in some rows, so they are taken in fp64 and rounded once (exact for fp32)."""
    x = x.float()
    amax = x.abs().amax(dim=1)
    inv = (127.0 / amax.double()).float()
    zero = ~(inv <= torch.finfo(torch.float32).max)
    inv, scale = inv.masked_fill(zero, 0.0), (amax.double() / 127.0).float().masked_fill(zero, 0.0)
    return torch.round(x * inv[:, None]).clamp(-127, 127).long(), scale


def activations(x: torch.Tensor, storage: str) -> torch.Tensor:
    """What the kernel multiplies the weights by, in fp64: bf16p rounds x to bf16 first, int8q
    quantizes its rows."""
    if storage == packed.QUAD_STORAGE:
        q, scale = q8_rows(x)
        return q.double() * scale.double()[:, None]
    return (x.float().bfloat16() if storage == packed.PAIR_STORAGE else x).double()


def dequantized(w: torch.Tensor, storage: str) -> torch.Tensor:
    """The weight the kernel multiplies by, in fp64: the storage rounding of w, or its
    quantization written out independently of the packing code."""
    if storage in FLOAT:
        return w.to(FLOAT[storage]).double()
    w = w.double()
    n, k = w.shape
    if storage == "mxfp4":
        # the block's scale: the smallest power of two bringing its largest magnitude within
        # 6, then each value to the nearest E2M1 value
        g = w.reshape(n, k // 32, 32)
        amax = g.abs().amax(dim=2, keepdim=True)
        scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
        grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
        mag = grid[((g / scale).abs()[..., None] - grid).abs().argmin(dim=-1)]
        return (torch.sign(g) * mag * scale).reshape(n, k)
    if storage in ("int8", packed.QUAD_STORAGE):
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
        return torch.round(w / scale).clamp(-127, 127) * scale
    g = w.reshape(n, k // 32, 32)
    scale = g.abs().amax(dim=2, keepdim=True).clamp_min(1e-12) / 7.0
    return (torch.round(g / scale).clamp(-8, 7) * scale).reshape(n, k)


def tolerance(storage: str) -> float:
    # fp32 accumulation over k <= 300 of O(0.1) terms; the quantized references round with fp64
    # scales, the kernel with fp32 ones (a last-bit difference of the scale on a few rows).
    # (mxfp4 scales are powers of two: exact in both). bf16p rounds the SwiGLU activations the
    # kernel computed in fp32 and the reference in fp64 to bf16: a value near a rounding tie
    # can land one bf16 step (2^-8 relative) apart.
    if storage == packed.PAIR_STORAGE:
        return 1e-4
    return 2e-5 if storage in FLOAT else 2e-4


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("storage", packed.STORAGE_DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_linear_matches_fp64_reference(isa, storage, tokens):
    torch.manual_seed(tokens)
    n, k = 72, 96  # n not a multiple of the 32-column panel
    w, b = torch.randn(n, k) * 0.1, torch.randn(n)
    x = torch.randn(tokens, k)
    y = packed.packed_linear(x, packed.pack_linear(w, storage), b, isa=isa, threads=2)
    ref = activations(x, storage) @ dequantized(w, storage).T + b.double()
    assert y.shape == (tokens, n) and y.dtype == torch.float32
    assert (y.double() - ref).abs().max().item() < tolerance(storage)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("storage", packed.PAIR_STORAGES)
@pytest.mark.parametrize("k", [1, 33, 97])
def test_bf16_pairs_take_an_odd_input_size(isa, storage, k):
    """An odd k pairs its last input with a zero (in the weight and in the activations)."""
    torch.manual_seed(k)
    w, x = torch.randn(40, k) * 0.1, torch.randn(17, k)
    y = packed.packed_linear(x, packed.pack_linear(w, storage), isa=isa, threads=2)
    ref = activations(x, storage) @ dequantized(w, storage).T
    assert (y.double() - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("isa", ISAS)
def test_bf16x3_terms_sum_to_the_activation_exactly(isa):
    """bf16x3's three bf16 terms carry every bit of an fp32 activation: through weights that
    pick one input at a time (1.0, exact in bf16) the kernel gives x back bitwise, on tiles
    and in the emulation, for values that bf16 rounding would change and the largest finite
    float (which bf16 rounds to inf); inf and NaN pass as themselves. (Below 2^-110 the last
    terms are subnormal, which tdpbf16ps reads as zero.)"""
    values = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -23, -(1 + 2 ** -9 + 2 ** -20),
                           3.4028235e38, -2.5, 0.1, 2.0 ** -100 / 3, 1 / 3])
    # 72 inputs: two whole steps of 16 pairs on tiles, then the tail; the values at the start
    # (tiles) and at the end (tail)
    x = torch.randn(3, 72)
    x[0, :8], x[1, -8:] = values, values
    y = packed.packed_linear(x, packed.pack_linear(torch.eye(72), "bf16x3"), isa=isa, threads=1)
    assert torch.equal(y, x)
    one = packed.pack_linear(torch.ones(1, 1), "bf16x3")
    special = torch.tensor([[float("inf")], [float("-inf")], [float("nan")]])
    y = packed.packed_linear(special, one, isa=isa)  # a row each: 0 * inf would be NaN
    assert y[0, 0] == float("inf") and y[1, 0] == float("-inf") and y[2, 0].isnan()


def test_bf16_pair_activations_round_to_nearest_even():
    """The kernel's fp32 -> bf16 rounding is torch's (ties to even, overflow to inf, NaN kept),
    seen through weights that pick one input at a time. (Subnormals are left out: vdpbf16ps
    treats them as zero, the emulation does not.)"""
    x = torch.tensor([[1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.3e38, -2.5, 1 + 2 ** -9]])
    y = packed.packed_linear(x, packed.pack_linear(torch.eye(x.shape[1]), "bf16p"), threads=1)
    assert torch.equal(y, x.bfloat16().float())
    one = packed.pack_linear(torch.ones(1, 1), "bf16p")
    big = packed.packed_linear(torch.tensor([[3.4e38]]), one, threads=1)  # rounds up past max
    assert torch.equal(big, torch.tensor([[3.4e38]]).bfloat16().float()) and big.isinf().all()
    assert packed.packed_linear(torch.tensor([[float("nan")]]), one, threads=1).isnan().all()


def _experts(num: int, hidden: int, inter: int, storage: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = [torch.randn(2 * inter, hidden, generator=g) * 0.1 for _ in range(num)]
    w2 = [torch.randn(hidden, inter, generator=g) * 0.1 for _ in range(num)]
    return w13, w2, [packed.pack_expert(ExpertWeights(a, b), storage) for a, b in zip(w13, w2)]


def _moe_reference(w13, w2, storage, h, weights, indices, b13=None, b2=None, clamp=None):
    """The experts in fp64, and how far one activation's quantization step moves an output
    (int8q; else 0): the kernel's SwiGLU outputs are fp32 and the reference's fp64, so a value
    within an ulp of a rounding boundary can land on the neighbouring int8 code."""
    out = torch.zeros(h.shape, dtype=torch.float64)
    step = 0.0
    inter = w2[0].shape[1]
    for e in range(len(w13)):
        tok, slot = (indices == e).nonzero(as_tuple=True)
        if len(tok) == 0:
            continue
        gu = activations(h[tok], storage) @ dequantized(w13[e], storage).T
        if b13 is not None:
            gu = gu + b13[e].double()
        gate, up = gu[:, :inter], gu[:, inter:]
        if clamp is None:
            act = F.silu(gate) * up
        else:  # GPT-OSS, as transformers writes it
            gate, up = gate.clamp(max=clamp.limit), up.clamp(-clamp.limit, clamp.limit)
            act = (up + 1) * (gate * torch.sigmoid(gate * clamp.alpha))
        y = activations(act, storage) @ dequantized(w2[e], storage).T
        if storage == packed.QUAD_STORAGE:
            step = max(step, (act.abs().max() / 127 * dequantized(w2[e], storage).abs().max()
                              * weights.abs().max()).item())
        if b2 is not None:
            y = y + b2[e].double()
        out.index_add_(0, tok, weights[tok, slot].double()[:, None] * y)
    return out, step


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("storage", packed.STORAGE_DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_moe_ffn_matches_fp64_reference(isa, storage, tokens):
    # int4 and mxfp4 group inputs by 32, so their sizes are multiples of 32; the others take
    # odd sizes.
    hidden, inter = (96, 64) if storage in packed.NIBBLE_STORAGE else (72, 40)
    w13, w2, experts = _experts(6, hidden, inter, storage)
    torch.manual_seed(tokens)
    h = torch.randn(tokens, hidden)
    # experts 4 and 5 get no token at all
    indices = torch.stack([torch.randperm(4)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2)
    out = packed.packed_moe_ffn(experts, h, weights, indices, isa=isa, threads=2)
    ref, step = _moe_reference(w13, w2, storage, h, weights, indices)
    assert (out.double() - ref).abs().max().item() < tolerance(storage) + 2 * step


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("storage", packed.STORAGE_DTYPES)
@pytest.mark.parametrize("tokens", [1, 17, 333])
def test_gpt_oss_experts_biases_and_clamped_swiglu(isa, storage, tokens):
    """GPT-OSS's experts on the kernel: gate|up and down biases, the clamped SwiGLU (limit
    small enough that both clamps bite)."""
    hidden, inter = (96, 64) if storage in packed.NIBBLE_STORAGE else (72, 40)
    clamp = SwigluClamp(alpha=1.702, limit=0.3)
    g = torch.Generator().manual_seed(7)
    w13 = [torch.randn(2 * inter, hidden, generator=g) * 0.1 for _ in range(5)]
    w2 = [torch.randn(hidden, inter, generator=g) * 0.1 for _ in range(5)]
    b13 = [torch.randn(2 * inter, generator=g) * 0.2 for _ in range(5)]
    b2 = [torch.randn(hidden, generator=g) * 0.2 for _ in range(5)]
    experts = [packed.pack_expert(ExpertWeights(*ws, b13=bs[0], b2=bs[1], clamp=clamp), storage)
               for ws, bs in zip(zip(w13, w2), zip(b13, b2))]
    torch.manual_seed(tokens)
    h = torch.randn(tokens, hidden)
    indices = torch.stack([torch.randperm(4)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2)
    out = packed.packed_moe_ffn(experts, h, weights, indices, isa=isa, threads=2)
    ref, step = _moe_reference(w13, w2, storage, h, weights, indices, b13, b2, clamp)
    assert (out.double() - ref).abs().max().item() < tolerance(storage) + 2 * step


@pytest.mark.parametrize("isa", ISAS)
def test_mxfp4_rows_as_loaded_pack_without_requantizing(isa):
    """An expert in the checkpoint's MXFP4 (byte-packed codes + E8M0 scales, as the loader
    keeps it) packs to the same panels as quantizing its values, computes transformers'
    dequantization of it, and packs to other storages through its values."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    hidden, inter = 64, 96
    w13 = torch.randn(2 * inter, hidden, generator=g) * 0.1
    w2 = torch.randn(hidden, inter, generator=g) * 0.1
    (c13, s13), (c2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
    rows = ExpertWeights(mxfp4.pack_codes(c13), mxfp4.pack_codes(c2), s13=s13, s2=s2)
    # transformers reads blocks [E, rows, k/32, 16] and scales [E, rows, k/32], returns [E, k, rows]
    hf13 = convert_moe_packed_tensors(rows.w13.reshape(1, 2 * inter, hidden // 32, 16),
                                      s13[None], dtype=torch.float32)[0].T
    assert torch.equal(hf13, mxfp4.dequantize(rows.w13, s13))
    assert torch.equal(hf13.double(), dequantized(w13, "mxfp4"))
    direct = packed.pack_expert(rows, "mxfp4")
    via_values = packed.pack_expert(ExpertWeights(w13, w2), "mxfp4")
    for a, b in zip(direct.tensors(), via_values.tensors()):
        assert torch.equal(a, b)
    h, idx, wts = torch.randn(9, hidden), torch.zeros(9, 1, dtype=torch.int64), torch.ones(9, 1)
    out = packed.packed_moe_ffn([direct], h, wts, idx, isa=isa)
    ref, _ = _moe_reference([w13], [w2], "mxfp4", h, wts, idx)
    assert (out.double() - ref).abs().max().item() < tolerance("mxfp4")
    as_bf16 = packed.pack_expert(rows, "bf16")
    ref_bf16 = packed.pack_expert(ExpertWeights(mxfp4.dequantize(rows.w13, s13),
                                                mxfp4.dequantize(rows.w2, s2)), "bf16")
    assert all(torch.equal(a, b) for a, b in zip(as_bf16.tensors(), ref_bf16.tensors()))


def test_mxfp4_quantize_round_trips_its_own_values():
    """Values already on the MXFP4 grid quantize to themselves (and codes pack losslessly)."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (8, 64), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (8, 2), generator=g, dtype=torch.uint8)
    codes[:, ::32] = 7  # every block holds a 6, so its scale is the one it was made with
    values = mxfp4.decode(codes, scales)
    q, s = mxfp4.quantize(values)
    assert torch.equal(s, scales)
    assert torch.equal(mxfp4.decode(q, s), values)
    assert torch.equal(mxfp4.unpack_codes(mxfp4.pack_codes(codes)), codes)


def test_moe_ffn_rejects_an_absent_expert():
    _, _, experts = _experts(3, 32, 32, "fp32")
    experts[1] = None
    with pytest.raises(ValueError, match="absent expert"):
        packed.packed_moe_ffn(experts, torch.randn(2, 32), torch.ones(2, 1),
                              torch.tensor([[0], [1]]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("storage", ["bf16", "bf16p", "bf16x3", "int8q"])
def test_a_rows_result_does_not_depend_on_its_batch(isa, storage):
    """Bitwise: one row alone, in a batch of 7, of 64, of 500 and of 800, at another position.
    136 and 104 inputs are not whole AMX steps of 32 (the amx build adds the last pairs after
    its tiles). Work items are 384 rows at these widths (plan_gemm: 1 MB of activations): 500
    rows put the linear's row in its second item; in the batch of 800 every row picks expert 3
    first, so expert 3 and the linear cut it into items of 384, 384 and 32 rows, the row in
    the last, partial one."""
    torch.manual_seed(0)
    hidden, inter = 136, 104
    _, _, experts = _experts(8, hidden, inter, storage)
    lin = packed.pack_linear(torch.randn(200, hidden), storage)
    row = torch.randn(1, hidden)
    idx, wts = torch.tensor([[3, 5]]), torch.tensor([[0.7, 0.3]])
    alone_ffn = packed.packed_moe_ffn(experts, row, wts, idx, isa=isa, threads=1)
    alone_lin = packed.packed_linear(row, lin, isa=isa, threads=1)
    for batch, pos in ((7, 3), (64, 50), (500, 420), (800, 790)):
        h = torch.randn(batch, hidden)
        h[pos] = row[0]
        indices = torch.randint(0, 8, (batch, 2))
        if batch == 800:
            indices[:, 0] = 3
        indices[:, 1] = (indices[:, 0] + 1) % 8
        weights = torch.rand(batch, 2)
        indices[pos], weights[pos] = idx[0], wts[0]
        ffn = packed.packed_moe_ffn(experts, h, weights, indices, isa=isa, threads=2)
        lin_out = packed.packed_linear(h, lin, isa=isa, threads=2)
        assert torch.equal(ffn[pos], alone_ffn[0])
        assert torch.equal(lin_out[pos], alone_lin[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("storage", packed.STORAGE_DTYPES)
def test_a_long_input_is_walked_in_k_blocks_with_the_same_results(isa, storage):
    """5604 inputs (5664 for the groups of 32 of int4 and mxfp4) over 100 rows overflow an
    item's activations in L2, so the kernels walk k in blocks (gemm_k_block), the raw sums
    kept between blocks: the linear's and the down GEMM's rows are bitwise what they are alone
    (walked whole), and within fp32's rounding of the fp64 reference. 5604 is no multiple of
    the block, and its 2802 pairs none of AMX's 16 (the last pairs come after the tiles).
    int8q's rows take a byte an input: 11604 of them overflow it."""
    k = {"int4": 5664, "mxfp4": 5664, "int8q": 11604}.get(storage, 5604)
    rows = 100
    assert packed.gemm_k_block(rows, k, storage, isa) < k == packed.gemm_k_block(1, k, storage, isa)
    torch.manual_seed(3)
    w, b, x = torch.randn(40, k) * 0.1, torch.randn(40), torch.randn(rows, k)
    lin = packed.pack_linear(w, storage)
    y = packed.packed_linear(x, lin, b, isa=isa, threads=2)
    ref = activations(x, storage) @ dequantized(w, storage).T + b.double()
    assert (y.double() - ref).abs().max().item() < 20 * tolerance(storage)
    for r in (0, 57, 99):
        assert torch.equal(y[r], packed.packed_linear(x[r:r + 1], lin, b, isa=isa, threads=1)[0])
    # the experts: gate|up walks its 64 inputs whole, the down GEMM its k in blocks
    w13, w2, experts = _experts(2, 64, k, storage)
    h, wts = torch.randn(rows, 64), torch.rand(rows, 2)
    idx = torch.tensor([[0, 1]]).repeat(rows, 1)
    out = packed.packed_moe_ffn(experts, h, wts, idx, isa=isa, threads=2)
    ref, step = _moe_reference(w13, w2, storage, h, wts, idx)
    assert (out.double() - ref).abs().max().item() < 20 * tolerance(storage) + 2 * step
    for r in (0, 99):
        alone = packed.packed_moe_ffn(experts, h[r:r + 1], wts[r:r + 1], idx[r:r + 1], isa=isa,
                                      threads=1)
        assert torch.equal(out[r], alone[0])


@pytest.mark.parametrize("storage", ["bf16", "bf16p", "bf16x3", "int8q", "int4", "mxfp4"])
def test_fma_isas_agree_bitwise(storage):
    # AVX512BF16 and AMX run bf16 weights with the AVX-512 code: they join the comparison;
    # bf16p and bf16x3 run there on vdpbf16ps / AMX tiles (compared with a tolerance below), on
    # the others as FMAs; int8q's integer sums are the same whichever instruction (vpdpbusd
    # or vpmaddwd) and so are its FMA SwiGLUs; int4 and mxfp4 scale their codes the same way
    # on every FMA build
    fma = [isa for isa in ISAS if isa != "generic" and not (
        storage in packed.PAIR_STORAGES and isa in packed.NATIVE_BF16_ISAS)]
    if len(fma) < 2:
        pytest.skip("one FMA-capable ISA build on this CPU")
    torch.manual_seed(1)
    # int8q: 200 inputs of w2 are three whole AMX tile steps (16 quad-rows) and a tail of two
    # quad-rows, so tdpbusd and the vpdpbusd tail both meet the other builds' sums
    inter = {"int4": 64, "mxfp4": 64, "int8q": 200}.get(storage, 48)
    _, _, experts = _experts(4, 64, inter, storage)
    h, idx, wts = torch.randn(33, 64), torch.randint(0, 4, (33, 1)), torch.rand(33, 1)
    outs = [packed.packed_moe_ffn(experts, h, wts, idx, isa=isa) for isa in fma]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("isa", ISAS)
def test_int4_weights_are_exactly_their_codes_times_their_group_scales(isa):
    """Unit rows read the dequantized weights out one by one: (q - 8) * s rounded once in
    fp32, which the FMA builds compute as q * s + (-8 * s) in one FMA (the same value, if the
    compiler fuses it: setup.py asks for -ffp-contract=fast)."""
    torch.manual_seed(3)
    n, k = 40, 96
    w = torch.randn(n, k) * torch.logspace(-3, 2, n)[:, None]
    q, scale = packed._quantize(w, "int4")
    expected = (q.float() - 8.0) * scale.repeat_interleave(packed.I4_GROUP, dim=1)
    out = packed.packed_linear(torch.eye(k), packed.pack_linear(w, "int4"), isa=isa)
    assert torch.equal(out.T, expected)


NATIVE_BF16 = [isa for isa in packed.NATIVE_BF16_ISAS if isa in ISAS]


@pytest.mark.skipif(not NATIVE_BF16, reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("isa", NATIVE_BF16)
@pytest.mark.parametrize("storage", packed.PAIR_STORAGES)
@pytest.mark.parametrize("hidden, inter, tokens", [(256, 128, 64), (200, 72, 45)])
def test_bf16_dot_instruction_matches_its_fma_emulation(isa, storage, hidden, inter, tokens):
    """vdpbf16ps (avx512bf16) and tdpbf16ps (amx) against the AVX-512 build's two FMAs per
    pair: the same to within the instructions' own rounding of their sums (an ulp or so of
    the fp32 sums). 200 x 72: k/2 is not a multiple of AMX's 16 pairs, so the amx build adds
    the last pairs after its tiles; 45 rows: two row tiles, the second partial. bf16x3: the
    three terms of each pair in turn."""
    torch.manual_seed(2)
    _, _, experts = _experts(4, hidden, inter, storage)
    h, wts = torch.randn(tokens, hidden), torch.rand(tokens, 2)
    idx = torch.randint(0, 4, (tokens, 2))
    dot = packed.packed_moe_ffn(experts, h, wts, idx, isa=isa)
    fma = packed.packed_moe_ffn(experts, h, wts, idx, isa="avx512")
    assert (dot - fma).abs().max().item() <= 1e-6 * fma.abs().max().item() + 1e-7
    lin = packed.pack_linear(torch.randn(40, hidden) * 0.1, storage)
    assert torch.allclose(packed.packed_linear(h, lin, isa=isa),
                          packed.packed_linear(h, lin, isa="avx512"), rtol=0, atol=1e-5)


def test_experts_that_mix_bf16_pairs_with_fp32_rows_are_refused():
    _, _, pairs = _experts(2, 32, 32, "bf16p")
    _, _, rows = _experts(2, 32, 32, "bf16")
    _, _, terms = _experts(2, 32, 32, "bf16x3")
    for a, b in ((pairs[0], rows[1]), (terms[0], rows[1]), (terms[0], pairs[1])):
        with pytest.raises(ValueError, match="mix bf16p, bf16x3 or i8q"):
            packed.packed_moe_ffn([a, b], torch.randn(2, 32), torch.ones(2, 1),
                                  torch.tensor([[0], [1]]))


@pytest.mark.parametrize("isa", ISAS)
def test_an_expert_whose_projections_take_different_activation_terms(isa):
    """gate|up in bf16 (fp32 rows), down in bf16x3 (three planes a row): the scratch is sized
    for the wider of the two (it was sized by gate|up alone) and the result is fp32's."""
    from moe_engine.model.weights import ExpertWeights as EW

    w13, w2, _ = _experts(3, 72, 40, "bf16")
    mixed = [EW(packed.pack_expert(EW(a, b), "bf16").w13, packed.pack_expert(EW(a, b), "bf16x3").w2)
             for a, b in zip(w13, w2)]
    torch.manual_seed(3)
    h, idx, wts = torch.randn(333, 72), torch.randint(0, 3, (333, 2)), torch.rand(333, 2)
    out = packed.packed_moe_ffn(mixed, h, wts, idx, isa=isa, threads=2)
    ref, _ = _moe_reference(w13, w2, "bf16", h, wts, idx)
    assert (out.double() - ref).abs().max().item() < tolerance("bf16")


def test_bf16p_experts_need_even_sizes():
    with pytest.raises(ValueError, match="even"):
        packed.pack_expert(ExpertWeights(torch.randn(2 * 33, 64), torch.randn(64, 33)), "bf16p")


def test_unsupported_isa_is_refused_not_run():
    with pytest.raises(ValueError):
        packed.packed_linear(torch.randn(1, 32), packed.pack_linear(torch.randn(32, 32), "fp32"),
                             isa="sve")


def test_fma_probe_measures_a_positive_rate():
    assert packed.fma_peak_flops(seconds=0.01, threads=1) > 1e8


@pytest.mark.parametrize("isa", ISAS)
def test_dot_probes_measure_a_positive_rate_on_every_isa(isa):
    assert packed.fma_peak_flops(seconds=0.01, threads=1, isa=isa, kind="bf16_dot") > 1e8
    assert packed.fma_peak_flops(seconds=0.01, threads=1, isa=isa, kind="int8_dot") > 1e8
    with pytest.raises(ValueError, match="probe"):
        packed.fma_peak_flops(seconds=0.01, kind="int8")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens, n, k", [(1, 32, 16), (3, 45, 37), (17, 70, 130),
                                          (64, 96, 1024), (333, 40, 700), (100, 8, 20001)])
def test_int8q_linear_is_its_integer_formula_bitwise(isa, tokens, n, k):
    """int8q: (float)(sum of int8 codes' products) * row scale * column scale + bias, the sum
    exact: bitwise the same torch formula on every ISA, k not a multiple of 4 included (its
    last quad padded with zero inputs)."""
    torch.manual_seed(k)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(tokens, k)
    xq, xs = q8_rows(x)
    ws = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # as packing computes them
    wq = torch.round(w / ws[:, None]).clamp(-127, 127).long()
    ref = ((xq @ wq.T).float() * xs[:, None]) * ws[None, :] + b
    y = packed.packed_linear(x, packed.pack_linear(w, "int8q"), b, isa=isa, threads=2)
    assert torch.equal(y, ref)


@pytest.mark.parametrize("isa", ISAS)
def test_int8q_rows_of_zeros_and_non_finite_values(isa):
    """A row of zeros gives the bias (its scale is 0, not a division by zero), and so do rows
    whose largest value is below ~3.7e-37 (127 / max|x| would overflow); a row with an inf or
    a NaN gives NaN, as an fp32 GEMM's outputs would not be finite either; the rows beside
    them are unaffected. 40 inputs: vectors and a tail on every build."""
    lin = packed.pack_linear(torch.randn(8, 40), "int8q")
    b = torch.randn(8)
    x = torch.randn(6, 40)
    x[1] = 0.0
    x[2, 5] = float("inf")
    x[3, 0] = float("nan")
    x[4] = torch.linspace(-1e-37, 1e-37, 40)
    x[5] = 0.0
    x[5, 39] = 1e-39  # subnormal, in the tail
    y = packed.packed_linear(x, lin, b, isa=isa)
    assert torch.equal(y[1], b) and torch.equal(y[4], b) and torch.equal(y[5], b)
    assert y[2].isnan().all() and y[3].isnan().all()
    assert torch.equal(y[0], packed.packed_linear(x[:1], lin, b, isa=isa)[0])


def test_int8q_packs_its_column_corrections_and_refuses_sizes_it_cannot_hold():
    """The scales tensor holds the fp32 column scales, then 128 * each column's sum of codes as
    int32 bits; experts need multiples of 4, and k beyond the int32 sums' range is refused."""
    w = torch.tensor([[1.0, -1.0, 0.5, 0.0, 1.0], [0.0] * 5])
    lin = packed.pack_linear(w, "int8q")
    assert lin.data.shape == (1, 2, packed.QUAD_BYTES) and lin.data.dtype == torch.int8
    corr = lin.scale[packed.NR:].view(torch.int32)
    assert corr[0].item() == 128 * (127 - 127 + 64 + 0 + 127) and corr[1:].eq(0).all()
    assert packed.I8Q_MAX_K == packed._ext.I8Q_MAX_K
    with pytest.raises(ValueError, match="multiples of 4"):
        packed.pack_expert(ExpertWeights(torch.randn(2 * 6, 64), torch.randn(64, 6)), "int8q")
    with pytest.raises(ValueError, match="at most"):
        packed.pack_linear(torch.randn(1, packed.I8Q_MAX_K + 4), "int8q")
    # the kernels refuse it too, before reading a weight
    big = packed.PackedLinear(data=torch.zeros(1, 1, packed.QUAD_BYTES, dtype=torch.int8),
                              scale=torch.zeros(2 * packed.NR), n=packed.NR,
                              k=packed.I8Q_MAX_K + 4, storage="int8q")
    with pytest.raises(ValueError, match="at most"):
        packed.packed_linear(torch.zeros(1, big.k), big)


def test_int8q_experts_beside_other_storage_are_refused():
    _, _, quads = _experts(2, 32, 32, "int8q")
    _, _, rows = _experts(2, 32, 32, "int8")
    with pytest.raises(ValueError, match="mix bf16p, bf16x3 or i8q"):
        packed.packed_moe_ffn([quads[0], rows[1]], torch.randn(2, 32), torch.ones(2, 1),
                              torch.tensor([[0], [1]]))


@pytest.mark.parametrize("isa", ISAS)
def test_int8q_activations_round_ties_to_even_in_vectors_and_tail(isa):
    """With max|x| = 127 a value quantizes to itself rounded: ties (k + 0.5) go to the even
    code, in the vectorized part of a row and in its scalar tail alike (37 inputs: two 16-lane
    vectors, or four of 8, then 5 in the tail), as torch.round does; through weights that pick
    one input at a time the output is the code times the scales."""
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5])
    x = torch.zeros(1, 37)
    x[0, 0] = 127.0
    x[0, 1:9], x[0, 29:37] = ties, ties
    w = torch.eye(37)
    y = packed.packed_linear(x, packed.pack_linear(w, "int8q"), isa=isa)
    assert torch.equal(y, torch.round(x))
