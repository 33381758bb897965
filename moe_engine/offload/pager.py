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
- With a disk tier (offload/disk_tier.py), experts the loader left on disk (None in the model's
  weights) are read into the disk tier's RAM ring in the order the step consumes them. On a
  backend whose device is the host (CPU) the ring slot is what computes; on CUDA a landed slot
  is copied into the device ring like a host-store expert (disk -> host -> device).
- An expert is one flat byte buffer in `ExpertLayout` (its w13, w2 and, quantized, scales;
  GPT-OSS's biases too), the same unit in the host store, the device ring and the disk tier.

Every device byte is reserved up front against the budget; nothing is allocated per step, so
the high-water mark is the reservation and a budget that is too small fails at construction.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch


from moe_engine.model.weights import ExpertWeights, LayerWeights, ModelWeights
from moe_engine.offload.backend import Backend, ComputeEvent, CopyHandle
from moe_engine.offload.disk_tier import DiskTier
from moe_engine.offload.expert_store import ExpertLayout
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
                 budget_bytes: Optional[int] = None, disk: Optional[DiskTier] = None,
                 host_copies_of_resident: bool = True):
        """`host_copies_of_resident=False` frees the host copy of each expert placed on a device
        apart from the host: only the device runs it then (engine.ffn_on_device), and the
        performance model counts host memory for the experts not resident on the device."""
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
        if profile.num_layers != len(layers) or profile.num_experts != len(first):
            raise ValueError("routing profile shape does not match the model")
        self.backend = backend
        self.profile = profile
        self.resident_ratio = resident_ratio
        self.disk = disk
        # Experts the loader left on disk: None in the weights, read through the disk tier.
        self.on_disk = [frozenset(e for e, x in enumerate(layer.experts) if x is None)
                        for layer in layers]
        present = [x for layer in layers for x in layer.experts if x is not None]
        if any(self.on_disk) and disk is None:
            raise ValueError("experts were left on disk but no disk tier reads them")
        self.layout = ExpertLayout.of(present[0]) if present else disk.layout
        if disk is not None and disk.layout != self.layout:
            raise ValueError(f"the disk tier's expert layout {disk.layout} differs from the "
                             f"loaded experts' {self.layout}")
        self.expert_bytes = self.layout.nbytes
        self.packet_bytes = packet_bytes

        self.resident = [profile.resident_set(i, resident_ratio) if i in moe_layers
                         else frozenset() for i in range(len(layers))]
        for i, res in enumerate(self.resident):
            if res & self.on_disk[i]:
                raise ValueError(f"layer {i}: experts {sorted(res & self.on_disk[i])} are to be "
                                 f"resident on the device but were left on disk (the device tier "
                                 f"must be inside the host tier: resident_ratio <= host ratio)")
        # Streamed experts of each layer, hottest first: their order in the ring. Disk experts
        # stream through the device ring only when the device is not the host itself.
        via_ring = not backend.device_is_host
        self.streamed = [[e for e in profile.ranking(i) if e not in self.resident[i]
                          and (via_ring or e not in self.on_disk[i])]
                         if i in moe_layers else [] for i in range(len(layers))]
        slot_experts = max((len(s) for s in self.streamed), default=0)

        self.ledger = DeviceLedger(budget_bytes)
        self._check_budget(weights, slot_experts)
        self.device_weights = self._place_resident(weights)
        self.host_experts = self._pack_host_store(
            weights, drop_resident=not host_copies_of_resident and not backend.device_is_host)
        self.ledger.reserve(2 * slot_experts * self.expert_bytes, "page ring")
        self._slots = [_Slot(backend.empty(slot_experts * self.expert_bytes, torch.uint8))
                       for _ in range(2)] if slot_experts else []
        self._position = [{e: p for p, e in enumerate(s)} for s in self.streamed]
        self._seq = 0
        self._releases = 0
        # Disk reads are ordered by layer visit (prefetch order), then hotness.
        self._visits = 0
        self._visit_of: dict[int, int] = {}
        self._rank = [{e: r for r, e in enumerate(profile.ranking(i))}
                      for i in range(len(layers))]
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
            experts = [x.map(lambda t, i=i, e=e: self._to_device(t, f"layer {i} expert {e}"))
                       if e in self.resident[i] else None
                       for e, x in enumerate(layer.experts)]
            layers.append(LayerWeights(dense, experts))
        return ModelWeights(embed=embed, final_norm=self._to_device(weights.final_norm, "norm"),
                            lm_head=lm_head, layers=layers)

    def _pack_host_store(self, weights: ModelWeights,
                         drop_resident: bool) -> list[list[Optional[ExpertWeights]]]:
        """Every expert's host weights (None for disk experts, and for device-resident ones
        when `drop_resident`); streamed ones in host memory repacked contiguously per layer,
        hottest first, so a layer's transfer is one contiguous range cut into packets."""
        self._host_flat: list[torch.Tensor] = []
        self._host_pos: list[dict[int, int]] = []
        host = []
        for i, layer in enumerate(weights.layers):
            experts = list(layer.experts)
            in_host = [e for e in self.streamed[i] if e not in self.on_disk[i]]
            flat = torch.empty(len(in_host) * self.expert_bytes, dtype=torch.uint8)
            for p, e in enumerate(in_host):
                self.layout.write(experts[e], self._bytes(flat, p))
            flat = self.backend.host_store(flat)
            self._host_flat.append(flat)
            self._host_pos.append({e: p for p, e in enumerate(in_host)})
            for p, e in enumerate(in_host):
                experts[e] = self._view(flat, p)
                # The model's own copy is dropped so host memory holds one copy of each expert.
                layer.experts[e] = experts[e]
            if drop_resident:
                for e in self.resident[i]:
                    experts[e] = layer.experts[e] = None
            host.append(experts)
        return host

    def _bytes(self, flat: torch.Tensor, position: int) -> torch.Tensor:
        return flat[position * self.expert_bytes:(position + 1) * self.expert_bytes]

    def _view(self, flat: torch.Tensor, position: int) -> ExpertWeights:
        return self.layout.view(self._bytes(flat, position))

    def is_resident(self, layer: int, expert: int) -> bool:
        return expert in self.resident[layer]

    @property
    def ring_bytes(self) -> int:
        return sum(s.flat.nbytes for s in self._slots)

    def host_expert(self, layer: int, expert: int) -> ExpertWeights:
        """The expert's weights in host memory (for CPU compute); not for disk experts."""
        x = self.host_experts[layer][expert]
        if x is None:
            where = "on the device only" if expert in self.resident[layer] else "on disk"
            raise ValueError(f"layer {layer} expert {expert} is {where}: it is computed where "
                             f"it is, never from the host store")
        return x

    def is_on_disk(self, layer: int, expert: int) -> bool:
        return expert in self.on_disk[layer]

    def _visit(self, layer: int) -> int:
        """The layer's visit number: assigned at its first prefetch (or wait) since its last
        release, so layers are numbered in the order the step reaches them."""
        visit = self._visit_of.get(layer)
        if visit is None:
            visit = self._visit_of[layer] = self._visits
            self._visits += 1
        return visit

    def _order(self, layer: int, expert: int) -> tuple[int, int]:
        """When the step needs the expert: its layer's visit, then its hotness rank."""
        return self._visit(layer), self._rank[layer][expert]

    def bytes_to_move(self, layer: int, expert: int) -> int:
        """Bytes of the expert not yet on the device (0 for resident or landed experts)."""
        if self.is_resident(layer, expert):
            return 0
        if expert in self.on_disk[layer] and self.backend.device_is_host:
            return self.expert_bytes  # read from disk: nowhere else to compute it
        slot = self._slot_of(layer)
        handles = slot.handles.get(expert) if slot is not None else None
        if handles is None:
            return self.expert_bytes
        return sum(h.nbytes for h in handles if not h.done())

    def issue_order(self, layer: int, expert: int) -> Optional[tuple[int, int]]:
        """When the expert's pages arrive relative to the layer's others (arrival order), None
        if not issued. Disk reads land after the host store's copies, in hotness order."""
        if expert in self.on_disk[layer] and (self.backend.device_is_host
                                              or self.disk.requested(layer, expert)):
            # Disk reads land after the host store's copies, in hotness order (on CUDA the
            # device copy of a disk expert is issued when it is waited for).
            return (1, self._rank[layer][expert]) if self.disk.requested(layer, expert) else None
        slot = self._slot_of(layer)
        seq = None if slot is None else slot.issue_seq.get(expert)
        return None if seq is None else (0, seq)

    def _slot_of(self, layer: int) -> Optional[_Slot]:
        for slot in self._slots:
            if slot.layer == layer and not slot.released:
                return slot
        return None

    def prefetch(self, layer: int, experts: Optional[Iterable[int]] = None) -> None:
        """Queue the pages of `layer`'s streamed experts (default: all, hottest first); disk
        experts are read into the disk tier (on CUDA their device copy waits for `wait`)."""
        self._visit(layer)  # the layer's visit starts now, before any later layer's
        if experts is None:
            experts = list(self.streamed[layer]) + sorted(
                self.on_disk[layer] - set(self.streamed[layer]), key=self._rank[layer].get)
        experts = [e for e in experts if not self.is_resident(layer, e)]
        for e in experts:
            if e in self.on_disk[layer]:
                self.disk.request(layer, e, self._order(layer, e))
        ring = [e for e in experts if e in self._position[layer] and e not in self.on_disk[layer]]
        if not ring or not self._slots:
            return
        slot = self._claim(layer)
        for e in ring:
            if e not in slot.handles:
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

    def _issue(self, slot: _Slot, layer: int, expert: int,
               src: Optional[torch.Tensor] = None) -> None:
        """Queue the expert's packets into its ring position, from the host store or from
        `src` (its landed disk-tier slot)."""
        dst = self._bytes(slot.flat, self._position[layer][expert])
        if src is None:
            src = self._bytes(self._host_flat[layer], self._host_pos[layer][expert])
        handles = []
        for k, start in enumerate(range(0, self.expert_bytes, self.packet_bytes)):
            end = min(start + self.packet_bytes, self.expert_bytes)
            handles.append(self.backend.copy_async(dst[start:end], src[start:end],
                                                   label=f"L{layer} E{expert} p{k}",
                                                   after=slot.free_after))
        slot.handles[expert] = handles
        slot.issue_seq[expert] = self._seq
        self._seq += 1
        self.stats.bytes_issued += self.expert_bytes
        self.stats.experts_streamed += 1

    def wait(self, layer: int, expert: int) -> ExpertWeights:
        """The expert's device weights, blocking only on its own pages (issued now if needed).
        A disk expert holds its disk-tier slot until `done`."""
        if self.is_resident(layer, expert):
            return self.device_weights.layers[layer].experts[expert]
        disk = expert in self.on_disk[layer]
        if disk and self.backend.device_is_host:
            if not self.disk.holds(layer, expert):
                self.stats.experts_on_demand += 1
            t0 = time.perf_counter()
            weights = self.disk.wait(layer, expert, self._order(layer, expert))
            self.stats.wait_s += time.perf_counter() - t0
            return weights
        slot = self._slot_of(layer)
        if slot is None or expert not in slot.handles:
            self.stats.experts_on_demand += 1
            self.prefetch(layer, [expert])
            slot = self._claim(layer)
        t0 = time.perf_counter()
        slot.waited.add(expert)
        from_disk = disk and expert not in slot.handles
        if from_disk:  # disk -> host slot -> device ring
            landed = self.disk.wait_bytes(layer, expert, self._order(layer, expert))
            self._issue(slot, layer, expert, src=landed)
        for h in slot.handles[expert]:
            self.backend.compute_after(h)
        if from_disk:  # the device copy was the disk slot's only reader, and it has landed
            self.disk.release(layer, expert)
        self.stats.wait_s += time.perf_counter() - t0
        return self._view(slot.flat, self._position[layer][expert])

    def done(self, layer: int, expert: int, again: bool = False) -> None:
        """The expert's compute has been launched: a disk expert's slot may take another read
        once the compute stream has run it (the read waits on an event recorded now). With
        `again` (another micro-batch of the layer may route to it) its bytes stay until a read
        needs the slot."""
        if self.disk is not None and expert in self.on_disk[layer] and \
                self.backend.device_is_host:
            event = self.backend.record_compute_event()
            if again:
                self.disk.unpin(layer, expert, after=event)
            else:
                self.disk.release(layer, expert, after=event)

    def cancel(self, layer: int, expert: int) -> None:
        """Drop the expert's queued packets (it will run on the CPU instead, or not at all this
        step), unless launched work already waits for them. A disk expert gives up its
        disk-tier slot: an unused read must not hold a slot the layer's other experts are
        waiting for."""
        if self.disk is not None and expert in self.on_disk[layer]:
            self.disk.release(layer, expert, after=self.backend.record_compute_event())
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
        self._visit_of.pop(layer, None)
        if self.disk is not None:
            self.disk.release_layer(layer, after=self.backend.record_compute_event())

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
        self._visit_of.clear()
        if self.disk is not None:
            self.disk.cancel_all()
