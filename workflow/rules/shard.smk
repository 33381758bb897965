# Normalize + validate + tokenize the corpus, split into shards balanced by token count.
rule shard:
    input:
        cfg=RESOLVED,
        model=MODEL_DIR,
        corpus=APP.workload.inputs,
    output:
        shards=SHARDS,
        rejected=f"{SHARD_DIR}/rejected.parquet",
        manifest=f"{SHARD_DIR}/manifest.json",
    log:
        f"{LOGS}/shard.log",
    benchmark:
        f"{BENCH}/shard.tsv"
    threads: 1
    resources:
        mem_mb=2000,
    shell:
        "{PY:q} -m moe_engine.cli shard --config {input.cfg:q} --model {input.model:q}"
        " --out-dir {SHARD_DIR:q} > {log:q} 2>&1"
