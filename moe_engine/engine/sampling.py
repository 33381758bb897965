"""Token selection for a step: greedy rows by argmax, sampled rows vectorised over the batch.

Randomness is counter-based: the uniform number for a sampled token is a hash of the request's
seed and the token's position, so a request samples the same tokens whatever batch it runs in,
and again after a preemption recomputes it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _to_signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _to_signed(0x9E3779B97F4A7C15)
_M1 = _to_signed(0xBF58476D1CE4E5B9)
_M2 = _to_signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    # Logical right shift on int64 (torch's >> is arithmetic for signed types).
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser over int64 tensors (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def uniform_from(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Deterministic uniforms in [0, 1) (float64) from per-row seeds and token positions."""
    h = splitmix64(splitmix64(seeds.long()) ^ positions.long())
    return _shr(h, 11).double() * (1.0 / (1 << 53))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of a step, as tensors."""

    temperature: torch.Tensor  # float32 [N]; 0 = greedy
    top_p: torch.Tensor  # float32 [N]
    top_k: torch.Tensor  # int64 [N]; 0 = off
    seeds: torch.Tensor  # int64 [N]
    positions: torch.Tensor  # int64 [N]: index of the token being sampled


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Next token per row of logits [N, V] (fp32)."""
    tokens = logits.argmax(dim=-1)
    rows = torch.nonzero(batch.temperature > 0).flatten()
    if rows.numel() == 0:
        return tokens
    lg = logits[rows] / batch.temperature[rows, None]
    sorted_lg, sorted_idx = torch.sort(lg, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_lg.double(), dim=-1)
    vocab = probs.shape[-1]
    rank = torch.arange(vocab)[None, :]
    k = batch.top_k[rows]
    k = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
    keep = rank < k[:, None]
    # top-p: keep the smallest prefix whose mass reaches p (the first token always stays).
    before = torch.cumsum(probs, dim=-1) - probs
    keep &= before < batch.top_p[rows, None].double()
    probs = probs * keep
    cdf = torch.cumsum(probs, dim=-1)
    u = uniform_from(batch.seeds[rows], batch.positions[rows]) * cdf[:, -1]
    choice = torch.searchsorted(cdf, u[:, None], right=True).clamp(max=vocab - 1)
    # Rounding can land past the last kept token; fall back to the last kept one.
    last_kept = keep.sum(dim=-1, keepdim=True) - 1
    choice = torch.minimum(choice, last_kept)
    tokens[rows] = sorted_idx.gather(1, choice).flatten()
    return tokens
