"""Merge shard outputs into results/generations.parquet, verifying every input row is there once.

The shard manifest lists every input id; the merged table must hold exactly those ids, each
once. A mismatch is a bug somewhere upstream and fails loudly (MergeError) instead of writing a
table that silently lost or duplicated rows.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import polars as pl

from moe_engine.io import atomic_path, write_text_atomic
from moe_engine.stages.tables import GENERATION_SCHEMA, MANIFEST_NAME, REJECTED_NAME, STATUS_OK


class MergeError(RuntimeError):
    """The shard outputs do not account for the input rows exactly once."""


def rejected_as_generations(rejected: pl.DataFrame) -> pl.DataFrame:
    """Rows rejected before generation, in the generation table's schema."""
    return rejected.with_columns(
        pl.lit(None, dtype=pl.Utf8).alias("finish_reason"),
        pl.lit(0, dtype=pl.Int64).alias("completion_tokens"),
        pl.lit(None, dtype=pl.Utf8).alias("output_text"),
        pl.lit([], dtype=pl.List(pl.Int32)).alias("output_token_ids"),
    ).select([pl.col(name).cast(dtype) for name, dtype in GENERATION_SCHEMA.items()])


def merge_generations(shard_dir: Path, generation_files: list[Path], out_path: Path) -> pl.DataFrame:
    """Concatenate shard generations + rejected rows, verify against the manifest, write Parquet."""
    manifest = json.loads((shard_dir / MANIFEST_NAME).read_text())
    parts = [pl.read_parquet(p).select(list(GENERATION_SCHEMA)) for p in generation_files]
    parts.append(rejected_as_generations(pl.read_parquet(shard_dir / REJECTED_NAME)))
    merged = pl.concat(parts, how="vertical").sort("order")

    expected = manifest["ids"]
    if merged.height != manifest["num_rows"]:
        raise MergeError(f"merged {merged.height} rows but the input had {manifest['num_rows']}")
    duplicated = merged.filter(pl.col("id").is_duplicated())["id"].unique().to_list()
    if duplicated:
        raise MergeError(f"ids appear more than once: {sorted(duplicated)[:10]}")
    missing = set(expected) - set(merged["id"].to_list())
    if missing:
        raise MergeError(f"{len(missing)} input ids missing from the outputs: {sorted(missing)[:10]}")
    with atomic_path(out_path) as tmp:
        merged.write_parquet(tmp)
    return merged


def write_openai_batch_output(merged: pl.DataFrame, model_name: str, out_path: Path) -> Path:
    """OpenAI Batch API output JSONL: one line per input request, errors as error objects."""
    created = int(time.time())
    lines = []
    for row in merged.iter_rows(named=True):
        custom_id = row["input_id"] if row["input_id"] is not None else row["id"]
        request_id = f"req_{row['order']:08d}"
        if row["status"] == STATUS_OK:
            body = {
                "id": f"chatcmpl-{row['order']:08d}", "object": "chat.completion",
                "created": created, "model": model_name,
                "choices": [{"index": 0, "finish_reason": row["finish_reason"],
                             "message": {"role": "assistant", "content": row["output_text"]}}],
                "usage": {"prompt_tokens": row["prompt_tokens"] or 0,
                          "completion_tokens": row["completion_tokens"] or 0,
                          "total_tokens": (row["prompt_tokens"] or 0) + (row["completion_tokens"] or 0)},
            }
            line = {"id": f"batch_req_{row['order']:08d}", "custom_id": custom_id,
                    "response": {"status_code": 200, "request_id": request_id, "body": body},
                    "error": None}
        else:
            line = {"id": f"batch_req_{row['order']:08d}", "custom_id": custom_id, "response": None,
                    "error": {"code": row["status"], "message": row["error"] or row["status"]}}
        lines.append(json.dumps(line, ensure_ascii=False))
    return write_text_atomic(out_path, "\n".join(lines) + ("\n" if lines else ""))
