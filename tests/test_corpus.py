"""Input normalization: every input row becomes exactly one row, bad ones with a reason."""
from __future__ import annotations

import json

import polars as pl
import pytest

from moe_engine.config import InputFormat, WorkloadConfig
from moe_engine.stages.corpus import detect_format, read_corpus, stable_seed


def _write_lines(path, lines: list[bytes]) -> None:
    path.write_bytes(b"\n".join(lines) + b"\n")


@pytest.fixture
def bad_corpus(tmp_path):
    lines = [
        json.dumps({"id": "good-1", "prompt": "Tell me about tides."}).encode(),
        b'{"id": "broken", "prompt": "unterminated',
        json.dumps({"id": "no-text"}).encode(),
        json.dumps({"id": "wrong-type", "prompt": 42}).encode(),
        json.dumps({"id": "empty", "prompt": "   "}).encode(),
        b'{"id": "latin1", "prompt": "caf\xe9"}',
        json.dumps({"id": "good-2", "messages": [{"role": "user", "content": "Hi"}]}).encode(),
        json.dumps({"id": "bad-messages", "messages": [{"role": "user"}]}).encode(),
        json.dumps({"id": "bad-max", "prompt": "x", "max_new_tokens": "ten"}).encode(),
        json.dumps({"id": "good-1", "prompt": "Same id again"}).encode(),
        json.dumps(["not", "an", "object"]).encode(),
        b"",
        json.dumps({"prompt": "no id given", "temperature": 0.7, "max_new_tokens": 5}).encode(),
    ]
    path = tmp_path / "bad.jsonl"
    _write_lines(path, lines)
    return path


def test_every_bad_row_is_kept_with_a_reason(bad_corpus):
    frame = read_corpus(WorkloadConfig(inputs=[str(bad_corpus)]))
    assert frame.height == 13
    assert frame["id"].n_unique() == 13
    assert frame["source_row"].to_list() == list(range(13))
    by_row = {r["source_row"]: r for r in frame.iter_rows(named=True)}
    expected_errors = {1: "malformed JSON", 2: "no 'prompt' or 'messages' field",
                       3: "prompt must be a string", 4: "empty prompt", 5: "undecodable bytes",
                       7: "messages[0].content", 8: "max_new_tokens must be an integer",
                       9: "duplicate id 'good-1'", 10: "row is a JSON list", 11: "blank line"}
    for row, needle in expected_errors.items():
        assert by_row[row]["status"] == "rejected", row
        assert needle in by_row[row]["error"], (row, by_row[row]["error"])
    for row in (0, 6, 12):
        assert by_row[row]["status"] == "pending" and by_row[row]["error"] is None
    assert by_row[12]["id"] == "bad:12"
    assert by_row[12]["temperature"] == 0.7 and by_row[12]["max_new_tokens"] == 5
    assert json.loads(by_row[6]["messages"]) == [{"role": "user", "content": "Hi"}]


def test_defaults_and_stable_seeds(tmp_path):
    path = tmp_path / "c.jsonl"
    _write_lines(path, [json.dumps({"id": f"r{i}", "prompt": f"p{i}"}).encode() for i in range(3)])
    w = WorkloadConfig(inputs=[str(path)], max_new_tokens=7, seed=5)
    a, b = read_corpus(w), read_corpus(w)
    assert a.equals(b)
    assert a["max_new_tokens"].to_list() == [7, 7, 7]
    assert a["seed"].to_list() == [stable_seed(5, f"r{i}") for i in range(3)]
    assert len(set(a["seed"].to_list())) == 3


def test_openai_batch_rows(tmp_path):
    rows = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9,
                  "temperature": 0.5}},
        {"custom_id": "b", "body": {"messages": "not a list"}},
        {"custom_id": "", "body": {"messages": [{"role": "user", "content": "x"}]}},
    ]
    path = tmp_path / "batch.jsonl"
    _write_lines(path, [json.dumps(r).encode() for r in rows])
    assert detect_format(path, InputFormat.auto) is InputFormat.openai
    frame = read_corpus(WorkloadConfig(inputs=[str(path)], id_column="custom_id"))
    first = frame.row(0, named=True)
    assert first["id"] == "a" and first["input_id"] == "a"
    assert first["max_new_tokens"] == 9 and first["temperature"] == 0.5
    assert frame["status"].to_list() == ["pending", "rejected", "rejected"]
    assert "custom_id" in frame["error"][2]


def test_parquet_with_configured_columns(tmp_path):
    path = tmp_path / "in.parquet"
    pl.DataFrame({"key": ["x", "y", None], "text": ["hello", None, "third"],
                  "max_new_tokens": [3, None, 4]}).write_parquet(path)
    w = WorkloadConfig(inputs=[str(path)], id_column="key", prompt_column="text")
    frame = read_corpus(w)
    assert frame["id"].to_list() == ["x", "y", "in:2"]
    assert frame["status"].to_list() == ["pending", "rejected", "pending"]
    assert frame["max_new_tokens"].to_list() == [3, w.max_new_tokens, 4]


def test_missing_input_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_corpus(WorkloadConfig(inputs=[str(tmp_path / "nope.jsonl")]))


def test_limit_keeps_first_rows(tmp_path):
    path = tmp_path / "c.jsonl"
    _write_lines(path, [json.dumps({"prompt": f"p{i}"}).encode() for i in range(10)])
    frame = read_corpus(WorkloadConfig(inputs=[str(path)], limit=4))
    assert frame["source_row"].to_list() == [0, 1, 2, 3]


def test_rows_the_engine_would_refuse_are_rejected_at_read(tmp_path):
    """A row with max_new_tokens 0 (or OpenAI max_tokens 0) or a seed beyond int64 used to pass
    the reader and then stop the policy or shard stage for the whole corpus."""
    path = tmp_path / "edge.jsonl"
    _write_lines(path, [json.dumps({"id": "a", "prompt": "Hi"}).encode(),
                        json.dumps({"id": "z", "prompt": "Hi", "max_new_tokens": 0}).encode(),
                        b'{"id": "big", "prompt": "Hi", "seed": 99999999999999999999999}',
                        json.dumps({"id": "p", "prompt": "Hi", "top_p": 0}).encode()])
    frame = read_corpus(WorkloadConfig(inputs=[str(path)]))
    errors = dict(zip(frame["id"].to_list(), frame["error"].to_list()))
    assert errors["a"] is None
    assert "max_new_tokens" in errors["z"] and "seed" in errors["big"] and "top_p" in errors["p"]
    batch = tmp_path / "batch.jsonl"
    _write_lines(batch, [json.dumps({"custom_id": "r0", "body": {"messages": [{"role": "user", "content": "x"}],
                                                                  "max_tokens": 0}}).encode()])
    frame = read_corpus(WorkloadConfig(inputs=[str(batch)], format=InputFormat.openai))
    assert frame["status"].to_list() == ["rejected"] and "max_new_tokens" in frame["error"][0]
