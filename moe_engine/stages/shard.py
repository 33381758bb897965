"""Tokenize the normalized corpus and split it into shards of balanced token work.

Shards are balanced by tokens (prompt + requested generation), not rows: MTBench-like corpora
have a long tail of long prompts, and a row-balanced split leaves one generate job running long
after the others. Rows that cannot run (rejected while reading, or here: too long, bad chat
template) go to a separate table that the merge step adds back, so every row is accounted for.
"""
from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from moe_engine.config import AppConfig
from moe_engine.engine.tokenizer import PromptTokenizer, load_tokenizer
from moe_engine.io import atomic_path, write_text_atomic
from moe_engine.stages.corpus import read_corpus
from moe_engine.stages.tables import MANIFEST_NAME, REJECTED_NAME, STATUS_PENDING, STATUS_REJECTED



def tokenize_frame(frame: pl.DataFrame, tokenizer: PromptTokenizer,
                   max_prompt_tokens: int | None = None) -> pl.DataFrame:
    """Add prompt_token_ids/prompt_tokens; reject rows whose prompt cannot run on the model.

    The limit is the model's context (a prompt needs room for at least one new token) or the
    workload's max_prompt_tokens when smaller.
    """
    limit = tokenizer.model_max_length - 1
    if max_prompt_tokens is not None:
        limit = min(limit, max_prompt_tokens)
    ids_col: list[list[int] | None] = []
    status = frame["status"].to_list()
    error = frame["error"].to_list()
    for i, row in enumerate(frame.select("prompt", "messages").iter_rows()):
        prompt, messages = row
        if status[i] != STATUS_PENDING:
            ids_col.append(None)
            continue
        try:
            ids = (tokenizer.encode_messages(json.loads(messages)) if messages is not None
                   else tokenizer.encode_prompt(prompt))
        except Exception as exc:  # a template may raise anything; the row is rejected, not the run
            status[i], error[i] = STATUS_REJECTED, f"cannot apply chat template: {exc}"
            ids_col.append(None)
            continue
        if len(ids) > limit:
            status[i] = STATUS_REJECTED
            error[i] = f"prompt has {len(ids)} tokens; the limit is {limit}"
            ids_col.append(None)
            continue
        ids_col.append(ids)
    return frame.with_columns(
        pl.Series("prompt_token_ids", ids_col, dtype=pl.List(pl.Int32)),
        pl.Series("prompt_tokens", [len(x) if x is not None else None for x in ids_col],
                  dtype=pl.Int64),
        pl.Series("status", status, dtype=pl.Utf8),
        pl.Series("error", error, dtype=pl.Utf8),
    )


def assign_shards(work: list[int], num_shards: int) -> list[int]:
    """Greedy longest-processing-time assignment: heaviest row first, to the lightest shard.

    Deterministic (ties broken by input position and shard index), and within 4/3 of the best
    possible makespan.
    """
    order = sorted(range(len(work)), key=lambda i: (-work[i], i))
    heap = [(0, s) for s in range(num_shards)]
    shard_of = [0] * len(work)
    for i in order:
        load, s = heapq.heappop(heap)
        shard_of[i] = s
        heapq.heappush(heap, (load + work[i], s))
    return shard_of


@dataclass(frozen=True)
class ShardManifest:
    """What the shard step produced; merge checks its output against it."""

    num_rows: int
    ids: list[str]
    num_shards: int
    shard_rows: list[int]
    shard_tokens: list[int]
    rejected_rows: int

    def to_json(self) -> dict:
        return self.__dict__.copy()


def write_shards(frame: pl.DataFrame, num_shards: int, out_dir: Path) -> ShardManifest:
    """Write out_dir/{i}.parquet for runnable rows, rejected.parquet and manifest.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runnable = frame.filter(pl.col("status") == STATUS_PENDING)
    rejected = frame.filter(pl.col("status") != STATUS_PENDING)
    work = (runnable["prompt_tokens"] + runnable["max_new_tokens"]).to_list()
    shard_col = assign_shards(work, num_shards)
    runnable = runnable.with_columns(pl.Series("shard", shard_col, dtype=pl.Int64))
    rows, tokens = [], []
    for s in range(num_shards):
        part = runnable.filter(pl.col("shard") == s).sort("order")
        _atomic_parquet(part, out_dir / f"{s}.parquet")
        rows.append(part.height)
        tokens.append(int(part["prompt_tokens"].sum() or 0))
    _atomic_parquet(rejected.with_columns(pl.lit(None, dtype=pl.Int64).alias("shard")).sort("order"),
                    out_dir / REJECTED_NAME)
    manifest = ShardManifest(num_rows=frame.height, ids=frame["id"].to_list(),
                             num_shards=num_shards, shard_rows=rows, shard_tokens=tokens,
                             rejected_rows=rejected.height)
    write_text_atomic(out_dir / MANIFEST_NAME, json.dumps(manifest.to_json(), indent=1) + "\n")
    return manifest


def shard_corpus(cfg: AppConfig, model_dir: Path, out_dir: Path) -> ShardManifest:
    """The `shard` rule: read every input row, tokenize with the model's tokenizer, split."""
    frame = read_corpus(cfg.workload)
    frame = tokenize_frame(frame, load_tokenizer(model_dir), cfg.workload.max_prompt_tokens)
    return write_shards(frame, cfg.workload.num_shards, out_dir)


def _atomic_parquet(frame: pl.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        frame.write_parquet(tmp)
