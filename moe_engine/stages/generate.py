"""Run the engine over one shard, checkpointing completed rows so a killed job resumes.

Completed results are appended to `<out>.ckpt.jsonl` every `engine.checkpoint_every` results
(flushed and fsynced). The stats name the rows this attempt generated and their tokens apart
from the resumed ones, since the attempt's time covers only the former. A job killed at any
point, SIGKILL included, loses at most the results since the last flush: on restart, rows
found in the checkpoint are not regenerated. The first line of the checkpoint fingerprints the
resolved config and the shard, so a checkpoint written under other settings is discarded rather
than mixed in. The shard's output Parquet is written to a temporary name and renamed only when
every row is present.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import polars as pl

from moe_engine.config import AppConfig, to_yaml
from moe_engine.io import atomic_path, write_text_atomic
from moe_engine.stages.policy import engine_config_for
from moe_engine.stages.tables import GENERATION_SCHEMA, RESULT_FIELDS, STATUS_ERROR, checkpoint_path

log = logging.getLogger(__name__)

LOG_PROGRESS_S = 5.0  # seconds between progress lines when stderr is a log file


def fingerprint(cfg: AppConfig, shard_path: Path) -> str:
    digest = hashlib.sha256(to_yaml(cfg).encode())
    digest.update(Path(shard_path).read_bytes())
    return digest.hexdigest()


def load_checkpoint(path: Path, expected_fingerprint: str) -> dict[str, dict[str, Any]]:
    """Completed rows by id. A torn last line (killed mid-write) is ignored."""
    if not path.exists():
        return {}
    done: dict[str, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        header = f.readline()
        try:
            if json.loads(header).get("fingerprint") != expected_fingerprint:
                return {}
        except ValueError:
            return {}
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                break
            done[row["id"]] = row
    return done


class CheckpointWriter:
    """Appends result rows as JSON lines; durable after each flush."""

    def __init__(self, path: Path, fingerprint_: str, done: dict[str, dict[str, Any]], every: int):
        self.path, self.every = path, every
        self.pending: list[dict[str, Any]] = []
        # Rewrite the file from what survived, so a torn line never sits between valid ones.
        lines = [json.dumps({"fingerprint": fingerprint_})]
        lines += [json.dumps(row, ensure_ascii=False) for row in done.values()]
        write_text_atomic(path, "\n".join(lines) + "\n")
        self.file = open(path, "a", encoding="utf-8")

    def add(self, row: dict[str, Any]) -> None:
        self.pending.append(row)
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.pending))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.pending.clear()

    def close(self) -> None:
        self.flush()
        self.file.close()


def result_row(result) -> dict[str, Any]:
    """The generation columns of one engine RequestResult."""
    return {"id": result.request_id, "status": result.status, "error": result.error,
            "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens, "output_text": result.text,
            "output_token_ids": list(result.token_ids)}


def build_requests(frame: pl.DataFrame, cfg: AppConfig) -> Iterator:
    from moe_engine.engine.request import Request, SamplingParams

    for row in frame.iter_rows(named=True):
        # The corpus reader filled each row's stop strings (its own, else workload.stop).
        sampling = SamplingParams(
            max_new_tokens=row["max_new_tokens"], temperature=row["temperature"],
            top_p=row["top_p"], top_k=row["top_k"], seed=row["seed"], stop=tuple(row["stop"]),
            ignore_eos=cfg.workload.ignore_eos)
        yield Request(request_id=row["id"], prompt_token_ids=list(row["prompt_token_ids"]),
                      sampling=sampling)


def run_shard(cfg: AppConfig, model_dir: Path, shard_path: Path, out_path: Path,
              stats_path: Path, policy: dict | None = None, engine=None,
              progress: bool = True) -> dict[str, Any]:
    """Generate every row of the shard (resuming from its checkpoint) and write the outputs."""
    frame = pl.read_parquet(shard_path)
    fp = fingerprint(cfg, shard_path)
    ckpt = checkpoint_path(out_path)
    done = load_checkpoint(ckpt, fp)
    resumed = len(done)
    todo = frame.filter(~pl.col("id").is_in(list(done)))
    writer = CheckpointWriter(ckpt, fp, done, cfg.engine.checkpoint_every)
    engine_stats: dict[str, Any] = {}
    started_at = time.time()
    started = time.perf_counter()
    owned = None  # an engine made here is closed here (its worker threads)
    try:
        if todo.height:
            if engine is None:
                from moe_engine.engine.llm_engine import LLMEngine

                engine = owned = LLMEngine(model_dir, engine_config_for(cfg, policy),
                                           dtype=cfg.model.dtype.value)
            _generate_into(engine, build_requests(todo, cfg), todo.height, frame.height, resumed,
                           writer, done, progress)
            engine_stats = engine.stats.to_dict()
            _learn_disk_rate(engine_stats.get("offload") or {})
    finally:
        writer.close()
        if owned is not None:
            owned.close()
    wall = time.perf_counter() - started

    outputs = _assemble(frame, done)
    with atomic_path(out_path) as tmp:
        outputs.write_parquet(tmp)
    stats = {
        "shard": shard_path.stem, "rows": frame.height, "resumed_rows": resumed,
        "generated_rows": todo.height, "wall_time_s": wall,
        "started_at": started_at, "finished_at": started_at + wall,
        "completion_tokens": int(outputs["completion_tokens"].sum() or 0),
        # This attempt's share: what wall_time_s measured. Rows resumed from an earlier,
        # killed attempt were timed by no one, so throughput counts these tokens only.
        "generated_completion_tokens": int(
            outputs.filter(pl.col("id").is_in(todo["id"].to_list()))["completion_tokens"].sum() or 0),
        "prompt_tokens": int(outputs["prompt_tokens"].sum() or 0),
        "status_counts": dict(outputs.group_by("status").len().iter_rows()),
        "engine": engine_stats,
        "engine_config": {k: (v.value if hasattr(v, "value") else v)
                          for k, v in engine_config_for(cfg, policy).__dict__.items()},
    }
    write_text_atomic(stats_path, json.dumps(stats, indent=2, default=str) + "\n")
    ckpt.unlink(missing_ok=True)
    return stats


def _learn_disk_rate(offload_stats: dict) -> None:
    """The disk tier's achieved read rate goes into the machine profile, so the next policy
    plans with the rate runs get rather than the profiler's sweep (perf.hardware.disk_read_gbps).
    An unwritable cache must not fail a job that generated its rows."""
    from moe_engine.io import hardware_cache_dir
    from moe_engine.perf.hardware import cached_profile_path
    from moe_engine.tools.profile_hardware import learn_disk_rate

    try:
        learn_disk_rate(cached_profile_path(hardware_cache_dir()), offload_stats)
    except OSError as exc:
        log.warning("could not record the disk rate in the machine profile: %s", exc)


def _generate_into(engine, requests: Iterable, count: int, total: int, resumed: int,
                   writer: CheckpointWriter, done: dict, progress: bool) -> None:
    from tqdm import tqdm

    # In a log file (Snakemake's log:, not a terminal) every refresh is a new line: one every
    # LOG_PROGRESS_S seconds keeps a 100k-row log small and still shows the run moving.
    interval = 1.0 if sys.stderr.isatty() else LOG_PROGRESS_S
    bar = tqdm(total=total, initial=resumed, desc="generate", unit="req", file=sys.stderr,
               disable=not progress, mininterval=interval, maxinterval=max(interval, 10.0),
               dynamic_ncols=False, ascii=True)
    started, tokens, seen = time.perf_counter(), 0, set()
    try:
        for result in engine.generate(requests):
            row = result_row(result)
            done[row["id"]] = row
            seen.add(row["id"])
            writer.add(row)
            tokens += row["completion_tokens"]
            bar.update(1)
            # refresh=False: the postfix rides on the next throttled refresh (True would write
            # a line per request).
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - started, 1e-9):.1f}",
                            refresh=False)
    finally:
        bar.close()
    if len(seen) != count:
        # The engine owes one result per request; a missing one must not vanish from the output.
        raise RuntimeError(f"engine returned {len(seen)} results for {count} requests")


def _assemble(frame: pl.DataFrame, done: dict[str, dict[str, Any]]) -> pl.DataFrame:
    records = []
    for row in frame.iter_rows(named=True):
        result = done.get(row["id"]) or {
            "status": STATUS_ERROR, "error": "no result produced", "finish_reason": None,
            "prompt_tokens": row["prompt_tokens"], "completion_tokens": 0, "output_text": None,
            "output_token_ids": []}
        record = {k: row.get(k) for k in GENERATION_SCHEMA if k not in RESULT_FIELDS}
        record.update({k: result.get(k) for k in RESULT_FIELDS})
        records.append(record)
    return pl.DataFrame(records, schema=GENERATION_SCHEMA)
