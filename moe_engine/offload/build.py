"""Assembles the offloaded runner from the engine's knobs: backend, expert latency profile,
pager and pipeline around a plain runner. The engine calls `build_offload_pipeline` with the
routing profile engine/calibrate.py found or recorded; nothing here computes anything itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from moe_engine.engine.model_runner import ModelRunner
from moe_engine.model.attention import DecodeAttention
from moe_engine.offload.backend import Backend, make_backend
from moe_engine.offload.disk import DirectReader
from moe_engine.offload.disk_tier import DiskTier, HostTierPlan, plan_host_tier
from moe_engine.offload.expert_store import ExpertFile, ExpertSource, checkpoint_source
from moe_engine.offload.pager import WeightPager
from moe_engine.offload.pipeline import OffloadPipeline
from moe_engine.offload.placement import (ExpertLatencyProfile, ExpertPlacer, LatencyCurve,
                                          measure_expert_profile)
from moe_engine.offload.routing import RoutingProfile
from moe_engine.offload.trace import Trace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadSettings:
    """The policy's offloading knobs (from EngineConfig) in one place."""

    backend: str = "cpu"
    resident_ratio: float = 1.0
    attention_on_device: bool = False
    ffn_on_device: bool = True
    cpu_experts: bool = True  # Twiddler: streamed experts may run on the CPU instead
    device_memory_bytes: Optional[int] = None
    packet_bytes: int = 32 << 20
    emulated_link_gbps: Optional[float] = None  # CPU backend only: a simulated slower link
    group_ffn: str = "layer"
    # Disk tier: on when either is set (see EngineConfig).
    host_resident_ratio: Optional[float] = None
    host_memory_bytes: Optional[int] = None
    disk_packet_bytes: int = 16 << 20
    disk_direct_io: bool = True
    step_tokens: int = 2048  # most tokens one step runs (sizes the activations in the budget)
    step_seqs: int = 256

    @property
    def disk_tier(self) -> bool:
        return self.host_resident_ratio is not None or self.host_memory_bytes is not None


def offload_settings(config) -> Optional[OffloadSettings]:
    """The offload knobs of an EngineConfig, or None when the plain runner serves: a fully
    resident CPU run with no emulated link (the pipeline only adds overhead there unless asked
    for, see docs/offload.md)."""
    backend = getattr(config.backend, "value", config.backend)
    disk = config.host_resident_ratio is not None or config.host_memory_gb is not None
    wanted = (backend != "cpu" or config.resident_ratio < 1.0 or disk
              or config.emulated_link_gbps is not None or config.offload_pipeline)
    if not wanted:
        return None
    budget = config.device_memory_gb
    host = config.host_memory_gb
    return OffloadSettings(
        backend=backend, resident_ratio=config.resident_ratio,
        attention_on_device=config.attention_on_device, ffn_on_device=config.ffn_on_device,
        cpu_experts=config.cpu_experts,
        device_memory_bytes=None if budget is None else int(budget * 1e9),
        packet_bytes=max(1, int(config.packet_mb * (1 << 20))),
        emulated_link_gbps=config.emulated_link_gbps,
        group_ffn=getattr(config.group_ffn, "value", config.group_ffn),
        host_resident_ratio=config.host_resident_ratio,
        host_memory_bytes=None if host is None else int(host * 1e9),
        disk_packet_bytes=max(1, int(config.disk_read_mb * (1 << 20))),
        disk_direct_io=config.disk_direct_io,
        step_tokens=max(config.max_prefill_tokens, config.max_num_seqs),
        step_seqs=config.max_num_seqs)


# A streamed expert "costs" this much on the CPU when cpu_experts is off: never cheaper.
_NEVER_ON_CPU = 1e9


def build_offload_pipeline(runner: ModelRunner, settings: OffloadSettings,
                           routing: Optional[RoutingProfile] = None,
                           latency: Optional[ExpertLatencyProfile] = None,
                           trace: Optional[Trace] = None,
                           experts: Optional[ExpertSource] = None,
                           loaded_bytes: Optional[int] = None,
                           backend: Optional[Backend] = None) -> OffloadPipeline:
    """Wrap `runner` (its weights moved behind a pager) into an OffloadPipeline.

    Residency follows `routing`; without one it follows expert index (with a warning when
    experts are streamed). The expert latency profile is measured on this backend unless given
    (or not needed: r_w 1). With the disk tier, `experts` is where the experts are on disk
    (the runner was loaded without them); the host tier is read from it here, and the ring
    takes what the host budget leaves after `loaded_bytes` (what loading the rest cost in RSS;
    default: the tensors' bytes). `backend` replaces the one `settings` names (tests pass the
    asynchronous CPU test backend, which the configuration does not offer).
    """
    spec = runner.spec
    if settings.backend != "cpu" and _packed_for_cpu(runner):
        # A device apart from the host runs torch GEMMs on torch-layout weights; the CPU
        # kernels' panels (and their int8/int4 scales) mean nothing there.
        raise ValueError(f"engine.backend={settings.backend} computes with torch GEMMs, but the "
                         "runner holds weights packed for the CPU kernels: load the engine with "
                         f"engine.backend={settings.backend} (or engine.gemm=torch)")
    if backend is None:
        backend = make_backend(settings.backend, settings.emulated_link_gbps, trace)
    resident_ratio = settings.resident_ratio
    disk, plan = None, None
    if settings.disk_tier:
        if experts is None:
            raise ValueError("the disk tier needs the experts' source on disk")
        dense = max(runner.weights.nbytes(), loaded_bytes or 0)
        plan = plan_host_tier(dense, experts.layout.nbytes,
                              spec.num_moe_layers, spec.num_experts,
                              settings.host_resident_ratio, settings.host_memory_bytes,
                              reserved_bytes=_step_state_bytes(runner, settings))
        # On the CPU backend device memory is host memory: the host tier is the resident set.
        if backend.device_is_host:
            resident_ratio = plan.ratio
        elif resident_ratio > plan.ratio:
            raise ValueError(f"engine.resident_ratio={resident_ratio} exceeds the host tier's "
                             f"{plan.ratio}: the device tier lies inside the host tier")
    if routing is None:
        if resident_ratio < 1.0:
            log.warning("no routing profile for this model: resident experts chosen by index; "
                        "record one with moe_engine.engine.calibrate.calibrate_routing")
        routing = RoutingProfile.uniform(spec.num_layers, spec.num_experts)
    if plan is not None:
        disk = _disk_tier(runner, experts, routing, plan, settings, trace)
    # Only streamed experts are placed by latency; fully resident (a calibration run, or a model
    # that fits) skips the measurement, which costs seconds for real expert sizes. Disk experts
    # are never placed (they run where they are read to).
    proto = next((x for layer in runner.weights.layers for x in layer.experts if x is not None),
                 None)
    host_streamed = not (settings.disk_tier and backend.device_is_host)
    if latency is None and resident_ratio < 1.0 and host_streamed and proto is not None:
        latency = measure_expert_profile(backend, proto)
    if latency is not None and not settings.cpu_experts:
        latency = _without_cpu_experts(latency)
    try:
        pager = WeightPager(runner.weights, backend, routing, resident_ratio,
                            packet_bytes=settings.packet_bytes,
                            budget_bytes=settings.device_memory_bytes, disk=disk,
                            host_copies_of_resident=not settings.ffn_on_device)
    except BaseException:  # its threads and files must not outlive a failed construction
        if disk is not None:
            disk.close()
        raise
    runner.weights = pager.device_weights
    if not backend.device_is_host:
        _place_runner_state(runner, backend, pager, settings.attention_on_device)
    return OffloadPipeline(runner, pager, ExpertPlacer(latency, settings.ffn_on_device),
                           attention_on_device=settings.attention_on_device,
                           group_ffn=settings.group_ffn, trace=trace)


def expert_source(model_dir, spec, dtype, expert_storage: Optional[str]) -> ExpertSource:
    """Where the disk tier reads experts: the checkpoint itself when the engine computes on its
    tensors as stored (torch GEMMs, the checkpoint's dtype), else the one-time expert file in
    the engine's form (`expert_storage`: the packed kernels' storage, None for torch)."""
    from moe_engine.model import packed
    from moe_engine.model.weights import ExpertWeights

    name = str(dtype).replace("torch.", "")
    if expert_storage is None:
        source = checkpoint_source(model_dir, spec, dtype)
        if source is not None:
            return source
        return ExpertFile.open_or_build(model_dir, spec, dtype, f"rowmajor-{name}", lambda x: x)

    def pack(x: ExpertWeights) -> ExpertWeights:
        return packed.pack_expert(x, expert_storage)

    # A quantized checkpoint's experts (MXFP4) reach `pack` as stored, never widened.
    source_form = spec.expert_storage or name
    fmt = f"packed{packed.NR}-{expert_storage}-from-{source_form}"
    return ExpertFile.open_or_build(model_dir, spec, dtype, fmt, pack, keep_quantized=True)


def _step_state_bytes(runner: ModelRunner, settings: OffloadSettings) -> int:
    """Host bytes besides weights and KV that the budget must leave room for: the RoPE tables
    and the peak activations of the largest step (perf model's estimate, at the width the
    runner computes in)."""
    from moe_engine.perf.cost import activation_bytes

    width = runner.dtype.itemsize  # the activations' dtype (fp32 on the packed kernels)
    act = activation_bytes(runner.spec.with_dtype_bytes(width), settings.step_tokens,
                           settings.step_seqs)
    return runner.state_nbytes(kv_cache=False) + int(act)


def _disk_tier(runner: ModelRunner, experts: ExpertSource, routing: RoutingProfile,
               plan: HostTierPlan, settings: OffloadSettings, trace: Optional[Trace]) -> DiskTier:
    """Read the host tier (each layer's hottest experts) into the runner's weights and open the
    disk tier for the rest."""
    reader = DirectReader(settings.disk_direct_io)
    try:
        experts.check(reader)  # the files are the ones the layout was taken from
        for i, layer in enumerate(runner.weights.layers):
            for e in routing.resident_set(i, plan.ratio) if layer.experts else ():
                if layer.experts[e] is None:
                    layer.experts[e] = experts.load(i, e, reader)
    except BaseException:
        reader.close()
        raise
    log.info("disk tier: %d of %d experts per layer in host memory, a ring of %d expert slots "
             "(%.0f MB), reads %s", plan.host_experts, runner.spec.num_experts, plan.ring_slots,
             plan.ring_slots * experts.layout.nbytes / 1e6, reader.mode)
    return DiskTier(experts, max(1, plan.ring_slots), settings.disk_packet_bytes, reader, trace)


def _place_runner_state(runner: ModelRunner, backend, pager: WeightPager,
                        attention_on_device: bool) -> None:
    """RoPE tables on the device; with attention on the device, the KV cache too (the policy
    then budgets it in device memory) and torch's decode attention, which runs on any device."""
    pager.ledger.reserve(runner.state_nbytes(kv_cache=attention_on_device),
                         "RoPE tables and KV cache" if attention_on_device else "RoPE tables")
    runner.place(backend.to_device, kv_cache=attention_on_device)
    if attention_on_device:
        runner.attention = DecodeAttention("torch", runner.attention.num_threads,
                                           latent_value_dim=runner.attention.latent_value_dim)


def _without_cpu_experts(latency: ExpertLatencyProfile) -> ExpertLatencyProfile:
    return ExpertLatencyProfile(LatencyCurve.linear(_NEVER_ON_CPU, _NEVER_ON_CPU),
                                latency.device, latency.link_bytes_per_s, latency.expert_bytes)


def _packed_for_cpu(runner: ModelRunner) -> bool:
    """Whether the runner's weights are laid out for the packed CPU kernels (engine.gemm)."""
    from moe_engine.model.packed import PackedLinear

    return any(isinstance(layer.dense.wqkv, PackedLinear) for layer in runner.weights.layers)
