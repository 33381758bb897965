"""Model weights held per layer as a dense part plus per-expert tensors.

The split is what the weight pager (offload/pager.py) swaps: a layer's dense part is small and always
resident; each expert is an independent unit that can be resident, streamed, or computed on the
CPU. Projections are fused at load time (q|k|v, w1|w3) so a step runs one GEMM each. A dense
layer's MLP and a shared expert are part of the dense weights: every token uses them, so they
are never paged.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator, Optional

import torch


@dataclass(frozen=True)
class SwigluClamp:
    """GPT-OSS's clamped SwiGLU: gate <= limit, -limit <= up <= limit,
    out = (up + 1) * gate * sigmoid(alpha * gate). Held by each expert so that every path
    computing an expert (runner, offload pipeline, placement timing) gets it with the weights."""

    alpha: float
    limit: float


@dataclass
class ExpertWeights:
    """One SwiGLU MLP (a routed expert, a shared expert or a dense layer's MLP):
    w13 = [gate; up] of shape [2*I, H], w2 = down of shape [H, I]; or, packed for the CPU
    kernels (model/packed.py), 3-D panel tensors with int8/int4 scales in s13/s2. GPT-OSS's
    experts add biases b13 = [gate; up] [2*I] and b2 [H] and the clamped activation."""

    w13: torch.Tensor
    w2: torch.Tensor
    s13: Optional[torch.Tensor] = None
    s2: Optional[torch.Tensor] = None
    b13: Optional[torch.Tensor] = None
    b2: Optional[torch.Tensor] = None
    clamp: Optional[SwigluClamp] = None

    def _all(self) -> tuple[Optional[torch.Tensor], ...]:
        return (self.w13, self.w2, self.s13, self.s2, self.b13, self.b2)

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from (t for t in self._all() if t is not None)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "ExpertWeights":
        """A copy with `fn` applied to every tensor."""
        return ExpertWeights(*(fn(t) if t is not None else None for t in self._all()),
                             clamp=self.clamp)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())


def _field_tensors(obj) -> Iterator[torch.Tensor]:
    """Every tensor of a weights dataclass, nested parts (an MLP, a packed projection)
    included."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, tuple):  # one packed projection per head
            for part in value:
                yield from part.tensors()
        elif value is not None:
            yield from value.tensors()


def _map_fields(obj, fn: Callable[[torch.Tensor], torch.Tensor]):
    """A copy of a weights dataclass with `fn` applied to every tensor, nested parts included."""
    changes = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = fn(value)
        elif isinstance(value, tuple):
            changes[f.name] = tuple(part.map(fn) for part in value)
        elif value is not None:
            changes[f.name] = value.map(fn)
    return replace(obj, **changes)


@dataclass
class MlaWeights:
    """The parts of multi-head latent attention besides the fused first projection (wqkv:
    q_a_proj or q_proj, then kv_a_proj_with_mqa) and o_proj (wo). kv_b_proj is held split per
    head for the absorbed form (model/mla.py): w_uk [heads, nope, rank] maps a query's nope
    part into the latent space, w_uv [heads, rank, v] the attended latent to a head's value
    (x @ w[h] for head h); on the packed CPU kernels each is a tuple of one PackedLinear per
    head, so that a row's result does not depend on its batch."""

    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    w_uk: torch.Tensor | tuple
    w_uv: torch.Tensor | tuple
    q_a_norm: Optional[torch.Tensor] = None  # [q_lora_rank]; None: q is one full projection
    wq_b: Optional[torch.Tensor] = None  # [heads * (nope + rope), q_lora_rank], or PackedLinear

    def tensors(self) -> Iterator[torch.Tensor]:
        return _field_tensors(self)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "MlaWeights":
        return _map_fields(self, fn)


@dataclass
class DenseLayerWeights:
    """The non-expert part of a decoder layer; the optional parts exist where the
    architecture (ModelSpec flags) has them."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    wqkv: torch.Tensor  # [q_size + 2*kv_size, H]; MLA: [spec.qkv_out_features, H]
    wo: torch.Tensor  # [H, q_size]; MLA: [H, heads * v_head_dim]
    router: Optional[torch.Tensor] = None  # [E, H]; None in a dense layer
    # On the packed CPU kernels wqkv, wo, router and shared_expert_gate are PackedLinear.
    bqkv: Optional[torch.Tensor] = None  # [q_size + 2*kv_size]
    bo: Optional[torch.Tensor] = None  # [H]
    q_norm: Optional[torch.Tensor] = None  # [head_dim] or [q_size], see ModelSpec.qk_norm
    k_norm: Optional[torch.Tensor] = None
    mlp: Optional[ExpertWeights] = None  # the FFN of a dense layer
    shared_expert: Optional[ExpertWeights] = None
    shared_expert_gate: Optional[torch.Tensor] = None  # [1, H]; None: an ungated shared expert
    # [E] fp32 (GLM-4.5's e_score_correction_bias, which transformers keeps in fp32 too)
    score_correction_bias: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None  # [n_q] attention-sink logits (GPT-OSS)
    router_bias: Optional[torch.Tensor] = None  # [E] (GPT-OSS)
    mla: Optional[MlaWeights] = None  # DeepSeek's latent attention (wqkv is its first GEMM)

    @property
    def holds_ffn(self) -> bool:
        """Whether part of the layer's FFN lives here (a dense MLP or a shared expert)."""
        return self.mlp is not None or self.shared_expert is not None

    def tensors(self) -> Iterator[torch.Tensor]:
        return _field_tensors(self)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "DenseLayerWeights":
        """A copy with `fn` applied to every tensor (e.g. moved to the device)."""
        return _map_fields(self, fn)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())


@dataclass
class LayerWeights:
    dense: DenseLayerWeights
    # Empty in a dense layer; an expert the loader left on disk (the disk tier reads it) is None.
    experts: list[Optional[ExpertWeights]]

    def nbytes(self) -> int:
        """Bytes in memory (experts left on disk count nothing)."""
        return self.dense.nbytes() + sum(e.nbytes() for e in self.experts if e is not None)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [V, H]; the embedding itself when tied (or a PackedLinear)
    layers: list[LayerWeights]

    @property
    def head_tied(self) -> bool:
        """Whether the LM head is the embedding tensor itself (a packed head is a copy)."""
        return isinstance(self.lm_head, torch.Tensor) and \
            self.lm_head.data_ptr() == self.embed.data_ptr()

    def nbytes(self) -> int:
        head = 0 if self.head_tied else self.lm_head.nbytes
        return (self.embed.nbytes + self.final_norm.nbytes + head
                + sum(layer.nbytes() for layer in self.layers))
