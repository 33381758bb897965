"""WeightPager: resident set from the routing profile, exact pages, the ring's size and reuse
rule, the device budget, and waits that block only on the expert needed."""
from __future__ import annotations

import copy
import time

import pytest
import torch

from moe_engine.offload.async_cpu import AsyncCpuBackend
from moe_engine.offload.backend import CompletedEvent, CpuBackend, cuda_available, make_backend
from moe_engine.model.loader import load_weights
from moe_engine.model.spec import load_spec
from moe_engine.offload.pager import DeviceBudgetError, WeightPager
from moe_engine.offload.routing import RoutingProfile


@pytest.fixture(scope="module")
def spec(tiny_mixtral_dir):
    return load_spec(tiny_mixtral_dir)


def _weights(tiny_mixtral_dir, spec):
    return load_weights(tiny_mixtral_dir, spec, torch.float32)


def _skewed_profile(spec) -> RoutingProfile:
    # Layer 0 prefers high indices, layer 1 low ones: residency must follow counts, not index.
    rows = [tuple(10 * (e + 1) for e in range(spec.num_experts)),
            tuple(10 * (spec.num_experts - e) for e in range(spec.num_experts))]
    return RoutingProfile(tuple(rows[i % 2] for i in range(spec.num_layers)))


def _need_bytes(weights, pager) -> int:
    dense = sum(layer.dense.nbytes() for layer in weights.layers)
    globals_ = weights.embed.nbytes + weights.lm_head.nbytes + weights.final_norm.nbytes
    resident = sum(len(r) for r in pager.resident) * pager.expert_bytes
    return dense + globals_ + resident + pager.ring_bytes


def test_resident_set_is_the_most_used_experts(tiny_mixtral_dir, spec):
    backend = CpuBackend()
    pager = WeightPager(_weights(tiny_mixtral_dir, spec), backend, _skewed_profile(spec), 0.5)
    assert pager.resident[0] == frozenset({4, 5, 6, 7})
    assert pager.resident[1] == frozenset({0, 1, 2, 3})
    assert pager.streamed[0] == [3, 2, 1, 0]  # hottest first
    assert pager.streamed[1] == [4, 5, 6, 7]
    backend.close()


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_every_expert_comes_back_bit_exact(tiny_mixtral_dir, spec, ratio):
    reference = _weights(tiny_mixtral_dir, spec)
    backend = CpuBackend()
    pager = WeightPager(_weights(tiny_mixtral_dir, spec), backend, _skewed_profile(spec), ratio,
                        packet_bytes=20_000)  # several packets per expert
    for layer in range(spec.num_layers):
        pager.prefetch(layer, pager.streamed[layer][:2])  # the rest are fetched on demand
        for e in range(spec.num_experts):
            got = pager.wait(layer, e)
            assert torch.equal(got.w13, reference.layers[layer].experts[e].w13)
            assert torch.equal(got.w2, reference.layers[layer].experts[e].w2)
            assert pager.bytes_to_move(layer, e) == 0
            host = pager.host_expert(layer, e)
            assert torch.equal(host.w13, reference.layers[layer].experts[e].w13)
        pager.release(layer)
    expected_streamed = sum(len(s) for s in pager.streamed)
    assert pager.stats.experts_streamed == expected_streamed
    assert backend.link_bytes_moved == expected_streamed * pager.expert_bytes
    backend.close()


def test_ring_is_twice_the_streamed_part_of_one_layer(tiny_mixtral_dir, spec):
    backend = CpuBackend()
    pager = WeightPager(_weights(tiny_mixtral_dir, spec), backend, _skewed_profile(spec), 0.25)
    streamed = spec.num_experts - 2
    assert pager.ring_bytes == 2 * streamed * pager.expert_bytes
    backend.close()


def test_high_water_stays_within_budget_and_too_small_a_budget_fails(tiny_mixtral_dir, spec):
    probe_backend = CpuBackend()
    weights = _weights(tiny_mixtral_dir, spec)
    probe = WeightPager(weights, probe_backend, _skewed_profile(spec), 0.5)
    need = _need_bytes(_weights(tiny_mixtral_dir, spec), probe)
    assert probe.ledger.high_water == need
    probe_backend.close()

    backend = CpuBackend()
    pager = WeightPager(_weights(tiny_mixtral_dir, spec), backend, _skewed_profile(spec), 0.5,
                        budget_bytes=need)
    for _ in range(2):  # two steps' worth of paging
        for layer in range(spec.num_layers):
            pager.prefetch(layer)
            for e in range(spec.num_experts):
                pager.wait(layer, e)
            pager.release(layer)
    assert pager.ledger.high_water <= need
    backend.close()

    with pytest.raises(DeviceBudgetError, match="budget"):
        WeightPager(_weights(tiny_mixtral_dir, spec), CpuBackend(), _skewed_profile(spec), 0.5,
                    budget_bytes=need - 1)


def test_a_slot_is_refilled_only_after_its_layer_is_released(tiny_mixtral_dir, spec):
    weights = _weights(tiny_mixtral_dir, spec)
    # A third layer (a copy of layer 0) so that the two ring slots can run out.
    weights.layers.append(copy.deepcopy(weights.layers[0]))
    reference = copy.deepcopy(weights)
    profile = RoutingProfile(_skewed_profile(spec).counts + (_skewed_profile(spec).counts[0],))
    backend = CpuBackend()
    pager = WeightPager(weights, backend, profile, 0.0)
    pager.prefetch(0)
    pager.prefetch(1)
    with pytest.raises(RuntimeError, match="release"):
        pager.prefetch(2)
    pager.release(0)
    pager.prefetch(2)  # takes layer 0's slot; layer 1's pages stay intact
    for e in range(spec.num_experts):
        assert torch.equal(pager.wait(1, e).w13, reference.layers[1].experts[e].w13)
        assert torch.equal(pager.wait(2, e).w2, reference.layers[2].experts[e].w2)
    pager.release(1)
    pager.prefetch(0)  # an odd layer count wraps into the next step's layer 0
    assert torch.equal(pager.wait(0, 3).w13, reference.layers[0].experts[3].w13)
    backend.close()


@pytest.mark.timing
def test_wait_blocks_only_for_the_expert_needed_now(tiny_mixtral_dir, spec):
    backend = CpuBackend(emulated_link_gbps=0.02)  # 20 MB/s: one 344 kB expert ~ 17 ms
    pager = WeightPager(_weights(tiny_mixtral_dir, spec), backend, _skewed_profile(spec), 0.0,
                        packet_bytes=64 << 10)
    layer_s = spec.num_experts * pager.expert_bytes / 0.02e9
    t0 = time.perf_counter()
    pager.prefetch(0)
    pager.wait(0, pager.streamed[0][0])  # the hottest is queued first
    first_s = time.perf_counter() - t0
    assert first_s < layer_s / 2, (first_s, layer_s)
    assert pager.bytes_to_move(0, pager.streamed[0][-1]) > 0  # the coldest is still coming
    pager.cancel_all()
    backend.close()


def test_cancel_drops_queued_pages(tiny_mixtral_dir, spec):
    backend = CpuBackend(emulated_link_gbps=0.02)
    pager = WeightPager(_weights(tiny_mixtral_dir, spec), backend, _skewed_profile(spec), 0.0,
                        packet_bytes=64 << 10)
    pager.prefetch(0)
    coldest = pager.streamed[0][-1]
    pager.cancel(0, coldest)
    for e in pager.streamed[0][:-1]:
        pager.wait(0, e)
    time.sleep(0.05)
    assert backend.link_bytes_moved == (spec.num_experts - 1) * pager.expert_bytes
    assert pager.stats.bytes_cancelled == pager.expert_bytes
    backend.close()


def _three_layers(tiny_mixtral_dir, spec):
    """Weights with a third layer (a copy of layer 1, ranked like it), the same unchanged for
    reference, and their profile: layer 2 refills layer 0's slot with different bytes."""
    weights = _weights(tiny_mixtral_dir, spec)
    weights.layers.append(copy.deepcopy(weights.layers[1]))
    counts = _skewed_profile(spec).counts
    return weights, copy.deepcopy(weights), RoutingProfile(counts + (counts[1],))


@pytest.mark.timing  # readers lag by 0.2 s on purpose
@pytest.mark.parametrize("release_event", [True, False])
def test_a_refill_waits_for_the_readers_launched_before_the_release(tiny_mixtral_dir, spec,
                                                                    release_event):
    """On an asynchronous device a released slot may still be read by queued compute: its
    refill must wait for the release event. Without the event (False) the harness sees the
    overwrite, so the test would fail if the pager did not order the refill."""
    weights, reference, profile = _three_layers(tiny_mixtral_dir, spec)
    backend = AsyncCpuBackend(seed=0, compute_delay_s=0.0, copy_delay_s=0.0)
    if not release_event:
        backend.record_compute_event = CompletedEvent
    pager = WeightPager(weights, backend, profile, 0.0)
    expert = pager.streamed[0][0]
    pager.prefetch(0)
    w = pager.wait(0, expert)  # the stream waits for the pages; the host does not
    seen = []
    backend.launch(time.sleep, 0.2)  # the compute stream lags the host
    backend.launch(lambda: seen.append(w.w13.clone()))
    pager.release(0)
    pager.prefetch(1)
    pager.prefetch(2)  # layer 0's slot, with layer 2's bytes
    landed = pager.wait(2, pager.streamed[2][0])
    backend.host_sync()
    assert torch.equal(landed.w13, reference.layers[2].experts[pager.streamed[2][0]].w13)
    assert torch.equal(seen[0], reference.layers[0].experts[expert].w13) is release_event
    pager.cancel_all()
    backend.close()


@pytest.mark.timing  # the host must claim the slot before the packets land
def test_pages_that_launched_work_waits_for_are_never_cancelled(tiny_mixtral_dir, spec):
    """Claiming a slot drops the previous layer's queued packets, except those the compute
    stream was told to wait for: on an asynchronous device that work may not have run yet."""
    weights, reference, profile = _three_layers(tiny_mixtral_dir, spec)
    backend = AsyncCpuBackend(seed=0, compute_delay_s=0.0, copy_delay_s=4e-3)
    pager = WeightPager(weights, backend, profile, 0.0, packet_bytes=64 << 10)
    coldest = pager.streamed[0][-1]
    pager.prefetch(0)
    w = pager.wait(0, coldest)  # its packets are queued last
    seen = []
    backend.launch(lambda: seen.append(w.w2.clone()))
    pager.cancel(0, coldest)  # launched work reads it: not dropped
    pager.release(0)
    pager.prefetch(1)
    pager.prefetch(2)  # claims layer 0's slot while the coldest expert is still queued
    backend.host_sync()  # would raise CopyCancelled had the pages been dropped
    assert torch.equal(seen[0], reference.layers[0].experts[coldest].w2)
    assert 0 < pager.stats.bytes_cancelled  # the others were dropped
    pager.cancel_all()
    backend.close()


@pytest.mark.gpu
def test_cuda_pager_pages_are_exact_and_within_budget(tiny_mixtral_dir, spec):
    reference = _weights(tiny_mixtral_dir, spec)
    backend = make_backend("cuda")
    weights = _weights(tiny_mixtral_dir, spec)
    pager = WeightPager(weights, backend, _skewed_profile(spec), 0.5, packet_bytes=20_000,
                        budget_bytes=64 << 20)
    for layer in range(spec.num_layers):
        pager.prefetch(layer)
        for e in range(spec.num_experts):
            got = pager.wait(layer, e)
            assert got.w13.is_cuda
            assert torch.equal(got.w13.cpu(), reference.layers[layer].experts[e].w13)
        pager.release(layer)
    assert pager.ledger.high_water <= 64 << 20
    assert cuda_available()
    backend.close()


def test_a_device_apart_from_the_host_drops_host_copies_of_resident_experts(tiny_mixtral_dir,
                                                                            spec):
    """With experts run only on the device, a resident expert's host copy is freed (the
    performance model counts host memory for the non-resident experts only); the streamed ones
    stay in the host store and every expert still comes back exact."""
    class DeviceApart(CpuBackend):
        device_is_host = False

    reference = _weights(tiny_mixtral_dir, spec)
    weights = _weights(tiny_mixtral_dir, spec)
    backend = DeviceApart()
    pager = WeightPager(weights, backend, _skewed_profile(spec), 0.5,
                        host_copies_of_resident=False)
    for layer in range(spec.num_layers):
        for e in range(spec.num_experts):
            resident = pager.is_resident(layer, e)
            assert (weights.layers[layer].experts[e] is None) == resident
            if resident:
                with pytest.raises(ValueError, match="on the device only"):
                    pager.host_expert(layer, e)
        pager.prefetch(layer)
        for e in range(spec.num_experts):
            got = pager.wait(layer, e)
            assert torch.equal(got.w13, reference.layers[layer].experts[e].w13)
        pager.release(layer)
    backend.close()
    kept = WeightPager(_weights(tiny_mixtral_dir, spec), DeviceApart(), _skewed_profile(spec),
                       0.5)  # the default keeps them (the CPU may run any expert)
    assert all(x is not None for row in kept.host_experts for x in row)
    kept.backend.close()
