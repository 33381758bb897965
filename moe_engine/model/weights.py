"""Model weights held per layer as a dense part plus per-expert tensors.

The split is what a weight pager (issue 5) swaps: a layer's dense part is small and always
resident; each expert is an independent unit that can be resident, streamed, or computed on the
CPU. Projections are fused at load time (q|k|v, w1|w3) so a step runs one GEMM each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertWeights:
    """One SwiGLU expert: w13 = [gate; up] of shape [2*I, H], w2 = down of shape [H, I]."""

    w13: torch.Tensor
    w2: torch.Tensor

    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes


@dataclass
class DenseLayerWeights:
    """The non-expert part of a decoder layer."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    wqkv: torch.Tensor  # [q_size + 2*kv_size, H]
    wo: torch.Tensor  # [H, q_size]
    router: torch.Tensor  # [E, H]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.input_norm, self.post_norm, self.wqkv, self.wo,
                                      self.router))


@dataclass
class LayerWeights:
    dense: DenseLayerWeights
    experts: list[ExpertWeights]

    def nbytes(self) -> int:
        return self.dense.nbytes() + sum(e.nbytes() for e in self.experts)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [V, H]; the embedding itself when tied
    layers: list[LayerWeights]

    def nbytes(self) -> int:
        head = 0 if self.lm_head.data_ptr() == self.embed.data_ptr() else self.lm_head.nbytes
        return (self.embed.nbytes + self.final_norm.nbytes + head
                + sum(layer.nbytes() for layer in self.layers))
