"""One model step over a step's micro-batches: embeddings, decoder layers, LM head.

Each layer runs per micro-batch in public parts that the offload pipeline (offload/pipeline.py,
CGOPipe) interleaves across micro-batches and devices: `pre_attention` (norm + QKV + RoPE),
`attend` (prefill SDPA / paged decode), `post_attention` (O projection, post norm, router) and
`ffn` (routed experts grouped by expert, plus what the dense weights hold: a shared expert or a
dense layer's whole MLP); `lm_head` ends the step. `forward` runs them in plain order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moe_engine.model.attention import DecodeAttention, prefill_attention
from moe_engine.model.kv_cache import KVCache
from moe_engine.model.layers import (RotaryTable, attention_output, ffn_output,
                                     input_scaled_routing, linear, moe_ffn, qkv_projection,
                                     rms_norm, route, sum_routed_rows)
from moe_engine.model.mla import latent_to_values, mla_projection
from moe_engine.model.spec import ModelSpec
from moe_engine.model.weights import ModelWeights

# Called with (layer, experts [T, top_k]) each time a MoE layer routes: calibration records
# the routing profile through it.
RoutingObserver = Callable[[int, torch.Tensor], None]


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
    # The sliding-window layers' own slots and tables (engine/block_manager.WindowPool), where
    # the cache keeps them apart; None: those layers use slot_mapping and block_tables.
    window_slot_mapping: Optional[torch.Tensor] = None
    window_block_tables: Optional[torch.Tensor] = None

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
class Activation:
    """One micro-batch's hidden state between the parts of a layer (q/k/v and attn are only
    set between pre_attention, attend and post_attention)."""

    x: torch.Tensor
    q: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    attn: Optional[torch.Tensor] = None


@dataclass
class Routed:
    """A micro-batch after post_attention: FFN input h and its routing (None in a dense layer).

    expert_rows: the routed experts' input when it is not h (Llama-4's rows scaled by their
    routing weights, one per token and slot, layers.input_scaled_routing); weights and experts
    then index those rows."""

    h: torch.Tensor
    weights: Optional[torch.Tensor] = None
    experts: Optional[torch.Tensor] = None
    expert_rows: Optional[torch.Tensor] = None

    @property
    def expert_input(self) -> torch.Tensor:
        return self.h if self.expert_rows is None else self.expert_rows


class ModelRunner:
    """Runs the decoder on packed micro-batches and writes their K/V into the paged cache."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, cache: KVCache,
                 attention: DecodeAttention, max_positions: int, dtype: torch.dtype):
        """`dtype` is the activations' (the weights' own, or fp32 over packed weights)."""
        self.spec = spec
        self.weights = weights
        self.cache = cache
        self.attention = attention
        self.dtype = dtype
        self.rope = RotaryTable(spec, max_positions, dtype)
        self.nope_layers = frozenset(spec.nope_layers)
        self.scale = spec.attention_scale
        # Attention's own parameters (GPT-OSS's sinks) live where attention runs, next to the KV
        # cache: the offload pipeline moves the dense weights to the device but may attend on
        # the host, and a per-step device->host copy would stall the copy of every layer.
        self.sinks = [layer.dense.sinks for layer in weights.layers]
        self.times = PhaseTimes()
        self.routing_observer: Optional[RoutingObserver] = None

    @torch.inference_mode()
    def forward(self, batches: list[MicroBatchInput]) -> torch.Tensor:
        """Logits [num_seqs, vocab] (fp32) for the last token of every sequence, batch order."""
        acts = [self.embed(mb) for mb in batches]
        for layer in range(self.spec.num_layers):
            for mb, act in zip(batches, acts):
                self.pre_attention(layer, mb, act)
                self.attend(layer, mb, act)
                self.ffn(layer, [act], [self.post_attention(layer, act)])
        return self.lm_head(batches, acts)

    def embed(self, mb: MicroBatchInput) -> Activation:
        # the activations' dtype (fp32 on the packed kernels, over a bf16 embedding say)
        return Activation(self.weights.embed[mb.input_ids].to(self.dtype))

    def pre_attention(self, layer: int, mb: MicroBatchInput, act: Activation) -> None:
        """Input norm, fused QKV projection, RoPE (MLA: q in the latent space and the latent
        cache entry, model/mla.py)."""
        t0 = time.perf_counter()
        dense = self.weights.layers[layer].dense
        h = rms_norm(act.x, dense.input_norm, self.spec.rms_norm_eps)
        project = qkv_projection if dense.mla is None else mla_projection
        rope = None if layer in self.nope_layers else self.rope
        act.q, act.k, act.v = project(dense, h, self.spec, rope, mb.positions)
        self.times.dense_s += time.perf_counter() - t0

    def attend(self, layer: int, mb: MicroBatchInput, act: Activation) -> None:
        """Store the new K/V, then prefill attention on the fresh K/V and decode on the cache."""
        t0 = time.perf_counter()
        kc = self.cache.key[layer]
        vc = self.cache.value[layer] if self.cache.value else None  # None: a latent cache
        sinks = self.sinks[layer]
        window = self.spec.attention_window(layer)
        slots, tables = mb.slot_mapping, mb.block_tables
        if window is not None and mb.window_slot_mapping is not None:
            slots, tables = mb.window_slot_mapping, mb.window_block_tables
        self.attention.write_kv(kc, vc, act.k, act.v, slots)
        npf = mb.num_prefill_tokens
        out = act.q.new_empty(*act.q.shape[:2], act.v.shape[-1])
        if npf:
            out[:npf] = prefill_attention(act.q[:npf], act.k[:npf], act.v[:npf], mb.prefill_lens,
                                          self.scale, sinks=sinks, window=window)
        if mb.num_decode:
            out[npf:] = self.attention(act.q[npf:].contiguous(), kc, vc, tables,
                                       mb.context_lens, self.scale, sinks=sinks, window=window)
        act.attn = out.reshape(out.shape[0], -1)
        act.q = act.k = act.v = None
        self.times.attention_s += time.perf_counter() - t0

    def post_attention(self, layer: int, act: Activation) -> Routed:
        """O projection + residual, post norm and (in a MoE layer) the router."""
        t0 = time.perf_counter()
        dense = self.weights.layers[layer].dense
        attn = act.attn if dense.mla is None else latent_to_values(dense.mla, act.attn)
        act.x = act.x + attention_output(dense, attn)
        act.attn = None
        h = rms_norm(act.x, dense.post_norm, self.spec.rms_norm_eps)
        routed = Routed(h)
        if self.spec.is_moe_layer(layer):
            routed.weights, routed.experts = route(dense.router, h, self.spec,
                                                     dense.score_correction_bias,
                                                     dense.router_bias)
            if self.routing_observer is not None:
                self.routing_observer(layer, routed.experts)
            if self.spec.router_scales_input:
                routed.expert_rows, routed.weights, routed.experts = input_scaled_routing(
                    h, routed.weights, routed.experts)
        self.times.dense_s += time.perf_counter() - t0
        return routed

    def ffn(self, layer: int, acts: list[Activation], routed: list[Routed],
            experts_out: Optional[torch.Tensor] = None) -> None:
        """x += FFN(h) for the given micro-batches, run as one batch of their rows.

        The routed experts' weighted sum is computed here from this runner's expert weights
        unless `experts_out` brings it (the offload pipeline computes it expert by expert,
        wherever each one's weights are, one row per Routed.expert_input row); the dense
        weights' part is added here either way.
        """
        t0 = time.perf_counter()
        h = routed[0].h if len(routed) == 1 else torch.cat([r.h for r in routed])
        if experts_out is None and self.spec.is_moe_layer(layer):
            rows = (routed[0].expert_input if len(routed) == 1
                    else torch.cat([r.expert_input for r in routed]))
            weights = torch.cat([r.weights for r in routed])
            experts = torch.cat([r.experts for r in routed])
            experts_out = moe_ffn(self.weights.layers[layer].experts, rows, weights, experts)
        if experts_out is not None:
            experts_out = sum_routed_rows(experts_out, h.shape[0])
        out = ffn_output(self.weights.layers[layer].dense, h, experts_out)
        start = 0
        for act in acts:
            end = start + act.x.shape[0]
            act.x = act.x + out[start:end]
            start = end
        self.times.ffn_s += time.perf_counter() - t0

    def lm_head(self, batches: list[MicroBatchInput], acts: list[Activation]) -> torch.Tensor:
        """Final norm and LM head on each sequence's last token: fp32 logits [num_seqs, vocab],
        where the weights are."""
        t0 = time.perf_counter()
        last = torch.cat([act.x[mb.logits_indices] for mb, act in zip(batches, acts)])
        h = rms_norm(last, self.weights.final_norm, self.spec.rms_norm_eps)
        logits = linear(h, self.weights.lm_head).float()
        self.times.head_s += time.perf_counter() - t0
        return logits

    def state_nbytes(self, kv_cache: bool) -> int:
        """Bytes of the RoPE tables, plus the KV cache and the attention sinks when `kv_cache`
        (what `place` moves)."""
        nbytes = self.rope.cos.nbytes + self.rope.sin.nbytes
        if kv_cache:
            nbytes += sum(t.nbytes for t in self.cache.key + self.cache.value)
            nbytes += sum(t.nbytes for t in self.sinks if t is not None)
        return nbytes

    def place(self, move: Callable[[torch.Tensor], torch.Tensor], kv_cache: bool) -> None:
        """Put the RoPE tables, and the KV cache with the attention sinks when `kv_cache`, where
        `move` puts a tensor (a backend's to_device; the weights move with the pager)."""
        rope = self.rope
        rope.cos, rope.sin = move(rope.cos), move(rope.sin)
        if kv_cache:
            self.sinks = [None if t is None else move(t) for t in self.sinks]
            cache = self.cache
            self.cache = KVCache(key=[move(t) for t in cache.key],
                                 value=[move(t) for t in cache.value],
                                 block_size=cache.block_size)
