"""Tensors one engine step feeds the model and the sampler, built from its sequences.

Kept apart from the engine loop so the loop reads as schedule, pack, run, sample; the
hardware profiler times all of it by running the loop itself (tools/profile_hardware.py,
`measure_host_overhead`).
"""
from __future__ import annotations

import torch

from moe_engine.engine.model_runner import MicroBatchInput
from moe_engine.engine.sampling import SamplingBatch
from moe_engine.engine.sequence import Sequence


def micro_batch_input(seqs: list[Sequence], block_size: int) -> MicroBatchInput:
    """Packed inputs of one micro-batch (prefills first, as the scheduler ordered them): no
    padding; a prefill feeds all its tokens, a decode its last one with its block table."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    prefill_lens: list[int] = []
    tables: list[list[int]] = []
    ctx: list[int] = []
    last: list[int] = []
    for seq in seqs:
        table = seq.block_table
        if seq.is_prefill:
            n = seq.num_tokens
            ids.extend(seq.token_ids)
            positions.extend(range(n))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(n))
            prefill_lens.append(n)
        else:
            p = seq.num_tokens - 1
            ids.append(seq.token_ids[-1])
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
            tables.append(table)
            ctx.append(seq.num_tokens)
        last.append(len(ids) - 1)
    block_tables = context_lens = None
    if tables:
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        context_lens = torch.tensor(ctx, dtype=torch.int32)
    return MicroBatchInput(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        prefill_lens=prefill_lens, num_decode=len(tables), block_tables=block_tables,
        context_lens=context_lens, logits_indices=torch.tensor(last, dtype=torch.int64))


def sampling_batch(seqs: list[Sequence]) -> SamplingBatch:
    """Per-sequence sampling parameters in batch order; `positions` is the index of the token
    being sampled, so a seeded draw is the same however the sequence was batched."""
    return SamplingBatch(
        temperature=torch.tensor([s.sampling.temperature for s in seqs], dtype=torch.float32),
        top_p=torch.tensor([s.sampling.top_p for s in seqs], dtype=torch.float32),
        top_k=torch.tensor([s.sampling.top_k for s in seqs], dtype=torch.int64),
        seeds=torch.tensor([s.seed for s in seqs], dtype=torch.int64),
        positions=torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64))
