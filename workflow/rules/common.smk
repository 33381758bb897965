# Paths derived from the resolved config, shared by every rule file.
MODEL_DIR = str(APP.model_dir)
LOGS = f"{RESULTS}/logs"
BENCH = f"{RESULTS}/benchmarks"
SHARD_DIR = f"{RESULTS}/shards"
SHARD_IDS = [str(i) for i in range(APP.workload.num_shards)]
SHARDS = expand(f"{SHARD_DIR}/{{i}}.parquet", i=SHARD_IDS)
POLICY = f"{RESULTS}/policy.json"
GENERATIONS = f"{RESULTS}/generations.parquet"
# OpenAI batch input gets the matching batch output file; other formats none.
OPENAI_OUTPUT = [f"{RESULTS}/batch_output.jsonl"] if APP.workload.format.value == "openai" else []
REPORT_HTML = f"{RESULTS}/report.html"
REPORT_MD = f"{RESULTS}/report.md"
# The report stage writes these beside report.md (see moe_engine.stages.report.write_report).
REPORT_SUMMARY = f"{RESULTS}/summary.json"
REPORT_PLOTS = f"{RESULTS}/plots"
USES_GPU = 1 if APP.engine.backend.value == "cuda" else 0


def all_cores() -> int:
    """Every core Snakemake may use here (--cores): a generate job takes them all, so shards on
    one machine run one after another. A cluster executor runs without --cores; there each
    job's threads come from the profile's set-threads (1 when it names none)."""
    from snakemake.exceptions import WorkflowError

    try:
        return workflow.cores
    except WorkflowError:
        return 1


GENERATE_THREADS = all_cores()
