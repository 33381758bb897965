"""The Snakemake workflow end to end on the tiny model: outputs, row accounting, dry run,
resume after SIGKILL, OpenAI batch round trip, one run for each architecture. Each test's
workflows run in directories of their own; they start together when the module's first test
needs one, two at a time (see `workflows`), and each test checks its own."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import polars as pl
import pytest

REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
pytestmark = pytest.mark.slow
# A test that waits on the background runs (`workflows`) may wait for all of them; each
# snakemake invocation has the 600 s a run_snakemake call allows.
WAITS_ON_RUNS = pytest.mark.timeout(1800)


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


def _full_overrides(corpus: Path) -> str:
    # The default policy path: performance-model search over the machine's profile.
    return _overrides(corpus, "workload.num_shards=3", policy="search")


def _killed_overrides(corpus: Path) -> str:
    return _overrides(corpus, "workload.num_shards=1", "workload.max_new_tokens=24",
                      "engine.checkpoint_every=3", "engine.max_num_seqs=2",
                      "workload.temperature=0.8")


OPENAI_OVERRIDES = (f"workload=openai-batch workload.inputs=[{REPO / 'data' / 'openai_batch_example.jsonl'}]"
                    " engine.policy=config results_dir='my results' resources_dir='my resources'")


class Workflows:
    """Workflow runs in the background, two at a time. Each is mostly single-threaded process
    start-up (Snakemake, then one Python process a rule), so on two cores a pair takes little
    longer than one: the ten architectures took ~145 s one after another, ~80 s in pairs, and
    the other tests' runs, one after another, left a core mostly idle for ~190 s. A scenario (a
    function of this object and its arguments) runs its steps in order in one slot; `result`
    waits for it and returns what it returned, or raises what it raised (a failed assertion
    in it included)."""

    def __init__(self) -> None:
        self._slots = ThreadPoolExecutor(max_workers=2, thread_name_prefix="workflow")
        self._scenarios: dict[str, Future] = {}
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._closing = False

    def start(self, name: str, scenario: Callable[..., Any], *args: Any) -> None:
        self._scenarios[name] = self._slots.submit(scenario, self, *args)

    def result(self, name: str) -> Any:
        return self._scenarios[name].result()

    def popen(self, workdir: Path, overrides: str, *extra: str, **kwargs) -> subprocess.Popen:
        """Snakemake as the tests run it, in its own session (`stop` kills it with every job
        it started), with one thread a generate job: two workflows share the two cores, and
        the engine's threads wait for each other at every step, so a second one where the
        other workflow runs costs far more than it brings (a tiny-model decode step took
        7-10x as long as on one thread)."""
        with self._lock:
            if self._closing:
                raise RuntimeError("the module's workflows were stopped")
            proc = subprocess.Popen(snakemake_cmd(workdir, overrides, "--set-threads", "generate=1",
                                                  *extra), start_new_session=True, **kwargs)
            self._running.add(proc)
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        """Kill a workflow with every job it started, and reap it."""
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        with self._lock:
            self._running.discard(proc)

    def run(self, workdir: Path, overrides: str, *extra: str) -> subprocess.CompletedProcess:
        """run_snakemake's run: a non-zero exit fails with the end of the output."""
        proc = self.popen(workdir, overrides, *extra, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=600)
        finally:
            self.stop(proc)
        assert proc.returncode == 0, out[-3000:] + err[-6000:]
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self) -> None:
        """Nothing left behind: runs not started are dropped, running ones killed."""
        with self._lock:
            self._closing = True
            running = list(self._running)
        for future in self._scenarios.values():
            future.cancel()
        for proc in running:
            self.stop(proc)
        self._slots.shutdown(wait=True)


def _run(workflows: Workflows, workdir: Path, overrides: str) -> Path:
    workflows.run(workdir, overrides)
    return workdir


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [folder, *folder.iterdir()]}


def _full_run_then_another_results_dir(workflows: Workflows, workdir: Path, corpus: Path) -> dict:
    """The full run (test_full_run_accounts_for_every_row); a run in a second results dir
    beside it (test_results_dirs_share_the_built_model_without_rebuilding), with the model
    folder's files before and after it; then the full run's invocation again."""
    # The policy rule measures the machine profile (hardware.profile=auto; conftest's
    # MOE_BATCH_PROFILE=fast) unless an earlier test of the session left one that serves.
    workflows.run(workdir, _full_overrides(corpus))
    [model] = (workdir / "resources" / "models").iterdir()
    before = _snapshot(model)
    workflows.run(workdir, _overrides(corpus, "workload.limit=4", "results_dir=run-b"))
    after = _snapshot(model)
    models = sorted(p.name for p in (workdir / "resources" / "models").iterdir())
    again = workflows.run(workdir, _full_overrides(corpus))
    return {"workdir": workdir, "model": model, "before": before, "after": after,
            "models": models, "again": again}


def _killed_and_resumed(workflows: Workflows, workdir: Path, corpus: Path) -> dict:
    """The workflow SIGKILLed (with its generate job) once 6 rows are checkpointed, then run
    again as a user would. Returns its directory, the checkpointed row count and the ids the
    kill left."""
    overrides = _killed_overrides(corpus)
    ckpt = workdir / "results" / "generations" / "0.parquet.ckpt.jsonl"
    proc = workflows.popen(workdir, overrides, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if ckpt.exists() and len(ckpt.read_text().splitlines()) >= 1 + 6:
                break
            assert proc.poll() is None, "workflow finished before it could be killed"
            time.sleep(0.05)
    finally:
        workflows.stop(proc)
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
    workflows.run(workdir, overrides, "--unlock")
    workflows.run(workdir, overrides, "--rerun-incomplete")
    return {"workdir": workdir, "checkpointed": checkpointed, "carried": carried}


# tiny-mixtral runs through every other test here; one run for each other architecture.
OTHER_ARCHITECTURES = sorted(p for p in __import__("moe_engine.tools.presets", fromlist=["PRESETS"])
                             .PRESETS if p.startswith("tiny-") and p != "tiny-mixtral")
ARCHITECTURE_TEST = "test_every_architecture_generates_transformers_greedy_tokens_through_the_workflow"


def _architecture_rows() -> list[dict]:
    """The first 6 sample rows without their own max_new_tokens (workload.max_new_tokens=8)."""
    return [json.loads(line) for line in (REPO / "data" / "sample_prompts.jsonl").read_text()
            .splitlines() if '"max_new_tokens"' not in line and '"prompt"' in line][:6]


@pytest.fixture(scope="module")
def workflows(request, tmp_path_factory, corpus) -> Workflows:
    """The workflow runs of this module's selected tests, started at once, longest first (the
    chains of runs before the single ones), so the two slots stay busy until the end."""
    selected = [item for item in request.session.items if item.module is request.module]
    names = {item.originalname for item in selected}
    presets = [item.callspec.params["preset"] for item in selected
               if item.originalname == ARCHITECTURE_TEST]
    runs = Workflows()
    try:
        if names & {"test_full_run_accounts_for_every_row",
                    "test_results_dirs_share_the_built_model_without_rebuilding"}:
            runs.start("full", _full_run_then_another_results_dir, tmp_path_factory.mktemp("full"),
                       corpus)
        if "test_killed_generate_job_resumes_without_redoing_checkpointed_rows" in names:
            runs.start("killed", _killed_and_resumed, tmp_path_factory.mktemp("killed"), corpus)
            # Reference: the same run, uninterrupted, in its own directory.
            runs.start("killed-reference", _run, tmp_path_factory.mktemp("reference"),
                       _killed_overrides(corpus))
        if "test_openai_batch_round_trip_in_results_dir_with_spaces" in names:
            runs.start("openai", _run, tmp_path_factory.mktemp("openai"), OPENAI_OVERRIDES)
        if presets:
            arch_corpus = tmp_path_factory.mktemp("arch-corpus") / "prompts.jsonl"
            arch_corpus.write_text("".join(json.dumps(r) + "\n" for r in _architecture_rows()))
            for preset in OTHER_ARCHITECTURES:
                if preset in presets:
                    runs.start(preset, _run, tmp_path_factory.mktemp(preset),
                               _overrides(arch_corpus, f"model={preset}"))
        yield runs
    finally:  # an interrupted session must not leave workflows running behind it
        runs.close()


@WAITS_ON_RUNS
def test_full_run_accounts_for_every_row(workflows, corpus):
    full = workflows.result("full")
    results = full["workdir"] / "results"
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
    # A second invocation has nothing to do (after a run in another results dir, too).
    again = full["again"]
    assert "Nothing to be done" in again.stdout + again.stderr


@WAITS_ON_RUNS
@pytest.mark.parametrize("preset", OTHER_ARCHITECTURES)
def test_every_architecture_generates_transformers_greedy_tokens_through_the_workflow(
        workflows, preset):
    import torch

    from moe_engine.engine.tokenizer import load_tokenizer
    from moe_engine.tools.presets import builtin_model_key
    from tests.test_engine_parity import _hf_model

    workdir = workflows.result(preset)  # its run exited 0
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


@WAITS_ON_RUNS
def test_killed_generate_job_resumes_without_redoing_checkpointed_rows(workflows):
    # The kill, and the checks between it and the rerun, are in _killed_and_resumed.
    killed = workflows.result("killed")
    workdir, checkpointed, carried = killed["workdir"], killed["checkpointed"], killed["carried"]
    reference = pl.read_parquet(workflows.result("killed-reference") / "results" / "generations.parquet")
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


@WAITS_ON_RUNS
def test_openai_batch_round_trip_in_results_dir_with_spaces(workflows):
    # Paths with spaces reach every rule's command quoted; each rule leaves its benchmark file.
    results = workflows.result("openai") / "my results"
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


@WAITS_ON_RUNS
def test_results_dirs_share_the_built_model_without_rebuilding(workflows):
    # The first results dir is test_full_run_accounts_for_every_row's ("results"); the second,
    # run-b, a run of 4 rows with the config policy: the model folder is all they share.
    full = workflows.result("full")
    workdir, model = full["workdir"], full["model"]
    assert model.name.startswith("tiny-mixtral-seed0-")
    assert full["after"] == full["before"]  # same folder, same files: nothing rebuilt
    assert not (workdir / "run-b" / "logs" / "prepare_model.log").exists()
    assert (workdir / "run-b" / "generations.parquet").exists()
    assert full["models"] == [model.name]
    # The first run's outputs are not stale because a second results dir was used.
    again = full["again"]
    assert "Nothing to be done" in again.stdout + again.stderr
