# Generate the built-in checkpoint the config asks for (skipped for a real checkpoint dir).
# MODEL_DIR is keyed by what defines the model (preset, seed, shards, definition hash) and the
# rule reads no run config: runs with other results dirs reuse the folder, never rebuild it.
if APP.model.builtin is not None:

    rule prepare_model:
        output:
            directory(MODEL_DIR),
        params:
            preset=APP.model.builtin,
            seed=APP.model.seed,
            num_shards=APP.model.num_shards,
        log:
            f"{LOGS}/prepare_model.log",
        benchmark:
            f"{BENCH}/prepare_model.tsv"
        threads: 1
        resources:
            mem_mb=4000,
        shell:
            "{PY:q} -m moe_engine.cli prepare-model --preset {params.preset:q} --seed {params.seed}"
            " --num-shards {params.num_shards} --out {output:q} > {log:q} 2>&1"
