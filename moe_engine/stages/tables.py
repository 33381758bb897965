"""What the stages hand each other: table schemas, row statuses and file names.

Every stage reads and writes these tables through the names here, so no stage imports another
to learn a column or a file name (merge never imports generate).
"""
from __future__ import annotations

from pathlib import Path

import polars as pl

STATUS_PENDING, STATUS_OK, STATUS_REJECTED, STATUS_ERROR = "pending", "ok", "rejected", "error"
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")

# The normalized table every later stage works on (shards, generations, merge).
CORPUS_SCHEMA = {
    "id": pl.Utf8,              # unique, stable across runs (input id, else "<file stem>:<row>")
    "input_id": pl.Utf8,        # the id as given in the input (null when absent)
    "source_file": pl.Utf8,
    "source_row": pl.Int64,     # 0-based line (JSONL) or row (Parquet) index in source_file
    "order": pl.Int64,          # global input order: output is sorted by it
    "prompt": pl.Utf8,
    "messages": pl.Utf8,        # JSON-encoded chat messages
    "max_new_tokens": pl.Int64,
    "temperature": pl.Float64,
    "top_p": pl.Float64,
    "top_k": pl.Int64,
    "seed": pl.Int64,
    "stop": pl.List(pl.Utf8),   # stop strings: the row's own (OpenAI body.stop), else workload.stop
    "status": pl.Utf8,
    "error": pl.Utf8,
}

GENERATION_SCHEMA = {
    "id": pl.Utf8, "input_id": pl.Utf8, "source_file": pl.Utf8, "source_row": pl.Int64,
    "order": pl.Int64, "shard": pl.Int64, "prompt": pl.Utf8, "messages": pl.Utf8,
    "status": pl.Utf8, "error": pl.Utf8, "finish_reason": pl.Utf8,
    "prompt_tokens": pl.Int64, "completion_tokens": pl.Int64,
    "output_text": pl.Utf8, "output_token_ids": pl.List(pl.Int32),
    "max_new_tokens": pl.Int64, "temperature": pl.Float64, "top_p": pl.Float64,
    "top_k": pl.Int64, "seed": pl.Int64, "stop": pl.List(pl.Utf8),
}
RESULT_FIELDS = ("status", "error", "finish_reason", "prompt_tokens", "completion_tokens",
                  "output_text", "output_token_ids")

REJECTED_NAME = "rejected.parquet"
MANIFEST_NAME = "manifest.json"


def checkpoint_path(out_path: Path) -> Path:
    """Where a generate job appends finished rows before its shard output is complete."""
    return out_path.with_name(out_path.name + ".ckpt.jsonl")
