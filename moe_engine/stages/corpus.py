"""Read input corpora into one normalized table, accounting for every input row.

Formats: JSONL or Parquet rows with a prompt column or a chat-messages column (names from the
workload config), optional per-row sampling fields (stop included); OpenAI Batch API JSONL
(`custom_id`, `body.messages`, `body.max_tokens`, `body.stop`, ...; `body.n` above 1 is
rejected, as a row holds one choice). A row that cannot be used (bad JSON, undecodable bytes,
missing or wrong-typed fields, duplicate id) is kept with status `rejected` and a reason, so the
output has exactly one row per input row.

JSONL is split into lines before parsing because a single malformed line must cost one row, not
the whole file (polars' and pyarrow's NDJSON readers reject the file). Parquet is read with
pyarrow. Rows are dicts only until `rows_to_frame` builds the polars table.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import polars as pl

from moe_engine.config import InputFormat, WorkloadConfig
from moe_engine.engine.request import SamplingParams, stable_seed
from moe_engine.stages.tables import CORPUS_SCHEMA, SAMPLING_FIELDS, STATUS_PENDING, STATUS_REJECTED




@dataclass
class _Row:
    source_file: str
    source_row: int
    input_id: str | None = None
    prompt: str | None = None
    messages: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def detect_format(path: Path, configured: InputFormat) -> InputFormat:
    """The configured format, or from the suffix and (for JSONL) the first parsable row."""
    if configured is not InputFormat.auto:
        return configured
    if path.suffix.lower() in (".parquet", ".pq"):
        return InputFormat.parquet
    with open(path, "rb") as f:
        for raw in f:
            try:
                row = json.loads(raw)
            except ValueError:
                continue
            if isinstance(row, dict):
                return InputFormat.openai if "custom_id" in row and "body" in row else InputFormat.jsonl
    return InputFormat.jsonl


# Bounds of the corpus table's Int64 columns (tables.CORPUS_SCHEMA).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _check_messages(value: Any) -> str | None:
    """Reason the value is not a usable chat message list, or None."""
    if not isinstance(value, list) or not value:
        return "messages must be a non-empty list"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"messages[{i}] is not an object"
        if not isinstance(message.get("role"), str):
            return f"messages[{i}].role missing or not a string"
        if not isinstance(message.get("content"), str):
            return f"messages[{i}].content missing or not a string"
    return None


def _check_sampling(raw: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Per-row sampling fields with their types and values checked (bool is not an int here).

    Values are checked here, not only by the engine: a row the engine would refuse (say
    max_new_tokens 0) must become a rejected row now, before the policy stage sizes the batch
    from it, and an integer the int64 columns cannot hold must not reach the table."""
    out: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        value = raw.get(name)
        if value is None:
            continue
        if name in ("max_new_tokens", "top_k", "seed"):
            if isinstance(value, bool) or not isinstance(value, int):
                return {}, f"{name} must be an integer, got {value!r}"
            if not INT64_MIN <= value <= INT64_MAX:
                return {}, f"{name} out of range: {value} does not fit in 64 bits"
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            return {}, f"{name} must be a number, got {value!r}"
        out[name] = value
    stop = raw.get("stop")
    if stop is not None:
        # OpenAI's form: one string or a list of them.
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            return {}, f"stop must be a string or a list of strings, got {stop!r}"
        out["stop"] = tuple(stop)
    return out, SamplingParams(**out).validate()


def _check_choices(body: dict[str, Any]) -> str | None:
    """Reason an OpenAI body asks for what a row cannot return: one row holds one choice."""
    n = body.get("n")
    if n is None or (n == 1 and isinstance(n, int) and not isinstance(n, bool)):
        return None
    return f"n={n!r}: only one choice per request is generated (body.n must be 1 or absent)"


def _normalize(raw: Any, row: _Row, fmt: InputFormat, w: WorkloadConfig) -> _Row:
    if not isinstance(raw, dict):
        row.error = f"row is a JSON {type(raw).__name__}, expected an object"
        return row
    if fmt is InputFormat.openai:
        custom_id = raw.get("custom_id")
        row.input_id = custom_id if isinstance(custom_id, str) and custom_id else None
        body = raw.get("body")
        if row.input_id is None:
            row.error = "custom_id missing or not a non-empty string"
            return row
        if not isinstance(body, dict):
            row.error = "body missing or not an object"
            return row
        row.error = _check_choices(body)
        if row.error:
            return row
        sampling = {"max_new_tokens": body.get("max_completion_tokens", body.get("max_tokens")),
                    **{k: body.get(k) for k in ("temperature", "top_p", "top_k", "seed", "stop")}}
        content = body.get("messages")
        prompt = body.get("prompt")
    else:
        if w.id_column and raw.get(w.id_column) is not None:
            value = raw[w.id_column]
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                row.error = f"{w.id_column} must be a string or integer, got {value!r}"
                return row
            row.input_id = str(value)
        sampling = raw
        content = raw.get(w.messages_column)
        prompt = raw.get(w.prompt_column)
    row.sampling, row.error = _check_sampling(sampling)
    if row.error:
        return row
    if content is not None:
        row.error = _check_messages(content)
        row.messages = None if row.error else json.dumps(content, ensure_ascii=False)
    elif prompt is not None:
        if not isinstance(prompt, str):
            row.error = f"{w.prompt_column} must be a string, got {type(prompt).__name__}"
        elif not prompt.strip():
            row.error = "empty prompt"
        else:
            row.prompt = prompt
    else:
        row.error = (f"no {w.prompt_column!r} or {w.messages_column!r} field"
                     if fmt is not InputFormat.openai else "body.messages missing")
    return row


def _jsonl_rows(path: Path, fmt: InputFormat, w: WorkloadConfig) -> Iterator[_Row]:
    with open(path, "rb") as f:
        for index, raw_line in enumerate(f):
            row = _Row(source_file=str(path), source_row=index)
            if not raw_line.strip():
                row.error = "blank line"
                yield row
                continue
            try:
                text = raw_line.decode("utf-8")
            except UnicodeDecodeError as exc:
                row.error = f"undecodable bytes (not UTF-8): {exc.reason} at byte {exc.start}"
                yield row
                continue
            try:
                raw = json.loads(text)
            except ValueError as exc:
                row.error = f"malformed JSON: {exc}"
                yield row
                continue
            yield _normalize(raw, row, fmt, w)


def _parquet_rows(path: Path, w: WorkloadConfig) -> Iterator[_Row]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for index, raw in enumerate(table.to_pylist()):
        raw = dict(raw)
        # Parquet has no "absent": a null column value means the field was not given.
        raw = {k: v for k, v in raw.items() if v is not None}
        yield _normalize(raw, _Row(source_file=str(path), source_row=index), InputFormat.jsonl, w)


def read_rows(paths: list[Path], w: WorkloadConfig) -> Iterator[_Row]:
    for path in paths:
        fmt = detect_format(path, w.format)
        if fmt is InputFormat.parquet:
            yield from _parquet_rows(path, w)
        else:
            yield from _jsonl_rows(path, fmt, w)


def rows_to_frame(rows: Iterator[_Row], w: WorkloadConfig) -> pl.DataFrame:
    """Assign unique stable ids, reject duplicates, apply the workload's sampling defaults."""
    records = []
    seen: dict[str, int] = {}
    for order, row in enumerate(rows):
        stem = Path(row.source_file).stem
        fallback = f"{stem}:{row.source_row}"
        row_id = row.input_id or fallback
        error = row.error
        if row_id in seen:
            first = seen[row_id]
            row_id = f"{row_id}@{fallback}"
            error = error or f"duplicate id {row.input_id or fallback!r} (first at input row {first})"
        seen.setdefault(row_id, order)
        s = row.sampling
        records.append({
            "id": row_id, "input_id": row.input_id, "source_file": row.source_file,
            "source_row": row.source_row, "order": order, "prompt": row.prompt,
            "messages": row.messages,
            "max_new_tokens": s.get("max_new_tokens", w.max_new_tokens),
            "temperature": float(s.get("temperature", w.temperature)),
            "top_p": float(s.get("top_p", w.top_p)),
            "top_k": s.get("top_k", w.top_k),
            "seed": s.get("seed", stable_seed(w.seed, row_id)),
            "stop": list(s.get("stop", w.stop)),
            "status": STATUS_REJECTED if error else STATUS_PENDING,
            "error": error,
        })
    return pl.DataFrame(records, schema=CORPUS_SCHEMA)


def read_corpus(w: WorkloadConfig, base_dir: Path | None = None) -> pl.DataFrame:
    """All rows of the workload's inputs, normalized; `limit` keeps the first rows only."""
    paths = [Path(p) if base_dir is None or Path(p).is_absolute() else base_dir / p for p in w.inputs]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"workload.inputs: file(s) not found: {missing}")
    frame = rows_to_frame(read_rows(paths, w), w)
    return frame.head(w.limit) if w.limit is not None else frame
