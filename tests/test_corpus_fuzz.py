"""Property tests of the corpus reader: whatever bytes a file holds, every line becomes exactly
one row, nothing raises, ids are unique, and a row is pending only if the engine would accept
it (so no later stage can be stopped by one row)."""
from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings, strategies as st

from moe_engine.config import InputFormat, WorkloadConfig
from moe_engine.engine.request import SamplingParams
from moe_engine.stages.corpus import read_corpus
from moe_engine.stages.tables import STATUS_PENDING, STATUS_REJECTED

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Any JSON value, with integers far outside int64 and non-finite floats (json writes NaN/Infinity
# and Python's reader accepts them, as a careless producer's file would contain).
# Hypothesis favours small integers, so integers around the int64 bounds get their own branch.
big_ints = st.integers(min_value=2**62, max_value=2**80) | st.integers(min_value=-(2**80), max_value=-(2**62))
scalars = (st.none() | st.booleans() | st.integers() | big_ints
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
messages = st.lists(st.fixed_dictionaries({}, optional={"role": json_values | st.sampled_from(["user", "system"]),
                                                        "content": json_values | st.text(max_size=30)}),
                    max_size=3)
# Sampling fields draw scalars (containers are covered by the other fields): a row reaches the
# later checks only when every earlier sampling field passes.
fields = {"id": json_values | st.text(max_size=6), "prompt": json_values | st.text(max_size=30),
          "messages": json_values | messages, "max_new_tokens": scalars | st.integers(-3, 3),
          "temperature": scalars, "top_p": scalars, "top_k": scalars, "seed": scalars}
rows = st.fixed_dictionaries({}, optional=fields)
openai_rows = st.fixed_dictionaries({}, optional={
    "custom_id": json_values | st.text(max_size=6),
    "body": json_values | st.fixed_dictionaries({}, optional={
        "messages": json_values | messages, "max_tokens": scalars | st.integers(-3, 3),
        "temperature": scalars, "seed": scalars})})


def _line(value) -> bytes:
    return json.dumps(value).encode().replace(b"\n", b" ")


# A line is random bytes, any JSON value, or an object with the fields a row may have.
lines = st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")) | json_values.map(_line)
                 | rows.map(_line), max_size=25)


def _line_count(data: bytes) -> int:
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def _check(frame, data: bytes) -> None:
    assert frame.height == _line_count(data)
    assert frame["id"].n_unique() == frame.height
    assert frame["order"].to_list() == list(range(frame.height))
    assert set(frame["status"].unique().to_list()) <= {STATUS_PENDING, STATUS_REJECTED}
    for row in frame.iter_rows(named=True):
        if row["status"] == STATUS_REJECTED:
            assert row["error"]
            continue
        assert row["error"] is None
        assert (row["prompt"] is not None) != (row["messages"] is not None)
        params = SamplingParams(max_new_tokens=row["max_new_tokens"], temperature=row["temperature"],
                                top_p=row["top_p"], top_k=row["top_k"], seed=row["seed"])
        assert params.validate() is None, params


@FUZZ
@given(lines=lines, trailing_newline=st.booleans())
def test_jsonl_reader_keeps_every_line(tmp_path, lines, trailing_newline):
    data = b"\n".join(lines) + (b"\n" if trailing_newline and lines else b"")
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(data)
    _check(read_corpus(WorkloadConfig(inputs=[str(path)], format=InputFormat.jsonl)), data)


@FUZZ
@given(batch=st.lists(openai_rows.map(_line) | st.binary(max_size=20).map(lambda b: b.replace(b"\n", b"")),
                      max_size=20))
def test_openai_reader_keeps_every_line(tmp_path, batch):
    data = b"".join(line + b"\n" for line in batch)
    path = tmp_path / "batch.jsonl"
    path.write_bytes(data)
    _check(read_corpus(WorkloadConfig(inputs=[str(path)], format=InputFormat.openai)), data)
