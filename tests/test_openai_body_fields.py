"""OpenAI batch bodies: `stop` is honoured (a string or a list, through shard and generate to the
output text), `n` above 1 rejects the row with a reason (a row holds one choice)."""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from moe_engine.config import InputFormat, WorkloadConfig, compose
from moe_engine.stages.corpus import read_corpus
from moe_engine.stages.generate import run_shard
from moe_engine.stages.shard import shard_corpus

MESSAGES = [{"role": "user", "content": "Write a poem about the sea."}]


def _batch(path: Path, bodies: dict[str, dict]) -> Path:
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": MESSAGES, **body}}) for cid, body in bodies.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_body_stop_and_n_are_read_or_rejected_with_a_reason(tmp_path):
    path = _batch(tmp_path / "batch.jsonl", {
        "one": {"stop": "END"}, "list": {"stop": ["a", "b"]}, "none": {}, "empty": {"stop": []},
        "null": {"stop": None}, "n1": {"n": 1}, "n3": {"n": 3}, "n-bool": {"n": True},
        "stop-int": {"stop": 5}, "stop-mixed": {"stop": ["ok", 7]}, "stop-blank": {"stop": [""]}})
    frame = read_corpus(WorkloadConfig(inputs=[str(path)], format=InputFormat.openai, stop=["W"]))
    rows = {r["id"]: r for r in frame.iter_rows(named=True)}
    assert rows["one"]["stop"] == ["END"] and rows["list"]["stop"] == ["a", "b"]
    # Absent or null: the workload's default; an explicit empty list: no stop string.
    assert rows["none"]["stop"] == rows["null"]["stop"] == ["W"] and rows["empty"]["stop"] == []
    assert all(rows[k]["status"] == "pending" for k in ("one", "list", "none", "empty", "null", "n1"))
    reasons = {"n3": "n=3", "n-bool": "n=True", "stop-int": "stop must be a string or a list",
               "stop-mixed": "stop must be a string or a list", "stop-blank": "non-empty strings"}
    for cid, needle in reasons.items():
        assert rows[cid]["status"] == "rejected" and needle in rows[cid]["error"], rows[cid]


def _generate(tmp_path: Path, model_dir: Path, bodies: dict[str, dict]) -> dict[str, dict]:
    run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    run.mkdir()
    batch = _batch(run / "batch.jsonl", bodies)
    cfg = compose(f"model=hf model.path={model_dir} workload.inputs=[{batch}] workload.format=openai"
                  " workload.ignore_eos=true workload.num_shards=1 engine.policy=config"
                  " engine.threads=2")
    shard_corpus(cfg, model_dir, run / "shards")
    run_shard(cfg, model_dir, run / "shards" / "0.parquet", run / "out.parquet", run / "stats.json",
              progress=False)
    return {r["id"]: r for r in pl.read_parquet(run / "out.parquet").iter_rows(named=True)}


def test_body_stop_cuts_the_output_where_the_unstopped_output_has_it(tmp_path, tiny_mixtral_dir):
    # Reference: the same greedy request without stop strings (EOS ignored, so all 16 tokens).
    base = _generate(tmp_path, tiny_mixtral_dir, {"base": {"max_tokens": 16}})["base"]
    text = base["output_text"]
    assert base["finish_reason"] == "length" and len(text) > 8
    stop = text[len(text) // 2:len(text) // 2 + 3]
    expected = text[:text.find(stop)]
    rows = _generate(tmp_path, tiny_mixtral_dir, {
        "string": {"max_tokens": 16, "stop": stop},
        "list": {"max_tokens": 16, "stop": ["\u2603 never produced", stop]},
        "absent": {"max_tokens": 16}})
    for cid in ("string", "list"):
        assert rows[cid]["finish_reason"] == "stop" and rows[cid]["output_text"] == expected, rows[cid]
        assert rows[cid]["stop"] == ([stop] if cid == "string" else ["\u2603 never produced", stop])
    assert rows["absent"]["output_text"] == text and rows["absent"]["finish_reason"] == "length"
