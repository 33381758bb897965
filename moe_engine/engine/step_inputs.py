"""Tensors one engine step feeds the model and the sampler, built from its sequences.

Kept apart from the engine loop so the loop reads as schedule, pack, run, sample; the
hardware profiler times all of it by running the loop itself (tools/profile_hardware.py,
`measure_host_overhead`).
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_engine.engine.model_runner import MicroBatchInput
from moe_engine.engine.sampling import SamplingBatch
from moe_engine.engine.sequence import Sequence


def micro_batch_input(seqs: list[Sequence], block_size: int,
                      windowed: bool = False) -> MicroBatchInput:
    """Packed inputs of one micro-batch (prefills first, as the scheduler ordered them): no
    padding; a prefill feeds all its tokens, a decode its last one with its block table.
    windowed: the sliding-window layers have their own blocks (Sequence.window_table); a
    position whose block has left the window (or was never kept) gets slot -1 (not stored)."""
    ids: list[int] = []
    positions: list[int] = []
    tables: list[list[int]] = []
    window_tables: list[list[int]] = []
    ctx: list[int] = []
    last: list[int] = []
    for seq in seqs:
        if seq.is_prefill:
            ids.extend(seq.token_ids)
            positions.extend(range(seq.num_tokens))
        else:
            ids.append(seq.token_ids[-1])
            positions.append(seq.num_tokens - 1)
            tables.append(seq.block_table)
            window_tables.append(seq.window_table)
            ctx.append(seq.num_tokens)
        last.append(len(ids) - 1)
    step_positions = [(seq, p) for seq in seqs
                      for p in (range(seq.num_tokens) if seq.is_prefill else [seq.num_tokens - 1])]
    out = MicroBatchInput(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=_slots([(s.block_table, p) for s, p in step_positions], block_size),
        prefill_lens=[s.num_tokens for s in seqs if s.is_prefill], num_decode=len(tables),
        block_tables=_tables(tables), context_lens=(torch.tensor(ctx, dtype=torch.int32)
                                                     if tables else None),
        logits_indices=torch.tensor(last, dtype=torch.int64))
    if windowed:
        out.window_slot_mapping = _slots([(s.window_table, p) for s, p in step_positions],
                                         block_size)
        out.window_block_tables = _tables(window_tables)
    return out


def _slots(at: list[tuple[list[int], int]], block_size: int) -> torch.Tensor:
    """slot of each (block table, position): -1 where the table holds no block for it."""
    slots = []
    for table, p in at:
        b = p // block_size
        block = table[b] if b < len(table) else -1
        slots.append(block * block_size + p % block_size if block >= 0 else -1)
    return torch.tensor(slots, dtype=torch.int64)


def _tables(tables: list[list[int]]) -> Optional[torch.Tensor]:
    if not tables:
        return None
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def sampling_batch(seqs: list[Sequence]) -> SamplingBatch:
    """Per-sequence sampling parameters in batch order; `positions` is the index of the token
    being sampled, so a seeded draw is the same however the sequence was batched."""
    return SamplingBatch(
        temperature=torch.tensor([s.sampling.temperature for s in seqs], dtype=torch.float32),
        top_p=torch.tensor([s.sampling.top_p for s in seqs], dtype=torch.float32),
        top_k=torch.tensor([s.sampling.top_k for s in seqs], dtype=torch.int64),
        seeds=torch.tensor([s.seed for s in seqs], dtype=torch.int64),
        positions=torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64))
