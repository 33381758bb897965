"""Backend copies: bytes land, handles complete, urgent copies pass queued weight packets,
cancelled copies never move, the emulated link is as slow as it says. Compute ordering: launched
work, compute events, copies after an event and compute after a copy, on the synchronous CPU
backend, the asynchronous CPU test backend and (with a GPU) CUDA."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from moe_engine.offload.async_cpu import AsyncCpuBackend
from moe_engine.offload.backend import (ComputeEvent, CopyCancelled, CpuBackend, cuda_available,
                                        make_backend)
from moe_engine.offload.trace import Trace


@pytest.fixture
def backend():
    b = CpuBackend()
    yield b
    b.close()


def test_copy_lands_the_bytes_and_counts_them(backend):
    src = torch.randn(1000)
    dst = backend.empty(1000, torch.float32)
    handle = backend.copy_async(dst, src, label="x")
    handle.wait()
    assert handle.done()
    assert torch.equal(dst, src)
    assert backend.link_bytes_moved == src.nbytes


def test_emulated_link_takes_bytes_over_bandwidth():
    trace = Trace()
    b = CpuBackend(emulated_link_gbps=0.01, trace=trace)  # 10 MB/s
    try:
        src = torch.zeros(250_000)  # 1 MB -> 100 ms
        t0 = time.perf_counter()
        b.copy_async(b.empty(src.numel(), src.dtype), src).wait()
        elapsed = time.perf_counter() - t0
        assert elapsed >= 0.1
        assert len(trace.spans("copy")) == 1
        assert trace.spans("copy")[0].duration >= 0.1
    finally:
        b.close()


@pytest.mark.timing
def test_urgent_copy_waits_for_at_most_one_packet():
    b = CpuBackend(emulated_link_gbps=0.01)
    try:
        packet = torch.zeros(50_000)  # 200 kB -> 20 ms each
        ring = b.empty(20 * packet.numel(), packet.dtype)
        layer = [b.copy_async(ring[i * packet.numel():(i + 1) * packet.numel()], packet)
                 for i in range(20)]  # a whole "layer": 400 ms
        time.sleep(0.005)
        t0 = time.perf_counter()
        b.copy_async(b.empty(16, torch.float32), torch.ones(16), urgent=True).wait()
        urgent_s = time.perf_counter() - t0
        assert urgent_s < 0.1  # one packet is 20 ms; the layer behind it is 400 ms
        assert not layer[-1].done()
        for h in layer:
            h.wait()
    finally:
        b.close()


def test_cancelled_copy_never_moves_and_wait_says_so():
    b = CpuBackend(emulated_link_gbps=0.01)
    try:
        blocker = b.copy_async(b.empty(250_000, torch.float32), torch.zeros(250_000))
        dst = torch.zeros(8)
        handle = b.copy_async(dst, torch.ones(8))
        assert handle.cancel()
        with pytest.raises(CopyCancelled):
            handle.wait()
        blocker.wait()
        time.sleep(0.01)
        assert torch.equal(dst, torch.zeros(8))
        assert not blocker.cancel()  # already done
    finally:
        b.close()


def test_copy_error_surfaces_on_wait(backend):
    handle = backend.copy_async(backend.empty(4, torch.float32), torch.ones(5))
    with pytest.raises(RuntimeError):
        handle.wait()


def test_compute_after_blocks_until_the_copy_landed():
    b = CpuBackend(emulated_link_gbps=0.01)
    try:
        src = torch.full((100_000,), 3.0)
        dst = b.empty(src.numel(), src.dtype)
        handle = b.copy_async(dst, src)
        b.compute_after(handle)
        assert handle.done() and float(dst.sum()) == 300_000.0
    finally:
        b.close()


def test_cpu_backend_places_weights_zero_copy(backend):
    w = torch.randn(4, 4)
    assert backend.to_device(w).data_ptr() == w.data_ptr()


@pytest.mark.skipif(cuda_available(), reason="checks the error raised without CUDA")
def test_cuda_backend_refuses_to_start_without_cuda():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        make_backend("cuda")


def test_emulated_link_is_cpu_only():
    with pytest.raises(ValueError):
        make_backend("cuda", emulated_link_gbps=1.0)


@pytest.mark.gpu
def test_cuda_copy_lands_and_urgent_copy_overtakes_queued_packets():
    b = make_backend("cuda")
    try:
        packet = torch.randn(8 << 20)  # 32 MB per packet
        src = b.host_store(packet)
        assert src.is_pinned()
        # 2 GB of packets: tens of ms even over a PCIe 5 link, far longer than queueing them.
        ring = b.empty(64 * packet.numel(), packet.dtype)
        dst = b.empty(4, torch.float32)
        b.synchronize()
        t0 = time.perf_counter()
        layer = [b.copy_async(ring[i * packet.numel():(i + 1) * packet.numel()], src)
                 for i in range(64)]
        urgent = b.copy_async(dst, torch.arange(4.0), urgent=True)
        queued = time.perf_counter() - t0
        urgent.wait()
        landed = sum(h.done() for h in layer)
        assert landed < len(layer), (
            f"all packets landed before the urgent copy (queued in {queued * 1e3:.2f} ms, "
            f"urgent done after {(time.perf_counter() - t0) * 1e3:.2f} ms)")
        for h in layer:
            b.compute_after(h)
        b.synchronize()
        assert torch.equal(ring[:packet.numel()].cpu(), packet)
        assert torch.equal(ring[-packet.numel():].cpu(), packet)
        assert torch.equal(dst.cpu(), torch.arange(4.0))
    finally:
        b.close()


def test_cpu_backend_computes_inline_and_its_events_are_already_reached(backend):
    out = []
    backend.launch(out.append, 1)
    assert out == [1]  # ran on the calling thread, before launch returned
    event = backend.record_compute_event()
    assert event.done()
    event.synchronize()
    backend.host_sync()
    dst = backend.empty(4, torch.float32)
    backend.copy_async(dst, torch.ones(4), after=event).wait()
    assert torch.equal(dst, torch.ones(4))


@pytest.fixture
def async_backend():
    b = AsyncCpuBackend(seed=0, compute_delay_s=0.0, copy_delay_s=0.0)
    yield b
    b.close()


def test_async_backend_runs_launched_work_in_order_on_its_own_thread(async_backend):
    gate = threading.Event()
    ran = []
    async_backend.launch(gate.wait)
    for k in range(5):
        async_backend.launch(lambda k=k: ran.append((k, threading.current_thread().name)))
    assert ran == []  # nothing runs before the gated item ahead of it
    gate.set()
    async_backend.host_sync()
    assert [k for k, _ in ran] == list(range(5))
    assert {name for _, name in ran} == {"async-cpu-compute"}


def test_async_compute_event_is_reached_only_after_the_work_launched_before_it(async_backend):
    gate = threading.Event()
    async_backend.launch(gate.wait)
    event = async_backend.record_compute_event()
    time.sleep(0.02)
    assert not event.done()
    gate.set()
    event.synchronize()
    assert event.done()


@pytest.mark.timing  # the compute stream lags by 0.2 s on purpose
@pytest.mark.parametrize("ordered", [True, False])
def test_async_copy_after_an_event_waits_for_the_readers_launched_before_it(async_backend,
                                                                            ordered):
    """The ring slot case: a reader still queued on the compute stream must see the old bytes.
    Without the event the copy overtakes it, which is what makes a missing wait visible."""
    dst = torch.ones(1000)
    seen = []
    async_backend.launch(time.sleep, 0.2)  # the compute stream lags the host
    async_backend.launch(lambda: seen.append(dst.clone()))
    event = async_backend.record_compute_event()
    handle = async_backend.copy_async(dst, torch.full((1000,), 2.0),
                                      after=event if ordered else None)
    if ordered:
        time.sleep(0.02)
        assert not handle.done()  # held back by the reader still queued
    handle.wait()
    async_backend.host_sync()
    assert torch.equal(dst, torch.full((1000,), 2.0))
    assert torch.equal(seen[0], torch.ones(1000)) is ordered


class _Gate(ComputeEvent):
    """An event the test sets by hand (holds a copy back)."""

    def __init__(self):
        self.flag = threading.Event()

    def done(self) -> bool:
        return self.flag.is_set()

    def synchronize(self) -> None:
        self.flag.wait()


@pytest.mark.timing
def test_async_compute_after_makes_the_stream_wait_for_the_copy_not_the_host(async_backend):
    gate = _Gate()
    dst = torch.zeros(1000)
    handle = async_backend.copy_async(dst, torch.full((1000,), 5.0), after=gate)
    seen = []
    t0 = time.perf_counter()
    async_backend.compute_after(handle)
    async_backend.launch(lambda: seen.append(dst.clone()))
    assert time.perf_counter() - t0 < 0.05  # the host went on
    event = async_backend.record_compute_event()
    time.sleep(0.02)
    assert not event.done() and not handle.done() and seen == []  # the stream waits
    gate.flag.set()
    async_backend.host_sync()
    assert torch.equal(seen[0], torch.full((1000,), 5.0))


def test_async_copy_lands_in_two_halves_and_keeps_the_queue_rules():
    b = AsyncCpuBackend(seed=1, compute_delay_s=0.0, copy_delay_s=0.01)
    try:
        src = torch.arange(1001.0)  # odd: the halves differ in size
        dst = b.empty(1001, torch.float32)
        b.copy_async(dst, src).wait()
        assert torch.equal(dst, src)
        gate = _Gate()
        held = b.copy_async(b.empty(8, torch.float32), torch.ones(8), after=gate)
        dropped = b.copy_async(torch.zeros(8), torch.ones(8))
        assert dropped.cancel()  # still queued behind the held copy
        with pytest.raises(CopyCancelled):
            dropped.wait()
        time.sleep(0.02)
        assert not held.done()
        gate.flag.set()
        held.wait()
    finally:
        b.close()


def test_async_error_in_launched_work_surfaces_at_the_next_host_sync_once(async_backend):
    ran = []

    def fail():
        raise ValueError("device fault")

    async_backend.launch(fail)
    async_backend.launch(ran.append, "skipped")  # would compute on the failed work's output
    with pytest.raises(ValueError, match="device fault"):
        async_backend.host_sync()
    assert ran == []
    async_backend.host_sync()  # reported once
    async_backend.launch(ran.append, "after")
    async_backend.host_sync()
    assert ran == ["after"]


def test_async_backend_refuses_work_once_closed():
    b = AsyncCpuBackend(seed=0)
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.host_sync()  # would otherwise wait forever for an event nobody sets
    b.close()  # idempotent


@pytest.mark.gpu
def test_cuda_copy_after_a_compute_event_waits_for_kernels_still_reading():
    """A kernel queued behind a long one reads a buffer; a copy into it issued with the event
    recorded after the reader must not overwrite it first (and the host is not blocked)."""
    b = make_backend("cuda")
    try:
        n = 1 << 20
        buf = b.empty(n, torch.float32)
        buf.fill_(1.0)
        out = b.empty(n, torch.float32)
        b.host_sync()
        b.launch(torch.cuda._sleep, 200_000_000)  # ~0.1 s of GPU cycles on the compute stream
        b.launch(out.copy_, buf)
        event = b.record_compute_event()
        t0 = time.perf_counter()
        handle = b.copy_async(buf, b.host_store(torch.full((n,), 2.0)), after=event)
        assert time.perf_counter() - t0 < 0.05  # the host issues and goes on
        handle.wait()
        assert event.done()  # the copy could only land after the compute stream passed it
        b.host_sync()
        assert torch.equal(out.cpu(), torch.ones(n))
        assert torch.equal(buf.cpu(), torch.full((n,), 2.0))
    finally:
        b.close()
