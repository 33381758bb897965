# Every input row exactly once, in input order; fails loudly if a row is missing or duplicated.
rule merge:
    input:
        cfg=RESOLVED,
        manifest=f"{SHARD_DIR}/manifest.json",
        rejected=f"{SHARD_DIR}/rejected.parquet",
        generations=expand(f"{RESULTS}/generations/{{i}}.parquet", i=SHARD_IDS),
    output:
        merged=GENERATIONS,
        openai=OPENAI_OUTPUT,
    params:
        # A list, so `:q` quotes the path on its own; empty (no argument) for other formats.
        openai=["--openai-out", *OPENAI_OUTPUT] if OPENAI_OUTPUT else [],
    log:
        f"{LOGS}/merge.log",
    benchmark:
        f"{BENCH}/merge.tsv"
    threads: 1
    resources:
        mem_mb=2000,
    shell:
        "{PY:q} -m moe_engine.cli merge --config {input.cfg:q} --shard-dir {SHARD_DIR:q}"
        " --generations {input.generations:q} --out {output.merged:q} {params.openai:q}"
        " > {log:q} 2>&1"
