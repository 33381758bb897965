"""The performance model replays the engine's scheduler (perf/schedule.py) step by step: its
steps must be the ones the real Scheduler runs, prompt tokens, prompts, decode sequences and
their contexts, on runs that fill the batch, drain it and admit as slots free up."""
from __future__ import annotations

import random

import pytest

from moe_engine.engine.block_manager import BlockAllocator
from moe_engine.engine.request import SamplingParams
from moe_engine.engine.scheduler import Scheduler
from moe_engine.engine.sequence import Sequence
from moe_engine.perf import Policy, load_preset, predict, workload_spec_from_lengths
from moe_engine.perf.cost import engine_step_times
from moe_engine.perf.schedule import StepBucket, StepShape, step_shapes, step_trace
from moe_engine.perf.specs import ModelSpec
from moe_engine.tools.presets import PRESETS, hf_config


def _engine_steps(prompts: list[int], gens: list[int], max_seqs: int, budget: int) -> list[StepShape]:
    """The real scheduler on a cache large enough never to preempt, driven as the engine drives
    it: after each step every sequence has its K/V cached and one token appended; a sequence
    that reached its max_new_tokens finishes."""
    sched = Scheduler(BlockAllocator(100_000, 16), max_num_seqs=max_seqs, max_prefill_tokens=budget)
    for i, (p, g) in enumerate(zip(prompts, gens)):
        sched.add(Sequence(str(i), list(range(1, p + 1)), SamplingParams(max_new_tokens=g), 0, 1_000_000))
    shapes = []
    while sched.has_unfinished():
        step = sched.schedule()
        decodes = [s for s in step.sequences if not s.is_prefill]
        shapes.append(StepShape(step.num_prefill_tokens, len(step.sequences) - len(decodes), len(decodes),
                                sum(s.num_tokens for s in decodes)))  # the new token is cached this step
        for s in step.sequences:
            s.num_cached_tokens = s.num_tokens
            s.token_ids.append(7)
            if s.num_completion_tokens >= s.sampling.max_new_tokens:
                sched.finish(s)
    return shapes


@pytest.mark.parametrize("max_seqs,budget", [(320, 2048), (16, 512), (4, 64), (64, 100)])
def test_replay_runs_the_steps_the_scheduler_runs(max_seqs, budget):
    rng = random.Random(max_seqs * 7 + budget)
    prompts = [rng.randint(1, 160) for _ in range(120)] + [300]  # one over the 64/100 budgets
    gens = [rng.choice([1, 2, 5, 32, 64]) for _ in prompts]
    assert list(step_shapes(prompts, gens, max_seqs, budget)) == _engine_steps(prompts, gens, max_seqs, budget)


def test_buckets_keep_every_step_token_and_context():
    rng = random.Random(3)
    prompts = tuple(rng.randint(8, 200) for _ in range(300))
    gens = tuple(rng.randint(1, 80) for _ in prompts)
    shapes = list(step_shapes(prompts, gens, 64, 1024))
    buckets = step_trace(prompts, gens, 64, 1024)
    assert len(buckets) < len(shapes) / 3
    assert sum(b.steps for b in buckets) == len(shapes)
    assert sum(b.steps * b.prefill_tokens for b in buckets) == pytest.approx(sum(prompts))
    assert sum(b.steps * b.decode_seqs for b in buckets) == pytest.approx(sum(g - 1 for g in gens))
    assert sum(b.steps * b.decode_seqs * b.decode_context for b in buckets) == pytest.approx(
        sum(s.decode_context_sum for s in shapes))
    with pytest.raises(ValueError, match="2 generation lengths for 3 prompts"):
        list(step_shapes([1, 2, 3], [4, 5], 8, 64))


def test_a_mixed_step_costs_its_prefill_and_decode_together():
    """A step carrying both is dearer than its prefill alone and cheaper than the two as separate
    steps (one pass over the weights, one step's host work), and the bounded-run prediction
    is the sum of its traced steps."""
    m = ModelSpec.from_hf_config(hf_config(PRESETS["small-mixtral"]))
    hw = load_preset("cpu")
    prompts, gens = [128] * 64, [32] * 64
    wl = workload_spec_from_lengths(prompts, gens)
    pol = Policy(64, 64, False, True, 1.0, prefill_tokens=2048)
    both = engine_step_times(m, hw, pol, wl, StepBucket(1, 2048, 16, 48, 150.0), True).total
    prefill = engine_step_times(m, hw, pol, wl, StepBucket(1, 2048, 16, 0, 0.0), True).total
    decode = engine_step_times(m, hw, pol, wl, StepBucket(1, 0, 0, 48, 150.0), True).total
    assert prefill < both < prefill + decode
    pred = predict(m, hw, wl, pol, True)
    traced = sum(b.steps * engine_step_times(m, hw, pol, wl, b, True).total
                 for b in step_trace(tuple(prompts), tuple(gens), 64, 2048))
    assert pred.prefill_s + pred.decode_s == pytest.approx(traced)
    assert pred.throughput_tok_s == pytest.approx(sum(gens) / traced)


def test_bucket_edges_are_the_first_power_of_1_25_at_or_above_the_count():
    """`_edge` bisects a table of edges; past the table it walks on. Either way a count lands
    in the bucket the repeated-multiplication definition gives, boundaries included."""
    from moe_engine.perf.schedule import _edge

    def by_definition(n: float) -> int:
        if n <= 0:
            return 0
        i, edge = 1, 1.25
        while n > edge:
            edge *= 1.25
            i += 1
        return i

    rng = random.Random(7)
    counts = [0, -3, 0.4, 1, 1.25, 1.26, 1e19, 3e19, 1e30] + list(range(1, 3000))
    counts += [rng.random() * 10 ** rng.randint(0, 12) for _ in range(3000)]
    edge = 1.0
    for _ in range(230):  # every edge of the table and past it, and its float neighbours
        counts += [edge, edge * (1 + 1e-15), edge * (1 - 1e-15)]
        edge *= 1.25
    assert [_edge(n) for n in counts] == [by_definition(n) for n in counts]
