"""The light workflow stages (shard, policy, merge, report) run without torch or the engine's
heavy modules: each runs the CLI in a fresh interpreter on the tiny checkpoint, and the modules
loaded when it exits are checked. A rule that pulls in torch pays ~1 s and a few hundred MB per
job for nothing, and a stage that needs the engine belongs in `generate`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from moe_engine.config import compose, save_resolved
from moe_engine.stages.tables import GENERATION_SCHEMA, STATUS_PENDING

REPO = Path(__file__).resolve().parent.parent
# Module prefixes a light stage must never load: torch and what only the engine needs.
HEAVY = ("torch", "moe_engine.model", "moe_engine.offload", "moe_engine._kernels",
         "moe_engine.engine.llm_engine", "moe_engine.engine.model_runner", "safetensors.torch")
# Allowed after all: the torch-free part of moe_engine.model (the config.json reader the
# performance model uses, and the audit that refuses fields it does not compute) and the kernels' empty package (the machine fingerprint looks up the
# compiled kernel's module spec, which imports the package, not the kernel).
LIGHT = {"moe_engine.model", "moe_engine.model.spec", "moe_engine.model.arch",
         "moe_engine.model.config_audit", "moe_engine._kernels"}
# Runs the CLI as `python -m moe_engine.cli` does, then writes the loaded module names.
DRIVER = """
import json, runpy, sys
out, argv = sys.argv[1], sys.argv[2:]
sys.argv = ["moe_engine.cli", *argv]
try:
    runpy.run_module("moe_engine.cli", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
else:
    code = 0
with open(out, "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""


def run_stage(tmp: Path, *argv: str | Path, env: dict[str, str] | None = None) -> list[str]:
    """Run one CLI subcommand in a fresh interpreter; the heavy modules it had loaded at exit."""
    report = tmp / "modules.json"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(report), *map(str, argv)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=None if env is None else {**os.environ, **env})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(report.read_text())
    assert result["code"] in (0, None), proc.stdout[-2000:] + proc.stderr[-4000:]
    return [m for m in result["modules"]
            if m not in LIGHT and any(m == h or m.startswith(h + ".") for h in HEAVY)]


def resolved_config(path: Path, *overrides: str, profile: str = "null") -> Path:
    # Figures from the config by default (hardware.profile=null): measuring is the profiler's job.
    cfg = compose([f"workload.inputs=[{REPO / 'data' / 'sample_prompts.jsonl'}]",
                   "workload.num_shards=2", "workload.max_new_tokens=4", f"hardware.profile={profile}",
                   *overrides])
    return save_resolved(cfg, path)


def fake_generation(shard: Path, out: Path, stats: Path) -> None:
    """What a generate job leaves behind, without running the engine: every pending row 'ok'
    with two tokens, and the per-shard stats the report reads."""
    frame = pl.read_parquet(shard).filter(pl.col("status") == STATUS_PENDING)
    frame = frame.with_columns(
        pl.lit("ok").alias("status"), pl.lit("length").alias("finish_reason"),
        pl.lit(2, dtype=pl.Int64).alias("completion_tokens"), pl.lit("hi").alias("output_text"),
        pl.lit([5, 6], dtype=pl.List(pl.Int32)).alias("output_token_ids"),
    ).select([pl.col(k).cast(v) for k, v in GENERATION_SCHEMA.items()])
    frame.write_parquet(out)
    n = frame.height
    engine = {"wall_time_s": 0.5, "decode_tokens": 2 * n, "prefill_time_s": 0.1,
              "decode_time_s": 0.4, "kv_blocks_high_water": 3, "kv_blocks_total": 8,
              "preemptions": 0, "timeline": [[0.1, n], [0.5, 2 * n]]}
    stats.write_text(json.dumps({"shard": shard.stem, "rows": n, "generated_rows": n,
                                 "resumed_rows": 0, "completion_tokens": 2 * n,
                                 "generated_completion_tokens": 2 * n,
                                 "wall_time_s": 1.0, "engine": engine}))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny_mixtral_dir):
    """A config (search policy, CPU figures) and the shard stage's output, checked torch-free."""
    tmp = tmp_path_factory.mktemp("light")
    cfg = resolved_config(tmp / "config.yaml", "engine.policy=search")
    heavy = run_stage(tmp, "shard", "--config", cfg, "--model", tiny_mixtral_dir,
                      "--out-dir", tmp / "shards")
    return tmp, cfg, heavy


def test_shard_stage_loads_no_torch(sharded):
    tmp, _, heavy = sharded
    assert heavy == []
    manifest = json.loads((tmp / "shards" / "manifest.json").read_text())
    assert manifest["num_shards"] == 2 and sum(manifest["shard_rows"]) > 0


@pytest.mark.parametrize("overrides", [("engine.policy=search",),
                                       ("engine.policy=search", "hardware=a100", "engine.backend=cuda"),
                                       ("engine.policy=config",)],
                         ids=["search-cpu", "search-device", "config"])
def test_policy_stage_loads_no_torch(sharded, tiny_mixtral_dir, overrides):
    tmp, _, _ = sharded
    cfg = resolved_config(tmp / "policy-config.yaml", *overrides)
    out = tmp / "policy.json"
    heavy = run_stage(tmp, "policy", "--config", cfg, "--model", tiny_mixtral_dir,
                      "--shards", tmp / "shards" / "0.parquet", tmp / "shards" / "1.parquet",
                      "--out", out)
    assert heavy == []
    assert json.loads(out.read_text())["source"] == overrides[0].split("=")[1]


def test_policy_stage_with_a_profile_file_loads_no_torch(sharded, tiny_mixtral_dir):
    # A measured profile given as a file is read, not measured: no profiler, no torch.
    tmp, _, _ = sharded
    profile = tmp / "profile.yaml"
    profile.write_text("name: profiled-test\ndevice_tflops: 0.3\ncpu_tflops: 0.3\n"
                       "cpu_bw_gbps: 15.0\ndevice_bw_gbps: 15.0\nlink_gbps: 15.0\n")
    cfg = resolved_config(tmp / "profile-config.yaml", "engine.policy=search", profile=str(profile))
    out = tmp / "profile-policy.json"
    heavy = run_stage(tmp, "policy", "--config", cfg, "--model", tiny_mixtral_dir,
                      "--shards", tmp / "shards" / "0.parquet", tmp / "shards" / "1.parquet",
                      "--out", out)
    assert heavy == []
    assert json.loads(out.read_text())["hardware"]["name"] == "profiled-test"


def test_policy_stage_with_the_machine_profile_cached_loads_no_torch(sharded, tiny_mixtral_dir):
    # hardware.profile=auto with a cached profile that covers the model: read, not measured.
    from moe_engine.config import load_resolved
    from moe_engine.perf import ModelSpec
    from moe_engine.perf.hardware import (CALIBRATION_KEY, CALIBRATION_METHOD, HOST_KEYS, cached_profile_path, engine_calibrated,
                                          gemm_shapes, profile_covers)
    from moe_engine.perf.specs import ENGINE_COMPONENTS, layer_layout

    tmp, _, _ = sharded
    cfg = resolved_config(tmp / "auto-config.yaml", "engine.policy=search", profile="auto")
    model = ModelSpec.from_hf_config(tiny_mixtral_dir, dtype=load_resolved(cfg).model.dtype.value)
    cache = tmp / "machine-cache"
    path = cached_profile_path(cache / "hardware")
    path.parent.mkdir(parents=True)
    rows = [{"inp": i, "out": o, "tokens": 1, "dtype_bytes": model.dtype_bytes, "gflops": 50.0}
            for i, o in gemm_shapes(model)]
    layout = layer_layout(model)  # the element-wise and attention figures of its layout too
    data = {"name": "profiled-cached", "device_tflops": 0.3, "cpu_tflops": 0.3, "cpu_bw_gbps": 15.0,
            "device_bw_gbps": 15.0, "link_gbps": 15.0, "gemm": rows, **{k: 1.0 for k in HOST_KEYS},
            "layer_ops": [{"layout": layout, "tokens": 1, "pre_attention_us": 1.0,
                           "post_attention_us": 1.0}],
            "prefill_attention": [{"layout": layout, "prompt": 8, "us_per_prompt": 1.0}],
            "decode_attention": [{"layout": layout, "batch": 1, "context": 16, "us_per_call": 1.0}],
            "moe_ffn": [{"layout": layout, "tokens": 1, "us_per_call": 1.0}],
            CALIBRATION_KEY: [{"layout": layout, **dict.fromkeys(ENGINE_COMPONENTS, 1.0),
                             "method": CALIBRATION_METHOD}]}
    assert profile_covers(data, [model]) and engine_calibrated(data, model)
    path.write_text(yaml.safe_dump(data))
    out = tmp / "auto-policy.json"
    heavy = run_stage(tmp, "policy", "--config", cfg, "--model", tiny_mixtral_dir,
                      "--shards", tmp / "shards" / "0.parquet", tmp / "shards" / "1.parquet",
                      "--out", out, env={"MOE_BATCH_CACHE": str(cache)})
    assert heavy == []
    assert json.loads(out.read_text())["hardware"]["name"] == "profiled-cached"


def test_merge_and_report_stages_load_no_torch(sharded, tiny_mixtral_dir):
    tmp, cfg, _ = sharded
    policy = tmp / "search-policy.json"
    assert run_stage(tmp, "policy", "--config", cfg, "--model", tiny_mixtral_dir,
                     "--shards", tmp / "shards" / "0.parquet", tmp / "shards" / "1.parquet",
                     "--out", policy) == []
    gens, stats = [], []
    for i in range(2):
        gens.append(tmp / f"gen-{i}.parquet")
        stats.append(tmp / "stats" / f"{i}.json")
        stats[-1].parent.mkdir(exist_ok=True)
        fake_generation(tmp / "shards" / f"{i}.parquet", gens[-1], stats[-1])

    merged = tmp / "out" / "generations.parquet"
    merged.parent.mkdir()
    assert run_stage(tmp, "merge", "--config", cfg, "--shard-dir", tmp / "shards",
                     "--generations", *gens, "--out", merged) == []
    assert pl.read_parquet(merged).height == json.loads((tmp / "shards" / "manifest.json").read_text())["num_rows"]

    assert run_stage(tmp, "report", "--config", cfg, "--generations", merged, "--stats", *stats,
                     "--policy", policy, "--md", tmp / "out" / "report.md",
                     "--html", tmp / "out" / "report.html") == []
    assert (tmp / "out" / "plots" / "roofline.png").exists()
    assert (tmp / "out" / "summary.json").exists()


def test_policy_sizes_the_experts_the_engine_will_hold():
    """The performance model sizes routed experts as the engine holds them: a quantized
    expert_dtype, the checkpoint's MXFP4 on the packed CPU path, widened on torch's GEMMs."""
    from moe_engine.config import compose
    from moe_engine.stages.policy import held_expert_storage

    def held(overrides, checkpoint):
        return held_expert_storage(compose(overrides).engine, checkpoint)

    assert held([], "mxfp4") == "mxfp4" and held([], None) is None
    assert held(["engine.expert_dtype=int4"], None) == "int4"
    assert held(["engine.expert_dtype=int8"], "mxfp4") == "int8"
    assert held(["engine.expert_dtype=bf16"], "mxfp4") is None
    assert held(["engine.gemm=torch"], "mxfp4") is None
    assert held(["engine.backend=cuda"], "mxfp4") is None
    # medium matmul precision holds float experts as bf16 pairs on the packed kernels
    medium = "engine.matmul_precision=medium"
    assert held([medium], None) == "bf16p"
    assert held_expert_storage(compose([medium]).engine, None, "float32") == "bf16p"
    assert held_expert_storage(compose([medium]).engine, None, "float16") is None
    # and int8 experts as int8 quads (int8 activations); int4 stays
    assert held([medium, "engine.expert_dtype=int8"], None) == "int8q"
    assert held([medium, "engine.expert_dtype=int4"], None) == "int4"
    assert held([medium], "mxfp4") == "mxfp4"
    # high holds bf16 experts as bf16x3 where the kernels have AMX tiles, and is highest
    # elsewhere; fp32 ones are not bf16s and keep highest's path
    high = compose(["engine.matmul_precision=high"]).engine
    assert held_expert_storage(high, None, tiles=True) == "bf16x3"
    assert held_expert_storage(high, None, tiles=False) is None
    assert held_expert_storage(high, None, "float32", tiles=True) is None
    assert held_expert_storage(high, "mxfp4", tiles=True) == "mxfp4"


def test_policy_prices_the_dense_weights_the_engine_will_hold():
    """Under medium the packed kernels hold the dense projections and the LM head as bf16
    pairs too: the model prices their GEMMs on that storage's profiled points."""
    from moe_engine.stages.policy import held_weight_storage

    def held(overrides, dtype="bfloat16"):
        return held_weight_storage(compose(overrides).engine, dtype)

    medium = "engine.matmul_precision=medium"
    assert held([]) is None and held([medium]) == "bf16p"
    assert held([medium], "float32") == "bf16p" and held([medium], "float16") is None
    high = compose(["engine.matmul_precision=high"]).engine
    assert held_weight_storage(high, tiles=True) == "bf16x3"
    assert held_weight_storage(high, tiles=False) is None
    assert held_weight_storage(high, "float32", tiles=True) is None
    # torch's GEMMs on the CPU are another path (the model dtype's F.linear, activations in
    # the model dtype); a device backend's GEMMs are the device's
    assert held(["engine.gemm=torch"]) == "torch" == held(["engine.gemm=torch"], "float32")
    assert held(["engine.backend=cuda"]) is None and held(["engine.backend=cuda", "engine.gemm=torch"]) is None
