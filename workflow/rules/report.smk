# Throughput, time split, prediction vs measurement, KV use and rejected rows, with plots.
rule report:
    input:
        cfg=RESOLVED,
        generations=GENERATIONS,
        stats=expand(f"{RESULTS}/stats/{{i}}.json", i=SHARD_IDS),
        policy=POLICY,
    output:
        html=REPORT_HTML,
        md=REPORT_MD,
    log:
        f"{LOGS}/report.log",
    threads: 1
    resources:
        mem_mb=2000,
    shell:
        "{PY} -m moe_engine.cli report --config {input.cfg} --generations {input.generations}"
        " --stats {input.stats} --policy {input.policy} --md {output.md} --html {output.html}"
        " > {log} 2>&1"
