"""MXFP4, the OCP microscaling 4-bit format GPT-OSS's released checkpoints store experts in.

A weight row is cut into blocks of 32 inputs; each value is an E2M1 code (sign bit 3, two
exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) and each block
has one E8M0 scale byte e, the value being code_value * 2^(e - 127). Checkpoints hold, per
expert projection [out, in], `*_blocks` uint8 [out, in/32, 16] (two codes a byte, the even
input in the low nibble) and `*_scales` uint8 [out, in/32].

Here: the row-major form the loader keeps (blocks flattened to [out, in/2] bytes, scales
[out, in/32]), unpacking to one code per byte (what model/packed.py lays into panels), the
dequantization the torch path needs, and a quantizer (for presets, tests and
`engine.expert_dtype=mxfp4` on a bf16/fp32 checkpoint) that picks each block's scale as the
reference implementations do: the smallest power of two that brings the block's largest
magnitude within 6.
"""
from __future__ import annotations

import torch

BLOCK = 32  # inputs per scale
E8M0_BIAS = 127
FP4_MAX = 6.0
# Value of each E2M1 code, sign in bit 3 (as transformers' FP4_VALUES).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between consecutive magnitudes: a magnitude rounds to the code of its interval.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def unpack_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Byte-packed codes [..., n/2] (even element in the low nibble) -> one code per byte
    [..., n]."""
    lo, hi = blocks & 0x0F, blocks >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_codes."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def decode(codes: torch.Tensor, scales: torch.Tensor,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes [rows, k] (one a byte) and scales [rows, k/32] -> values [rows, k] in `dtype`
    (exact in bf16 and wider: a 2-bit significand times a power of two)."""
    rows, k = codes.shape
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)[codes.long()]
    exponent = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(values.reshape(rows, k // BLOCK, BLOCK), exponent[..., None].float())
    return values.reshape(rows, k).to(dtype)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Row-major MXFP4 (blocks [rows, k/2] bytes, scales [rows, k/32]) -> [rows, k] values."""
    return decode(unpack_codes(blocks), scales, dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rows, k] weight -> (codes [rows, k] one a byte, E8M0 scales [rows, k/32] uint8).
    Each block's scale is 2^ceil(log2(amax / 6)) (so no value clips), each value rounds to the
    nearest E2M1 value, ties to the larger magnitude."""
    rows, k = w.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs an input size that is a multiple of {BLOCK}, got {k}")
    blocks = w.float().reshape(rows, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=2)
    # frexp: amax / 6 = m * 2^e with m in [0.5, 1), so 2^e >= amax / 6 and 2^(e-1) < amax / 6;
    # an exact power of two (m = 0.5) needs only 2^(e-1).
    mantissa, exp = torch.frexp(amax / FP4_MAX)
    exp = torch.where(mantissa == 0.5, exp - 1, exp)
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = blocks / torch.ldexp(torch.ones_like(amax), exp)[..., None]
    magnitude = torch.bucketize(scaled.abs(), torch.tensor(_MIDPOINTS), right=True)
    codes = (magnitude | ((scaled < 0).to(torch.int64) << 3)).to(torch.uint8)
    return codes.reshape(rows, k), (exp + E8M0_BIAS).to(torch.uint8)


__all__ = ["BLOCK", "FP4_VALUES", "decode", "dequantize", "pack_codes", "quantize",
           "unpack_codes"]
