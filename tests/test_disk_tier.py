"""The disk tier: experts left on disk, read with O_DIRECT into a ring of RAM slots, give the
tokens of the fully resident run at every host ratio on every architecture; reads land the exact
bytes whatever their alignment; the ring serves reads in consumption order without deadlock; a
truncated, corrupt or changed file fails with an error naming it."""
from __future__ import annotations

import json
import os
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moe_engine.config import ConfigError, EngineConfig, compose
from moe_engine.engine.llm_engine import LLMEngine
from moe_engine.engine.request import Request, SamplingParams
from moe_engine.model.loader import load_weights
from moe_engine.model.spec import load_spec
from moe_engine.model.weights import ExpertWeights
from moe_engine.offload.disk import (ALIGN, DirectReader, DiskRead, DiskReadError, Extent,
                                     aligned_empty, read_bytes)
from moe_engine.offload.disk_tier import DiskTier, plan_host_tier
from moe_engine.offload.expert_store import (ExpertFile, ExpertLayout, ExpertSource,
                                             checkpoint_source, safetensors_header)
from moe_engine.tools.presets import PRESETS

TINY_PRESETS = sorted(p for p in PRESETS if p.startswith("tiny-"))
PROMPTS = ["Explain how a mixture of experts layer routes tokens.", "hi",
           "Write a short story about a cat who learns to fly.", "What is 2 + 2?",
           "a b c d e f g h i j k l m n o p q r s t u v w x y z"]
CONFIG = EngineConfig(threads=2, kv_cache_gb=0.02, num_micro_batches=2)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    # Expert files and routing profiles of this module stay out of the user's cache.
    monkeypatch.setenv("MOE_BATCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def model_dirs(builtin_dir, tmp_path_factory):
    """model_dirs(preset): the built-in checkpoint's files linked into a directory of this
    module, so the routing profiles its disk-tier runs record stay out of the session's shared
    checkpoints (other tests assert that a fresh checkpoint has none)."""
    made: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in made:
            out = tmp_path_factory.mktemp("disk") / preset
            out.mkdir()
            for f in builtin_dir(preset).iterdir():
                if f.name != "routing_profile.json":
                    (out / f.name).symlink_to(f)
            made[preset] = out
        return made[preset]

    return get


def _tokens(model_dir, config: EngineConfig, dtype: str = "float32") -> dict[str, list[int]]:
    with LLMEngine(model_dir, config, dtype=dtype) as engine:
        results = list(engine.generate(
            [Request(f"r{i}", prompt=p, sampling=SamplingParams(max_new_tokens=8))
             for i, p in enumerate(PROMPTS)]))
    # Rows that failed have no tokens: two failing runs must not compare equal.
    assert all(r.status == "ok" for r in results), [(r.status, r.error) for r in results]
    return {r.request_id: r.token_ids for r in results}


# ---------------------------------------------------------------- reads

def test_reads_land_exact_bytes_at_any_alignment(tmp_path):
    data = torch.randint(0, 256, (3 * ALIGN + 777,), dtype=torch.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    reader = DirectReader()
    cases = [(0, 2 * ALIGN, 0), (ALIGN, ALIGN, 0), (5, 100, 3), (ALIGN - 1, ALIGN + 2, 0),
             (3 * ALIGN, 777, 64), (0, data.numel(), 0)]
    for offset, n, at in cases:
        dst = aligned_empty(at + n)
        reader.read_into(dst, DiskRead((Extent(str(path), offset, n, at),)))
        assert torch.equal(dst[at:], data[offset:offset + n]), (offset, n, at)
    # Packets split an extent at multiples of ALIGN and land the same bytes.
    read = DiskRead((Extent(str(path), 3, data.numel() - 3, 0),))
    parts = read.split(ALIGN)
    assert len(parts) == 4 and sum(p.nbytes for p in parts) == read.nbytes
    dst = aligned_empty(read.nbytes)
    for p in parts:
        reader.read_into(dst, p)
    assert torch.equal(dst, data[3:])
    assert reader.mode in ("o_direct", "buffered+dontneed")
    reader.close()


def test_buffered_fallback_reads_the_same_bytes(tmp_path):
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    reader = DirectReader(direct=False)
    out = read_bytes([Extent(str(path), 17, 9000)], reader)
    assert torch.equal(out, data[17:9017]) and reader.mode == "buffered+dontneed"


def test_a_truncated_file_fails_naming_it(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 5000)
    reader = DirectReader()
    reader.read_into(aligned_empty(100), DiskRead((Extent(str(path), 0, 100),)))
    with open(path, "r+b") as f:  # truncated in place under the open reader
        f.truncate(1000)
    with pytest.raises(DiskReadError, match="blob"):
        reader.read_into(aligned_empty(4096), DiskRead((Extent(str(path), 0, 4096),)))


def test_a_file_changed_under_the_reader_fails_naming_it(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"a" * 8192)
    reader = DirectReader()
    reader.read_into(aligned_empty(4096), DiskRead((Extent(str(path), 0, 4096),)))
    os.utime(path, ns=(1, 1))  # same size, new mtime: rewritten
    with pytest.raises(DiskReadError, match=r"blob changed while the job was reading it"):
        reader.read_into(aligned_empty(4096), DiskRead((Extent(str(path), 0, 4096),)))


def test_corrupt_or_truncated_safetensors_headers_fail_naming_the_file(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 10) + b"{not json}")
    with pytest.raises(ValueError, match="bad.safetensors: corrupt safetensors header"):
        safetensors_header(bad)
    short = tmp_path / "short.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [100], "data_offsets": [0, 400]}}).encode()
    short.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 40)
    with pytest.raises(ValueError, match="short.safetensors: tensor w ends at byte"):
        safetensors_header(short)


# ---------------------------------------------------------------- sources and the ring

@pytest.fixture(scope="module")
def mixtral_dir(model_dirs):
    return model_dirs("tiny-mixtral")


def test_checkpoint_source_reads_each_expert_as_loaded(mixtral_dir):
    spec = load_spec(mixtral_dir)
    weights = load_weights(mixtral_dir, spec, torch.float32)
    source = checkpoint_source(mixtral_dir, spec, torch.float32)
    assert source is not None and source.kind == "checkpoint"
    assert checkpoint_source(mixtral_dir, spec, torch.bfloat16) is None  # needs conversion
    reader = DirectReader()
    for layer in range(spec.num_layers):
        for e in range(spec.num_experts):
            got = source.load(layer, e, reader)
            want = weights.layers[layer].experts[e]
            assert torch.equal(got.w13, want.w13) and torch.equal(got.w2, want.w2)


def test_expert_file_is_built_once_and_rebuilt_when_the_checkpoint_changes(builtin_dir,
                                                                            tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(builtin_dir("tiny-mixtral"), model)
    spec = load_spec(model)
    calls = []

    def convert(x: ExpertWeights) -> ExpertWeights:
        calls.append(1)
        return ExpertWeights(x.w13 * 2, x.w2)

    cache = tmp_path / "cache"
    a = ExpertFile.open_or_build(model, spec, torch.float32, "double", convert, cache_dir=cache)
    n = len(calls)
    assert n == spec.num_layers * spec.num_experts and a.kind == "expert-file"
    b = ExpertFile.open_or_build(model, spec, torch.float32, "double", convert, cache_dir=cache)
    assert len(calls) == n  # reused
    weights = load_weights(model, spec, torch.float32)
    got = b.load(1, 3, DirectReader())
    assert torch.equal(got.w13, weights.layers[1].experts[3].w13 * 2)
    for f in model.glob("*.safetensors"):
        os.utime(f, ns=(1, 1))
    ExpertFile.open_or_build(model, spec, torch.float32, "double", convert, cache_dir=cache)
    assert len(calls) == 2 * n  # a changed checkpoint never reuses a stale file


def _toy_source(tmp_path, num_layers=3, num_experts=4):
    """A hand-made expert file: expert (l, e) is a w13 filled with 100*l + e."""
    layout = ExpertLayout.of(ExpertWeights(torch.zeros(8, 1024), torch.zeros(1024, 4)))
    path = tmp_path / "experts.bin"
    reads = {}
    with open(path, "wb") as f:
        for n, key in enumerate((i, e) for i in range(num_layers) for e in range(num_experts)):
            buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
            layout.write(ExpertWeights(torch.full((8, 1024), 100.0 * key[0] + key[1]),
                                       torch.zeros(1024, 4)), buf)
            f.write(buf.numpy().tobytes())
            reads[key] = DiskRead((Extent(str(path), n * layout.nbytes, layout.nbytes),))
    from moe_engine.offload.disk import file_identity
    return ExpertSource(layout, reads, {str(path): file_identity(path)}, "expert-file")


def test_ring_serves_earlier_needs_first_and_cannot_deadlock(tmp_path):
    source = _toy_source(tmp_path)
    tier = DiskTier(source, num_slots=2, packet_bytes=8192)
    # The next layer's reads take both slots...
    tier.request(1, 0, (1, 0))
    tier.request(1, 1, (1, 1))
    assert tier.holds(1, 0) and tier.holds(1, 1)
    # ...then the current layer needs an expert it did not prefetch: it takes the latest slot.
    w = tier.wait(0, 2, (0, 2))
    assert float(w.w13[0, 0]) == 2.0 and not tier.holds(1, 1) and tier.requested(1, 1)
    assert tier.stats.evictions == 1
    tier.release(0, 2)  # the evicted read gets the slot back
    assert tier.holds(1, 1)
    for e in (0, 1):
        assert float(tier.wait(1, e, (1, e)).w13[3, 5]) == 100.0 + e
        tier.release(1, e)
    # Every slot in use: a further wait fails loudly instead of hanging.
    tier.wait(2, 0, (2, 0))
    tier.wait(2, 1, (2, 1))
    with pytest.raises(RuntimeError, match="no ring slot"):
        tier.wait(2, 2, (2, 2))
    tier.release_layer(2)
    assert not tier.holds(2, 0) and tier.num_slots == 2
    tier.close()


def test_a_read_error_reaches_the_waiter_and_frees_the_slot(tmp_path):
    source = _toy_source(tmp_path)
    tier = DiskTier(source, num_slots=1)
    with open(tmp_path / "experts.bin", "r+b") as f:
        f.truncate(source.layout.nbytes)  # only expert (0, 0) is left
    with pytest.raises(DiskReadError, match="experts.bin"):
        tier.wait(2, 3, (0, 0))
    assert not tier.holds(2, 3)
    tier.close()


def test_host_tier_plan_fits_the_budget():
    mb = 10**6
    # No budget: the ratio decides, the ring holds two layers of disk experts.
    p = plan_host_tier(100 * mb, 10 * mb, 4, 8, host_ratio=0.5)
    assert (p.host_experts, p.ring_slots, p.ratio) == (4, 8, 0.5)
    # Budget only: small-mixtral's shape (152 MB dense, 22 MB experts, 300 MB) streams all.
    p = plan_host_tier(152 * mb, 22 * mb, 4, 8, budget_bytes=300 * mb)
    assert (p.host_experts, p.ring_slots) == (0, 6)
    p = plan_host_tier(152 * mb, 22 * mb, 4, 8, budget_bytes=600 * mb)
    assert (p.host_experts, p.ring_slots) == (4, 4)  # 152 + 4 x 4 x 22 + 4 x 22 = 592
    assert plan_host_tier(152 * mb, 22 * mb, 4, 8, budget_bytes=10**12).ring_slots == 0
    with pytest.raises(ValueError, match="engine.host_memory_gb=0.16"):
        plan_host_tier(152 * mb, 22 * mb, 4, 8, budget_bytes=160 * mb)
    with pytest.raises(ValueError, match="engine.host_memory_gb=0.3"):
        plan_host_tier(152 * mb, 22 * mb, 4, 8, host_ratio=0.5, budget_bytes=300 * mb)


def test_config_checks_name_the_key():
    with pytest.raises(ConfigError, match="engine.host_resident_ratio=1.5"):
        compose(["engine.host_resident_ratio=1.5"])
    with pytest.raises(ConfigError, match="engine.host_memory_gb=0"):
        compose(["engine.host_memory_gb=0"])
    with pytest.raises(ConfigError, match="engine.disk_read_mb=0"):
        compose(["engine.disk_read_mb=0"])


# ---------------------------------------------------------------- the engine

@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tokens_identical_at_every_host_ratio(model_dirs, preset):
    model_dir = model_dirs(preset)
    reference = _tokens(model_dir, CONFIG)
    for ratio in (1.0, 0.5, 0.1, 0.0):
        # Packets far smaller than an expert: every expert is several reads.
        config = replace(CONFIG, host_resident_ratio=ratio, disk_read_mb=0.01)
        assert _tokens(model_dir, config) == reference, ratio


def test_the_first_disk_tier_run_records_the_routing_profile(builtin_dir, tmp_path):
    """The plain runner has no experts to calibrate on with the disk tier: the first run ranks
    experts by index and records the profile through the pipeline, for the next run."""
    from moe_engine.offload.routing import find_profile

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in builtin_dir("tiny-mixtral").iterdir():
        if f.name != "routing_profile.json":
            (model_dir / f.name).symlink_to(f)
    assert find_profile(model_dir) is None
    _tokens(model_dir, replace(CONFIG, host_resident_ratio=0.5))
    assert find_profile(model_dir) is not None


def test_torch_gemm_reads_the_checkpoint_in_place_and_bf16_packs_once(mixtral_dir):
    reference = _tokens(mixtral_dir, replace(CONFIG, gemm="torch"))
    with LLMEngine(mixtral_dir, replace(CONFIG, gemm="torch", host_resident_ratio=0.0),
                   dtype="float32") as engine:
        assert engine.offload.pager.disk.source.kind == "checkpoint"
    assert _tokens(mixtral_dir, replace(CONFIG, gemm="torch", host_resident_ratio=0.0)) == reference
    bf16 = _tokens(mixtral_dir, CONFIG, dtype="bfloat16")
    assert _tokens(mixtral_dir, replace(CONFIG, host_resident_ratio=0.25),
                   dtype="bfloat16") == bf16


def test_a_one_slot_ring_and_per_micro_batch_grouping_give_identical_tokens(mixtral_dir,
                                                                           monkeypatch):
    import moe_engine.offload.build as build
    from moe_engine.offload.disk_tier import HostTierPlan

    reference = _tokens(mixtral_dir, CONFIG)
    spec = load_spec(mixtral_dir)
    # The tightest ring there is (a budget that leaves one slot, without depending on how
    # many MB loading this tiny model happens to cost in RSS).
    monkeypatch.setattr(build, "plan_host_tier",
                        lambda *a, **k: HostTierPlan(0, spec.num_experts, 1))
    with LLMEngine(mixtral_dir, replace(CONFIG, host_resident_ratio=0.0), dtype="float32") as engine:
        assert engine.offload.pager.disk.num_slots == 1
        out = {r.request_id: r.token_ids for r in engine.generate(
            [Request(f"r{i}", prompt=p, sampling=SamplingParams(max_new_tokens=8))
             for i, p in enumerate(PROMPTS)])}
        assert engine.offload.pager.disk.stats.reads >= spec.num_layers
    assert out == reference
    monkeypatch.undo()
    grouped = replace(CONFIG, host_resident_ratio=0.0, group_ffn="micro_batch")
    assert _tokens(mixtral_dir, grouped) == reference


@pytest.mark.parametrize("storage", ["int8", "int4", "bf16p", "bf16x3", "int8q"])
def test_quantized_experts_page_from_disk_like_resident_ones(mixtral_dir, storage, monkeypatch):
    # bf16p: medium matmul precision's bf16 pairs (int32 words), bf16x3: high's (uint32 words,
    # from a bf16 model; held where the CPU has AMX tiles, which the engine is told it has),
    # int8q: medium's int8 quads (int8 experts, [P, k/4, 128] bytes) page as any other storage
    monkeypatch.setattr("moe_engine.engine.llm_engine.bf16_tiles", lambda: True)
    knobs = ({"matmul_precision": "medium"} if storage == "bf16p"
             else {"matmul_precision": "high"} if storage == "bf16x3"
             else {"matmul_precision": "medium", "expert_dtype": "int8"} if storage == "int8q"
             else {"expert_dtype": storage})
    dtype = "bfloat16" if storage == "bf16x3" else "float32"
    resident = _tokens(mixtral_dir, replace(CONFIG, **knobs), dtype)
    assert _tokens(mixtral_dir, replace(CONFIG, **knobs, host_resident_ratio=0.25),
                   dtype) == resident
    assert _tokens(mixtral_dir, replace(CONFIG, **knobs, resident_ratio=0.5,
                                        cpu_experts=False), dtype) == resident


def test_a_checkpoint_changed_under_a_running_job_fails_naming_the_file(builtin_dir, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(builtin_dir("tiny-mixtral"), model)
    config = replace(CONFIG, gemm="torch", host_resident_ratio=0.0)
    with LLMEngine(model, config, dtype="float32") as engine:
        (shard,) = model.glob("*.safetensors")
        os.utime(shard, ns=(1, 1))
        with pytest.raises(DiskReadError, match=shard.name):
            list(engine.generate([Request("r0", prompt="hello",
                                          sampling=SamplingParams(max_new_tokens=4))]))


def test_small_mixtral_peak_rss_stays_within_the_budgets(model_dirs):
    """A 857 MB checkpoint under a 300 MB host budget: the job's RSS growth over its runtime
    (interpreter, torch, tokenizer) stays within host_memory_gb + kv_cache_gb + 10%, measured
    by the kernel (VmHWM) in a fresh process."""
    from moe_engine.tools.rss_check import rss_check

    budget_gb, kv_gb = 0.3, 0.05
    got = rss_check(model_dirs("small-mixtral"), budget_gb, kv_gb)
    assert got["ok"] == 16 and got["read"] > 0 and got["slots"] >= 1
    assert got["ratio"] <= 1.10, (got["growth"] / 1e6, got)


def test_a_disk_read_error_fails_the_shard_and_the_rerun_loses_no_row(model_dirs, tmp_path,
                                                                       monkeypatch):
    """A read error mid-shard fails the generate job naming the file (no row is blamed for
    the disk); the rows finished before it are in the checkpoint, and the rerun resumes from
    them: every row once, with the tokens of an uninterrupted run."""
    import polars as pl

    from moe_engine.offload import disk as disk_mod
    from moe_engine.stages.generate import run_shard
    from moe_engine.stages.shard import shard_corpus

    model = model_dirs("tiny-mixtral")
    cfg = compose(["workload.limit=10", "workload.max_new_tokens=6", "engine.policy=config",
                   "engine.max_num_seqs=2", "engine.kv_cache_gb=0.02", "engine.threads=2",
                   "engine.checkpoint_every=1", "engine.host_resident_ratio=0.25",
                   "engine.disk_read_mb=0.1", "model.dtype=float32", "hardware.profile=null"])
    shard_corpus(cfg, model, tmp_path / "shards")
    shard = tmp_path / "shards" / "0.parquet"

    def run(name: str) -> pl.DataFrame:
        run_shard(cfg, model, shard, tmp_path / f"{name}.parquet", tmp_path / f"{name}.json",
                  progress=False)
        return pl.read_parquet(tmp_path / f"{name}.parquet")

    real = disk_mod.DirectReader.read_into
    calls = {"n": 0, "fail_after": None}

    def counting(self, dst, read):
        calls["n"] += 1
        if calls["fail_after"] is not None and calls["n"] > calls["fail_after"]:
            raise DiskReadError(5, f"read of {read.extents[0].path} failed: Input/output error")
        return real(self, dst, read)

    monkeypatch.setattr(disk_mod.DirectReader, "read_into", counting)
    import moe_engine.tools.profile_hardware as profiler

    learnt = []
    monkeypatch.setattr(profiler, "learn_disk_rate", lambda path, stats: learnt.append(stats))
    run("calibrate")  # records the routing profile: both runs below rank experts alike
    calls["n"] = 0
    reference = run("reference")
    # Each job hands its reader's figures to the machine profile (the learnt disk rate).
    assert len(learnt) == 2 and learnt[-1]["disk_bytes_read"] > 0
    assert learnt[-1]["disk_busy_time_s"] > 0
    calls["n"], calls["fail_after"] = 0, calls["n"] // 2  # half way through the shard
    with pytest.raises(DiskReadError, match="experts.bin|safetensors"):
        run("resumed")
    monkeypatch.setattr(disk_mod.DirectReader, "read_into", real)
    resumed = run("resumed")
    stats = json.loads((tmp_path / "resumed.json").read_text())
    assert 0 < stats["resumed_rows"] < 10 and stats["rows"] == 10, stats
    cols = ["id", "status", "output_token_ids"]
    assert resumed.select(cols).equals(reference.select(cols))
    assert resumed["id"].n_unique() == 10 and set(resumed["status"]) == {"ok"}


def _disk_pipeline_tokens(model_dir, backend, monkeypatch, slots: int, **settings):
    """Tokens of an engine whose experts are all left on disk, through a pipeline built on
    `backend` with a ring of `slots` expert slots."""
    import moe_engine.offload.build as build
    from moe_engine.offload.build import OffloadSettings, build_offload_pipeline, expert_source
    from moe_engine.offload.disk_tier import HostTierPlan
    from moe_engine.offload.routing import find_profile

    engine = LLMEngine(model_dir, CONFIG, dtype="float32")
    spec = engine.spec
    source = expert_source(model_dir, spec, engine.dtype, engine.expert_storage)
    for layer in engine.runner.weights.layers:
        layer.experts = [None] * len(layer.experts)
    ratio = settings.pop("host_resident_ratio", 0.0)
    monkeypatch.setattr(build, "plan_host_tier", lambda *a, **k: HostTierPlan(
        round(ratio * spec.num_experts), spec.num_experts, slots))
    engine.runner = build_offload_pipeline(
        engine.runner, OffloadSettings(host_resident_ratio=ratio, **settings),
        routing=find_profile(model_dir), backend=backend, experts=source)
    try:
        results = list(engine.generate(
            [Request(f"r{i}", prompt=p, sampling=SamplingParams(max_new_tokens=8))
             for i, p in enumerate(PROMPTS)]))
        assert all(r.status == "ok" for r in results), [(r.status, r.error) for r in results]
        return {r.request_id: r.token_ids for r in results}
    finally:
        engine.runner.close()
        engine.runner.pager.disk.close()
        backend.close()


@pytest.mark.parametrize("slots", [1, 2])
def test_per_micro_batch_grouping_with_a_ring_smaller_than_a_layer(mixtral_dir, monkeypatch,
                                                                  slots):
    """Each micro-batch needs the layer's experts again: an expert computed for one stays in
    its slot until a read needs it, and a read needed now takes any slot not being computed."""
    from moe_engine.offload.backend import CpuBackend

    reference = _tokens(mixtral_dir, CONFIG)
    assert _disk_pipeline_tokens(mixtral_dir, CpuBackend(), monkeypatch, slots,
                                 group_ffn="micro_batch") == reference


def test_three_tiers_on_a_device_that_is_not_the_host(mixtral_dir, monkeypatch):
    """The CUDA path's order of tiers on the CPU: a backend that declares its device apart from
    the host streams host-tier experts through the device ring and disk experts disk -> host
    slot -> device ring (memcpys here, copies on CUDA); r_w 0.25 <= r_host 0.5."""
    from moe_engine.offload.backend import CpuBackend

    class DeviceApart(CpuBackend):
        device_is_host = False

    reference = _tokens(mixtral_dir, CONFIG)
    assert _disk_pipeline_tokens(mixtral_dir, DeviceApart(), monkeypatch, 4,
                                 host_resident_ratio=0.5, resident_ratio=0.25,
                                 cpu_experts=False) == reference


def _first_logits(model_dir, config: EngineConfig) -> dict[str, torch.Tensor]:
    seen = []
    with LLMEngine(model_dir, config, dtype="float32") as engine:
        engine.logits_observer = lambda seqs, logits: seen.append(
            {s.request_id: row for s, row in zip(seqs, logits.float().cpu())})
        list(engine.generate([Request(f"r{i}", prompt=p,
                                      sampling=SamplingParams(max_new_tokens=8))
                              for i, p in enumerate(PROMPTS)]))
    return seen[0]


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-glm4-moe",
                                    "tiny-gpt-oss"])
def test_three_tiers_on_cuda(model_dirs, preset):
    """Device, host and disk on a real GPU: disk experts go disk -> host slot -> device ring,
    so the tokens are those of the same CUDA run with every expert in host memory, and the
    prefill logits those of the CPU engine (GPU GEMMs round differently)."""
    model_dir = model_dirs(preset)
    cuda = replace(CONFIG, backend="cuda", resident_ratio=0.25, cpu_experts=False)
    reference = _tokens(model_dir, cuda)
    for ratio in (0.5, 0.25):
        assert _tokens(model_dir, replace(cuda, host_resident_ratio=ratio,
                                          disk_read_mb=0.01)) == reference, ratio
    with LLMEngine(model_dir, replace(cuda, host_resident_ratio=0.25), dtype="float32") as engine:
        list(engine.generate([Request("r", prompt=PROMPTS[0],
                                      sampling=SamplingParams(max_new_tokens=4))]))
        assert engine.offload.pager.disk.stats.reads > 0
    cpu = _first_logits(model_dir, CONFIG)
    gpu = _first_logits(model_dir, replace(cuda, host_resident_ratio=0.25))
    for rid, row in cpu.items():
        assert torch.allclose(gpu[rid], row, atol=1e-3, rtol=1e-3), rid
