"""The hardware profiler in its reduced mode: it measures, writes a usable profile, and caches."""
from __future__ import annotations

import pytest
import yaml

from moe_engine.config import HardwareConfig
from moe_engine.perf import ModelSpec, choose_policy, hardware_spec_from_config, workload_spec_from_lengths
from moe_engine.perf.hardware import cached_profile_path, machine_fingerprint, spec_from_figures
from moe_engine.tools.profile_hardware import ensure_profile, gemm_shapes, main


@pytest.fixture(scope="module")
def tiny():
    from moe_engine.tools.presets import PRESETS, hf_config

    return ModelSpec.from_hf_config(hf_config(PRESETS["tiny-mixtral"]), name="tiny-mixtral")


@pytest.fixture(scope="module")
def tiny_profile(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("hw") / "profile.yaml"
    return path, ensure_profile(path, model=tiny, fast=True)


def test_profile_measures_every_shape_and_the_machine(tiny, tiny_profile):
    path, data = tiny_profile
    assert path.exists()
    on_disk = yaml.safe_load(path.read_text())
    assert on_disk["fingerprint"] == machine_fingerprint()
    shapes = {(r["inp"], r["out"]) for r in on_disk["gemm"]}
    assert set(gemm_shapes(tiny)) <= shapes
    assert all(r["gflops"] > 0 for r in on_disk["gemm"])
    for key in ("cpu_bw_gbps", "link_gbps", "device_tflops", "cpu_attention_gbps", "op_overhead_us",
                "host_step_us", "host_seq_us", "host_token_us"):
        assert on_disk[key] > 0, key
    assert on_disk["attention_kernel"].split()[0] in ("cython", "torch")
    assert on_disk["profile_seconds"] < 60


def test_profile_drives_the_cpu_policy(tiny, tiny_profile):
    _, data = tiny_profile
    hw = spec_from_figures(data)
    r = choose_policy(tiny, hw, workload_spec_from_lengths([40, 60, 80], 8), backend="cpu")
    assert r.throughput_tok_s > 0 and r.policy.batch_size <= 3


def test_cached_profile_is_reused(tiny, tiny_profile):
    path, data = tiny_profile
    before = path.stat().st_mtime_ns
    again = ensure_profile(path, model=tiny, fast=True)
    assert path.stat().st_mtime_ns == before
    assert again["gemm"] == data["gemm"]


def test_auto_profile_goes_through_the_fingerprint_cache(tiny, tiny_profile, tmp_path):
    _, data = tiny_profile
    cache = cached_profile_path(tmp_path)
    cache.write_text(yaml.safe_dump(data))
    spec = hardware_spec_from_config(HardwareConfig(profile="auto"), tmp_path, model=tiny)
    assert spec.cpu_bw == pytest.approx(data["cpu_bw_gbps"] * 1e9)
    assert len(spec.gemm_points) == len(data["gemm"])


def test_cli_writes_profile(tmp_path, capsys):
    out = tmp_path / "cli.yaml"
    assert main(["--out", str(out), "--model", "tiny-mixtral", "--fast"]) == 0
    printed = capsys.readouterr()
    assert "profile written" in printed.out
    # A minute of measuring says what it is doing, step by step (the policy job's log).
    steps = [line for line in printed.err.splitlines() if line.startswith("profile_hardware ")]
    assert any("GEMMs of tiny-mixtral" in s for s in steps) and any("layer layout" in s for s in steps), steps
    assert yaml.safe_load(out.read_text())["models"] == ["tiny-mixtral"]


def test_cached_profile_without_host_figures_is_extended(tiny, tiny_profile, tmp_path):
    """Profiles written before the engine-loop figures existed gain them on next use."""
    _, data = tiny_profile
    old = {k: v for k, v in data.items() if not k.startswith("host_")}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    again = ensure_profile(path, model=tiny, fast=True)
    assert all(again[k] > 0 for k in ("host_step_us", "host_seq_us", "host_token_us"))
    assert again["gemm"] == data["gemm"]  # nothing else re-measured


def test_cli_ensure_keeps_a_covering_profile(tiny_profile, tmp_path, capsys):
    """What the policy stage runs on a cache miss: measures only what the cache lacks."""
    _, data = tiny_profile
    out = tmp_path / "cached.yaml"
    out.write_text(yaml.safe_dump(data))
    before = out.stat().st_mtime_ns
    assert main(["--ensure", "--out", str(out), "--model", "tiny-mixtral", "--fast"]) == 0
    assert out.stat().st_mtime_ns == before and "covers tiny-mixtral" in capsys.readouterr().out


def test_the_disk_rate_is_learnt_from_generate_jobs(tiny_profile, tmp_path):
    """A sweep of the disk need not describe the reads of a run (this CI's virtual disk: 1.1-1.7
    GB/s back to back, 1.9-2.1 GB/s spread through a run): generate jobs record the rate their
    reader achieved, and the model plans with the median of the last few."""
    import shutil

    from moe_engine.perf.hardware import disk_read_gbps, load_profile
    from moe_engine.tools.profile_hardware import DISK_RUNS_KEPT, learn_disk_rate

    path = tmp_path / "profile.yaml"
    shutil.copy(tiny_profile[0], path)
    swept = load_profile(path)["disk_read_gbps"]
    assert disk_read_gbps(load_profile(path)) == swept  # nothing learnt yet
    # Too few bytes to say anything, or no profile: nothing is recorded.
    assert learn_disk_rate(path, {"disk_bytes_read": 1 << 20, "disk_busy_time_s": 0.001}) is None
    assert learn_disk_rate(tmp_path / "none.yaml", {"disk_bytes_read": 4e9,
                                                    "disk_busy_time_s": 2.0}) is None
    assert learn_disk_rate(path, {}) is None
    for gbps in (1.0, 3.0, 2.0):
        assert learn_disk_rate(path, {"disk_bytes_read": gbps * 2e9,
                                      "disk_busy_time_s": 2.0}) == gbps
    data = load_profile(path)
    assert data["disk_read_gbps_runs"] == [1.0, 3.0, 2.0] and data["disk_read_gbps"] == swept
    assert disk_read_gbps(data) == 2.0
    assert spec_from_figures(data).disk_bw == 2.0e9
    for _ in range(DISK_RUNS_KEPT + 3):
        learn_disk_rate(path, {"disk_bytes_read": 5e9, "disk_busy_time_s": 1.0})
    assert load_profile(path)["disk_read_gbps_runs"] == [5.0] * DISK_RUNS_KEPT


def test_profile_times_the_layer_layouts_element_wise_work_and_prefill_attention(tiny, tiny_profile):
    """The non-GEMM work of a layer and prefill attention per prompt are timed on the model's
    layout at every token count and prompt length of the mode, and read into the spec."""
    from moe_engine.perf.specs import layer_layout
    from moe_engine.tools.profile_hardware import FAST_TOKENS
    from moe_engine.tools.profile_layer_ops import FAST_PROMPT_LENGTHS

    _, data = tiny_profile
    layout = layer_layout(tiny)
    ops = [r for r in data["layer_ops"] if r["layout"] == layout]
    assert sorted(r["tokens"] for r in ops) == sorted(FAST_TOKENS)
    assert all(r["pre_attention_us"] > 0 and r["post_attention_us"] > 0 for r in ops)
    prefill = [r for r in data["prefill_attention"] if r["layout"] == layout]
    assert sorted(r["prompt"] for r in prefill) == sorted(FAST_PROMPT_LENGTHS)
    assert all(r["us_per_prompt"] > 0 for r in prefill)
    from moe_engine.tools.profile_layer_ops import FAST_DECODE_BATCHES

    decode = [r for r in data["decode_attention"] if r["layout"] == layout]
    assert sorted(r["batch"] for r in decode) == sorted(FAST_DECODE_BATCHES)
    assert all(r["us_per_call"] > 0 for r in decode)
    experts = [r for r in data["moe_ffn"] if r["layout"] == layout]
    assert sorted(r["tokens"] for r in experts) == sorted(FAST_TOKENS)
    assert all(r["us_per_call"] > 0 for r in experts)
    spec = spec_from_figures(data)
    assert len(spec.layer_ops_points) == len(data["layer_ops"])
    assert len(spec.prefill_attention_points) == len(data["prefill_attention"])
    assert len(spec.decode_attention_points) == len(data["decode_attention"])
    assert len(spec.moe_ffn_points) == len(data["moe_ffn"])
    # The engine loop's per-sequence cost is split into a fixed part and one per logit.
    assert data["host_logit_ns"] >= 0 and spec.host_seq_cost(32000) >= spec.host_seq_cost(1024)


def test_profile_from_before_layer_ops_gains_them_and_keeps_its_gemms(tiny, tiny_profile, tmp_path):
    """An old profile (GEMMs, no layer-layout points) is extended with the model's layout alone:
    its GEMM rates are not measured again, and a second model of the same layout adds nothing."""
    from moe_engine.perf.hardware import LAYOUT_KEYS, profile_covers

    _, data = tiny_profile
    old = {k: v for k, v in data.items() if k not in ("layer_ops", "prefill_attention")}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    assert not profile_covers(old, [tiny])
    again = ensure_profile(path, model=tiny, fast=True)
    assert again["gemm"] == data["gemm"]
    assert profile_covers(again, [tiny])
    assert len(again["layer_ops"]) == len(data["layer_ops"])
    # A profile from before decode attention was profiled per call gains it, and the layout's
    # other rows are replaced by the new measurement's, not added to.
    older = {k: v for k, v in again.items() if k not in ("decode_attention", "moe_ffn")}
    path.write_text(yaml.safe_dump(older))
    assert not profile_covers(older, [tiny])
    newer = ensure_profile(path, model=tiny, fast=True)
    assert profile_covers(newer, [tiny]) and newer["gemm"] == data["gemm"]
    for key in LAYOUT_KEYS:
        assert len(newer[key]) == len(data[key]), key
    renamed = ModelSpec.from_hf_config(hf_config_of("tiny-mixtral"), name="another-checkpoint")
    before = path.stat().st_mtime_ns
    ensure_profile(path, model=renamed, fast=True)
    assert path.stat().st_mtime_ns == before


def hf_config_of(preset: str) -> dict:
    from moe_engine.tools.presets import PRESETS, hf_config

    return hf_config(PRESETS[preset])


@pytest.mark.parametrize("preset", ["tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-olmoe", "tiny-glm4-moe",
                                    "tiny-gpt-oss", "tiny-ernie45-moe", "tiny-llama4"])
def test_layer_ops_are_timed_on_every_family_the_engine_runs(preset):
    """The layouts' variants (q/k norms per head or projection, sigmoid routing with a bias and
    expert groups, sinks and a sliding window, partial RoPE) run through the engine's own
    functions in the profiler; MLA's layouts are left to the launch counts."""
    from moe_engine.perf.hardware import layer_ops_profiled
    from moe_engine.perf.specs import layer_layout
    from moe_engine.tools.profile_layer_ops import (measure_layer_ops, measure_moe_ffn,
                                                    measure_prefill_attention)

    m = ModelSpec.from_hf_config(hf_config_of(preset))
    assert layer_ops_profiled(m)
    ops = measure_layer_ops(m, (1, 16), fast=True)
    attention = measure_prefill_attention(m, fast=True)
    experts = measure_moe_ffn(m, (1, 16), fast=True, cache_bytes=1 << 20)
    assert {r["layout"] for r in ops + attention + experts} == {layer_layout(m)}
    assert all(r["pre_attention_us"] > 0 and r["post_attention_us"] > 0 for r in ops)
    assert all(r["us_per_prompt"] > 0 for r in attention)
    assert [r["tokens"] for r in experts] == [1, 16] and all(r["us_per_call"] > 0 for r in experts)
    assert not layer_ops_profiled(ModelSpec.from_hf_config(hf_config_of("tiny-deepseek-v3")))


def test_a_forced_isa_build_or_another_kernel_build_is_another_machine(monkeypatch, tmp_path):
    """Profiles time the packed kernels: one measured on a forced ISA build (MOE_BATCH_ISA) or
    on another build of the extension (a rebuild that adds an AMX path) is not reused."""
    from moe_engine.perf import hardware
    monkeypatch.delenv("MOE_BATCH_ISA", raising=False)
    chosen = machine_fingerprint()
    monkeypatch.setenv("MOE_BATCH_ISA", "avx2")
    assert machine_fingerprint() != chosen
    monkeypatch.delenv("MOE_BATCH_ISA")
    fake = tmp_path / f"{hardware.PACKED_KERNEL_NAME}.so"
    monkeypatch.setattr(hardware, "CYTHON_KERNEL_DIR", tmp_path)
    monkeypatch.setattr(hardware.importlib.machinery, "EXTENSION_SUFFIXES", [".so"])
    fake.write_bytes(b"one build")
    first = machine_fingerprint()
    fake.write_bytes(b"another build")
    assert machine_fingerprint() != first


def test_a_profile_taken_by_an_older_measuring_method_is_not_reused(monkeypatch):
    """When what a figure measures changes (the experts' call gained GPT-OSS's biases and
    clamp), a cached profile would mix old figures with new ones: the method is part of the
    machine's fingerprint, so the cache path moves and the machine is measured again."""
    from moe_engine.perf import hardware

    now = machine_fingerprint()
    monkeypatch.setattr(hardware, "PROFILE_METHOD", hardware.PROFILE_METHOD - 1)
    assert machine_fingerprint() != now


def _policy_profiler_cli(held, model_dir, tmp_path, monkeypatch) -> list[str]:
    """The profiler arguments the policy stage's ensure_machine_profile runs for `held`."""
    from moe_engine.stages import policy

    commands = []
    monkeypatch.setattr(policy.subprocess, "run", lambda cmd, check: commands.append(cmd))
    monkeypatch.setenv("MOE_BATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MOE_BATCH_PROFILE", raising=False)  # as a user runs it (conftest: fast)
    policy.ensure_machine_profile(held, model_dir, "auto")
    return commands[0][commands[0].index("moe_engine.tools.profile_hardware") + 1:]


def _run_profiler_cli(cli: list[str], out) -> None:
    """Runs those arguments, fast, writing the profile to `out` instead."""
    at = cli.index("--out")
    assert main([*cli[:at + 1], str(out), *cli[at + 2:], "--fast"]) == 0


def _assert_points_of_their_own_rows(profile, storage: str) -> None:
    """The dtype's GEMM points and `storage`'s are each read from their own rows of the
    profile. (Comparing the points themselves is not enough: an overhead-bound shape, a few
    MFLOP/s in GFLOP/s to 3 decimals, can measure the same rate in both storages.)"""
    from moe_engine.perf.hardware import gemm_storage_of

    def key(p):
        return p.inp, p.out, p.tokens, p.flops_per_s

    for tag, points in ((None, spec_from_figures(profile).gemm_points),
                        (storage, spec_from_figures(profile, storage).gemm_points)):
        rows = [r for r in profile["gemm"] if gemm_storage_of(r) == tag]
        assert rows and sorted(map(key, points)) == sorted(
            (int(r["inp"]), int(r["out"]), int(r["tokens"]), float(r["gflops"]) * 1e9) for r in rows)


@pytest.mark.parametrize("experts, weights", [("int8", None), ("bf16p", "bf16p"),
                                              ("int8q", "bf16p")])
def test_ensure_with_the_held_storage_covers_what_the_policy_asks(tiny, tiny_profile, tmp_path,
                                                                  monkeypatch, experts, weights):
    """The policy stage sizes what the engine will hold (int8 experts; under medium, bf16p
    experts and bf16p dense weights) and asks the profile for their points: the experts' call
    under layout key x<storage>, the dense GEMMs in bf16p. The profiler it runs must measure
    those, or the stage's profile never covers the model."""
    from moe_engine.perf.hardware import load_profile, profile_covers

    _, data = tiny_profile
    out = tmp_path / "profile.yaml"
    out.write_text(yaml.safe_dump(data))
    held = tiny.with_expert_storage(experts).with_weight_storage(weights)
    assert not profile_covers(load_profile(out), [held])
    cli = _policy_profiler_cli(held, "tiny-mixtral", tmp_path, monkeypatch)
    asked = ["--expert-storage", experts] + (["--weight-storage", weights] if weights else [])
    assert cli[cli.index("--expert-storage"):] == asked
    _run_profiler_cli(cli, out)
    profile = load_profile(out)
    assert profile_covers(profile, [held]) and profile_covers(profile, [tiny])
    if weights:  # the plain and the bf16p GEMM points, each read for its own model
        _assert_points_of_their_own_rows(profile, weights)


def test_ensure_for_widened_mxfp4_experts_profiles_the_model_dtype(tiny_profile, tmp_path,
                                                                   monkeypatch):
    """An MXFP4 checkpoint's experts are widened to the model dtype on torch's GEMMs
    (engine.gemm=torch): the policy holds them as None, so the profiler, which reads the
    checkpoint's own MXFP4, must be told; before, it profiled the MXFP4 call, the profile never
    covered the held model and the policy stage failed with ProfileMissing."""
    from moe_engine.model.spec import MODEL_DTYPE_STORAGE
    from moe_engine.perf.hardware import load_profile, profile_covers
    from moe_engine.tools.profile_hardware import resolve_model

    checkpoint = resolve_model("tiny-gpt-oss-mxfp4")
    assert checkpoint.expert_storage == "mxfp4"
    held = checkpoint.with_expert_storage(None)
    out = tmp_path / "profile.yaml"
    out.write_text(yaml.safe_dump(tiny_profile[1]))
    cli = _policy_profiler_cli(held, "tiny-gpt-oss-mxfp4", tmp_path, monkeypatch)
    assert cli[cli.index("--expert-storage") + 1] == MODEL_DTYPE_STORAGE
    _run_profiler_cli(cli, out)
    profile = load_profile(out)
    assert profile_covers(profile, [held]) and not profile_covers(profile, [checkpoint])


def test_ensure_for_torch_gemms_profiles_torch_in_the_model_dtype(tiny, tiny_profile, tmp_path,
                                                                monkeypatch):
    """engine.gemm=torch on the CPU runs every projection on F.linear and the layer's other work
    in the model dtype, where the packed kernels are built too: the policy holds the model as
    TORCH_GEMM_STORAGE, and the profiler it runs times torch's path (the packed kernels are
    never called), under GEMM rows and a layer layout of its own. Before, the profile had only
    the packed kernels' points and the prediction of such a run was 2x high."""
    import torch

    from moe_engine.model import packed
    from moe_engine.model.spec import MODEL_DTYPE_STORAGE, TORCH_GEMM_STORAGE
    from moe_engine.perf.hardware import load_profile, profile_covers
    from moe_engine.perf.specs import layer_layout
    from moe_engine.tools.profile_layer_ops import activation_dtype

    held = tiny.with_weight_storage(TORCH_GEMM_STORAGE)
    assert layer_layout(held) != layer_layout(tiny)
    # tiny-mixtral is fp32, where both paths' activations are fp32; a bf16 model's differ
    bf16 = tiny.with_dtype("bfloat16")
    assert activation_dtype(bf16.with_weight_storage(TORCH_GEMM_STORAGE)) is torch.bfloat16
    assert activation_dtype(bf16) is (torch.float32 if packed.HAS_PACKED_KERNELS else torch.bfloat16)
    out = tmp_path / "profile.yaml"
    out.write_text(yaml.safe_dump(tiny_profile[1]))
    assert not profile_covers(load_profile(out), [held])
    cli = _policy_profiler_cli(held, "tiny-mixtral", tmp_path, monkeypatch)
    assert cli[cli.index("--expert-storage"):] == ["--expert-storage", MODEL_DTYPE_STORAGE,
                                                    "--weight-storage", TORCH_GEMM_STORAGE]

    def not_on_torch_gemms(*args, **kwargs):
        raise AssertionError("the packed kernels ran in a torch-GEMM profile")

    for name in ("packed_linear", "pack_linear", "pack_expert", "packed_moe_ffn"):
        monkeypatch.setattr(packed, name, not_on_torch_gemms)
    _run_profiler_cli(cli, out)
    profile = load_profile(out)
    assert profile_covers(profile, [held]) and profile_covers(profile, [tiny])
    _assert_points_of_their_own_rows(profile, TORCH_GEMM_STORAGE)
    assert {r["layout"] for r in profile["moe_ffn"]} >= {layer_layout(tiny), layer_layout(held)}


def test_gemm_points_of_a_storage_fall_back_to_the_untagged_ones(tiny, tiny_profile):
    """A profile without bf16p rows (written before rows were tagged, or by hand) prices a
    medium model's GEMMs on its untagged points, as before, not at the compute roof; coverage
    still asks for the tagged rows, wherever the profile keeps the packed kernels' rows (a CUDA
    machine's profile: cpu_gemm)."""
    from moe_engine.perf.hardware import gemms_covered

    _, data = tiny_profile
    plain = spec_from_figures(data).gemm_points
    assert plain and spec_from_figures(data, "bf16p").gemm_points == plain
    medium = tiny.with_weight_storage("bf16p")
    assert gemms_covered(data, [tiny]) and not gemms_covered(data, [medium])
    tagged = [{**r, "storage": "bf16p", "gflops": 2 * r["gflops"]} for r in data["gemm"]]
    on_cuda = {**data, "gemm": [], "cpu_gemm": data["gemm"] + tagged}
    assert gemms_covered(on_cuda, [medium]) and gemms_covered(on_cuda, [tiny])
    pairs = spec_from_figures(on_cuda, "bf16p").cpu_gemm_points
    assert pairs and all(p.flops_per_s == 2 * q.flops_per_s for p, q in zip(pairs, plain))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_attention_is_timed_on_a_cache_in_the_model_dtype(tiny, dtype, monkeypatch):
    """The engine's KV cache takes the model's dtype (engine.kv_dtype=auto), and the kernel
    widens fp16 and bf16 differently: an fp16 model's rate is not a bf16 cache's. Every
    attention figure (the KV rate, decode's per-call cost, prefill's writes into the cache)
    is timed on such a cache; prefill's was written in the activations' fp32 before."""
    import torch

    from moe_engine.model.attention import DecodeAttention
    from moe_engine.tools.profile_hardware import measure_attention
    from moe_engine.tools.profile_layer_ops import (measure_decode_attention,
                                                    measure_prefill_attention)

    read, written = set(), set()
    run, init = DecodeAttention.__call__, DecodeAttention.__init__

    def spy_read(self, q, key, value, *args, **kwargs):
        read.add(key.dtype)
        return run(self, q, key, value, *args, **kwargs)

    def spy_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        write = self.write_kv  # chosen per instance (kernel or torch)

        def spy_write(key_cache, value_cache, *rest, **kw):
            written.update((key_cache.dtype, value_cache.dtype))
            return write(key_cache, value_cache, *rest, **kw)
        self.write_kv = spy_write

    monkeypatch.setattr(DecodeAttention, "__call__", spy_read)
    monkeypatch.setattr(DecodeAttention, "__init__", spy_init)
    m = tiny.with_dtype(dtype)
    rate, _ = measure_attention(m, fast=True)
    decode = measure_decode_attention(m, fast=True)
    prefill = measure_prefill_attention(m, fast=True)
    assert rate > 0 and all(r["us_per_call"] > 0 for r in decode)
    assert all(r["us_per_prompt"] > 0 for r in prefill)
    assert read == written == {getattr(torch, dtype)}


def test_ensure_measures_a_fast_profile_again_when_a_full_one_is_asked(tiny, tiny_profile, tmp_path,
                                                                       monkeypatch):
    """The profiler's side of MOE_BATCH_PROFILE: `--ensure` without `--fast` replaces a cached
    fast profile by a full measurement (stubbed here: it takes ~45 s) and keeps it when fast."""
    from moe_engine.tools import profile_hardware

    _, data = tiny_profile
    assert data["mode"] == "fast"
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    asked = []

    def full_profile(models, fast=False, threads=0):
        asked.append(fast)
        return {**data, "mode": "fast" if fast else "full"}

    monkeypatch.setattr(profile_hardware, "profile_machine", full_profile)
    assert ensure_profile(path, model=tiny, fast=True)["mode"] == "fast" and asked == []
    assert ensure_profile(path, model=tiny)["mode"] == "full" and asked == [False]
    assert yaml.safe_load(path.read_text())["mode"] == "full"
    assert ensure_profile(path, model=tiny)["mode"] == "full" and asked == [False]
    # a full profile extended by a fast run (a model it lacks) holds fast figures from then on:
    # it says so, and the next full run measures it anew
    other = tiny.with_weight_storage("bf16x3")
    assert ensure_profile(path, model=other, fast=True)["mode"] == "fast" and asked[1:] == [True]
    assert ensure_profile(path, model=other)["mode"] == "full" and asked[2:] == [False]


@pytest.mark.timing  # the run's seconds against the profile's: both move with any load beside
def test_ensure_with_a_checkpoint_measures_the_engines_in_run_factors(tiny_profile, tiny_mixtral_dir, tmp_path,
                                                                       monkeypatch):
    """Given the checkpoint, the profiler runs the engine on it and records, for its layout, how
    much longer each part of a step took in the run than the micro-benchmarks predict; the
    model then prices each part with its factor, and a second ensure keeps the row."""
    from moe_engine.perf.cost import Policy, traced_component_times
    from moe_engine.perf.hardware import CALIBRATION_KEY, engine_calibrated
    from moe_engine.perf.specs import ENGINE_COMPONENTS, layer_layout
    from moe_engine.tools.profile_engine import FACTOR_BOUNDS

    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(tiny_profile[1]))
    model = ModelSpec.from_hf_config(tiny_mixtral_dir)
    assert not engine_calibrated(tiny_profile[1], model)
    data = ensure_profile(path, model=model, fast=True, checkpoint=tiny_mixtral_dir)
    rows = data[CALIBRATION_KEY]
    assert [r["layout"] for r in rows] == [layer_layout(model)] and engine_calibrated(data, model)
    row = rows[0]
    # the run took about what the uncalibrated model priced it at (the factors are clamped)
    assert row["requests"] >= 8 and 0.2 < row["run_s"] / row["predicted_s"] < 10, row
    for c in ENGINE_COMPONENTS:
        assert FACTOR_BOUNDS[0] <= row[c] <= FACTOR_BOUNDS[1], (c, row)
    assert yaml.safe_load(path.read_text())[CALIBRATION_KEY] == rows
    # each part of the model's prices is scaled by its own factor
    plain, calibrated = spec_from_figures({**data, CALIBRATION_KEY: []}), spec_from_figures(data)
    wl = workload_spec_from_lengths([16, 64, 256], [8, 16, 32])
    policy = Policy(3, 3, False, True, 1.0, 0.0)
    before = traced_component_times(model, plain, policy, wl)
    after = traced_component_times(model, calibrated, policy, wl)
    for c in ENGINE_COMPONENTS:
        assert after[c] == pytest.approx(before[c] * row[c], rel=1e-9), c
    # the model prices a CPU step as the sum of those parts
    from moe_engine.perf.cost import engine_step_times
    from moe_engine.perf.schedule import step_trace

    total = sum(b.steps * engine_step_times(model, calibrated, policy, wl, b, True).total
                for b in step_trace(wl.prompt_lengths, wl.request_gen_lengths, 3, policy.prefill_tokens))
    assert sum(after.values()) == pytest.approx(total, rel=1e-9)
    # measured once: a second ensure finds the row and runs nothing
    from moe_engine.tools import profile_engine

    monkeypatch.setattr(profile_engine, "measure_engine_factors", None)
    assert ensure_profile(path, model=model, fast=True, checkpoint=tiny_mixtral_dir)[CALIBRATION_KEY] == rows


@pytest.mark.timing  # a profile measured beside other load prices the run over its budget
@pytest.mark.parametrize("experts, weights, knobs", [
    ("bf16p", "bf16p", {"matmul_precision": "medium"}),
    ("int8q", "bf16p", {"matmul_precision": "medium", "expert_dtype": "int8"}),
    ("int8", None, {"expert_dtype": "int8"})])
def test_the_calibration_run_holds_what_the_model_prices(tiny_profile, tiny_mixtral_dir,
                                                         experts, weights, knobs):
    """The in-run factors of a held storage (medium's bf16 pairs and int8 quads, int8 experts)
    come from an engine that holds it: the run is configured from the spec (engine_knobs), not
    left to a default engine, which held bf16 and was refused, so those layouts kept factor 1
    (the tiny model's medium runs reported 53-80% over the engine)."""
    from moe_engine.perf.specs import ENGINE_COMPONENTS, layer_layout
    from moe_engine.tools.profile_engine import engine_knobs, measure_engine_factors

    model = (ModelSpec.from_hf_config(tiny_mixtral_dir).with_expert_storage(experts)
             .with_weight_storage(weights))
    assert engine_knobs(model) == knobs
    row = measure_engine_factors(tiny_mixtral_dir, model, tiny_profile[1], True, 2)
    assert row["layout"] == layer_layout(model) and f"x{experts}" in row["layout"]
    assert "error" not in row and all(c in row for c in ENGINE_COMPONENTS)


def test_a_failed_calibration_run_keeps_factor_one_and_is_not_retried(tiny_profile, tiny_mixtral_dir, tmp_path,
                                                                      monkeypatch, capsys):
    """The calibration run failing (a checkpoint the engine cannot load, say) leaves the model
    priced as before and says so; the row it records stops the policy stage from running the
    profiler again every time. A model too large for the run keeps factor 1 without a run."""
    from dataclasses import replace

    from moe_engine.perf.hardware import CALIBRATION_KEY, calibration_applies, engine_calibrated
    from moe_engine.tools import profile_engine

    def broken(*args, **kwargs):
        raise RuntimeError("cannot load")

    monkeypatch.setattr(profile_engine, "measure_engine_factors", broken)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(tiny_profile[1]))
    model = ModelSpec.from_hf_config(tiny_mixtral_dir)
    data = ensure_profile(path, model=model, fast=True, checkpoint=tiny_mixtral_dir)
    (row,) = data[CALIBRATION_KEY]
    assert row["dense"] == row["ffn"] == 1.0 and "cannot load" in row["error"]
    assert engine_calibrated(data, model) and "cannot load" in capsys.readouterr().err
    # a run killed outright (out of memory) leaves the row written before it: not run again
    def killed(*args, **kwargs):
        assert yaml.safe_load(path.read_text())[CALIBRATION_KEY][0]["error"] == "the calibration run did not finish"
        raise SystemExit(137)

    monkeypatch.setattr(profile_engine, "measure_engine_factors", killed)
    path.write_text(yaml.safe_dump(tiny_profile[1]))
    with pytest.raises(SystemExit):
        ensure_profile(path, model=model, fast=True, checkpoint=tiny_mixtral_dir)
    assert engine_calibrated(yaml.safe_load(path.read_text()), model)
    huge = replace(model, num_layers=10**6)
    assert not calibration_applies(huge, 24 * 2**30) and engine_calibrated({"host_memory_gb": 24}, huge)
    assert engine_calibrated({"device": "cuda"}, model) and not engine_calibrated({}, model)


def test_a_calibration_row_of_an_older_method_is_measured_again(tiny_mixtral_dir):
    """Rows that refused or failed under an older calibration method (method 1 ran a default
    engine only, which refused medium's and quantized storages: factor 1, and the tiny model's
    medium runs reported 53-80% over the engine) do not count as calibrated, nor do rows
    measured under one (method 2 timed host as sampling and scheduling alone); under the current
    method a row with an error still does (not retried), and so does a measured row."""
    from moe_engine.perf.hardware import CALIBRATION_KEY, CALIBRATION_METHOD, engine_calibrated
    from moe_engine.perf.specs import ENGINE_COMPONENTS, layer_layout

    model = ModelSpec.from_hf_config(tiny_mixtral_dir).with_expert_storage("int8q")
    row = {"layout": layer_layout(model), **dict.fromkeys(ENGINE_COMPONENTS, 1.0)}
    stale = {**row, "error": "CalibrationSkipped: a default engine holds the experts as None, "
                             "the model prices them as int8q"}
    failed = {**row, "error": "RuntimeError: cannot load", "method": CALIBRATION_METHOD}
    host = {"host_memory_gb": 24}
    assert not engine_calibrated({**host, CALIBRATION_KEY: []}, model)
    assert not engine_calibrated({**host, CALIBRATION_KEY: [stale]}, model)
    assert not engine_calibrated({**host, CALIBRATION_KEY: [{**stale, "method": 1}]}, model)
    assert engine_calibrated({**host, CALIBRATION_KEY: [{**stale, "method": CALIBRATION_METHOD}]}, model)
    assert engine_calibrated({**host, CALIBRATION_KEY: [failed]}, model)
    assert not engine_calibrated({**host, CALIBRATION_KEY: [row]}, model)  # no method: method 1
    assert not engine_calibrated({**host, CALIBRATION_KEY: [{**row, "method": CALIBRATION_METHOD - 1}]}, model)
    assert engine_calibrated({**host, CALIBRATION_KEY: [{**row, "method": CALIBRATION_METHOD}]}, model)
