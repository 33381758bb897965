# Throughput, time split, prediction vs measurement, KV use and rejected rows, with plots.
# The report writes summary.json and its PNGs beside report.md; which PNGs depends on the run
# (rows-not-generated only when some were, the roofline only for a searched policy), so the
# plots folder is the declared output.
rule report:
    input:
        cfg=RESOLVED,
        generations=GENERATIONS,
        stats=expand(f"{RESULTS}/stats/{{i}}.json", i=SHARD_IDS),
        policy=POLICY,
    output:
        html=REPORT_HTML,
        md=REPORT_MD,
        summary=REPORT_SUMMARY,
        plots=directory(REPORT_PLOTS),
    log:
        f"{LOGS}/report.log",
    benchmark:
        f"{BENCH}/report.tsv"
    threads: 1
    resources:
        mem_mb=2000,
    shell:
        "{PY:q} -m moe_engine.cli report --config {input.cfg:q} --generations {input.generations:q}"
        " --stats {input.stats:q} --policy {input.policy:q} --md {output.md:q}"
        " --html {output.html:q} > {log:q} 2>&1"
