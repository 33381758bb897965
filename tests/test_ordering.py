"""The offload pipeline is race-free on an asynchronous device: on AsyncCpuBackend (compute and
copies on their own threads, random delays, real events) it generates exactly the plain runner's
tokens, and the harness is sharp enough to see a missing wait: dropping the ring slot's release
event, or the compute stream's wait for its pages, changes the tokens."""
from __future__ import annotations

import pytest

from moe_engine.config import EngineConfig
from moe_engine.engine.llm_engine import LLMEngine
from moe_engine.engine.request import Request, SamplingParams
from moe_engine.offload.async_cpu import AsyncCpuBackend
from moe_engine.offload.backend import CompletedEvent
from moe_engine.offload.build import OffloadSettings, build_offload_pipeline
from moe_engine.offload.pipeline import OffloadStats
from moe_engine.offload.routing import find_profile

from test_offload_parity import NEW_TOKENS, PROMPTS  # the same prompts as the parity tests
CONFIG = EngineConfig(threads=2, kv_cache_gb=0.02, num_micro_batches=2)


def _requests():
    return [Request(f"r{i}", prompt=p, sampling=SamplingParams(max_new_tokens=NEW_TOKENS))
            for i, p in enumerate(PROMPTS)]


def _generate(engine) -> dict[str, list[int]]:
    results = list(engine.generate(_requests()))
    assert all(r.status == "ok" for r in results), [r.error for r in results]
    return {r.request_id: r.token_ids for r in results}


def _plain(model_dir) -> dict[str, list[int]]:
    return _generate(LLMEngine(model_dir, CONFIG, dtype="float32"))


def _async_run(model_dir, backend: AsyncCpuBackend,
               **settings) -> tuple[dict[str, list[int]], OffloadStats]:
    # cpu_experts=False unless asked: every non-resident expert crosses the link into the ring.
    settings = dict(dict(cpu_experts=False, packet_bytes=100_000), **settings)
    engine = LLMEngine(model_dir, CONFIG, dtype="float32")
    engine.runner = build_offload_pipeline(engine.runner, OffloadSettings(**settings),
                                           routing=find_profile(model_dir), backend=backend)
    try:
        return _generate(engine), engine.runner.totals
    finally:
        engine.runner.close()
        backend.close()


def _async_tokens(model_dir, backend: AsyncCpuBackend, **settings) -> dict[str, list[int]]:
    tokens, totals = _async_run(model_dir, backend, **settings)
    if settings.get("resident_ratio", 1.0) < 1.0:
        assert totals.bytes_moved > 0
    return tokens


@pytest.fixture(scope="module")
def two_layer_reference(tiny_mixtral_dir):
    return _plain(tiny_mixtral_dir)


@pytest.fixture(scope="module")
def three_layer_reference(tiny_three_layer_dir):
    return _plain(tiny_three_layer_dir)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("attention_on_device", [False, True])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_async_device_gives_the_plain_tokens(tiny_mixtral_dir, two_layer_reference, ratio,
                                             attention_on_device, seed):
    backend = AsyncCpuBackend(seed=seed)
    assert _async_tokens(tiny_mixtral_dir, backend, resident_ratio=ratio,
                         attention_on_device=attention_on_device) == two_layer_reference


# Three layers: each ring slot holds a different layer on every visit, so a page read too
# early or overwritten too soon gives wrong numbers (see the negative tests below).
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_async_device_gives_the_plain_tokens_when_slots_change_layers(
        tiny_three_layer_dir, three_layer_reference, ratio, seed):
    backend = AsyncCpuBackend(seed=seed)
    assert _async_tokens(tiny_three_layer_dir, backend, resident_ratio=ratio,
                         attention_on_device=True) == three_layer_reference


def test_async_device_per_micro_batch_grouping_and_cpu_attention(tiny_three_layer_dir,
                                                                three_layer_reference):
    backend = AsyncCpuBackend(seed=3)
    assert _async_tokens(tiny_three_layer_dir, backend, resident_ratio=0.0,
                         group_ffn="micro_batch") == three_layer_reference


def test_async_device_with_streamed_experts_run_on_the_cpu(tiny_three_layer_dir,
                                                           three_layer_reference):
    # Twiddler's rule on a CPU "device" puts every streamed expert on the CPU worker; their
    # outputs join the device sum through launched work, in stream order.
    backend = AsyncCpuBackend(seed=5)
    tokens, totals = _async_run(tiny_three_layer_dir, backend, resident_ratio=0.25,
                                cpu_experts=True, attention_on_device=True)
    assert tokens == three_layer_reference
    assert totals.experts_on_cpu > 0


@pytest.mark.parametrize("attention_on_device", [False, True])
def test_async_device_on_a_model_with_a_dense_layer_and_shared_experts(builtin_dir,
                                                                       attention_on_device):
    # tiny-qwen2-moe: 3 layers, layer 1 a dense MLP (nothing paged), a gated shared expert.
    model_dir = builtin_dir("tiny-qwen2-moe")
    backend = AsyncCpuBackend(seed=4)
    assert _async_tokens(model_dir, backend, resident_ratio=0.0,
                         attention_on_device=attention_on_device) == _plain(model_dir)


# The harness catches a missing wait. Attention on the device: CPU attention makes the host wait
# for the compute stream before every layer's prefetch (it reads q/k/v), which hides a missing
# release event; on the device nothing does, as on a GPU.

def test_without_the_release_event_a_refill_overwrites_pages_still_being_read(
        tiny_three_layer_dir, three_layer_reference):
    # The compute stream lags far behind quick copies; the pager's release event is replaced by
    # one that is always complete, i.e. the slot is refilled as soon as it is flagged free.
    backend = AsyncCpuBackend(seed=0, compute_delay_s=2e-3, copy_delay_s=2e-4)
    backend.record_compute_event = CompletedEvent
    tokens = _async_tokens(tiny_three_layer_dir, backend, resident_ratio=0.0,
                           attention_on_device=True)
    assert tokens != three_layer_reference


def test_without_the_wait_for_pages_experts_read_stale_bytes(tiny_three_layer_dir,
                                                            three_layer_reference):
    # Slow copies, a quick compute stream that no longer waits for the pages it reads.
    backend = AsyncCpuBackend(seed=0, compute_delay_s=2e-4, copy_delay_s=2e-3)
    backend.compute_after = lambda handle: None
    tokens = _async_tokens(tiny_three_layer_dir, backend, resident_ratio=0.0,
                           attention_on_device=True)
    assert tokens != three_layer_reference


# The disk tier on the same discipline: a disk read into an expert slot waits for the compute
# event of the slot's last reader. Attention on the device, as above, so nothing else makes the
# host wait for the compute stream.

def _async_disk_run(model_dir, backend: AsyncCpuBackend, monkeypatch, slots: int = 2):
    import moe_engine.offload.build as build
    from moe_engine.offload.build import expert_source
    from moe_engine.offload.disk_tier import HostTierPlan

    engine = LLMEngine(model_dir, CONFIG, dtype="float32")
    spec = engine.spec
    source = expert_source(model_dir, spec, engine.dtype, engine.expert_storage)
    for layer in engine.runner.weights.layers:  # as the disk tier's loader leaves them
        layer.experts = [None] * len(layer.experts)
    # A ring of two slots: each is refilled several times per layer.
    monkeypatch.setattr(build, "plan_host_tier",
                        lambda *a, **k: HostTierPlan(0, spec.num_experts, slots))
    settings = OffloadSettings(host_resident_ratio=0.0, attention_on_device=True,
                               disk_packet_bytes=64 << 10)
    engine.runner = build_offload_pipeline(engine.runner, settings, routing=find_profile(model_dir),
                                           backend=backend, experts=source)
    try:
        return _generate(engine)
    finally:
        engine.runner.close()
        engine.runner.pager.disk.close()
        backend.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_async_device_reading_experts_from_disk_gives_the_plain_tokens(
        tiny_three_layer_dir, three_layer_reference, seed, monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_BATCH_CACHE", str(tmp_path))
    backend = AsyncCpuBackend(seed=seed, compute_delay_s=1e-3)
    assert _async_disk_run(tiny_three_layer_dir, backend, monkeypatch) == three_layer_reference


def test_without_the_release_event_a_disk_read_overwrites_an_expert_being_computed(
        tiny_three_layer_dir, three_layer_reference, monkeypatch, tmp_path):
    from moe_engine.offload.disk_tier import DiskTier

    monkeypatch.setenv("MOE_BATCH_CACHE", str(tmp_path))
    real = DiskTier._transfer
    monkeypatch.setattr(DiskTier, "_transfer",
                        lambda self, dst, src, handle, after: real(self, dst, src, handle, None))
    backend = AsyncCpuBackend(seed=0, compute_delay_s=2e-3, copy_delay_s=2e-4)
    assert _async_disk_run(tiny_three_layer_dir, backend, monkeypatch) != three_layer_reference
