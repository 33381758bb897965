# moe-batch workflow. Configuration comes from Hydra (config/ + overrides), never from this file:
#   snakemake --cores all --config overrides="model=small-mixtral engine.kv_cache_gb=2"
# The composed config is written to <results_dir>/config.yaml and every rule reads only that.
import sys

from moe_engine.config import compose, save_resolved_if_changed

APP = compose(config.get("overrides"))
RESULTS = APP.results_dir
RESOURCES = APP.resources_dir
RESOLVED = f"{RESULTS}/config.yaml"
save_resolved_if_changed(APP, RESOLVED)
# Rules run the moe_engine CLI with the interpreter that runs Snakemake (the project venv).
PY = sys.executable


include: "workflow/rules/common.smk"
include: "workflow/rules/prepare.smk"
include: "workflow/rules/shard.smk"
include: "workflow/rules/policy.smk"
include: "workflow/rules/generate.smk"
include: "workflow/rules/merge.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        GENERATIONS,
        OPENAI_OUTPUT,
        REPORT_HTML,
