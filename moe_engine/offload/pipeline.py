"""One model step with weight paging, CPU attention and the link working at once (CGOPipe).

Per layer i, over the step's micro-batches j (prefill and decode alike, layer by layer over all
micro-batches: FlexGen's zig-zag order):
1. the pages of layer i+1 are queued at the start of layer i (the last layer queues layer 0 of
   the next step), so they land while layer i computes;
2. for each j: wait for CPU attention of j, run the device post-attention dense part (O proj,
   residual, post norm, router) of j while the CPU attends j+1;
3. the MoE FFN of the layer runs grouped by expert over all micro-batches (Klotski 5): resident
   experts first, hottest first, then streamed experts in arrival order; a streamed expert runs
   on the CPU instead when Twiddler's latency rule says so (it then never crosses the link);
4. for each j: device pre-attention (norm, QKV, RoPE) of layer i+1, then its attention goes to
   the CPU worker at once, so the CPU attends j while the device projects j+1.

With `group_ffn="micro_batch"` the FFN instead runs per micro-batch right after its dense part
(Lightning's order: post-attention of j, pre-attention of j for the next layer, CPU attention
of j+1 meanwhile), still expert by expert and hot first.

The device is the backend's compute stream: device work is `launch`ed onto it (inline on the
CPU backend and on CUDA, where kernels are asynchronous anyway; on its own thread on the test
backend `AsyncCpuBackend`), and the host reads what it computed only after `host_sync` (the
router's choices before placing experts, q/k/v before CPU attention, the logits). CPU attention
and CPU experts run on one worker thread; the link is the backend's copy worker. Every part of
the math is a public step of the ModelRunner (embed, pre_attention, attend, post_attention, ffn,
lm_head); this module only decides where and in which order they run, and computes the routed
experts one at a time where their weights are.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

import torch

from moe_engine.engine.model_runner import Activation, MicroBatchInput, ModelRunner, Routed
from moe_engine.model.layers import moe_ffn
from moe_engine.model.weights import ExpertWeights
from moe_engine.offload.pager import WeightPager
from moe_engine.offload.placement import ExpertPlacer, Place
from moe_engine.offload.trace import Trace

DEVICE_LANE, CPU_LANE, WAIT_LANE = "device", "cpu", "wait"


@dataclass
class OffloadStats:
    """Where a step's time and bytes went (summed over steps by `add`)."""

    steps: int = 0
    transfer_wait_time_s: float = 0.0  # device side blocked on weight pages
    device_compute_time_s: float = 0.0  # device-side work, waits excluded (host issue time on CUDA)
    cpu_attention_time_s: float = 0.0
    cpu_expert_time_s: float = 0.0
    cpu_wait_time_s: float = 0.0  # device side blocked on CPU attention / CPU experts
    bytes_moved: int = 0  # weight bytes that crossed the link
    experts_on_cpu: int = 0  # (layer, expert) computations placed on the CPU
    experts_on_device: int = 0
    experts_streamed: int = 0  # experts whose pages were issued (prefetched or on demand)
    disk_bytes_read: int = 0  # disk tier: expert bytes read from disk
    disk_busy_time_s: float = 0.0  # disk tier: time the reader spent in reads

    def add(self, other: "OffloadStats") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    def since(self, earlier: "OffloadStats") -> "OffloadStats":
        """What was added after `earlier` (a copy of these totals taken before)."""
        now, then = asdict(self), asdict(earlier)
        return OffloadStats(**{k: now[k] - then[k] for k in now})

    def to_dict(self) -> dict:
        return asdict(self)


class OffloadPipeline:
    """Drop-in for ModelRunner.forward that pages experts through a WeightPager."""

    def __init__(self, runner: ModelRunner, pager: WeightPager, placer: ExpertPlacer,
                 attention_on_device: bool = False, group_ffn: str = "layer",
                 trace: Optional[Trace] = None):
        if group_ffn not in ("layer", "micro_batch"):
            raise ValueError(f"group_ffn must be 'layer' or 'micro_batch', got {group_ffn!r}")
        self.runner = runner
        self.pager = pager
        self.placer = placer
        self.backend = pager.backend
        self.attention_on_device = attention_on_device
        self.group_ffn = group_ffn
        self.trace = trace or Trace(enabled=False)
        self.spec = runner.spec
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-worker")
        self.totals = OffloadStats()
        self.last_step = OffloadStats()
        self._step = OffloadStats()
        self._first_prefetch_done = False
        self._inflight: list[Future] = []  # CPU tasks submitted during the current step
        # (layer, expert, tokens, bytes still to move, place) of the last step, in decision order.
        self.last_decisions: list[tuple[int, int, int, int, Place]] = []

    # The engine reads these from its runner.
    @property
    def times(self):
        return self.runner.times

    @times.setter
    def times(self, value) -> None:
        self.runner.times = value

    @property
    def attention(self):
        return self.runner.attention

    @property
    def routing_observer(self):
        return self.runner.routing_observer

    @routing_observer.setter
    def routing_observer(self, value) -> None:
        self.runner.routing_observer = value

    def close(self) -> None:
        """Stop the CPU worker and drop queued pages (the pager's copy worker stays up)."""
        self._cpu.shutdown(wait=True)
        self.backend.host_sync()  # no launched work may still read the slots cancel_all frees
        self.pager.cancel_all()

    def forward(self, batches: list[MicroBatchInput]) -> torch.Tensor:
        """Logits [num_seqs, vocab] (fp32, on the host) for the last token of every sequence."""
        try:
            return self._forward(batches)
        except BaseException:
            # CPU tasks of the failed step must not outlive it (they write KV blocks the
            # scheduler is about to hand to other sequences), and its ring slots are claimed.
            for job in self._inflight:
                if not job.cancel():
                    job.exception()
            # Device work of the failed step must not outlive it either (it reads the ring
            # slots cancel_all frees, and writes activations and, on the device, KV blocks);
            # an error of its own is secondary to the one being raised.
            with suppress(Exception):
                self.backend.host_sync()
            self.pager.cancel_all()
            self._first_prefetch_done = False
            raise

    @torch.inference_mode()
    def _forward(self, batches: list[MicroBatchInput]) -> torch.Tensor:
        self._step = OffloadStats(steps=1)
        self._inflight = []
        self.last_decisions = []
        streamed_before = self.pager.stats.experts_streamed
        link_before = self.backend.link_bytes_moved
        disk = self.pager.disk
        disk_before = (disk.bytes_read, disk.busy_s) if disk is not None else (0, 0.0)
        num_layers = self.spec.num_layers
        num_tokens = sum(int(mb.input_ids.numel()) for mb in batches)
        if not self._first_prefetch_done:
            self._prefetch(0, num_tokens)
            self._first_prefetch_done = True
        # The embedding runs on the host thread, not launched: it reads only resident weights
        # and this step's inputs and writes fresh tensors, so no device work orders it, and the
        # Activation objects the launched steps mutate exist from here on.
        acts = []
        with self._device("embed"):
            batches = [self._on_device(mb) for mb in batches]
            for mb in batches:
                acts.append(self.runner.embed(mb))
        pending = [self._pre_attention(0, j, mb, act) for j, (mb, act) in
                   enumerate(zip(batches, acts))]
        for i in range(num_layers):
            nxt = (i + 1) % num_layers  # the last layer prefetches layer 0 of the next step
            if nxt != i:
                self._prefetch(nxt, num_tokens)
            # Filled by launched post-attention work: read on the host after a host_sync only.
            routed: list[Optional[Routed]] = [None] * len(batches)
            for j, (mb, act) in enumerate(zip(batches, acts)):
                self._await_attention(pending[j], act)
                with self._device(f"post L{i} mb{j}"):
                    self.backend.launch(self._post_attention, i, act, routed, j)
                if self.group_ffn == "micro_batch":
                    self._ffn(i, acts, routed, [j])
                    if i + 1 < num_layers:
                        pending[j] = self._pre_attention(i + 1, j, mb, act)
            if self.group_ffn == "layer":
                self._ffn(i, acts, routed, list(range(len(batches))))
            # Every reader of the layer's ring slot has been launched: the release event
            # follows them on the compute stream, and the slot's next fill waits for it.
            self.pager.release(i)
            if nxt == i:  # one layer: its slot is free only now
                self._prefetch(nxt, num_tokens)
            if i + 1 < num_layers and self.group_ffn == "layer":
                pending = [self._pre_attention(i + 1, j, mb, act) for j, (mb, act) in
                           enumerate(zip(batches, acts))]
        logits = self._head(batches, acts)
        self._finish_step(streamed_before, link_before, disk_before)
        return logits

    def _on_device(self, mb: MicroBatchInput) -> MicroBatchInput:
        """The micro-batch's index tensors where the device reads them (identity on CPU).
        Cache indices move too only when attention runs on the device; CPU attention keeps
        the host copies."""
        move = self.backend.activation_to_device
        changes = dict(input_ids=move(mb.input_ids), positions=move(mb.positions),
                       logits_indices=move(mb.logits_indices))
        if self.attention_on_device:
            changes.update(slot_mapping=move(mb.slot_mapping))
            if mb.block_tables is not None:
                changes.update(block_tables=move(mb.block_tables),
                               context_lens=move(mb.context_lens))
            if mb.window_slot_mapping is not None:
                changes.update(window_slot_mapping=move(mb.window_slot_mapping))
            if mb.window_block_tables is not None:
                changes.update(window_block_tables=move(mb.window_block_tables))
        return replace(mb, **changes)

    def _prefetch(self, layer: int, num_tokens: int) -> None:
        pager = self.pager
        freq = pager.profile.frequency(layer)
        expected = num_tokens * self.spec.top_k
        hot = [e for e in pager.streamed[layer] if e not in pager.on_disk[layer]
               and self.placer.should_prefetch(expected * freq[e])]
        # A disk expert can only run once read, so every one the step is likely to route a
        # token to is read ahead (hottest first): a wasted read costs link time in the shadow
        # of compute, a missing one stalls the layer for a whole expert read.
        disk = [e for e in pager.profile.ranking(layer)
                if e in pager.on_disk[layer] and expected * freq[e] >= 0.5]
        pager.prefetch(layer, hot + disk)  # also starts the layer's visit (disk read order)

    def _pre_attention(self, layer: int, j: int, mb: MicroBatchInput, act: Activation) -> Future:
        """Device norm + QKV of micro-batch j; its attention starts at once where it runs."""
        with self._device(f"pre L{layer} mb{j}"):
            self.backend.launch(self.runner.pre_attention, layer, mb, act)
        if self.attention_on_device:
            with self._device(f"attn L{layer} mb{j}"):
                self.backend.launch(self.runner.attend, layer, mb, act)
            done: Future = Future()
            done.set_result(None)
            return done
        # The CPU reads q/k/v: wait for the projection (on CUDA to_host would wait anyway).
        self.backend.host_sync()
        act.q, act.k, act.v = (self.backend.to_host(t) for t in (act.q, act.k, act.v))
        return self._submit_cpu(self._cpu_attention, layer, j, mb, act)

    def _post_attention(self, layer: int, act: Activation, routed: list[Optional[Routed]],
                        j: int) -> None:
        """Launched: the runner's post-attention part, its result stored for later steps."""
        routed[j] = self.runner.post_attention(layer, act)

    def _submit_cpu(self, fn, *args) -> Future:
        job = self._cpu.submit(fn, *args)
        self._inflight.append(job)
        return job

    def _cpu_attention(self, layer: int, j: int, mb: MicroBatchInput, act: Activation) -> None:
        t0 = time.perf_counter()
        with torch.inference_mode():  # inference mode is per thread
            self.runner.attend(layer, mb, act)
        t1 = time.perf_counter()
        self._step.cpu_attention_time_s += t1 - t0
        self.trace.add(CPU_LANE, f"attn L{layer} mb{j}", t0, t1)

    def _await_attention(self, pending: Future, act: Activation) -> None:
        t0 = time.perf_counter()
        pending.result()
        t1 = time.perf_counter()
        self._step.cpu_wait_time_s += t1 - t0
        if not self.attention_on_device:
            act.attn = self.backend.activation_to_device(act.attn)

    def _ffn(self, layer: int, acts: list[Activation], routed: list[Optional[Routed]],
             which: list[int]) -> None:
        """x += FFN(h) for micro-batches `which`: the routed experts one at a time across all of
        them (wherever each one's weights are), then the runner adds the dense part."""
        t0 = time.perf_counter()
        out = None
        if self.spec.is_moe_layer(layer):
            # Placement is decided on the host from the router's choices: wait for them.
            self.backend.host_sync()
            chosen = [routed[j] for j in which]
            out = self._experts(layer, torch.cat([r.expert_input for r in chosen]), chosen)
        t1 = time.perf_counter()
        self.runner.times.ffn_s += t1 - t0  # the runner's ffn times its own part
        with self._device(f"dense ffn L{layer}"):
            self.backend.launch(self._dense_ffn, layer, [acts[j] for j in which], routed, which,
                                out)

    def _dense_ffn(self, layer: int, acts: list[Activation], routed: list[Optional[Routed]],
                   which: list[int], experts_out: Optional[torch.Tensor]) -> None:
        """Launched: the runner's FFN over the micro-batches (routed read when it runs: in a
        dense layer the host never waited for them)."""
        self.runner.ffn(layer, acts, [routed[j] for j in which], experts_out=experts_out)

    def _experts(self, layer: int, h: torch.Tensor, routed: list[Routed]) -> torch.Tensor:
        """Sum of the routed experts' outputs per row of `h` (the Routed.expert_input rows),
        resident and streamed ones on the device, the ones Twiddler places on the CPU there."""
        weights = torch.cat([r.weights for r in routed])
        experts = torch.cat([r.experts for r in routed])
        counts = torch.bincount(experts.reshape(-1), minlength=self.spec.num_experts).tolist()
        device, cpu = self._plan(layer, counts)
        cpu_jobs = [(e, self._submit_cpu(self._cpu_expert, layer, e,
                                         *self._rows(h, weights, experts, e)))
                    for e in cpu]
        # Written only by work launched below, in launch order, and read by the launched FFN.
        out = torch.zeros_like(h)
        for e in device:
            t0 = time.perf_counter()
            w = self.pager.wait(layer, e)  # orders the compute stream after the pages
            t1 = time.perf_counter()
            if t1 - t0 > 1e-4:
                self.trace.add(WAIT_LANE, f"wait L{layer} E{e}", t0, t1)
            self._step.transfer_wait_time_s += t1 - t0
            with self._device(f"expert L{layer} E{e}"):
                tokens, rows, rw = self._rows(h, weights, experts, e)
                self.backend.launch(_add_expert_output, out, tokens, w, rows, rw)
            # Grouped by layer, each expert runs once per step: a disk expert's slot can take
            # the next read once the compute stream has run this FFN. Per micro-batch the next
            # one may need it again: its bytes stay until a read needs the slot.
            self.pager.done(layer, e, again=self.group_ffn == "micro_batch")
        for e, job in cpu_jobs:
            t0 = time.perf_counter()
            tokens, result = job.result()
            self._step.cpu_wait_time_s += time.perf_counter() - t0
            self.backend.launch(_add_rows, out, tokens,
                                self.backend.activation_to_device(result))
        return out

    def _plan(self, layer: int, counts: list[int]) -> tuple[list[int], list[int]]:
        """Device experts in execution order and CPU experts (Twiddler), pages of CPU experts
        cancelled so they do not occupy the link."""
        pager, ranking = self.pager, self.pager.profile.ranking(layer)
        resident, streamed, cpu = [], [], []
        for e in ranking:
            to_move = pager.bytes_to_move(layer, e)
            if pager.is_on_disk(layer, e):  # only where it is read to can it run
                place = Place.device if counts[e] else Place.skip
                if place is Place.skip and self.group_ffn == "layer":
                    pager.cancel(layer, e)  # read ahead for nothing: free its slot
            else:
                place = self.placer.decide(counts[e], pager.is_resident(layer, e), to_move)
            if place is not Place.skip:
                self.last_decisions.append((layer, e, counts[e], to_move, place))
            if place is Place.cpu:
                cpu.append(e)
                pager.cancel(layer, e)
            elif place is Place.device:
                (resident if pager.is_resident(layer, e) else streamed).append(e)
        # Experts not prefetched are requested now, hottest first, behind the prefetched ones.
        for e in streamed:
            if pager.issue_order(layer, e) is None:
                pager.prefetch(layer, [e])
        streamed.sort(key=lambda e: pager.issue_order(layer, e))
        self._step.experts_on_cpu += len(cpu)
        self._step.experts_on_device += len(resident) + len(streamed)
        return resident + streamed, cpu

    @staticmethod
    def _rows(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, slot = (experts == e).nonzero(as_tuple=True)
        return tokens, h[tokens], weights[tokens, slot]

    def _cpu_expert(self, layer: int, e: int, tokens: torch.Tensor, rows: torch.Tensor,
                    rw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            result = _expert_output(self.pager.host_expert(layer, e),
                                    self.backend.to_host(rows), self.backend.to_host(rw))
        t1 = time.perf_counter()
        self._step.cpu_expert_time_s += t1 - t0
        self.trace.add(CPU_LANE, f"cpu-expert L{layer} E{e}", t0, t1)
        return tokens, result

    def _head(self, batches: list[MicroBatchInput], acts: list[Activation]) -> torch.Tensor:
        logits: list[torch.Tensor] = []
        with self._device("head"):
            self.backend.launch(_append, logits, self.runner.lm_head, batches, acts)
        self.backend.host_sync()  # the sampler reads the logits on the host
        return self.backend.to_host(logits[0])

    def _device(self, label: str) -> "_DeviceSpan":
        return _DeviceSpan(self, label)

    def _finish_step(self, streamed_before: int, link_before: int,
                     disk_before: tuple[int, float]) -> None:
        s = self._step
        s.experts_streamed = self.pager.stats.experts_streamed - streamed_before
        s.bytes_moved = self.backend.link_bytes_moved - link_before
        disk = self.pager.disk
        if disk is not None:
            # Reads of the next step's first layer that finished already count here; summed
            # over a run the split does not matter.
            s.disk_bytes_read = disk.bytes_read - disk_before[0]
            s.disk_busy_time_s = disk.busy_s - disk_before[1]
        self.last_step = s
        self.totals.add(s)


class _DeviceSpan:
    """Times a block of device work into the step stats and the trace (the runner's parts
    record their own PhaseTimes)."""

    def __init__(self, pipe: OffloadPipeline, label: str):
        self.pipe, self.label = pipe, label

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        t1 = time.perf_counter()
        self.pipe._step.device_compute_time_s += t1 - self.t0
        self.pipe.trace.add(DEVICE_LANE, self.label, self.t0, t1)
        return False


def _add_expert_output(out: torch.Tensor, tokens: torch.Tensor, expert: ExpertWeights,
                       rows: torch.Tensor, rw: torch.Tensor) -> None:
    """Launched: out[tokens] += rw * expert(rows), reading the expert's (ring) pages."""
    out.index_add_(0, tokens, _expert_output(expert, rows, rw))


def _add_rows(out: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> None:
    """Launched: out[tokens] += rows (a CPU expert's result, in stream order with the others)."""
    out.index_add_(0, tokens, rows)


def _append(results: list, fn: Callable[..., torch.Tensor], *args) -> None:
    """Launched: keep fn's result where the host finds it after a host_sync."""
    results.append(fn(*args))


def _expert_output(expert: ExpertWeights, rows: torch.Tensor, rw: torch.Tensor) -> torch.Tensor:
    """rw * SwiGLU_expert(rows), via layers.moe_ffn on a one-expert list (the math lives there)."""
    idx = torch.zeros(rows.shape[0], 1, dtype=torch.int64, device=rows.device)
    return moe_ffn([expert], rows, rw.reshape(-1, 1), idx)
