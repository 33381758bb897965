"""Backend copies: bytes land, handles complete, urgent copies pass queued weight packets,
cancelled copies never move, the emulated link is as slow as it says."""
from __future__ import annotations

import time

import pytest
import torch

from moe_engine.offload.backend import CopyCancelled, CpuBackend, cuda_available, make_backend
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
        ring = b.empty(16 * packet.numel(), packet.dtype)
        layer = [b.copy_async(ring[i * packet.numel():(i + 1) * packet.numel()], src)
                 for i in range(16)]
        dst = b.empty(4, torch.float32)
        urgent = b.copy_async(dst, torch.arange(4.0), urgent=True)
        urgent.wait()
        assert sum(h.done() for h in layer) < len(layer)
        for h in layer:
            b.compute_after(h)
        b.synchronize()
        assert torch.equal(ring[:packet.numel()].cpu(), packet)
        assert torch.equal(dst.cpu(), torch.arange(4.0))
    finally:
        b.close()
