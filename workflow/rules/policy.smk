# Choose N, micro-batches, placements and resident ratios with the performance model
# (engine.policy=search), or record the configured knobs (engine.policy=config).
rule policy:
    input:
        cfg=RESOLVED,
        model=MODEL_DIR,
        shards=SHARDS,
    output:
        POLICY,
    log:
        f"{LOGS}/policy.log",
    benchmark:
        f"{BENCH}/policy.tsv"
    threads: 1
    resources:
        mem_mb=1000,
    shell:
        "{PY:q} -m moe_engine.cli policy --config {input.cfg:q} --model {input.model:q}"
        " --shards {input.shards:q} --out {output:q} > {log:q} 2>&1"
