"""Runs the engine itself on a model's checkpoint to measure its in-run factors (EngineFactors).

The profiler's micro-benchmarks time each part of a step alone, many times over on the same
tensors: warm caches, a heap that hands back the same pages, one OpenMP team kept busy. In a
run each part finds its tensors evicted by the parts before it (the KV cache the attention
streams, the LM head's logits, the step's scheduling) and the heap in another state. On
tiny-mixtral's default run that made the QKV/O part 1.7-2x, attention 1.3-1.5x and the experts
1.1-1.3x their micro-benchmark, and the report's predicted throughput 36-66% above the engine's.
Here a short bounded run of the engine (prompts of several lengths, generation lengths that
drain the batch step by step, continuous batching) is timed part by part (EngineStats) and set
against what the model predicts from the micro-benchmarks for the same steps
(`perf.cost.traced_component_times`); the ratio of each part is the layout's factor. It is
what MoE-Lens's pipeline profiler does: measure the pipeline as it runs, not its parts alone.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from moe_engine.perf.cost import Policy, traced_component_times
from moe_engine.perf.hardware import config_figures, spec_from_figures
from moe_engine.perf.specs import ENGINE_COMPONENTS, ModelSpec, layer_layout, workload_spec_from_lengths

PROMPT_CYCLE = (16, 32, 64, 128, 256)
GEN_CYCLE = (8, 16, 32, 64)
# The largest that the model predicts to run within the budget: more steps average the noise.
REQUEST_COUNTS = (256, 128, 64, 32, 16, 8)
BUDGET_S = {True: 0.5, False: 4.0}  # predicted seconds of one run, by fast mode (tests: 0.5)
REPEATS = {True: 1, False: 3}
PREFILL_TOKENS = 2048  # the engine's default pass
# A workload whose smallest run the model prices at more than this many budgets is not run
# (a large model's few seconds of generation would be minutes): its factors stay 1.
OVER_BUDGET = 4.0
# A factor outside these bounds says the run went wrong (another process took the cores for
# part of it), not that the micro-benchmarks are that far off: it is clamped.
FACTOR_BOUNDS = (0.5, 4.0)


def engine_knobs(m: ModelSpec, native: str | None = None) -> dict[str, str]:
    """The EngineConfig fields under which the engine holds the weights as m describes them
    (the inverse of model.spec.precision_storage and of the policy stage's held storages):
    torch's GEMMs, medium's bf16 pairs and int8 quads, high's bf16x3, quantized experts, and
    experts the checkpoint stores quantized (`native`, MXFP4) widened to the model dtype."""
    from moe_engine.model.spec import (BF16X3_STORAGE, FLOAT_STORAGE, PAIR_STORAGE, QUAD_STORAGE,
                                       TORCH_GEMM_STORAGE)

    held = {m.weight_storage, m.expert_storage}
    knobs: dict[str, str] = {}
    if m.weight_storage == TORCH_GEMM_STORAGE:
        knobs["gemm"] = "torch"
    if held & {PAIR_STORAGE, QUAD_STORAGE}:
        knobs["matmul_precision"] = "medium"
    elif BF16X3_STORAGE in held:
        knobs["matmul_precision"] = "high"
    if m.expert_storage in ("int8", "int4", "mxfp4"):
        knobs["expert_dtype"] = m.expert_storage
    elif m.expert_storage == QUAD_STORAGE:
        knobs["expert_dtype"] = "int8"
    elif m.expert_storage is None and native is not None and "gemm" not in knobs:
        knobs["expert_dtype"] = FLOAT_STORAGE.get(m.torch_dtype, "bf16")  # torch's GEMMs widen
    return knobs


class CalibrationSkipped(Exception):
    """The run would not measure what the model prices (the engine would hold the experts in
    another storage than the profile describes) or would take too long."""


def calibration_lengths(count: int, max_len: int) -> tuple[list[int], list[int]]:
    """Prompt and generation lengths of `count` requests: every prompt length with every
    generation length, in turn, cut to fit `max_len` tokens in all."""
    prompts, gens = [], []
    for i in range(count):
        g = GEN_CYCLE[(i // len(PROMPT_CYCLE)) % len(GEN_CYCLE)]
        p = min(PROMPT_CYCLE[i % len(PROMPT_CYCLE)], max(1, max_len - g))
        prompts.append(p)
        gens.append(g)
    return prompts, gens


def _policy(count: int) -> Policy:
    """The engine's run as the model sees it: every request admitted at once, one micro-batch."""
    return Policy(count, count, False, True, 1.0, 0.0, PREFILL_TOKENS)


def measure_engine_factors(checkpoint: Path | str, m: ModelSpec, data: dict[str, Any], fast: bool,
                           threads: int) -> dict[str, Any]:
    """The in-run factors of m's layout, from the engine run on `checkpoint` (whose spec is m)
    against the model priced with the profile `data` (its micro-benchmark figures only).
    Returns the profile row: the layout, one factor per ENGINE_COMPONENTS, the requests run
    and the measured and predicted seconds of one run."""
    from moe_engine.config import EngineConfig, HardwareConfig
    from moe_engine.engine.llm_engine import LLMEngine
    from moe_engine.engine.request import Request, SamplingParams

    # The profile's figures over the config's defaults, as hardware.profile=auto reads them.
    hw = spec_from_figures({**config_figures(HardwareConfig()), **data}, m.weight_storage)
    hw = replace(hw, engine_factors=())
    knobs = engine_knobs(m, ModelSpec.from_hf_config(checkpoint, dtype=m.torch_dtype).expert_storage)
    predicted: dict[str, float] = {}
    for count in REQUEST_COUNTS:
        prompts, gens = calibration_lengths(count, m.max_position_embeddings)
        predicted = traced_component_times(m, hw, _policy(count), workload_spec_from_lengths(prompts, gens))
        if sum(predicted.values()) <= BUDGET_S[fast]:
            break
    if sum(predicted.values()) > OVER_BUDGET * BUDGET_S[fast]:
        raise CalibrationSkipped(f"{count} requests are priced at {sum(predicted.values()):.0f} s a run")
    tokens = sum(prompts) + sum(gens) + 2 * count * 16  # a block of slack per sequence
    kv_gb = 1.5 * tokens * m.num_layers * m.kv_bytes_per_token_layer / 1e9 + 0.01
    config = EngineConfig(threads=threads, kv_cache_gb=kv_gb, max_num_seqs=count,
                          max_prefill_tokens=PREFILL_TOKENS, num_micro_batches=1, **knobs)
    rng = random.Random(0)
    requests = [[rng.randrange(3, m.vocab_size) for _ in range(p)] for p in prompts]

    def run(ids_gens) -> None:
        for _ in engine.generate(Request(f"calibrate-{i}", prompt_token_ids=ids,
                                         sampling=SamplingParams(max_new_tokens=g, ignore_eos=True))
                                 for i, (ids, g) in enumerate(ids_gens)):
            pass

    engine = LLMEngine(checkpoint, config, dtype=m.torch_dtype)
    if engine.spec.expert_storage != m.expert_storage:
        engine.close()
        raise CalibrationSkipped(f"the engine holds the experts as {engine.spec.expert_storage} "
                                 f"under {knobs}, the model prices them as {m.expert_storage}")
    runs: list[dict[str, float]] = []
    seconds: list[float] = []
    try:
        # untimed: the first calls of each kernel and the heap's first growth are one-off costs
        run([(ids, 4) for ids in requests[:8]])
        for _ in range(REPEATS[fast]):
            started = time.perf_counter()
            run(zip(requests, gens))
            seconds.append(time.perf_counter() - started)
            s = engine.stats
            parts = {"dense": s.dense_time_s, "attention": s.attention_time_s, "ffn": s.ffn_time_s,
                     "head": s.head_time_s}
            # host: the rest of the run (sampling, scheduling, admission, results), so the
            # factors price the run's whole wall time (CALIBRATION_METHOD 3)
            runs.append({**parts, "host": max(0.0, s.wall_time_s - sum(parts.values()))})
    finally:
        engine.close()
    low, high = FACTOR_BOUNDS
    factors = {c: round(min(high, max(low, statistics.median(r[c] for r in runs) / predicted[c]))
                        if predicted[c] > 0 else 1.0, 3)
               for c in ENGINE_COMPONENTS}
    return {"layout": layer_layout(m), **factors, "requests": count,
            "run_s": round(statistics.median(seconds), 3), "predicted_s": round(sum(predicted.values()), 3)}
