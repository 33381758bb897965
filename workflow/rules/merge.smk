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
        openai=f"--openai-out {OPENAI_OUTPUT[0]}" if OPENAI_OUTPUT else "",
    log:
        f"{LOGS}/merge.log",
    threads: 1
    resources:
        mem_mb=2000,
    shell:
        "{PY} -m moe_engine.cli merge --config {input.cfg} --shard-dir {SHARD_DIR}"
        " --generations {input.generations} --out {output.merged} {params.openai} > {log} 2>&1"
