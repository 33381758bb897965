"""Assembles the offloaded runner from the engine's knobs: backend, routing profile, expert
latency profile, pager and pipeline. The engine calls `build_offload_pipeline`; nothing here
computes anything itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moe_engine.offload.backend import make_backend
from moe_engine.offload.placement import ExpertLatencyProfile, ExpertPlacer, measure_expert_profile
from moe_engine.engine.model_runner import ModelRunner
from moe_engine.offload.pager import WeightPager
from moe_engine.offload.pipeline import OffloadPipeline
from moe_engine.offload.routing import RoutingProfile, RoutingRecorder, find_profile
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
                           model_dir: Optional[str | Path] = None,
                           routing: Optional[RoutingProfile] = None,
                           latency: Optional[ExpertLatencyProfile] = None,
                           trace: Optional[Trace] = None,
                           recorder: Optional[RoutingRecorder] = None) -> OffloadPipeline:
    """Wrap `runner` (its weights moved behind a pager) into an OffloadPipeline.

    The routing profile comes from `routing`, else the one saved beside the model, else a
    uniform one (with a warning: residency then follows expert index, not popularity).
    The expert latency profile is measured on this backend unless given (or not needed: r_w 1).
    """
    spec = runner.spec
    backend = make_backend(settings.backend, settings.emulated_link_gbps, trace)
    if routing is None and model_dir is not None:
        routing = find_profile(model_dir)
    if routing is None:
        if settings.resident_ratio < 1.0:
            log.warning("no routing profile for this model: resident experts chosen by index; "
                        "record one with moe_engine.offload.routing (calibration run)")
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
    if backend.name != "cpu":
        _place_runner_state(runner, backend, pager, settings.attention_on_device)
    return OffloadPipeline(runner, pager, ExpertPlacer(latency, settings.ffn_on_device),
                           attention_on_device=settings.attention_on_device,
                           group_ffn=settings.group_ffn, trace=trace, recorder=recorder)


def _place_runner_state(runner: ModelRunner, backend, pager: WeightPager,
                        attention_on_device: bool) -> None:
    """RoPE tables on the device; with attention on the device, the KV cache too (the policy
    then budgets it in device memory) and torch's decode attention, which runs on any device."""
    from moe_engine.model.attention import DecodeAttention
    from moe_engine.model.kv_cache import KVCache

    rope = runner.rope
    pager.ledger.reserve(rope.cos.nbytes + rope.sin.nbytes, "RoPE tables")
    rope.cos, rope.sin = backend.to_device(rope.cos), backend.to_device(rope.sin)
    if attention_on_device:
        cache = runner.cache
        pager.ledger.reserve(sum(t.nbytes for t in cache.key + cache.value), "KV cache")
        runner.cache = KVCache(key=[backend.to_device(t) for t in cache.key],
                               value=[backend.to_device(t) for t in cache.value],
                               block_size=cache.block_size)
        runner.attention = DecodeAttention("torch", runner.attention.num_threads)


def _without_cpu_experts(latency: ExpertLatencyProfile) -> ExpertLatencyProfile:
    from moe_engine.offload.placement import LatencyCurve

    return ExpertLatencyProfile(LatencyCurve.linear(_NEVER_ON_CPU, _NEVER_ON_CPU),
                                latency.device, latency.link_bytes_per_s, latency.expert_bytes)


CALIBRATION_CORPUS = Path(__file__).resolve().parents[2] / "data" / "sample_prompts.jsonl"


def calibration_requests(path: Path = CALIBRATION_CORPUS, limit: int = 32,
                         new_tokens: int = 16) -> list:
    """The first `limit` rows of the bundled sample corpus as greedy requests (empty when the
    corpus is not there, e.g. in an installed package without data/)."""
    import json

    from moe_engine.engine.request import Request, SamplingParams

    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines()[:limit]:
        row = json.loads(line)
        out.append(Request(f"calib-{len(out)}", prompt=row.get("prompt"),
                           messages=None if "prompt" in row else row.get("messages"),
                           sampling=SamplingParams(max_new_tokens=new_tokens)))
    return out


def record_routing(engine, requests) -> RoutingProfile:
    """Run `requests` on `engine` with every expert resident on the CPU backend, recording each
    layer's routing; the engine's own runner is put back afterwards."""
    runner = engine.runner
    spec = engine.spec
    recorder = RoutingRecorder(spec.num_layers, spec.num_experts)
    pipe = build_offload_pipeline(runner, OffloadSettings(backend="cpu", resident_ratio=1.0),
                                  routing=RoutingProfile.uniform(spec.num_layers,
                                                                 spec.num_experts),
                                  recorder=recorder)
    engine.runner = pipe
    try:
        for _ in engine.generate(requests):
            pass
    finally:
        pipe.close()
        pipe.backend.close()
        engine.runner = runner
    return recorder.profile()


def calibrate_routing(model_dir: str | Path, requests, config=None, dtype: str = "auto",
                      save: bool = True, cache_dir: Optional[str | Path] = None) -> RoutingProfile:
    """Run `requests` fully resident and record every layer's routing; save the profile where
    `find_profile` looks (beside the model, or the cache dir when that is read-only)."""
    from dataclasses import replace

    from moe_engine.config import EngineConfig
    from moe_engine.engine.llm_engine import LLMEngine
    from moe_engine.offload.routing import profile_path

    config = replace(config or EngineConfig(), resident_ratio=1.0, backend="cpu",
                     emulated_link_gbps=None, offload_pipeline=False)
    profile = record_routing(LLMEngine(model_dir, config, dtype=dtype), requests)
    if save:
        profile.save(profile_path(model_dir, cache_dir))
    return profile
