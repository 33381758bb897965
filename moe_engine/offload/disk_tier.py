"""The disk tier: experts that stay on disk, read on demand into a ring of expert slots in RAM.

Host memory holds the dense weights, the hottest experts (the host tier) and a ring of
`num_slots` expert-sized, page-aligned slots; every other expert is read into a slot when a step
needs it and the slot is reused once the expert has been computed. Slots are expert-sized, not
layer-sized (the device ring's unit), because the budgets this tier exists for are smaller than
two layers of experts: small-mixtral has 176 MB of experts per layer and a 300 MB budget.

Reads go through a `CopyWorker` (the same bounded-packet link the device tier uses) whose copy is
an O_DIRECT read (offload/disk.py), in the order the step will consume the experts: every request
carries an `order` (layer visit, then hotness rank), the earliest pending request gets the next
free slot, and when none is free it takes the slot of the latest-ordered expert not yet in use
(that one is requested again later). So the next layer's reads fill whatever the current layer
leaves free, yet never starve the current layer: no order of requests can deadlock the ring.

A slot is rewritten only after `release`, and its next read waits on the compute event given
there (recorded after the slot's last reader was launched): on the CPU backend that event has
passed already (compute runs on the calling thread); on an asynchronous backend the reader
thread waits for it, so a read never lands under an expert still being computed.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from moe_engine.model.weights import ExpertWeights
from moe_engine.offload.backend import ComputeEvent, CopyHandle, CopyWorker
from moe_engine.offload.disk import DirectReader, DiskRead, aligned_empty
from moe_engine.offload.expert_store import ExpertSource
from moe_engine.offload.trace import Trace

DISK_LANE = "disk"
_LAST = (float("inf"),)  # the order of an unpinned expert: later than every request
Key = tuple[int, int]  # (layer, expert)


@dataclass
class DiskStats:
    """Counters since construction (the pipeline takes differences per step)."""

    reads: int = 0  # experts whose reads were issued
    evictions: int = 0  # requested experts whose slot went to an earlier one
    wait_s: float = 0.0  # time the compute side blocked on reads


@dataclass
class _RingSlot:
    flat: torch.Tensor
    key: Optional[Key] = None
    order: tuple = ()
    handles: list[CopyHandle] = field(default_factory=list)
    in_use: bool = False
    free_after: Optional[ComputeEvent] = None  # the last reader's compute event


class DiskTier:
    """Experts of `source` read on demand into `num_slots` ring slots of `source.layout`."""

    def __init__(self, source: ExpertSource, num_slots: int, packet_bytes: int = 16 << 20,
                 reader: Optional[DirectReader] = None, trace: Optional[Trace] = None):
        if num_slots < 1:
            raise ValueError(f"the disk tier needs at least one ring slot, got {num_slots}")
        self.source = source
        self.layout = source.layout
        self.reader = reader or DirectReader()
        source.check(self.reader)
        self.packet_bytes = packet_bytes
        self.buffer = aligned_empty(num_slots * self.layout.nbytes)
        nb = self.layout.nbytes
        self._slots = [_RingSlot(self.buffer[i * nb:(i + 1) * nb]) for i in range(num_slots)]
        self._held: dict[Key, _RingSlot] = {}
        self._pending: dict[Key, tuple] = {}  # requested, no slot yet: key -> order
        self._lock = threading.RLock()
        self.stats = DiskStats()
        self._worker = CopyWorker(self._transfer, trace, "disk-reader", lane=DISK_LANE)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def ring_bytes(self) -> int:
        return self.buffer.numel()

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    @property
    def busy_s(self) -> float:
        return self._worker.busy_s

    def _transfer(self, dst: torch.Tensor, src: DiskRead, handle: CopyHandle,
                  after: Optional[ComputeEvent]) -> None:
        if after is not None:  # the slot's last reader must have run before its bytes change
            after.synchronize()
        self.reader.read_into(dst, src)

    def holds(self, layer: int, expert: int) -> bool:
        """Whether the expert has a slot (its reads issued, maybe landed)."""
        with self._lock:
            return (layer, expert) in self._held

    def requested(self, layer: int, expert: int) -> bool:
        """Whether the expert has a slot or waits for one."""
        with self._lock:
            return (layer, expert) in self._held or (layer, expert) in self._pending

    def request(self, layer: int, expert: int, order: tuple) -> None:
        """Read the expert ahead of use; `order` says when it will be needed (lower first)."""
        key = (layer, expert)
        with self._lock:
            slot = self._held.get(key)
            if slot is not None:
                slot.order = min(slot.order, order)
                return
            self._pending[key] = min(order, self._pending.get(key, order))
            self._fill()

    def wait(self, layer: int, expert: int, order: tuple) -> ExpertWeights:
        """The expert's weights in its slot, blocking only on its own reads; the slot stays the
        expert's until `release`."""
        return self.layout.view(self.wait_bytes(layer, expert, order))

    def wait_bytes(self, layer: int, expert: int, order: tuple) -> torch.Tensor:
        """`wait`, returning the slot's flat bytes (what a further copy moves)."""
        key = (layer, expert)
        self.request(layer, expert, order)
        with self._lock:
            slot = self._held.get(key)
            if slot is None:
                # Needed now: it takes the slot of any expert not being computed, whatever that
                # one's order (read-ahead of a later layer, or one unpinned by `unpin`).
                slot = self._victim(later_than=None)
                if slot is None:
                    busy = sorted(k for k, s in self._held.items() if s.in_use)
                    raise RuntimeError(
                        f"disk tier: no ring slot for layer {layer} expert {expert}: all "
                        f"{self.num_slots} are in use by {busy} (release experts after "
                        f"computing them, or give the ring more slots)")
                self._assign(slot, key, order)
            slot.in_use = True
            handles = list(slot.handles)
        t0 = time.perf_counter()
        try:
            for h in handles:
                h.wait()
        except BaseException:
            self.release(layer, expert)  # a failed read must not keep its slot
            raise
        self.stats.wait_s += time.perf_counter() - t0
        return slot.flat

    def release(self, layer: int, expert: int, after: Optional[ComputeEvent] = None) -> None:
        """The expert's compute was launched (or it is not needed): its slot may take another
        expert, whose read waits for `after` (None: nothing reads the slot any more)."""
        with self._lock:
            self._pending.pop((layer, expert), None)
            slot = self._held.get((layer, expert))
            if slot is not None:
                self._vacate(slot, after)
            self._fill()

    def unpin(self, layer: int, expert: int, after: Optional[ComputeEvent] = None) -> None:
        """The expert's compute was launched but it may be needed again soon (the next
        micro-batch of the layer): its bytes stay, and its slot is the first any other read
        takes, once the compute stream passed `after`."""
        with self._lock:
            slot = self._held.get((layer, expert))
            if slot is None:
                return
            slot.in_use = False
            slot.order = _LAST
            if after is not None:
                slot.free_after = after
            self._fill()

    def release_layer(self, layer: int, after: Optional[ComputeEvent] = None) -> None:
        """Drop every read of `layer` still held or pending (experts it did not use)."""
        with self._lock:
            for key in [k for k in self._pending if k[0] == layer]:
                del self._pending[key]
            for key in [k for k in self._held if k[0] == layer]:
                self._vacate(self._held[key], after)
            self._fill()

    def cancel_all(self) -> None:
        """Drop every read (end of a run, or a failed step) and wait for the one in flight."""
        with self._lock:
            self._pending.clear()
            for slot in list(self._held.values()):
                self._vacate(slot)

    def close(self) -> None:
        self.cancel_all()
        self._worker.close()
        self.reader.close()

    # ------------------------------------------------------------------ slot assignment

    def _vacate(self, slot: _RingSlot, after: Optional[ComputeEvent] = None) -> None:
        for h in slot.handles:
            if not h.cancel():
                h.settle()  # a packet in flight lands before its bytes can be overwritten
        if slot.key is not None:
            self._held.pop(slot.key, None)
        if after is not None:
            slot.free_after = after
        slot.key, slot.order, slot.handles, slot.in_use = None, (), [], False

    def _fill(self) -> None:
        """Give slots to pending requests, earliest order first, evicting later-ordered
        experts that are not in use when no slot is free."""
        while self._pending:
            key = min(self._pending, key=self._pending.__getitem__)
            order = self._pending[key]
            slot = self._victim(later_than=order)
            if slot is None:
                return
            self._assign(slot, key, order)

    def _victim(self, later_than: Optional[tuple]) -> Optional[_RingSlot]:
        """A free slot, else the slot of the latest-ordered expert not in use (and ordered
        after `later_than`, unless that is None), else None."""
        free = next((s for s in self._slots if s.key is None), None)
        if free is not None:
            return free
        victims = [s for s in self._slots
                   if not s.in_use and (later_than is None or s.order > later_than)]
        return max(victims, key=lambda s: s.order) if victims else None

    def _assign(self, slot: _RingSlot, key: Key, order: tuple) -> None:
        """Give `slot` to `key`: its occupant, if any, is requested again for later."""
        if slot.key is not None:
            self._pending[slot.key] = slot.order
            self.stats.evictions += 1
            self._vacate(slot)
        self._pending.pop(key, None)
        self._issue(slot, key, order)

    def _issue(self, slot: _RingSlot, key: Key, order: tuple) -> None:
        layer, expert = key
        slot.key, slot.order, slot.in_use = key, order, False
        slot.handles = [self._worker.submit(slot.flat, part, f"disk L{layer} E{expert} p{k}",
                                            urgent=False, after=slot.free_after, rank=order)
                        for k, part in enumerate(self.source.read(layer, expert)
                                                 .split(self.packet_bytes))]
        self._held[key] = slot
        self.stats.reads += 1


# A ring of fewer slots than this cannot read ahead while it computes (one slot computing, the
# rest reading), so the budget buys ring slots before it buys host-resident experts.
MIN_RING_SLOTS = 4


@dataclass(frozen=True)
class HostTierPlan:
    """How host memory splits between resident experts and the disk tier's ring."""

    host_experts: int  # per MoE layer, the hottest ones
    num_experts: int
    ring_slots: int  # 0 when every expert is in host memory

    @property
    def ratio(self) -> float:
        """r_host: the fraction the pager's `resident_set(layer, ratio)` rounds back to
        host_experts."""
        return self.host_experts / self.num_experts


def plan_host_tier(dense_bytes: int, expert_bytes: int, num_moe_layers: int, num_experts: int,
                   host_ratio: Optional[float] = None, budget_bytes: Optional[int] = None,
                   reserved_bytes: int = 0) -> HostTierPlan:
    """Experts per layer held in host memory and the ring's slots, within `budget_bytes` (the
    host budget: dense weights + host experts + ring + `reserved_bytes`, the rest of what the
    engine keeps besides its KV cache: RoPE tables, a step's activations).

    With `host_ratio` the host tier is round(host_ratio * E) experts and the ring takes what
    the budget leaves, at most two layers' worth of disk experts (no budget: exactly that);
    without, the host tier is the most experts that leave the ring MIN_RING_SLOTS slots (or
    every disk expert of a layer, when fewer). Raises naming engine.host_memory_gb when not
    even one ring slot fits.
    """
    def ring_for(k: int) -> int:
        on_disk = num_experts - k
        if on_disk == 0:
            return 0
        if budget_bytes is None:
            return 2 * on_disk
        left = budget_bytes - dense_bytes - reserved_bytes - k * num_moe_layers * expert_bytes
        return max(0, min(2 * on_disk, left // expert_bytes))

    if host_ratio is not None:
        k = round(host_ratio * num_experts)
        ring = ring_for(k)
        if k < num_experts and ring < 1:
            raise ValueError(
                f"engine.host_memory_gb={budget_bytes / 1e9:g}: the dense weights "
                f"({dense_bytes / 1e6:.0f} MB), a step's activations ({reserved_bytes / 1e6:.0f} "
                f"MB) and {k} host experts per layer "
                f"({k * num_moe_layers * expert_bytes / 1e6:.0f} MB) leave no room for one "
                f"{expert_bytes / 1e6:.1f} MB disk read slot; lower engine.host_resident_ratio "
                f"or raise the budget")
        if budget_bytes is not None and k == num_experts and \
                dense_bytes + reserved_bytes + k * num_moe_layers * expert_bytes > budget_bytes:
            raise ValueError(f"engine.host_memory_gb={budget_bytes / 1e9:g} cannot hold every "
                             f"expert (engine.host_resident_ratio={host_ratio}): "
                             f"{(dense_bytes + reserved_bytes + k * num_moe_layers * expert_bytes) / 1e6:.0f} MB")
        return HostTierPlan(k, num_experts, ring)
    if budget_bytes is None:
        raise ValueError("the disk tier needs engine.host_resident_ratio or engine.host_memory_gb")
    for k in range(num_experts, -1, -1):
        ring = ring_for(k)
        if k == num_experts:
            if dense_bytes + reserved_bytes + k * num_moe_layers * expert_bytes <= budget_bytes:
                return HostTierPlan(k, num_experts, 0)
            continue
        if ring >= min(MIN_RING_SLOTS, num_experts - k):
            return HostTierPlan(k, num_experts, ring)
    ring = ring_for(0)
    if ring < 1:
        raise ValueError(
            f"engine.host_memory_gb={budget_bytes / 1e9:g}: the dense weights alone take "
            f"{dense_bytes / 1e6:.0f} MB and a step's activations {reserved_bytes / 1e6:.0f} MB, leaving no room for one {expert_bytes / 1e6:.1f} MB "
            f"disk read slot")
    return HostTierPlan(0, num_experts, ring)
