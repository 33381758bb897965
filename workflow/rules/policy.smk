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
    threads: 1
    resources:
        mem_mb=1000,
    shell:
        "{PY} -m moe_engine.cli policy --config {input.cfg} --model {input.model}"
        " --shards {input.shards} --out {output} > {log} 2>&1"
