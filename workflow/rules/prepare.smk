# Generate the built-in checkpoint the config asks for (skipped for a real checkpoint dir).
if APP.model.builtin is not None:

    rule prepare_model:
        input:
            cfg=RESOLVED,
        output:
            directory(MODEL_DIR),
        log:
            f"{LOGS}/prepare_model.log",
        benchmark:
            f"{BENCH}/prepare_model.tsv"
        threads: 1
        resources:
            mem_mb=4000,
        shell:
            "{PY:q} -m moe_engine.cli prepare-model --config {input.cfg:q} --out {output:q} > {log:q} 2>&1"
