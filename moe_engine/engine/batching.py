"""Request batching into micro-batches: MoE-Lightning, Algorithm 2 (appendix A.2).

Items are sorted by descending length and each goes into the open micro-batch with the fewest
tokens (greedy longest-processing-time), which keeps micro-batches within one item's length of
each other. A micro-batch that reaches `max_items` closes; an item whose length plus reserved
generation space would overflow the micro-batch's cache share is aborted, to be retried in the
next batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Optional, Sequence, TypeVar

T = TypeVar("T")


@dataclass
class MicroBatch(Generic[T]):
    items: list[T] = field(default_factory=list)
    tokens: int = 0


@dataclass
class Partition(Generic[T]):
    """Output of Algorithm 2: the micro-batches (non-empty) and the aborted items."""

    micro_batches: list[list[T]]
    aborted: list[T]
    tokens: list[int]


def partition(items: Sequence[T], lengths: Sequence[int], num_micro_batches: int,
              max_items: Optional[int] = None, gen_len: int = 0,
              cache_size: Optional[int] = None) -> Partition[T]:
    """Split `items` (with token `lengths`) into at most `num_micro_batches` balanced groups.

    max_items: ubs, most items per micro-batch (None = unbounded). gen_len: tokens reserved per
    item for generation. cache_size: most tokens (lengths + reservations) a micro-batch may hold
    (None = unbounded). Aborted items keep their input order.
    """
    if num_micro_batches < 1:
        raise ValueError("num_micro_batches must be >= 1")
    if len(items) != len(lengths):
        raise ValueError("items and lengths differ in length")
    open_batches: list[MicroBatch[T]] = [MicroBatch() for _ in range(num_micro_batches)]
    closed: list[MicroBatch[T]] = []
    aborted: list[tuple[int, T]] = []
    order = sorted(range(len(items)), key=lambda i: lengths[i], reverse=True)
    for i in order:
        if not open_batches:
            aborted.append((i, items[i]))
            continue
        idx = min(range(len(open_batches)), key=lambda j: open_batches[j].tokens)
        mb = open_batches[idx]
        need = mb.tokens + lengths[i] + (1 + len(mb.items)) * gen_len
        if cache_size is not None and need > cache_size:
            aborted.append((i, items[i]))
            continue
        mb.items.append(items[i])
        mb.tokens += lengths[i]
        if max_items is not None and len(mb.items) == max_items:
            closed.append(open_batches.pop(idx))
    done = [mb for mb in closed + open_batches if mb.items]
    aborted.sort(key=lambda x: x[0])
    return Partition(micro_batches=[mb.items for mb in done], aborted=[it for _, it in aborted],
                     tokens=[mb.tokens for mb in done])
