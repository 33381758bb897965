"""Routing calibration: the routing profile by which an offloaded engine keeps experts resident.

The profile is looked up once (beside the model, else in the cache dir); when residency needs
one (r_w < 1) and none is saved, a calibration generate on the bundled prompts records it, with
every expert resident on the plain runner, through the runner's routing observer, and it is
saved once. This runs while the engine still has its plain runner, before the offloaded runner
is built, so recording never goes through the pager.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Optional

from moe_engine.engine.request import Request, SamplingParams
from moe_engine.offload.routing import RoutingProfile, RoutingRecorder, find_profile, profile_path

log = logging.getLogger(__name__)

CALIBRATION_CORPUS = Path(__file__).resolve().parents[2] / "data" / "sample_prompts.jsonl"


def calibration_requests(path: Path = CALIBRATION_CORPUS, limit: int = 32,
                         new_tokens: int = 1) -> list[Request]:
    """The first `limit` rows of the bundled sample corpus as greedy requests (empty when the
    corpus is not there, e.g. in an installed package without data/).

    One new token each: the prompts' tokens make the counts (~2,550 routed tokens with the
    built-in tokenizer), and a decode step adds only one token a row. On the disk tier every
    calibration step reads every expert outside the host tier from disk: small-mixtral's first
    disk-tier run (tools/rss_check.py: 16 rows, 300 MB host budget) read 26.2 GB to calibrate
    with 16 new tokens a row, 7.9 GB with one. With every expert in memory they cost 15 decode
    steps of compute."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines()[:limit]:
        row = json.loads(line)
        out.append(Request(f"calib-{len(out)}", prompt=row.get("prompt"),
                           messages=None if "prompt" in row else row.get("messages"),
                           sampling=SamplingParams(max_new_tokens=new_tokens)))
    return out


def record_routing(engine, requests: Iterable[Request]) -> RoutingProfile:
    """Run `requests` on `engine` (its plain, fully resident runner) and count every MoE
    layer's expert choices."""
    runner = engine.runner
    spec = engine.spec
    recorder = RoutingRecorder(spec.num_layers, spec.num_experts)
    runner.routing_observer = recorder.record
    try:
        for _ in engine.generate(requests):
            pass
    finally:
        runner.routing_observer = None
    return recorder.profile()


def save_routing_profile(profile: RoutingProfile, model_dir: str | Path,
                         cache_dir: Optional[str | Path] = None) -> Path:
    """Save where `find_profile` looks: beside the model, or the cache dir when that is
    read-only."""
    return profile.save(profile_path(model_dir, cache_dir))


def find_or_record_routing(engine, model_dir: str | Path, resident_ratio: float,
                    cache_dir: Optional[str | Path] = None) -> Optional[RoutingProfile]:
    """The model's saved profile; with none saved and r_w < 1 (residency then matters), one
    recorded on the bundled prompts and saved. None when there is none and none is needed or
    the prompts are missing (the pager then ranks experts by index)."""
    profile = find_profile(model_dir, cache_dir)
    if profile is not None or resident_ratio >= 1.0:
        return profile
    return record_bundled_routing(engine, model_dir, cache_dir)


def record_bundled_routing(engine, model_dir: str | Path,
                           cache_dir: Optional[str | Path] = None) -> Optional[RoutingProfile]:
    """A routing profile recorded with `engine` on the bundled prompts and saved for the next
    run (None when the prompts are missing)."""
    requests = calibration_requests()
    if not requests:
        return None
    log.info("no routing profile for %s: recording one on %d bundled prompts", model_dir,
             len(requests))
    profile = record_routing(engine, requests)
    try:
        save_routing_profile(profile, model_dir, cache_dir)
    except OSError as exc:  # an unwritable cache must not stop the run
        log.warning("could not save the routing profile: %s", exc)
    return profile


def calibrate_routing(model_dir: str | Path, requests: Iterable[Request], config=None,
                      dtype: str = "auto", save: bool = True,
                      cache_dir: Optional[str | Path] = None) -> RoutingProfile:
    """Record a model's routing profile on `requests` with a fully resident CPU engine and
    (unless `save` is False) save it where `find_profile` looks."""
    from moe_engine.config import EngineConfig
    from moe_engine.engine.llm_engine import LLMEngine

    config = replace(config or EngineConfig(), resident_ratio=1.0, backend="cpu",
                     emulated_link_gbps=None, offload_pipeline=False)
    with LLMEngine(model_dir, config, dtype=dtype) as engine:
        profile = record_routing(engine, requests)
    if save:
        save_routing_profile(profile, model_dir, cache_dir)
    return profile
