"""The report judges the prediction against the engine's own generate time, and says so."""
from __future__ import annotations

import polars as pl
import pytest

from moe_engine.stages.report import ShardSummary, summarize


def _merged(n: int) -> pl.DataFrame:
    return pl.DataFrame({"status": ["ok"] * n, "error": [None] * n, "prompt_tokens": [10] * n})


def test_prediction_error_is_measured_against_engine_time_not_job_time():
    # Two shards: 4 s jobs of which 2 s were the engine's generate (the rest: model load).
    shards = [ShardSummary(str(i), 10, 10, 0, 200, 4.0,
                           {"wall_time_s": 2.0, "decode_tokens": 200}) for i in range(2)]
    summary = summarize(_merged(20), shards, {"prediction": {"throughput_tok_s": 110.0}})
    assert summary["measured_tok_s"] == pytest.approx(50.0)
    assert summary["engine_tok_s"] == pytest.approx(100.0)
    assert summary["prediction_error"] == pytest.approx(0.10)


def test_fully_resumed_run_falls_back_to_job_time():
    shards = [ShardSummary("0", 10, 0, 10, 200, 4.0, {})]
    summary = summarize(_merged(10), shards, {"prediction": {"throughput_tok_s": 60.0}})
    assert summary["engine_tok_s"] is None
    assert summary["prediction_error"] == pytest.approx(0.2)
