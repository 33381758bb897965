"""Sharding: token-balanced, deterministic, and over-long prompts are rejected, not dropped."""
from __future__ import annotations

import json
import random

import polars as pl

from moe_engine.config import WorkloadConfig
from moe_engine.stages.corpus import read_corpus
from moe_engine.stages.shard import assign_shards, tokenize_frame, write_shards
from moe_engine.engine.tokenizer import load_tokenizer


def test_assignment_balances_tokens_not_rows():
    rng = random.Random(0)
    work = [rng.choice([20, 40, 80, 450]) for _ in range(300)]
    shards = assign_shards(work, 4)
    loads = [sum(w for w, s in zip(work, shards) if s == k) for k in range(4)]
    # Greedy LPT: every shard within the largest item of the mean.
    assert max(loads) - min(loads) <= max(work)
    assert max(loads) <= sum(work) / 4 + max(work)
    assert assign_shards(work, 4) == shards


def test_assignment_beats_row_split_on_skewed_lengths():
    work = [400] * 10 + [10] * 90
    lpt = assign_shards(work, 2)
    lpt_loads = [sum(w for w, s in zip(work, lpt) if s == k) for k in range(2)]
    contiguous = [sum(work[:50]), sum(work[50:])]
    assert max(lpt_loads) < max(contiguous)
    assert max(lpt_loads) - min(lpt_loads) <= 10


def test_write_shards_accounts_for_every_row(tiny_mixtral_dir, tmp_path):
    path = tmp_path / "c.jsonl"
    rows = [{"id": f"r{i}", "prompt": "word " * (5 + 7 * i)} for i in range(12)]
    rows.append({"id": "huge", "prompt": "word " * 5000})
    rows.append({"id": "bad-role", "messages": [{"role": "tool", "content": "x"}]})
    rows.append({"id": "empty", "prompt": ""})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    frame = read_corpus(WorkloadConfig(inputs=[str(path)]))
    frame = tokenize_frame(frame, load_tokenizer(tiny_mixtral_dir), max_prompt_tokens=None)
    manifest = write_shards(frame, 3, tmp_path / "shards")
    parts = [pl.read_parquet(tmp_path / "shards" / f"{i}.parquet") for i in range(3)]
    rejected = pl.read_parquet(tmp_path / "shards" / "rejected.parquet")
    ids = sorted(sum((p["id"].to_list() for p in parts), []) + rejected["id"].to_list())
    assert ids == sorted(r["id"] for r in rows)
    assert manifest.num_rows == 15 and manifest.rejected_rows == 3
    reasons = dict(zip(rejected["id"].to_list(), rejected["error"].to_list()))
    assert "tokens; the limit is" in reasons["huge"]
    assert "chat template" in reasons["bad-role"]
    assert reasons["empty"] == "empty prompt"
    assert all(p.height > 0 for p in parts)
    assert all(len(ids) == n for p in parts
               for ids, n in zip(p["prompt_token_ids"].to_list(), p["prompt_tokens"].to_list()))


def test_max_prompt_tokens_limit(tiny_mixtral_dir, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt": "word " * 50}) + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    frame = tokenize_frame(read_corpus(WorkloadConfig(inputs=[str(path)])),
                           load_tokenizer(tiny_mixtral_dir), max_prompt_tokens=10)
    assert frame["status"].to_list() == ["rejected", "pending"]
    assert "limit is 10" in frame["error"][0]
