"""Continuous batching with KV admission and preemption (MoE-Lens, section 6.2).

Each step: every running (decoding) sequence whose next token fits in the KV cache is scheduled,
oldest first; when blocks run out the newest running sequences are preempted (blocks freed,
requeued at the head of the waiting queue for recompute). Then, unless the step preempted,
prefills are admitted from the head of the queue up to the per-step token budget and the KV
capacity left. The step's sequences are split into micro-batches with Lightning's Algorithm 2.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from moe_engine.engine.batching import partition
from moe_engine.engine.block_manager import BlockAllocator, WindowPool
from moe_engine.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledStep:
    """The sequences of one step, grouped in micro-batches (prefills first within each)."""

    micro_batches: list[list[Sequence]]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def sequences(self) -> list[Sequence]:
        return [s for mb in self.micro_batches for s in mb]

    @property
    def is_empty(self) -> bool:
        return not self.micro_batches


class Scheduler:
    """Waiting queue + running set over a block allocator."""

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_prefill_tokens: int,
                 num_micro_batches: int = 1, watermark: float = 0.01,
                 window_pool: Optional[WindowPool] = None):
        self.allocator = allocator
        # The sliding-window layers' own blocks (GPT-OSS); None: every layer in `allocator`.
        self.window_pool = window_pool
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.num_micro_batches = num_micro_batches
        # Free blocks kept back at admission so fresh prefills do not force the next decode
        # step straight into preemption.
        self.watermark_blocks = int(watermark * allocator.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # admission order: newest at the right
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        decodes, preempted = self._schedule_decodes()
        prefills = [] if preempted else self._admit_prefills(len(decodes))
        step = self._partition(prefills, decodes)
        step.preempted = preempted
        return step

    def _schedule_decodes(self) -> tuple[list[Sequence], list[Sequence]]:
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        pending = deque(self.running)
        while pending and len(scheduled) < self.max_num_seqs:
            seq = pending.popleft()
            while not self._can_append(seq):
                if pending:
                    victim = pending.pop()
                    self.preempt(victim)
                    preempted.append(victim)
                else:
                    self.preempt(seq)
                    preempted.append(seq)
                    break
            else:
                self._append_slot(seq)
                scheduled.append(seq)
        return scheduled, preempted

    def _admit_prefills(self, num_decodes: int) -> list[Sequence]:
        """Prompts from the head of the queue up to the step's token budget. max_num_seqs bounds
        the sequences that will decode: a prompt whose only token comes from its prefill (a
        scoring row, max_new_tokens=1) leaves at the end of the step, so it takes no decode slot
        and a prefill-only run fills every pass to the budget whatever N is."""
        admitted: list[Sequence] = []
        tokens = staying = 0
        while self.waiting:
            seq = self.waiting[0]
            leaves = seq.max_remaining_tokens() <= 1
            if not leaves and num_decodes + staying >= self.max_num_seqs:
                break
            n = seq.num_tokens
            # The first prefill of a step is always admitted (KV permitting), so a prompt over
            # the token budget still runs instead of blocking the queue.
            if admitted and tokens + n > self.max_prefill_tokens:
                break
            need = self.allocator.blocks_needed(n)
            reserve = self.watermark_blocks if self.running else 0
            if self.allocator.num_free - need < reserve or not self._window_fits(seq, n):
                break
            self.waiting.popleft()
            seq.block_table = self.allocator.allocate(need)
            if self.window_pool is not None:
                self.window_pool.grow(seq.window_table, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            tokens += n
            staying += not leaves
        return admitted

    def _partition(self, prefills: list[Sequence], decodes: list[Sequence]) -> ScheduledStep:
        seqs = prefills + decodes
        if not seqs:
            return ScheduledStep(micro_batches=[])
        n_ub = min(self.num_micro_batches, len(seqs))
        # Lightning's cache-share check is for static per-micro-batch caches. Here every
        # scheduled sequence already holds its blocks in the shared paged pool, so a micro-batch's
        # share is the pool minus the blocks of sequences outside the step, and gen_len is 0
        # (growth is handled by preemption). ubs is the per-micro-batch share of max_num_seqs.
        in_step = set(seqs)
        held_elsewhere = sum(len(s.block_table) for s in self.running if s not in in_step)
        share = (self.allocator.num_blocks - held_elsewhere) * self.allocator.block_size
        # Prefill-only sequences admitted beyond N count toward the per-micro-batch cap too.
        part = partition(seqs, [s.num_tokens for s in seqs], n_ub,
                         max_items=math.ceil(max(self.max_num_seqs, len(seqs)) / n_ub), cache_size=share)
        # Aborted prefills go back to the head of the queue in order, blocks returned, and are
        # retried next step; an aborted decode keeps its blocks and skips this step.
        for seq in reversed([s for s in part.aborted if s.is_prefill]):
            self._release(seq)
            seq.status = SequenceStatus.WAITING
            self.running.remove(seq)
            self.waiting.appendleft(seq)
        micro_batches = [sorted(mb, key=lambda s: not s.is_prefill) for mb in part.micro_batches]
        step = ScheduledStep(micro_batches=micro_batches)
        for s in step.sequences:
            if s.is_prefill:
                step.num_prefill_tokens += s.num_tokens
            else:
                step.num_decode_tokens += 1
        return step

    def _window_fits(self, seq: Sequence, num_tokens: int) -> bool:
        pool = self.window_pool
        return pool is None or pool.allocator.can_allocate(pool.needed(seq.window_table, num_tokens))

    def _can_append(self, seq: Sequence) -> bool:
        if self.window_pool is not None:
            # Blocks that left the window go back first: a sequence never waits on its own.
            self.window_pool.expire(seq.window_table, seq.num_tokens)
        need = self.allocator.blocks_needed(seq.num_tokens) - len(seq.block_table)
        return (need <= 0 or self.allocator.can_allocate(need)) and \
            self._window_fits(seq, seq.num_tokens)

    def _append_slot(self, seq: Sequence) -> None:
        need = self.allocator.blocks_needed(seq.num_tokens) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.allocator.allocate(need))
        if self.window_pool is not None:
            self.window_pool.grow(seq.window_table, seq.num_tokens)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
        if self.window_pool is not None:
            self.window_pool.release(seq.window_table)

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and requeue it at the head for recompute."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """A finished sequence leaves at once and returns its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
