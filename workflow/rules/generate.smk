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
    threads: GENERATE_THREADS
    resources:
        mem_mb=8000,
        gpu=USES_GPU,
    shell:
        "{PY:q} -m moe_engine.cli generate --config {input.cfg:q} --model {input.model:q}"
        " --shard {input.shard:q} --policy {input.policy:q} --out {output.generations:q}"
        " --stats {output.stats:q} --threads {threads} 2>&1 | tee {log:q} >&2"
