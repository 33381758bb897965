"""One model step over a step's micro-batches: embeddings, decoder layers, LM head.

Each layer runs per micro-batch in three parts that a pipelined backend (issue 5, CGOPipe) will
interleave across micro-batches: pre-attention (norm + QKV + RoPE), attention (prefill SDPA /
paged decode) and post-attention (O projection + FFN: experts grouped by expert, plus what
the dense weights hold, a shared expert or a dense layer's whole MLP).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from moe_engine.model.attention import DecodeAttention, prefill_attention
from moe_engine.model.kv_cache import KVCache
from moe_engine.model.layers import (RotaryTable, attention_output, ffn_output, moe_ffn,
                                     qkv_projection, rms_norm, route)
from moe_engine.model.spec import ModelSpec
from moe_engine.model.weights import ModelWeights


@dataclass
class MicroBatchInput:
    """Packed tokens of one micro-batch: prefill sequences first, then decode sequences."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    prefill_lens: list[int]
    num_decode: int
    block_tables: Optional[torch.Tensor]  # int32 [num_decode, max_blocks]
    context_lens: Optional[torch.Tensor]  # int32 [num_decode], including the new token
    logits_indices: torch.Tensor  # int64 [num_seqs]: last token of each sequence

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_lens)


@dataclass
class PhaseTimes:
    """Wall time spent per part of the step, accumulated over calls."""

    dense_s: float = 0.0
    attention_s: float = 0.0
    ffn_s: float = 0.0
    head_s: float = 0.0


@dataclass
class _Activation:
    x: torch.Tensor
    q: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    attn: Optional[torch.Tensor] = None


class ModelRunner:
    """Runs the decoder on packed micro-batches and writes their K/V into the paged cache."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, cache: KVCache,
                 attention: DecodeAttention, max_positions: int, dtype: torch.dtype):
        self.spec = spec
        self.weights = weights
        self.cache = cache
        self.attention = attention
        self.dtype = dtype
        self.rope = RotaryTable(spec, max_positions, dtype)
        self.scale = spec.head_dim ** -0.5
        self.times = PhaseTimes()

    @torch.inference_mode()
    def forward(self, batches: list[MicroBatchInput]) -> torch.Tensor:
        """Logits [num_seqs, vocab] (fp32) for the last token of every sequence, batch order."""
        acts = [_Activation(self.weights.embed[mb.input_ids]) for mb in batches]
        for layer in range(self.spec.num_layers):
            for mb, act in zip(batches, acts):
                self.pre_attention(layer, mb, act)
                self.attend(layer, mb, act)
                self.post_attention(layer, mb, act)
        t0 = time.perf_counter()
        last = torch.cat([act.x[mb.logits_indices] for mb, act in zip(batches, acts)])
        h = rms_norm(last, self.weights.final_norm, self.spec.rms_norm_eps)
        logits = F.linear(h, self.weights.lm_head).float()
        self.times.head_s += time.perf_counter() - t0
        return logits

    def pre_attention(self, layer: int, mb: MicroBatchInput, act: _Activation) -> None:
        """Input norm, fused QKV projection, RoPE."""
        t0 = time.perf_counter()
        dense = self.weights.layers[layer].dense
        h = rms_norm(act.x, dense.input_norm, self.spec.rms_norm_eps)
        act.q, act.k, act.v = qkv_projection(dense, h, self.spec, self.rope, mb.positions)
        self.times.dense_s += time.perf_counter() - t0

    def attend(self, layer: int, mb: MicroBatchInput, act: _Activation) -> None:
        """Store the new K/V, then prefill attention on the fresh K/V and decode on the cache."""
        t0 = time.perf_counter()
        kc, vc = self.cache.key[layer], self.cache.value[layer]
        self.attention.write_kv(kc, vc, act.k, act.v, mb.slot_mapping)
        npf = mb.num_prefill_tokens
        out = torch.empty_like(act.q)
        if npf:
            out[:npf] = prefill_attention(act.q[:npf], act.k[:npf], act.v[:npf], mb.prefill_lens,
                                          self.scale)
        if mb.num_decode:
            out[npf:] = self.attention(act.q[npf:].contiguous(), kc, vc, mb.block_tables,
                                       mb.context_lens, self.scale)
        act.attn = out.reshape(out.shape[0], -1)
        act.q = act.k = act.v = None
        self.times.attention_s += time.perf_counter() - t0

    def post_attention(self, layer: int, mb: MicroBatchInput, act: _Activation) -> None:
        """O projection + residual, post norm, FFN (routed experts and/or dense part) + residual."""
        t0 = time.perf_counter()
        lw = self.weights.layers[layer]
        x = act.x + attention_output(lw.dense, act.attn)
        act.attn = None
        h = rms_norm(x, lw.dense.post_norm, self.spec.rms_norm_eps)
        moe = self.spec.is_moe_layer(layer)
        routing = route(lw.dense.router, h, self.spec) if moe else None
        t1 = time.perf_counter()
        self.times.dense_s += t1 - t0
        routed = moe_ffn(lw.experts, h, *routing) if moe else None
        act.x = x + ffn_output(lw.dense, h, routed)
        self.times.ffn_s += time.perf_counter() - t1
