"""WeightPager: which weights live on the device, and how the rest stream in.

Layout (Lightning A.1, MoE-Lens 6.5):
- Dense layer weights (shared experts and dense layers' MLPs included), embeddings and LM head
  are resident on the device.
- Per layer, the round(r_w * E) most-used experts (routing profile) are resident.
- The other experts of a layer are packed contiguously in a host store (pinned on CUDA), most
  used first, and stream into a device page ring of two layer slots (2x the streamed part of
  one layer): consecutive layers alternate slots, so layer i+1's pages land while layer i
  computes, and a slot is refilled only after its layer was released. Release records an
  event on the compute stream after the slot's last reader; every copy into the slot after
  that waits for it on the device side (the host does not block), so a refill never
  overwrites pages that kernels launched earlier still read.
- Each expert moves as packets of at most `packet_bytes`, queued hot-first, so activation
  copies never wait behind a whole layer and `wait(layer, expert)` blocks only for the packets
  of the expert needed now.

Every device byte is reserved up front against the budget; nothing is allocated per step, so
the high-water mark is the reservation and a budget that is too small fails at construction.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from moe_engine.offload.backend import Backend, ComputeEvent, CopyHandle
from moe_engine.model.weights import ExpertWeights, LayerWeights, ModelWeights
from moe_engine.offload.routing import RoutingProfile


class DeviceBudgetError(ValueError):
    """The resident weights plus the page ring do not fit the device memory budget."""


@dataclass
class DeviceLedger:
    """Bytes reserved on the device and their high-water mark, checked against a budget."""

    budget_bytes: Optional[int]
    in_use: int = 0
    high_water: int = 0

    def reserve(self, nbytes: int, what: str) -> None:
        if self.budget_bytes is not None and self.in_use + nbytes > self.budget_bytes:
            raise DeviceBudgetError(
                f"{what} needs {nbytes} bytes with {self.in_use} in use; the device budget is "
                f"{self.budget_bytes} bytes")
        self.in_use += nbytes
        self.high_water = max(self.high_water, self.in_use)


@dataclass
class PagerStats:
    """Counters since the last reset (the pipeline resets them per step)."""

    wait_s: float = 0.0  # time the compute side blocked on pages
    bytes_issued: int = 0
    bytes_cancelled: int = 0
    experts_streamed: int = 0
    experts_on_demand: int = 0  # requested only when needed (not prefetched)


@dataclass
class _Slot:
    """One half of the page ring and what it currently holds."""

    flat: torch.Tensor
    layer: Optional[int] = None
    released: bool = True
    handles: dict[int, list[CopyHandle]] = field(default_factory=dict)
    issue_seq: dict[int, int] = field(default_factory=dict)
    draining: list[CopyHandle] = field(default_factory=list)  # started, then cancelled
    # Experts the compute stream was ordered after (`wait`): launched work reads their pages,
    # so their packets are never cancelled, even once the layer is released.
    waited: set[int] = field(default_factory=set)
    released_at: int = -1  # release counter value, to reuse the older free slot first
    # Compute-stream point after the last reader of the previous occupant: copies into the
    # slot wait for it (None: never read yet).
    free_after: Optional[ComputeEvent] = None


class WeightPager:
    """Resident set + host store + device page ring for a model's experts."""

    def __init__(self, weights: ModelWeights, backend: Backend, profile: RoutingProfile,
                 resident_ratio: float, packet_bytes: int = 32 << 20,
                 budget_bytes: Optional[int] = None):
        if not 0.0 <= resident_ratio <= 1.0:
            raise ValueError(f"resident_ratio must be in [0, 1], got {resident_ratio}")
        if packet_bytes < 1:
            raise ValueError(f"packet_bytes must be >= 1, got {packet_bytes}")
        layers = weights.layers
        # Dense layers (Qwen's mlp_only_layers) have no experts: nothing of theirs is paged.
        moe_layers = {i for i, layer in enumerate(layers) if layer.experts}
        if not moe_layers:
            raise ValueError("the model has no expert layers to page")
        first = layers[min(moe_layers)].experts
        proto = first[0]
        if profile.num_layers != len(layers) or profile.num_experts != len(first):
            raise ValueError("routing profile shape does not match the model")
        self.backend = backend
        self.profile = profile
        self.resident_ratio = resident_ratio
        self._w13_shape, self._w2_shape = tuple(proto.w13.shape), tuple(proto.w2.shape)
        self._w13_numel = proto.w13.numel()
        self.expert_numel = self._w13_numel + proto.w2.numel()
        self.dtype = proto.w13.dtype
        self.expert_bytes = self.expert_numel * proto.w13.element_size()
        self.packet_numel = max(1, packet_bytes // proto.w13.element_size())

        self.resident = [profile.resident_set(i, resident_ratio) if i in moe_layers
                         else frozenset() for i in range(len(layers))]
        # Streamed experts of each layer, hottest first: their order in the host store and ring.
        self.streamed = [[e for e in profile.ranking(i) if e not in self.resident[i]]
                         if i in moe_layers else [] for i in range(len(layers))]
        slot_experts = max((len(s) for s in self.streamed), default=0)

        self.ledger = DeviceLedger(budget_bytes)
        self._check_budget(weights, slot_experts)
        self.device_weights = self._place_resident(weights)
        self.host_experts = self._pack_host_store(weights)
        ring = 2 * slot_experts * self.expert_numel
        self.ledger.reserve(ring * proto.w13.element_size(), "page ring")
        self._slots = [_Slot(backend.empty(slot_experts * self.expert_numel, self.dtype))
                       for _ in range(2)] if slot_experts else []
        self._position = [{e: p for p, e in enumerate(s)} for s in self.streamed]
        self._seq = 0
        self._releases = 0
        self.stats = PagerStats()

    def _check_budget(self, weights: ModelWeights, slot_experts: int) -> None:
        """Fail before allocating anything when the layout cannot fit the budget."""
        if self.ledger.budget_bytes is None:
            return
        head = 0 if weights.head_tied else weights.lm_head.nbytes
        need = (weights.embed.nbytes + head + weights.final_norm.nbytes
                + sum(layer.dense.nbytes() for layer in weights.layers)
                + sum(len(r) for r in self.resident) * self.expert_bytes
                + 2 * slot_experts * self.expert_bytes)
        if need > self.ledger.budget_bytes:
            raise DeviceBudgetError(
                f"resident_ratio={self.resident_ratio} needs {need} device bytes (dense + "
                f"{sum(len(r) for r in self.resident)} resident experts + a ring of "
                f"2x{slot_experts} experts); the budget is {self.ledger.budget_bytes}")

    def _to_device(self, t: torch.Tensor, what: str) -> torch.Tensor:
        self.ledger.reserve(t.nbytes, what)
        return self.backend.to_device(t)

    def _place_resident(self, weights: ModelWeights) -> ModelWeights:
        embed = self._to_device(weights.embed, "embeddings")
        if weights.head_tied:
            lm_head = embed
        elif isinstance(weights.lm_head, torch.Tensor):
            lm_head = self._to_device(weights.lm_head, "lm_head")
        else:  # packed for the CPU kernels
            lm_head = weights.lm_head.map(lambda t: self._to_device(t, "lm_head"))
        layers = []
        for i, layer in enumerate(weights.layers):
            dense = layer.dense.map(lambda t, i=i: self._to_device(t, f"layer {i} dense"))
            experts = [ExpertWeights(self._to_device(x.w13, f"layer {i} expert {e}"),
                                     self._to_device(x.w2, f"layer {i} expert {e}"))
                       if e in self.resident[i] else None
                       for e, x in enumerate(layer.experts)]
            layers.append(LayerWeights(dense, experts))
        return ModelWeights(embed=embed, final_norm=self._to_device(weights.final_norm, "norm"),
                            lm_head=lm_head, layers=layers)

    def _pack_host_store(self, weights: ModelWeights) -> list[list[ExpertWeights]]:
        """Every expert's host weights; streamed ones repacked contiguously per layer, hottest
        first, so a layer's transfer is one contiguous range cut into packets."""
        self._host_flat: list[torch.Tensor] = []
        host = []
        for i, layer in enumerate(weights.layers):
            experts = list(layer.experts)
            flat = torch.empty(len(self.streamed[i]) * self.expert_numel, dtype=self.dtype)
            for p, e in enumerate(self.streamed[i]):
                part = flat[p * self.expert_numel:(p + 1) * self.expert_numel]
                part[:self._w13_numel].copy_(experts[e].w13.reshape(-1))
                part[self._w13_numel:].copy_(experts[e].w2.reshape(-1))
            flat = self.backend.host_store(flat)
            self._host_flat.append(flat)
            for p, e in enumerate(self.streamed[i]):
                experts[e] = self._view(flat, p)
                # The model's own copy is dropped so host memory holds one copy of each expert.
                layer.experts[e] = experts[e]
            host.append(experts)
        return host

    def _view(self, flat: torch.Tensor, position: int) -> ExpertWeights:
        part = flat[position * self.expert_numel:(position + 1) * self.expert_numel]
        return ExpertWeights(part[:self._w13_numel].view(self._w13_shape),
                             part[self._w13_numel:].view(self._w2_shape))

    def is_resident(self, layer: int, expert: int) -> bool:
        return expert in self.resident[layer]

    @property
    def ring_bytes(self) -> int:
        return sum(s.flat.nbytes for s in self._slots)

    def host_expert(self, layer: int, expert: int) -> ExpertWeights:
        """The expert's weights in host memory (for CPU compute)."""
        return self.host_experts[layer][expert]

    def bytes_to_move(self, layer: int, expert: int) -> int:
        """Bytes of the expert not yet on the device (0 for resident or landed experts)."""
        if self.is_resident(layer, expert):
            return 0
        slot = self._slot_of(layer)
        handles = slot.handles.get(expert) if slot is not None else None
        if handles is None:
            return self.expert_bytes
        return sum(h.nbytes for h in handles if not h.done())

    def issue_order(self, layer: int, expert: int) -> Optional[int]:
        """Sequence number of the expert's first packet (arrival order), None if not issued."""
        slot = self._slot_of(layer)
        return None if slot is None else slot.issue_seq.get(expert)

    def _slot_of(self, layer: int) -> Optional[_Slot]:
        for slot in self._slots:
            if slot.layer == layer and not slot.released:
                return slot
        return None

    def prefetch(self, layer: int, experts: Optional[Iterable[int]] = None) -> None:
        """Queue the pages of `layer`'s streamed experts (default: all, hottest first)."""
        if not self._slots or not self.streamed[layer]:
            return
        slot = self._claim(layer)
        for e in (self.streamed[layer] if experts is None else experts):
            if e not in slot.handles and not self.is_resident(layer, e):
                self._issue(slot, layer, e)

    def _claim(self, layer: int) -> _Slot:
        held = self._slot_of(layer)
        if held is not None:
            return held
        # Consecutive layers alternate slots (by visit, not by index, so an odd layer count
        # wraps into the next step correctly): take the slot released longest ago.
        free = [s for s in self._slots if s.released]
        if not free:
            raise RuntimeError(f"both page ring slots are in use (layers "
                               f"{[s.layer for s in self._slots]}); release one before "
                               f"prefetching layer {layer}")
        slot = min(free, key=lambda s: s.released_at)
        # Packets of the previous occupant still queued are dropped; one already in the link
        # must land before its bytes are overwritten (copy after copy: this host wait is for
        # at most one packet). Compute still reading the slot is waited for by the copies
        # themselves (`free_after`), not here.
        for e, handles in slot.handles.items():
            for h in handles:
                if e not in slot.waited and h.cancel():
                    self.stats.bytes_cancelled += h.nbytes
                else:
                    slot.draining.append(h)
        for h in slot.draining:
            h.settle()
        slot.handles, slot.issue_seq, slot.draining, slot.waited = {}, {}, [], set()
        slot.layer, slot.released = layer, False
        return slot

    def _issue(self, slot: _Slot, layer: int, expert: int) -> None:
        pos = self._position[layer][expert]
        base = pos * self.expert_numel
        src = self._host_flat[layer]
        handles = []
        for k, start in enumerate(range(0, self.expert_numel, self.packet_numel)):
            end = min(start + self.packet_numel, self.expert_numel)
            handles.append(self.backend.copy_async(
                slot.flat[base + start:base + end], src[base + start:base + end],
                label=f"L{layer} E{expert} p{k}", after=slot.free_after))
        slot.handles[expert] = handles
        slot.issue_seq[expert] = self._seq
        self._seq += 1
        self.stats.bytes_issued += self.expert_bytes
        self.stats.experts_streamed += 1

    def wait(self, layer: int, expert: int) -> ExpertWeights:
        """The expert's device weights, blocking only on its own pages (issued now if needed)."""
        if self.is_resident(layer, expert):
            return self.device_weights.layers[layer].experts[expert]
        slot = self._slot_of(layer)
        if slot is None or expert not in slot.handles:
            self.stats.experts_on_demand += 1
            self.prefetch(layer, [expert])
            slot = self._slot_of(layer)
        t0 = time.perf_counter()
        slot.waited.add(expert)
        for h in slot.handles[expert]:
            self.backend.compute_after(h)
        self.stats.wait_s += time.perf_counter() - t0
        return self._view(slot.flat, self._position[layer][expert])

    def cancel(self, layer: int, expert: int) -> None:
        """Drop the expert's queued packets (it will run on the CPU instead), unless launched
        work already waits for them."""
        slot = self._slot_of(layer)
        if slot is None or expert not in slot.handles or expert in slot.waited:
            return
        for h in slot.handles.pop(expert):
            if h.cancel():
                self.stats.bytes_cancelled += h.nbytes
            else:
                slot.draining.append(h)
        slot.issue_seq.pop(expert, None)

    def release(self, layer: int) -> None:
        """The layer's compute has been launched: its ring slot may be refilled once the compute
        stream has run it (call it after the slot's last reader was launched)."""
        slot = self._slot_of(layer)
        if slot is not None:
            slot.free_after = self.backend.record_compute_event()
            slot.released = True
            self._releases += 1
            slot.released_at = self._releases

    def cancel_all(self) -> None:
        """Drop every queued packet (end of a run, or a failed step after its device work was
        waited for: no launched work may still wait for pages) and wait for those in the link."""
        for slot in self._slots:
            for handles in slot.handles.values():
                for h in handles:
                    if not h.cancel():
                        h.settle()
            for h in slot.draining:
                h.settle()
            slot.handles, slot.issue_seq, slot.draining, slot.waited = {}, {}, [], set()
            if not slot.released:  # dropped without a release: its readers may still run
                slot.free_after = self.backend.record_compute_event()
            slot.layer, slot.released = None, True
