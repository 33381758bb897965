"""The workflow on a real Slurm (issue 16): a one-node cluster started on this machine by
tests/cluster/slurm_up.sh, the Slurm executor plugin, and a test variant of the Slurm profile
(tests/cluster/profile). Every rule runs as a Slurm job; one generate job is cancelled with
`scancel` once its checkpoint holds rows, Snakemake's retry resubmits it, and it resumes from the
checkpoint. The merged output must hold every row exactly once, with the tokens of a local run.

Needs root (daemons, apt-get on a fresh machine); skipped otherwise, or with
MOE_BATCH_SLURM_TEST=0. Takes ~1.5 min with the packages installed (README, "On a Slurm
cluster").
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "cluster" / "slurm_up.sh"
PROFILE = REPO / "tests" / "cluster" / "profile"
SNAKEMAKE = [str(Path(sys.executable).parent / "snakemake")]
# The cluster run's Snakemake: the same, with the Slurm plugin's wait between status checks
# capped at 0.5 s (see the script: its back-off let a step start up to 21 s after the last).
SNAKEMAKE_ON_SLURM = [sys.executable, str(REPO / "tests" / "cluster" / "snakemake_polling.py")]
SHARDS = 4
CANCELLED_SHARD = "1"
# The first rows of the bundled corpus: 16 rows a shard are enough for a job to be cancelled
# half way (it is cancelled after 3 checkpointed rows), and rows run one at a time, so the whole
# 320-row corpus would spend two minutes of the suite on generation the test does not look at.
CORPUS_ROWS = 64


def _overrides(corpus: Path) -> tuple[str, str]:
    """(cluster, local) overrides. The cluster runs one sequence at a time with a checkpoint line
    per row, so a generate job runs for seconds and checkpoints from its first row on. The
    reference is one local shard in batches of 64: a row's tokens do not depend on its batch
    (the packed kernels are batch invariant), so the cluster's one-at-a-time rows must match it."""
    common = f"workload.inputs=[{corpus}] engine.policy=config"
    return (f"{common} workload.num_shards={SHARDS} engine.max_num_seqs=1 engine.checkpoint_every=1",
            f"{common} workload.num_shards=1 engine.max_num_seqs=64")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="starting a Slurm cluster needs root"),
    pytest.mark.skipif(os.environ.get("MOE_BATCH_SLURM_TEST") == "0", reason="MOE_BATCH_SLURM_TEST=0"),
    pytest.mark.skipif(shutil.which("slurmctld") is None and shutil.which("apt-get") is None,
                       reason="neither Slurm nor apt-get to install it"),
]


def _sh(*cmd: str, check: bool = True, timeout: float = 60) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


@pytest.fixture(scope="module")
def slurm():
    """A running cluster; stopped afterwards unless it was already running before the tests."""
    was_up = shutil.which("sinfo") is not None and subprocess.run(
        ["sinfo", "-h"], capture_output=True).returncode == 0
    started = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT), "up"], capture_output=True, text=True, timeout=600)
    try:
        if proc.returncode == 3:
            pytest.skip(f"Slurm could not be installed here: {proc.stderr.strip()[-500:]}")
        assert proc.returncode == 0, f"slurm_up.sh up failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        print(f"cluster up in {time.monotonic() - started:.0f} s")
        yield
    finally:  # also after a failed `up`: whatever it started is stopped
        if not was_up:
            _sh("bash", str(SCRIPT), "down", check=False, timeout=180)


def _snakemake(workdir: Path, *extra: str, overrides: str,
               snakemake: list[str] = SNAKEMAKE) -> subprocess.Popen:
    cmd = [*snakemake, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), *extra,
           "--config", f"overrides={overrides}"]
    log = open(workdir / "snakemake.out", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def _jobs(run_uuid: str | None = None) -> list[dict[str, str]]:
    """This workflow's Slurm jobs from the accounting database (sacct), oldest first."""
    out = _sh("sacct", "-X", "-n", "-P", "-S", "now-1hour", "-o", "JobID,JobName,Partition,State,Comment")
    rows = [dict(zip(("id", "name", "partition", "state", "comment"), line.split("|")))
            for line in out.splitlines() if line.strip()]
    return [r for r in rows if run_uuid is None or r["name"] == run_uuid]


def _cancel_when_checkpointed(workdir: Path, proc: subprocess.Popen, deadline_s: float = 400) -> str:
    """scancel the shard's generate job once its checkpoint holds rows; returns the job id."""
    ckpt = workdir / "results" / "generations" / f"{CANCELLED_SHARD}.parquet.ckpt.jsonl"
    comment = f"rule_generate_wildcards_{CANCELLED_SHARD}"
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and proc.poll() is None:
        rows = ckpt.read_text().count("\n") - 1 if ckpt.exists() else 0  # first line: fingerprint
        if rows >= 3:
            running = [line.split("|") for line in _sh("squeue", "-h", "-o", "%i|%k|%T").splitlines()]
            ids = [jid for jid, com, state in running if com == comment and state == "RUNNING"]
            if ids:
                _sh("scancel", ids[0])
                return ids[0]
        time.sleep(0.1)
    raise AssertionError(f"generate job of shard {CANCELLED_SHARD} never ran with a checkpoint "
                         f"(snakemake exited {proc.poll()}): {(workdir / 'snakemake.out').read_text()[-3000:]}")


def _outputs(workdir: Path) -> pl.DataFrame:
    return pl.read_parquet(workdir / "results" / "generations.parquet").sort("id")


def test_generate_jobs_run_as_slurm_jobs_and_a_cancelled_one_resumes(slurm, tmp_path):
    local, cluster = tmp_path / "local", tmp_path / "slurm"
    local.mkdir()
    cluster.mkdir()
    corpus = tmp_path / "prompts.jsonl"
    rows = [line for line in (REPO / "data" / "sample_prompts.jsonl").read_text().splitlines() if line.strip()]
    corpus.write_text("\n".join(rows[:CORPUS_ROWS]) + "\n")
    cluster_overrides, local_overrides = _overrides(corpus)
    started = time.monotonic()
    proc = _snakemake(cluster, "--workflow-profile", str(PROFILE), overrides=cluster_overrides,
                      snakemake=SNAKEMAKE_ON_SLURM)
    # The local reference runs meanwhile (its own directory, nothing shared with the cluster
    # run): the cluster run spends most of its time on job start-up and status checks.
    local_run = _snakemake(local, "--cores", "2", overrides=local_overrides)
    try:
        cancelled = _cancel_when_checkpointed(cluster, proc)
        assert proc.wait(timeout=600) == 0, (cluster / "snakemake.out").read_text()[-4000:]
        slurm_s = time.monotonic() - started
        assert local_run.wait(timeout=600) == 0, (local / "snakemake.out").read_text()[-4000:]
    finally:  # a failed or hung run must not leave Snakemake submitting jobs behind the test
        for run in (proc, local_run):
            if run.poll() is None:
                run.terminate()
                run.wait(timeout=120)

    # Every rule ran as a Slurm job of this run, generate jobs on the gpu partition.
    log = (cluster / "snakemake.out").read_text()
    run_uuid = next(r["name"] for r in _jobs() if r["id"] == cancelled)
    jobs = _jobs(run_uuid)
    by_rule: dict[str, list[dict[str, str]]] = {}
    for job in jobs:
        by_rule.setdefault(job["comment"], []).append(job)
    generate = {f"rule_generate_wildcards_{i}" for i in range(SHARDS)}
    assert generate <= set(by_rule), by_rule
    assert {"rule_shard", "rule_policy", "rule_merge", "rule_report"} <= set(by_rule), by_rule
    assert all(j["partition"] == "gpu" for c in generate for j in by_rule[c])
    # The cancelled job, then its resubmission, which completed; the other shards ran once.
    cancelled_rule = by_rule[f"rule_generate_wildcards_{CANCELLED_SHARD}"]
    assert [j["state"].split()[0] for j in cancelled_rule] == ["CANCELLED", "COMPLETED"], cancelled_rule
    assert cancelled_rule[0]["id"] == cancelled
    for c in generate - {f"rule_generate_wildcards_{CANCELLED_SHARD}"}:
        assert [j["state"] for j in by_rule[c]] == ["COMPLETED"], by_rule[c]

    # The resubmitted job resumed from the checkpoint instead of starting over.
    stats = json.loads((cluster / "results" / "stats" / f"{CANCELLED_SHARD}.json").read_text())
    assert 3 <= stats["resumed_rows"] < stats["rows"], stats
    assert stats["resumed_rows"] + stats["generated_rows"] == stats["rows"]

    # Every row exactly once, with the tokens a local run gives.
    ours, theirs = _outputs(cluster), _outputs(local)
    assert ours.height == CORPUS_ROWS and ours["id"].n_unique() == CORPUS_ROWS
    assert ours.select("id", "status", "output_token_ids").equals(theirs.select("id", "status", "output_token_ids"))
    print(f"slurm run with one cancelled and resumed generate job: {slurm_s:.0f} s; {log.count('submitted with SLURM jobid')} Slurm submissions")
