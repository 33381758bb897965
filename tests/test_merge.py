"""Merge fails loudly when rows are missing or duplicated; OpenAI output matches the input."""
from __future__ import annotations

import json

import polars as pl
import pytest

from moe_engine.stages.merge import MergeError, merge_generations, write_openai_batch_output
from moe_engine.stages.tables import GENERATION_SCHEMA, MANIFEST_NAME, REJECTED_NAME


def _generation(id_: str, order: int, status: str = "ok") -> dict:
    row = {k: None for k in GENERATION_SCHEMA}
    row.update(id=id_, order=order, status=status, prompt_tokens=3, completion_tokens=2,
               output_text="hi", output_token_ids=[5, 6], finish_reason="length")
    return row


def _setup(tmp_path, gen_ids: list[list[str]], manifest_ids: list[str], rejected_ids=()):
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    files = []
    order = {id_: i for i, id_ in enumerate(manifest_ids)}
    for k, ids in enumerate(gen_ids):
        path = tmp_path / f"{k}.parquet"
        pl.DataFrame([_generation(i, order.get(i, 99)) for i in ids], schema=GENERATION_SCHEMA).write_parquet(path)
        files.append(path)
    rejected_schema = {k: v for k, v in GENERATION_SCHEMA.items()
                       if k not in ("finish_reason", "completion_tokens", "output_text", "output_token_ids")}
    rows = []
    for i in rejected_ids:
        r = {k: None for k in rejected_schema}
        r.update(id=i, order=order[i], status="rejected", error="empty prompt")
        rows.append(r)
    pl.DataFrame(rows, schema=rejected_schema).write_parquet(shard_dir / REJECTED_NAME)
    (shard_dir / MANIFEST_NAME).write_text(json.dumps({"num_rows": len(manifest_ids), "ids": manifest_ids}))
    return shard_dir, files


def test_merge_orders_rows_and_keeps_rejected(tmp_path):
    shard_dir, files = _setup(tmp_path, [["c", "a"], ["d"]], ["a", "b", "c", "d"], rejected_ids=["b"])
    merged = merge_generations(shard_dir, files, tmp_path / "out.parquet")
    assert merged["id"].to_list() == ["a", "b", "c", "d"]
    assert merged["status"].to_list() == ["ok", "rejected", "ok", "ok"]
    assert pl.read_parquet(tmp_path / "out.parquet").equals(merged)


def test_merge_fails_on_missing_row(tmp_path):
    shard_dir, files = _setup(tmp_path, [["a"], ["c"]], ["a", "b", "c"])
    with pytest.raises(MergeError, match="merged 2 rows but the input had 3"):
        merge_generations(shard_dir, files, tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()


def test_merge_fails_on_duplicate_row(tmp_path):
    shard_dir, files = _setup(tmp_path, [["a", "b"], ["b"]], ["a", "b", "c"])
    with pytest.raises(MergeError, match="more than once"):
        merge_generations(shard_dir, files, tmp_path / "out.parquet")


def test_merge_fails_on_foreign_id(tmp_path):
    shard_dir, files = _setup(tmp_path, [["a", "zz"]], ["a", "b"])
    with pytest.raises(MergeError, match="missing"):
        merge_generations(shard_dir, files, tmp_path / "out.parquet")


def test_openai_output_has_one_line_per_request(tmp_path):
    shard_dir, files = _setup(tmp_path, [["a", "c"]], ["a", "b", "c"], rejected_ids=["b"])
    merged = merge_generations(shard_dir, files, tmp_path / "out.parquet")
    merged = merged.with_columns(pl.col("id").alias("input_id"))
    path = write_openai_batch_output(merged, "tiny", tmp_path / "batch_output.jsonl")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["a", "b", "c"]
    ok = lines[0]["response"]
    assert ok["status_code"] == 200 and ok["body"]["choices"][0]["message"]["content"] == "hi"
    assert ok["body"]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert lines[1]["response"] is None and lines[1]["error"]["message"] == "empty prompt"
