"""The Snakemake workflow end to end on the tiny model: outputs, row accounting, dry run,
resume after SIGKILL, OpenAI batch round trip. Each test runs snakemake in its own directory."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
pytestmark = pytest.mark.slow


def snakemake_cmd(workdir: Path, overrides: str, *extra: str) -> list[str]:
    return [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--cores", "2",
            "--config", f"overrides={overrides}", *extra]


def run_snakemake(workdir: Path, overrides: str, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(snakemake_cmd(workdir, overrides, *extra), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """30 sample rows plus bad rows of every kind the reader must account for."""
    path = tmp_path_factory.mktemp("corpus") / "mixed.jsonl"
    # Rows without their own max_new_tokens, so workload.max_new_tokens keeps the test short.
    sample = [line for line in (REPO / "data" / "sample_prompts.jsonl").read_bytes().splitlines()
              if b'"max_new_tokens"' not in line][:30]
    bad = [b'{"id": "broken", "prompt": "unterminated', b'{"id": "empty", "prompt": ""}',
           b'{"id": "latin1", "prompt": "caf\xe9"}', b'{"id": "typed", "prompt": 7}',
           json.dumps({"id": "long", "prompt": "word " * 6000}).encode(),
           json.dumps({"id": "neg-temp", "prompt": "hi", "temperature": -1.0}).encode()]
    path.write_bytes(b"\n".join(sample[:10] + bad + sample[10:]) + b"\n")
    return path


def _overrides(corpus: Path, *more: str, policy: str = "config") -> str:
    return " ".join([f"workload.inputs=[{corpus}]", "workload.max_new_tokens=8",
                     f"engine.policy={policy}", *more])


@pytest.fixture(scope="module")
def machine_profile():
    """The machine cache's hardware profile (hardware.profile=auto, the default), measured in
    the profiler's reduced mode so the policy rule finds it instead of measuring for ~45 s.
    conftest points the machine cache at a temporary directory."""
    from moe_engine.io import hardware_cache_dir
    from moe_engine.tools.presets import PRESETS, hf_config
    from moe_engine.perf import ModelSpec
    from moe_engine.perf.hardware import cached_profile_path
    from moe_engine.tools.profile_hardware import ensure_profile

    tiny = ModelSpec.from_hf_config(hf_config(PRESETS["tiny-mixtral"]), name="tiny-mixtral")
    path = cached_profile_path(hardware_cache_dir())
    ensure_profile(path, model=tiny, fast=True)
    return path


def test_full_run_accounts_for_every_row(tmp_path, corpus, machine_profile):
    # The default policy path: performance-model search over the machine's profile.
    run_snakemake(tmp_path, _overrides(corpus, "workload.num_shards=3", policy="search"))
    results = tmp_path / "results"
    merged = pl.read_parquet(results / "generations.parquet")
    lines = corpus.read_bytes().splitlines()
    assert merged.height == len(lines)
    assert merged["source_row"].to_list() == list(range(len(lines)))
    assert merged["id"].n_unique() == merged.height
    by_row = {r["source_row"]: r for r in merged.iter_rows(named=True)}
    # The bad rows sit at lines 10-15 (see the corpus fixture).
    expected = {10: "malformed JSON", 11: "empty prompt", 12: "undecodable bytes",
                13: "prompt must be a string", 14: "tokens; the limit is", 15: "temperature"}
    for row, needle in expected.items():
        assert by_row[row]["status"] == "rejected" and needle in by_row[row]["error"], by_row[row]
    assert by_row[12]["id"] == "mixed:12" and by_row[11]["id"] == "empty"
    ok = merged.filter(pl.col("status") == "ok")
    assert ok.height == 30
    assert all(1 <= n <= 8 for n in ok["completion_tokens"].to_list())
    assert set(ok["finish_reason"].to_list()) <= {"length", "stop"}
    assert set(ok["shard"].to_list()) == {0, 1, 2}
    for name in ("report.html", "report.md", "summary.json", "policy.json", "config.yaml",
                 "plots/throughput.png", "plots/time_split.png", "plots/rejected.png"):
        assert (results / name).exists(), name
    summary = json.loads((results / "summary.json").read_text())
    assert summary["rows"] == len(lines) and summary["completion_tokens"] == ok["completion_tokens"].sum()
    policy = json.loads((results / "policy.json").read_text())
    assert policy["source"] == "search" and policy["hardware"]["name"].startswith("profiled-")
    # Chosen for one shard (each generate job runs one): the largest by valid rows.
    pending = [pl.read_parquet(results / "shards" / f"{i}.parquet")
               .filter(pl.col("status") == "pending").height for i in range(3)]
    assert policy["workload"]["num_requests"] == max(pending) < 30
    assert summary["predicted_tok_s"] > 0 and summary["engine_tok_s"] > 0
    # A second invocation has nothing to do.
    again = run_snakemake(tmp_path, _overrides(corpus, "workload.num_shards=3", policy="search"))
    assert "Nothing to be done" in again.stdout + again.stderr


# tiny-mixtral runs through every other test here; one run for each other architecture.
OTHER_ARCHITECTURES = sorted(p for p in __import__("moe_engine.tools.presets", fromlist=["PRESETS"])
                             .PRESETS if p.startswith("tiny-") and p != "tiny-mixtral")


def _architecture_rows() -> list[dict]:
    """The first 6 sample rows without their own max_new_tokens (workload.max_new_tokens=8)."""
    return [json.loads(line) for line in (REPO / "data" / "sample_prompts.jsonl").read_text()
            .splitlines() if '"max_new_tokens"' not in line and '"prompt"' in line][:6]


def _stop(proc: subprocess.Popen) -> None:
    """Kill a workflow started in its own session, with every job it started, and reap it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def architecture_runs(request, tmp_path_factory) -> dict[str, tuple[Path, int, str]]:
    """The workflow for each selected preset of OTHER_ARCHITECTURES on 6 sample rows: {preset:
    (workdir, exit status, end of its output)}. Two run at a time: each is mostly
    single-threaded process start-up (Snakemake, then one Python process a rule), so on two
    cores a pair takes little longer than one (the ten took ~145 s one after another, ~80 s
    in pairs). Each run has the 600 s a run_snakemake call allows."""
    wanted = {item.callspec.params["preset"] for item in request.session.items
              if item.originalname == "test_every_architecture_generates_transformers_greedy_tokens_through_the_workflow"}
    corpus = tmp_path_factory.mktemp("arch-corpus") / "prompts.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in _architecture_rows()))
    pending = [p for p in OTHER_ARCHITECTURES if p in wanted]
    running: dict[str, tuple[Path, float, subprocess.Popen]] = {}
    done = {}
    try:
        while pending or running:
            while pending and len(running) < 2:
                preset = pending.pop(0)
                workdir = tmp_path_factory.mktemp(preset)
                with open(workdir / "snakemake.out", "wb") as log:
                    proc = subprocess.Popen(snakemake_cmd(workdir, _overrides(corpus, f"model={preset}")),
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                running[preset] = (workdir, time.monotonic(), proc)
            for preset, (workdir, started, proc) in list(running.items()):
                if proc.poll() is None and time.monotonic() - started < 600:
                    continue
                _stop(proc)
                output = (workdir / "snakemake.out").read_text(errors="replace")
                done[preset] = (workdir, proc.returncode, output[-6000:])
                del running[preset]
            time.sleep(0.2)
    finally:  # an interrupted session must not leave workflows running behind it
        for _, _, proc in running.values():
            _stop(proc)
    return done


# The first of these tests sets up the fixture, which runs every selected workflow: its
# timeout covers them all.
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("preset", OTHER_ARCHITECTURES)
def test_every_architecture_generates_transformers_greedy_tokens_through_the_workflow(
        architecture_runs, preset):
    import torch

    from moe_engine.engine.tokenizer import load_tokenizer
    from moe_engine.tools.presets import builtin_model_key
    from tests.test_engine_parity import _hf_model

    workdir, status, output = architecture_runs[preset]
    assert status == 0, output
    rows = _architecture_rows()
    merged = pl.read_parquet(workdir / "results" / "generations.parquet")
    assert merged.height == len(rows) and set(merged["status"].to_list()) == {"ok"}
    model_dir = workdir / "resources" / "models" / builtin_model_key(preset, 0, 1)
    tokenizer = load_tokenizer(model_dir)
    model = _hf_model(model_dir)  # fp32, MXFP4 experts dequantized as transformers does
    for row in merged.iter_rows(named=True):
        ids = tokenizer.encode_prompt(row["prompt"])
        assert row["prompt_tokens"] == len(ids)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=8, do_sample=False, pad_token_id=0)
        mine = list(row["output_token_ids"])
        # transformers keeps the EOS token it stopped at; a row that stopped there may not
        assert 1 <= len(mine) and out[0, len(ids):].tolist()[:len(mine)] == mine, row["id"]


def test_dry_run_plans_one_generate_job_per_shard(tmp_path, corpus):
    proc = run_snakemake(tmp_path, _overrides(corpus, "workload.num_shards=4"), "-n")
    out = proc.stdout + proc.stderr
    counts = {parts[0]: int(parts[1]) for parts in (l.split() for l in out.splitlines())
              if len(parts) == 2 and parts[1].isdigit()}
    assert counts.get("generate") == 4 and counts.get("shard") == 1 and counts.get("merge") == 1


def test_bad_override_fails_at_parse_time_naming_the_key(tmp_path, corpus):
    proc = subprocess.run(snakemake_cmd(tmp_path, "engine.kv_cache_gb=oops", "-n"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "engine.kv_cache_gb" in proc.stdout + proc.stderr


def test_killed_generate_job_resumes_without_redoing_checkpointed_rows(tmp_path, corpus):
    overrides = _overrides(corpus, "workload.num_shards=1", "workload.max_new_tokens=24",
                           "engine.checkpoint_every=3", "engine.max_num_seqs=2",
                           "workload.temperature=0.8")
    # Reference: the same run, uninterrupted, in its own directory.
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    run_snakemake(reference_dir, overrides)
    reference = pl.read_parquet(reference_dir / "results" / "generations.parquet")

    workdir = tmp_path / "killed"
    workdir.mkdir()
    ckpt = workdir / "results" / "generations" / "0.parquet.ckpt.jsonl"
    proc = subprocess.Popen(snakemake_cmd(workdir, overrides), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if ckpt.exists() and len(ckpt.read_text().splitlines()) >= 1 + 6:
            break
        assert proc.poll() is None, "workflow finished before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    checkpointed = len(ckpt.read_text().splitlines()) - 1
    assert 6 <= checkpointed < 30
    assert not (workdir / "results" / "generations" / "0.parquet").exists()
    carried = set()
    for line in ckpt.read_text().splitlines()[1:]:
        try:
            carried.add(json.loads(line)["id"])
        except ValueError:
            break  # a line torn by the kill is regenerated

    # What a user does after a kill: release Snakemake's lock, then run again.
    run_snakemake(workdir, overrides, "--unlock")
    run_snakemake(workdir, overrides, "--rerun-incomplete")
    stats = json.loads((workdir / "results" / "stats" / "0.json").read_text())
    assert stats["resumed_rows"] == checkpointed
    # The 30 sample rows: every bad row, the negative temperature included, is rejected when the
    # corpus is read and never reaches a shard.
    assert stats["rows"] == 30
    assert stats["generated_rows"] == stats["rows"] - checkpointed
    resumed = pl.read_parquet(workdir / "results" / "generations.parquet")
    cols = ["id", "status", "output_token_ids", "output_text", "finish_reason"]
    assert resumed.select(cols).equals(reference.select(cols))
    # Throughput: tokens of the rows the finishing attempt generated over its own time; the
    # carried-over rows (timed by the killed attempt, whose time is lost) are excluded.
    fresh = resumed.filter(~pl.col("id").is_in(sorted(carried)))
    assert stats["generated_completion_tokens"] == fresh["completion_tokens"].sum()
    assert stats["completion_tokens"] == resumed["completion_tokens"].sum() > fresh["completion_tokens"].sum()
    summary = json.loads((workdir / "results" / "summary.json").read_text())
    assert summary["resumed_rows"] == checkpointed
    assert summary["measured_tok_s"] == pytest.approx(
        stats["generated_completion_tokens"] / stats["wall_time_s"])
    report = (workdir / "results" / "report.md").read_text()
    assert f"resumed rows: {checkpointed}" in report and "excluded from every throughput" in report


def test_openai_batch_round_trip_in_results_dir_with_spaces(tmp_path):
    # Paths with spaces reach every rule's command quoted; each rule leaves its benchmark file.
    run_snakemake(tmp_path, f"workload=openai-batch workload.inputs=[{REPO / 'data' / 'openai_batch_example.jsonl'}]"
                            " engine.policy=config results_dir='my results' resources_dir='my resources'")
    results = tmp_path / "my results"
    inputs = [json.loads(l) for l in (REPO / "data" / "openai_batch_example.jsonl").read_text().splitlines() if l.strip()]
    outputs = [json.loads(l) for l in (results / "batch_output.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == [i["custom_id"] for i in inputs]
    for i, o in zip(inputs, outputs):
        assert o["error"] is None
        body = o["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] <= i["body"]["max_tokens"]
    benchmarks = {p.relative_to(results / "benchmarks").as_posix()
                  for p in (results / "benchmarks").rglob("*.tsv")}
    assert benchmarks == {"prepare_model.tsv", "shard.tsv", "policy.tsv", "generate/0.tsv",
                          "merge.tsv", "report.tsv"}
    assert (results / "summary.json").exists() and (results / "plots" / "throughput.png").exists()


def test_results_dirs_share_the_built_model_without_rebuilding(tmp_path, corpus):
    def run(results: str) -> subprocess.CompletedProcess:
        return run_snakemake(tmp_path, _overrides(corpus, "workload.limit=4", f"results_dir={results}"))

    def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [folder, *folder.iterdir()]}

    run("run-a")
    [model] = (tmp_path / "resources" / "models").iterdir()
    assert model.name.startswith("tiny-mixtral-seed0-")
    before = snapshot(model)
    run("run-b")
    assert snapshot(model) == before  # same folder, same files: nothing rebuilt
    assert not (tmp_path / "run-b" / "logs" / "prepare_model.log").exists()
    assert (tmp_path / "run-b" / "generations.parquet").exists()
    assert sorted(p.name for p in (tmp_path / "resources" / "models").iterdir()) == [model.name]
    # The first run's outputs are not stale because a second results dir was used.
    again = run("run-a")
    assert "Nothing to be done" in again.stdout + again.stderr
