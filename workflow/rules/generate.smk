# One job per shard. Resumable: completed rows are checkpointed beside the output, and the
# output is renamed into place only when the shard is complete.
rule generate:
    input:
        cfg=RESOLVED,
        model=MODEL_DIR,
        shard=f"{SHARD_DIR}/{{i}}.parquet",
        policy=POLICY,
    output:
        generations=f"{RESULTS}/generations/{{i}}.parquet",
        stats=f"{RESULTS}/stats/{{i}}.json",
    log:
        f"{LOGS}/generate/{{i}}.log",
    benchmark:
        f"{BENCH}/generate/{{i}}.tsv"
    threads: workflow.cores
    resources:
        mem_mb=8000,
        gpu=USES_GPU,
    shell:
        "{PY} -m moe_engine.cli generate --config {input.cfg} --model {input.model}"
        " --shard {input.shard} --policy {input.policy} --out {output.generations}"
        " --stats {output.stats} --threads {threads} 2>&1 | tee {log} >&2"
