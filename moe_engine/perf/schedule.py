"""The engine's step sequence on a bounded run, replayed from token counts alone (MoE-Lens's
stage-2 model: predict the run as the scheduler will run it, not as separate prefill and decode
phases).

The engine's scheduler (engine/scheduler.py) decodes every running sequence each step and admits
waiting prompts, in order, up to the step's prefill token budget and the decode batch N. So a
shard's prefill does not run alone: its later passes carry the decode tokens of the prompts
admitted before them, and the last prompts admitted decode while the first ones have finished.
A step's cost depends on its prefill tokens, its prompts and its decode sequences at their
contexts; `step_trace` yields those per step, grouped into buckets of similar steps so the cost
model prices a few dozen steps, not thousands.

Not replayed: KV-capacity admission and preemption (the search only keeps policies whose cache
holds N sequences at their final length) and the micro-batch split (the cost model divides a
step's tokens evenly).
"""
from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class StepBucket:
    """`steps` engine steps of about the same shape, by their means: prefill tokens and prompts,
    decode sequences and those sequences' context (cached tokens, including the new one)."""

    steps: int
    prefill_tokens: float
    prefill_prompts: float
    decode_seqs: float
    decode_context: float

    @property
    def carries_prefill(self) -> bool:
        return self.prefill_prompts > 0


def _geometric_edges(count: int) -> tuple[float, ...]:
    """1, 1.25, 1.25^2, ... by repeated multiplication, `count` of them."""
    edges = [1.0]
    for _ in range(count - 1):
        edges.append(edges[-1] * 1.25)
    return tuple(edges)


# Past 1.25^199 (~2e19) no count reaches; `_edge` walks on for one that would.
_EDGES = _geometric_edges(200)


def _edge(n: float) -> int:
    """Geometric bucket index of a count (0 for none; ratio about 1.25 between edges), so steps
    of similar size share one cost evaluation: the first edge at or above n (index 1 for n up
    to 1.25). A bisection, since the search buckets millions of steps."""
    if n <= 0:
        return 0
    if n <= _EDGES[-1]:
        return bisect.bisect_left(_EDGES, n, 1)
    i, edge = len(_EDGES) - 1, _EDGES[-1]
    while n > edge:
        edge *= 1.25
        i += 1
    return i


@dataclass(frozen=True)
class StepShape:
    """One engine step: prompts admitted and their tokens, decode sequences and the sum of
    their contexts (cached tokens, the new one included)."""

    prefill_tokens: int
    prefill_prompts: int
    decode_seqs: int
    decode_context_sum: int


def step_shapes(prompt_lengths: Sequence[int], gen_lengths: Sequence[int], max_seqs: int,
                prefill_budget: int) -> Iterator[StepShape]:
    """Replay the scheduler on requests in queue order (prompt length p_i, generation g_i: g_i - 1
    decode steps after the prefill that yields the first token), one step at a time.

    Each step decodes every running sequence, then admits prompts from the head of the queue
    while the budget lasts (the first always, so a prompt over the budget still runs) and, for a
    prompt that will decode (g_i > 1), while fewer than `max_seqs` sequences would decode. A
    prompt admitted at step s decodes from step s + 1 on, at context p_i + t - s in step t."""
    if len(prompt_lengths) != len(gen_lengths):
        raise ValueError(f"{len(gen_lengths)} generation lengths for {len(prompt_lengths)} prompts")
    max_seqs = max(1, int(max_seqs))
    # Running sequences as (first step they no longer decode, context offset p - s): the batch's
    # context sum at step t is sum(offsets) + running * t.
    leaving: list[tuple[int, int]] = []
    offsets = 0
    nxt, n = 0, len(prompt_lengths)
    step = 0
    while True:
        while leaving and leaving[0][0] <= step:
            offsets -= heapq.heappop(leaving)[1]
        if nxt == n and not leaving:
            return
        decode = len(leaving)
        decode_ctx = offsets + decode * step
        tokens = prompts = staying = 0
        while nxt < n:
            p, g = prompt_lengths[nxt], gen_lengths[nxt]
            if g > 1 and decode + staying >= max_seqs:
                break
            if prompts and tokens + p > prefill_budget:
                break
            tokens += p
            prompts += 1
            nxt += 1
            if g > 1:
                staying += 1
                heapq.heappush(leaving, (step + g, p - step))
                offsets += p - step
        yield StepShape(tokens, prompts, decode, decode_ctx)
        step += 1


# The policy search asks for one trace per (N, pass size) pair it scores: a few hundred, each
# asked for again by every micro-batch size and placement. Fewer slots than pairs thrashed.
@lru_cache(maxsize=1024)
def step_trace(prompt_lengths: tuple[int, ...], gen_lengths: tuple[int, ...], max_seqs: int,
               prefill_budget: int) -> tuple[StepBucket, ...]:
    """`step_shapes` grouped into buckets of steps with about the same prefill tokens and decode
    sequences (geometric edges), each described by its steps' means."""
    acc: dict[tuple[int, int], list[float]] = {}
    for shape in step_shapes(prompt_lengths, gen_lengths, max_seqs, prefill_budget):
        b = acc.setdefault((_edge(shape.prefill_tokens), _edge(shape.decode_seqs)), [0, 0, 0, 0, 0])
        b[0] += 1
        b[1] += shape.prefill_tokens
        b[2] += shape.prefill_prompts
        b[3] += shape.decode_seqs
        b[4] += shape.decode_context_sum
    return tuple(StepBucket(c, t / c, pr / c, d / c, cx / d if d else 0.0)
                 for c, t, pr, d, cx in acc.values())
