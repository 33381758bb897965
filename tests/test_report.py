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
                           {"wall_time_s": 2.0, "decode_tokens": 200}, generated_completion_tokens=200)
              for i in range(2)]
    summary = summarize(_merged(20), shards, {"prediction": {"throughput_tok_s": 110.0}})
    assert summary["measured_tok_s"] == pytest.approx(50.0)
    assert summary["engine_tok_s"] == pytest.approx(100.0)
    assert summary["prediction_error"] == pytest.approx(0.10)


def test_fully_resumed_run_has_no_measured_throughput():
    # Every row came from a killed attempt's checkpoint: no attempt timed them.
    shards = [ShardSummary("0", 10, 0, 10, 200, 4.0, {}, generated_completion_tokens=0)]
    summary = summarize(_merged(10), shards, {"prediction": {"throughput_tok_s": 60.0}})
    assert summary["engine_tok_s"] is None and summary["measured_tok_s"] is None
    assert summary["prediction_error"] is None
    assert summary["completion_tokens"] == 200 and summary["resumed_rows"] == 10


def test_resumed_rows_are_excluded_from_throughput():
    # Shard 0 ran whole: 100 tokens in 2 s. Shard 1 was killed after 6 rows (120 tokens) and
    # resumed: the finishing attempt generated 4 rows, 80 tokens, in 2 s.
    shards = [ShardSummary("0", 10, 10, 0, 100, 2.0, {}, generated_completion_tokens=100),
              ShardSummary("1", 10, 4, 6, 200, 2.0, {}, generated_completion_tokens=80)]
    summary = summarize(_merged(20), shards, None)
    assert summary["measured_tok_s"] == pytest.approx((100 + 80) / 4.0)  # was (100 + 200) / 4
    assert [s["tok_s"] for s in summary["shards"]] == pytest.approx([50.0, 40.0])
    assert summary["completion_tokens"] == 300 and summary["timed_completion_tokens"] == 180


def test_weight_traffic_is_summed_over_shards_and_shown():
    from moe_engine.stages.report import _markdown

    offload = {"bytes_moved": 2e9, "disk_bytes_read": 3e9, "disk_busy_time_s": 2.0,
               "transfer_wait_time_s": 0.5, "steps": 7}
    shards = [ShardSummary(str(i), 10, 10, 0, 100, 2.0, {"offload": offload},
                           generated_completion_tokens=100) for i in range(2)]
    summary = summarize(_merged(20), shards, None)
    assert summary["offload"] == {"bytes_moved": 4e9, "disk_bytes_read": 6e9,
                                  "disk_busy_time_s": 4.0, "transfer_wait_time_s": 1.0}
    text = _markdown(summary, {}, None)
    assert ("weight offloading: 4.00 GB over the host link; disk tier: 6.00 GB read at 1.50 GB/s "
            "(reader busy 4.0 s); compute blocked on weights 1.0 s") in text
    resident = summarize(_merged(10), [ShardSummary("0", 10, 10, 0, 100, 2.0, {},
                                                    generated_completion_tokens=100)], None)
    assert resident["offload"] is None
    assert "weight offloading: none (every expert resident)" in _markdown(resident, {}, None)
