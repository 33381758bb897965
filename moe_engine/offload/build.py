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


def offload_settings(config) -> Optional[OffloadSettings]:
    """The offload knobs of an EngineConfig, or None when the plain runner serves: a fully
    resident CPU run with no emulated link (the pipeline only adds overhead there unless asked
    for, see docs/offload.md)."""
    backend = getattr(config.backend, "value", config.backend)
    wanted = (backend != "cpu" or config.resident_ratio < 1.0
              or config.emulated_link_gbps is not None or config.offload_pipeline)
    if not wanted:
        return None
    budget = config.device_memory_gb
    return OffloadSettings(
        backend=backend, resident_ratio=config.resident_ratio,
        attention_on_device=config.attention_on_device, ffn_on_device=config.ffn_on_device,
        cpu_experts=config.cpu_experts,
        device_memory_bytes=None if budget is None else int(budget * 1e9),
        packet_bytes=max(1, int(config.packet_mb * (1 << 20))),
        emulated_link_gbps=config.emulated_link_gbps,
        group_ffn=getattr(config.group_ffn, "value", config.group_ffn))


# A streamed expert "costs" this much on the CPU when cpu_experts is off: never cheaper.
_NEVER_ON_CPU = 1e9


def build_offload_pipeline(runner: ModelRunner, settings: OffloadSettings,
                           routing: Optional[RoutingProfile] = None,
                           latency: Optional[ExpertLatencyProfile] = None,
                           trace: Optional[Trace] = None,
                           backend: Optional[Backend] = None) -> OffloadPipeline:
    """Wrap `runner` (its weights moved behind a pager) into an OffloadPipeline.

    Residency follows `routing`; without one it follows expert index (with a warning when
    experts are streamed). The expert latency profile is measured on this backend unless given
    (or not needed: r_w 1). `backend` replaces the one `settings` names (tests pass the
    asynchronous CPU test backend, which the configuration does not offer).
    """
    spec = runner.spec
    if backend is None:
        backend = make_backend(settings.backend, settings.emulated_link_gbps, trace)
    if routing is None:
        if settings.resident_ratio < 1.0:
            log.warning("no routing profile for this model: resident experts chosen by index; "
                        "record one with moe_engine.engine.calibrate.calibrate_routing")
        routing = RoutingProfile.uniform(spec.num_layers, spec.num_experts)
    # Only streamed experts are placed by latency; fully resident (a calibration run, or a model
    # that fits) skips the measurement, which costs seconds for real expert sizes.
    if latency is None and settings.resident_ratio < 1.0:
        proto = next(layer.experts[0] for layer in runner.weights.layers if layer.experts)
        latency = measure_expert_profile(backend, proto.w13, proto.w2)
    if latency is not None and not settings.cpu_experts:
        latency = _without_cpu_experts(latency)
    pager = WeightPager(runner.weights, backend, routing, settings.resident_ratio,
                        packet_bytes=settings.packet_bytes,
                        budget_bytes=settings.device_memory_bytes)
    runner.weights = pager.device_weights
    if not backend.device_is_host:
        _place_runner_state(runner, backend, pager, settings.attention_on_device)
    return OffloadPipeline(runner, pager, ExpertPlacer(latency, settings.ffn_on_device),
                           attention_on_device=settings.attention_on_device,
                           group_ffn=settings.group_ffn, trace=trace)


def _place_runner_state(runner: ModelRunner, backend, pager: WeightPager,
                        attention_on_device: bool) -> None:
    """RoPE tables on the device; with attention on the device, the KV cache too (the policy
    then budgets it in device memory) and torch's decode attention, which runs on any device."""
    pager.ledger.reserve(runner.state_nbytes(kv_cache=attention_on_device),
                         "RoPE tables and KV cache" if attention_on_device else "RoPE tables")
    runner.place(backend.to_device, kv_cache=attention_on_device)
    if attention_on_device:
        runner.attention = DecodeAttention("torch", runner.attention.num_threads)


def _without_cpu_experts(latency: ExpertLatencyProfile) -> ExpertLatencyProfile:
    return ExpertLatencyProfile(LatencyCurve.linear(_NEVER_ON_CPU, _NEVER_ON_CPU),
                                latency.device, latency.link_bytes_per_s, latency.expert_bytes)
