"""Hardware profiler: measures this machine and writes a profile YAML the policy search reads.

Measured: GEMM time for the model's own weight shapes at several token counts, on the GEMM the
engine runs (the packed CPU kernels when built; the roofline with peak figures is 2-4x off for
skinny decode GEMMs on a CPU), the decode-attention kernel's KV
streaming rate (the issue-3 Cython kernel when built, else the torch fallback; the YAML says
which), memory read and copy bandwidth, the launch overhead of a small operator, per layer
layout the element-wise work around the GEMMs and prefill attention per prompt
(profile_layer_ops), and on CUDA the pinned host-to-device bandwidth and device GEMM rates. The
VM is noisy, so each figure is the median of several timed batches (the layer-layout figures:
the fastest, see profile_layer_ops).

    python -m moe_engine.tools.profile_hardware [--out this.yaml] [--model small-mixtral] [--fast]
    python -m moe_engine.tools.profile_hardware --ensure --model <checkpoint dir>   # the policy stage
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml

from moe_engine.host_alloc import huge_page_zeros, tune_host_allocator
from moe_engine.io import default_cache_dir, exclusive_lock, hardware_cache_dir, write_text_atomic

# gemm_shapes is re-exported: callers import it from here.
from moe_engine.perf.hardware import (CALIBRATION_KEY, CALIBRATION_METHOD, HOST_KEYS, LAYOUT_KEYS, calibration_applies, engine_calibrated,
                                      gemm_shapes, gemm_storage_of, gemms_covered, layer_ops_profiled, layouts_missing,
                                      load_profile, profile_host_memory, machine_fingerprint, profile_covers, profile_mode_serves,
                                      total_memory_bytes)
from moe_engine.model.spec import (BF16X3_STORAGE, EXPERT_STORAGE_BITS, MODEL_DTYPE_STORAGE, PAIR_STORAGE,
                                   TORCH_GEMM_STORAGE)
from moe_engine.perf.specs import ENGINE_COMPONENTS, GB, ModelSpec, layer_layout
from moe_engine.tools.profile_layer_ops import activation_dtype, kv_cache_dtype, on_packed_kernels
from moe_engine.tools.timing import median_time, rotation_copies

FULL_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
FAST_TOKENS = (1, 8, 64, 256)


def _step(what: str) -> None:
    """One progress line on stderr, stamped with the time: a full profile takes ~1 minute on a
    2-core machine, which the policy job otherwise spends without a word (its log is where
    `tail -f results/logs/policy.log` looks)."""
    print(f"profile_hardware {time.strftime('%H:%M:%S')}  {what}", file=sys.stderr, flush=True)


def _torch_dtype(dtype_bytes: int):
    import torch

    return torch.float32 if dtype_bytes == 4 else torch.bfloat16


def measure_gemms(shapes: list[tuple[int, int]], dtype_bytes: int, tokens: tuple[int, ...], fast: bool,
                  device: str = "cpu", storage: Optional[str] = None,
                  torch_dtype: Optional[str] = None) -> list[dict[str, Any]]:
    """Achieved GFLOP/s per (shape, token count) of the GEMM the engine runs there: on the CPU
    the packed kernels (fp32 activations over weights stored in the model's dtype) when they
    are built, as the engine's default; else, and on CUDA, torch's F.linear in the model's
    dtype. Token counts stop growing for a shape once one call takes over 0.25 s (the time model
    extrapolates the affine tail), which keeps LM-head-sized shapes from eating the time budget.
    `storage` (ModelSpec.weight_storage: bf16p under matmul_precision=medium) packs the weights
    in that storage instead, and the rows name it; TORCH_GEMM_STORAGE (engine.gemm=torch) times
    torch's F.linear in the model's dtype even where the packed kernels are built, rows named
    so. `torch_dtype` (the model's, e.g. "float16") is the dtype torch's GEMMs run in on the
    CPU; without it, bf16 for 2-byte weights."""
    import torch
    import torch.nn.functional as F

    from moe_engine.model import packed

    use_packed = device == "cpu" and on_packed_kernels(storage)
    dt = (getattr(torch, torch_dtype) if torch_dtype else _torch_dtype(dtype_bytes)) if device == "cpu" \
        else torch.float16 if dtype_bytes == 2 else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    llc = last_level_cache_bytes() if device == "cpu" else 0
    for inp, out in shapes:
        # Rotate through enough copies of the weight that each call reads it from DRAM, as the
        # engine does (its layers' weights together exceed the cache); one hot copy would
        # measure the cache instead and flatter small-token GEMMs.
        wbytes = inp * out * dtype_bytes
        copies = rotation_copies(wbytes, llc, max_copies=256)
        base = torch.randn(out, inp, dtype=dt, device=device) * 0.02
        if use_packed:
            ws = [packed.pack_linear(base, storage or packed.storage_name(dt))
                  for _ in range(copies)]
        else:
            ws = [base] + [base.clone() for _ in range(copies - 1)]
        turn = [0]

        def call() -> None:
            turn[0] = (turn[0] + 1) % copies
            if use_packed:
                packed.packed_linear(x, ws[turn[0]])
            else:
                F.linear(x, ws[turn[0]])

        for n in tokens:
            x = torch.randn(n, inp, dtype=torch.float32 if use_packed else dt, device=device)
            sec = median_time(call, 0.01 if fast else 0.04, 3 if fast else 5, sync)
            rows.append({"inp": inp, "out": out, "tokens": n, "dtype_bytes": dtype_bytes,
                         **({"storage": storage} if storage and (use_packed or storage == TORCH_GEMM_STORAGE)
                            else {}),
                         "gflops": round(2.0 * n * inp * out / sec / 1e9, 3)})
            if sec > 0.25:
                break
        del ws
    return rows


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache (sysfs), 32 MiB when unknown."""
    best = 0
    for size_file in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size_file.read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
            best = max(best, int(text.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best or 32 << 20


def measure_read_bandwidth(nbytes: int) -> float:
    """Bytes/s of a streaming reduction over an fp32 buffer far larger than the caches."""
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32)
    sec = median_time(lambda: x.sum(), 0.05, 5)
    return nbytes / sec


def measure_disk_read_bandwidth(directory: Path | str, nbytes: int = 256 << 20,
                                packet_bytes: int = 16 << 20) -> float:
    """Bytes/s of the disk tier's own reads (O_DIRECT, `packet_bytes` at a time, one in
    flight) of a file written under `directory`, where the expert files live; median of 3
    passes. The file is removed afterwards."""
    from moe_engine.offload.disk import DiskRead, Extent, sweep_read_rate

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"disk-probe-{os.getpid()}.bin"
    chunk = os.urandom(1 << 20)
    try:
        with open(path, "wb") as f:
            for _ in range(nbytes >> 20):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        return sweep_read_rate(DiskRead((Extent(str(path), 0, nbytes),)).split(packet_bytes))
    finally:
        path.unlink(missing_ok=True)


def measure_copy_bandwidth(nbytes: int) -> float:
    """Bytes/s moved by a host-to-host copy (what paging a weight 'to the device' costs on CPU)."""
    import torch

    src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    sec = median_time(lambda: dst.copy_(src), 0.05, 5)
    return nbytes / sec


def measure_op_overhead(hidden: int = 1024, dtype_bytes: int = 4) -> float:
    """Seconds per small element-wise op: an fp32 RMSNorm over 16 tokens of the model's width
    (8 ops: cast, square, mean, add, rsqrt, multiply, cast back, scale) divided by 8. This is
    the dispatch-dominated cost every norm/RoPE/top-k/gather op pays in a decode step."""
    import torch

    x = torch.randn(16, hidden, dtype=_torch_dtype(dtype_bytes))
    w = torch.ones(hidden, dtype=x.dtype)

    def norm() -> None:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
        w * xf.to(x.dtype)

    return median_time(norm, 0.02, 5) / 8


def measure_host_overhead(vocab_size: int, evict_bytes: Optional[int] = None, block_size: int = 16, prompt: int = 64,
                          batches: tuple[int, int] = (1, 128), steps: int = 24, repeats: int = 3) -> dict[str, float]:
    """Host-side seconds the engine loop spends per step outside the model: scheduling, packing
    the step's inputs, sampling (argmax over the vocabulary), appending the tokens and the
    step's bookkeeping. Measured by running the engine's own loop (`LLMEngine.around`) on a
    runner that returns logits at once, at two decode batch sizes, and split into a per-step
    and a per-sequence part; a prefill pass costs per prompt token (`host_token_s`). Small
    models on a CPU spend a fifth of a step here. Each model call first streams `evict_bytes`
    (at most, and by default, twice the last-level cache), outside the timed intervals: a real
    forward pass evicts the loop's sequences, block tables and logits, and the loop runs about
    twice as long per step from memory as from a warm cache (tiny-mixtral's default run: ~150 us
    a step, not ~75). Each figure is the median over `repeats` runs of each batch size."""
    import torch

    from moe_engine.config import EngineConfig
    from moe_engine.engine.llm_engine import LLMEngine
    from moe_engine.engine.model_runner import PhaseTimes
    from moe_engine.engine.request import Request, SamplingParams

    class InstantRunner:
        """Fixed logits, returned at once; notes when each step reaches the model, so the time
        between two calls is one step of host work."""

        def __init__(self, n: int):
            self.logits = torch.randn(n, vocab_size)
            self.times = PhaseTimes()
            self.calls: list[float] = []  # when each step reached the model
            self.returns: list[float] = []  # when the model call returned, caches evicted

        def forward(self, micro_batches) -> torch.Tensor:
            self.calls.append(time.perf_counter())
            evict.add_(1.0)
            self.returns.append(time.perf_counter())
            return self.logits[:sum(int(mb.logits_indices.numel()) for mb in micro_batches)]

    def run(n: int) -> tuple[float, float]:
        runner = InstantRunner(n)
        config = EngineConfig(block_size=block_size, max_num_seqs=n, max_prefill_tokens=n * prompt,
                              num_micro_batches=1)
        engine = LLMEngine.around(runner, config,
                                  num_blocks=n * ((prompt + steps + 2) // block_size + 2) + 8,
                                  vocab_size=vocab_size, max_model_len=prompt + steps + 8)
        greedy = SamplingParams(max_new_tokens=steps + 2)
        requests = [Request(f"p{i}", prompt_token_ids=list(range(1, prompt + 1)),
                            sampling=greedy) for i in range(n)]
        t0 = time.perf_counter()
        for _ in engine.generate(requests):
            pass
        calls, returns = runner.calls, runner.returns  # the prefill step, then steps + 1 decode steps
        # Admission, the prefill pass and one decode step's scheduling.
        prefill = calls[1] - t0 - (returns[0] - calls[0])
        return prefill, statistics.median(b - a for a, b in zip(returns[1:], calls[2:]))

    llc_twice = 2 * last_level_cache_bytes()
    evict = torch.zeros(max(1 << 20, min(evict_bytes or llc_twice, llc_twice)) // 4)
    # Each size in turn, the median of each figure: one run's median step moved by 2x from one
    # run to the next on the shared VM.
    runs = [(run(batches[0]), run(batches[1])) for _ in range(repeats)]
    small = statistics.median(r[0][1] for r in runs)
    prefill, large = (statistics.median(r[1][i] for r in runs) for i in (0, 1))
    per_seq = max(0.0, (large - small) / (batches[1] - batches[0]))
    return {"host_step_s": max(0.0, small - per_seq * batches[0]), "host_seq_s": per_seq,
            "host_token_s": max(0.0, prefill - small) / (batches[1] * prompt)}


def measure_engine_loop(models: list[ModelSpec], small_vocab: int = 1024) -> dict[str, float]:
    """The engine loop's host figures, with its per-sequence cost split into a fixed part and
    a part per vocabulary entry (sampling reads each sequence's logits row: 8 us a sequence at
    8192 entries, 18 at 32000 on the 2-core EPYC), so one profile prices models of any
    vocabulary. The caches are evicted between steps by as many bytes as the largest model's
    weights (a step reads them all), at most twice the last-level cache."""
    vocab = max([m.vocab_size for m in models] + [32000])
    weights = max([int(m.total_bytes) for m in models] + [1 << 20])
    large = measure_host_overhead(vocab, weights)
    small = measure_host_overhead(small_vocab, weights)
    per_logit = max(0.0, (large["host_seq_s"] - small["host_seq_s"]) / (vocab - small_vocab))
    return {**large, "host_seq_s": max(0.0, large["host_seq_s"] - per_logit * vocab),
            "host_logit_s": per_logit}


def measure_attention(m: ModelSpec, fast: bool) -> tuple[float, str]:
    """KV bytes/s the CPU decode-attention kernel streams, for the model's head layout, over a
    cache larger than the last-level cache. Returns (rate, the path that ran: "cython avx2"...)."""
    import torch

    from moe_engine.model.attention import DecodeAttention

    dt = kv_cache_dtype(m)  # fp16 stays fp16: the kernel widens it differently from bf16
    block, ctx = 16, 256 if fast else 512
    per_seq = ctx * m.kv_bytes_per_token_layer
    # K+V of one layer larger than the last-level cache: the engine's cache is, across layers.
    target = max(64 << 20, (1 if fast else 2) * last_level_cache_bytes())
    seqs = max(8, math.ceil(target / per_seq))
    blocks_per_seq = ctx // block
    nblocks = seqs * blocks_per_seq
    heads, d_k, d_v = m.kv_cache_layout
    # MLA's latent cache: one entry whose first kv_lora_rank dims are the values.
    latent = m.mla.kv_lora_rank if m.mla is not None else None
    d_k = max(d_k, d_v)
    # allocated as the engine's cache is (KVCache.allocate: huge pages where offered)
    key = huge_page_zeros((nblocks, heads, block, d_k), dt).uniform_(-1, 1)
    value = (huge_page_zeros((nblocks, heads, block, d_k), dt).uniform_(-1, 1)
             if latent is None else None)
    q = torch.randn(seqs, m.num_heads, d_k, dtype=activation_dtype(m))
    tables = torch.arange(nblocks, dtype=torch.int32).view(seqs, blocks_per_seq)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    # the path the engine takes for this head_dim (the torch reference where the kernel cannot)
    attention = DecodeAttention("auto", head_dim=d_k, latent_value_dim=latent)
    sec = median_time(lambda: attention(q, key, value, tables, lens, d_k ** -0.5),
                      0.02 if fast else 0.05, 3 if fast else 5)
    kv = key.nbytes + (value.nbytes if value is not None else 0)
    return kv / sec, attention.describe()


def measure_cuda(shapes: list[tuple[int, int]], dtype_bytes: int, tokens: tuple[int, ...], fast: bool) -> dict[str, Any]:
    """Pinned host-to-device bandwidth, device memory and device GEMM rates (CUDA machines only)."""
    import torch

    nbytes = (256 if fast else 1024) << 20
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = nbytes / median_time(lambda: dst.copy_(src, non_blocking=True), 0.05, 5, torch.cuda.synchronize)
    props = torch.cuda.get_device_properties(0)
    rows = measure_gemms(shapes, dtype_bytes, tokens, fast, device="cuda")
    buf = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    dev_bw = nbytes / median_time(lambda: buf.sum(), 0.05, 5, torch.cuda.synchronize)
    peak = max(r["gflops"] for r in rows) / 1e3
    return {"link_gbps": round(h2d / GB, 2), "device_memory_gb": round(props.total_memory / GB, 1),
            "device_bw_gbps": round(dev_bw / GB, 1), "device_tflops": round(peak, 3), "gemm": rows,
            "device_name": props.name}


def profile_machine(models: list[ModelSpec], fast: bool = False, threads: int = 0) -> dict[str, Any]:
    """Measure this machine for the given models' shapes and return the profile dict.

    `threads` (0 = all usable cores) must match the engine's `engine.threads`: the rates are
    those of that many cores."""
    t_start = time.perf_counter()
    allocator = tune_host_allocator()  # as the engine runs its steps
    with _threads(threads) as cores:
        return {**_profile(models, fast, cores, t_start), "host_allocator": allocator}


@contextlib.contextmanager
def _threads(threads: int) -> Iterator[int]:
    """torch on `threads` threads (0 = all usable cores) inside the block; yields the count."""
    import torch

    cores = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    previous = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        yield cores
    finally:
        torch.set_num_threads(previous)


def _profile(models: list[ModelSpec], fast: bool, cores: int, t_start: float) -> dict[str, Any]:
    import torch

    tokens = FAST_TOKENS if fast else FULL_TOKENS
    _step(f"measuring this machine ({'fast' if fast else 'full'} profile, {cores} threads): "
          "read and copy bandwidth, operator overhead")
    # Buffers of twice the last-level cache (at least 256 MiB) so the figures are DRAM's.
    big = max(256 << 20, 2 * last_level_cache_bytes())
    read_bw = measure_read_bandwidth(big)
    copy_bw = measure_copy_bandwidth(big)
    overhead = measure_op_overhead(models[0].hidden_size, models[0].dtype_bytes) if models else measure_op_overhead()
    cpu_rows: list[dict[str, Any]] = []
    attention = []
    for m in models:
        shapes = gemm_shapes(m)
        _step(f"GEMMs of {m.name}: {len(shapes)} shapes x {len(tokens)} token counts, then its "
              "decode attention")
        cpu_rows += measure_gemms(shapes, m.dtype_bytes, tokens, fast,
                                  storage=m.weight_storage, torch_dtype=m.torch_dtype)
        attention.append(measure_attention(m, fast))
    layouts = measure_layers(models, tokens, fast)
    cpu_peak = max([r["gflops"] for r in cpu_rows] or [0.0]) / 1e3
    _step("the engine loop's per-step, per-sequence and per-token costs; disk read rate")
    host = measure_engine_loop(models)
    att_rate = statistics.median(a[0] for a in attention) if attention else None
    data: dict[str, Any] = {
        "name": f"profiled-{machine_fingerprint()}", "device": "cpu",
        "fingerprint": machine_fingerprint(),
        "profiled_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "fast" if fast else "full",
        "models": sorted({m.name for m in models}),
        "host_memory_gb": round(total_memory_bytes() / GB, 1),
        "device_memory_gb": round(total_memory_bytes() / GB, 1),
        "cpu_cores": cores, "cpu_bw_gbps": round(read_bw / GB, 2),
        "device_bw_gbps": round(read_bw / GB, 2),
        # No accelerator: moving a weight "to the device" is a host copy.
        "link_gbps": round(copy_bw / GB, 2),
        "cpu_tflops": round(cpu_peak, 4), "device_tflops": round(cpu_peak, 4),
        "op_overhead_us": round(overhead * 1e6, 3),
        "host_step_us": round(host["host_step_s"] * 1e6, 2),
        "host_seq_us": round(host["host_seq_s"] * 1e6, 3),
        "host_token_us": round(host["host_token_s"] * 1e6, 4),
        "host_logit_ns": round(host["host_logit_s"] * 1e9, 4),
        "cpu_attention_gbps": round(att_rate / GB, 2) if att_rate else None,
        "disk_read_gbps": round(measure_disk_read_bandwidth(default_cache_dir()) / GB, 3),
        "attention_kernel": attention[0][1] if attention else None,
        "gemm_impl": _gemm_impl(),
        "gemm": cpu_rows, "cpu_gemm": [],
        **layouts,
    }
    if torch.cuda.is_available():
        shapes = [s for m in models for s in gemm_shapes(m)]
        cuda = measure_cuda(list(dict.fromkeys(shapes)), models[0].dtype_bytes if models else 2, tokens, fast)
        data.update({k: v for k, v in cuda.items() if k != "gemm"})
        data["name"] = f"profiled-{cuda['device_name'].replace(' ', '-').lower()}"
        data["device"] = "cuda"
        data["cpu_gemm"], data["gemm"] = cpu_rows, cuda["gemm"]
    data["profile_seconds"] = round(time.perf_counter() - t_start, 2)
    return data


def measure_layers(models: list[ModelSpec], tokens: tuple[int, ...], fast: bool) -> dict[str, list[dict[str, Any]]]:
    """The element-wise layer work, prefill attention per prompt, decode attention per call and
    routed experts per call of each model's layer layout (profile_layer_ops), once per layout:
    rows by LAYOUT_KEYS."""
    from moe_engine.tools.profile_layer_ops import (measure_decode_attention, measure_layer_ops,
                                                    measure_moe_ffn, measure_prefill_attention)

    tune_host_allocator()  # as the engine runs its steps
    rows: dict[str, list[dict[str, Any]]] = {key: [] for key in LAYOUT_KEYS}
    seen = set()
    for m in models:
        if not layer_ops_profiled(m) or layer_layout(m) in seen:
            continue
        seen.add(layer_layout(m))
        _step(f"layer layout {layer_layout(m)}: element-wise work, prefill and decode attention, "
              "routed experts")
        rows["layer_ops"] += measure_layer_ops(m, tokens, fast)
        rows["prefill_attention"] += measure_prefill_attention(m, fast)
        rows["decode_attention"] += measure_decode_attention(m, fast)
        rows["moe_ffn"] += measure_moe_ffn(m, tokens, fast, last_level_cache_bytes())
    return rows


def _gemm_impl() -> str:
    """What measure_gemms timed on the CPU, for the profile's reader."""
    from moe_engine.model import packed

    return f"packed {packed.ISA}" if packed.HAS_PACKED_KERNELS else "torch"


def write_profile(data: dict[str, Any], path: Path | str) -> Path:
    """Write atomically (a concurrent reader sees the old file or the new one, never half)."""
    return write_text_atomic(path, "# Measured by python -m moe_engine.tools.profile_hardware; GB, GB/s, "
                             "TFLOP/s, GFLOP/s.\n" + yaml.safe_dump(data, sort_keys=False))


# Recent runs the learnt disk rate is the median of; reads below this many bytes say too little.
DISK_RUNS_KEPT = 8
DISK_RUN_MIN_BYTES = 64 << 20


def learn_disk_rate(path: Path | str, offload_stats: dict[str, Any]) -> Optional[float]:
    """Record the rate the disk tier's reader achieved in a generate job (its offload stats:
    disk_bytes_read over disk_busy_time_s) into the cached profile at `path`, keeping the last
    DISK_RUNS_KEPT; the model then plans with their median (perf.hardware.disk_read_gbps).
    Nothing is recorded without a profile or for a run that read under DISK_RUN_MIN_BYTES.
    Returns the recorded GB/s."""
    nbytes = float(offload_stats.get("disk_bytes_read") or 0)
    busy = float(offload_stats.get("disk_busy_time_s") or 0)
    path = Path(path)
    if nbytes < DISK_RUN_MIN_BYTES or busy <= 0 or not path.exists():
        return None
    gbps = round(nbytes / busy / GB, 3)
    # Shard jobs finish at the same time: one read-modify-write at a time.
    with exclusive_lock(path.with_suffix(".lock")):
        data = load_profile(path)
        data["disk_read_gbps_runs"] = (list(data.get("disk_read_gbps_runs") or ())
                                       + [gbps])[-DISK_RUNS_KEPT:]
        write_profile(data, path)
    return gbps


def ensure_profile(path: Path | str, model: ModelSpec | None = None, fast: bool = False,
                   checkpoint: Optional[Path] = None) -> dict[str, Any]:
    """The cached profile at `path`, measured (or extended with `model`'s GEMM shapes and layer
    layout) if needed. A profile from before the layer-layout points gets only those measured;
    a fast one, when a full one is asked for, is measured again (profile_mode_serves). Given
    the model's `checkpoint`, the engine's in-run factors of its layout are measured on it
    too where the profile lacks them (calibrate)."""
    data = _ensure_figures(Path(path), model, fast)
    if model is not None and checkpoint is not None and not engine_calibrated(data, model):
        calibrate(data, [(model, checkpoint)], fast, path=Path(path))
        write_profile(data, path)
    return data


def calibrate(data: dict[str, Any], models: list[tuple[ModelSpec, Optional[Path]]], fast: bool,
              threads: int = 0, path: Optional[Path] = None) -> None:
    """Add to the profile `data` the in-run factors (profile_engine) of each model that has a
    checkpoint and gets them (calibration_applies), replacing its layout's earlier row. A run
    that fails, or that cannot measure what the model prices, leaves a row of factor 1 with
    the reason: the policy stage does not run it again each time (the job itself meets the
    same checkpoint and says what is wrong with it). Given the profile's `path`, that row is
    written there before the run, so a run killed outright (out of memory) counts as failed
    too."""
    from moe_engine.tools.profile_engine import CalibrationSkipped, measure_engine_factors

    if data.get("device", "cpu") != "cpu":
        return  # engine_calibrated: a CUDA machine's parts are not calibrated yet
    for m, checkpoint in models:
        if checkpoint is None or not calibration_applies(m, profile_host_memory(data)):
            continue
        _set_calibration(data, {"layout": layer_layout(m), **dict.fromkeys(ENGINE_COMPONENTS, 1.0),
                                "error": "the calibration run did not finish"})
        if path is not None:
            write_profile(data, path)
        _step(f"the engine's calibration run on {checkpoint} (seconds of generation, timed part "
              "by part)")
        with _threads(threads) as cores:
            try:
                row = measure_engine_factors(checkpoint, m, data, fast, cores)
            except Exception as exc:  # noqa: BLE001 - any failure leaves the model as it was
                why = "skipped" if isinstance(exc, CalibrationSkipped) else "failed"
                print(f"profile_hardware: the engine's calibration run {why} on {checkpoint} "
                      f"({exc}); its in-run factors stay 1", file=sys.stderr)
                row = {"layout": layer_layout(m), **dict.fromkeys(ENGINE_COMPONENTS, 1.0),
                       "error": f"{type(exc).__name__}: {exc}"}
        _set_calibration(data, row)


def _set_calibration(data: dict[str, Any], row: dict[str, Any]) -> None:
    """`row` as its layout's in-run factors in `data`, under the current CALIBRATION_METHOD,
    replacing an earlier one."""
    data[CALIBRATION_KEY] = ([r for r in data.get(CALIBRATION_KEY) or () if r["layout"] != row["layout"]]
                             + [{**row, "method": CALIBRATION_METHOD}])


def _ensure_figures(path: Path, model: ModelSpec | None, fast: bool) -> dict[str, Any]:
    """ensure_profile's micro-benchmark figures."""
    models = [model] if model is not None else []
    data = load_profile(path) if path.exists() else None
    if data is not None and not profile_mode_serves(data, fast):
        data = None  # measured anew, not extended: its fast figures would stay
    if data is not None:
        if data.get("disk_read_gbps") is None:  # a profile from before the disk tier: ~1 s
            data["disk_read_gbps"] = round(measure_disk_read_bandwidth(default_cache_dir()) / GB, 3)
            write_profile(data, path)
        if profile_covers(data, models):
            return data
        missing = layouts_missing(data, models)
        if gemms_covered(data, models):
            with _threads(0):
                measured = measure_layers(missing, FAST_TOKENS if fast else FULL_TOKENS, fast)
        else:
            extra = profile_machine(models, fast=fast)
            measured = {key: extra.get(key) or [] for key in LAYOUT_KEYS}
            _merge_gemms(data, extra)
        # A layout's rows come whole from one measurement: a missing layout's rows (including
        # the kinds an older profile had before a kind was added) are replaced, others kept.
        layouts = {layer_layout(m) for m in missing}
        for key in LAYOUT_KEYS:
            data[key] = ([r for r in data.get(key) or () if r["layout"] not in layouts]
                         + [r for r in measured[key] if r["layout"] in layouts])
        # In-run factors are relative to the figures they were measured against.
        data[CALIBRATION_KEY] = [r for r in data.get(CALIBRATION_KEY) or () if r["layout"] not in layouts]
        if fast:  # it now holds fast figures: a full run measures it anew (profile_mode_serves)
            data["mode"] = "fast"
    else:
        if not models:
            models = [_default_model()]
        data = profile_machine(models, fast=fast)
    write_profile(data, path)
    return data


def _merge_gemms(data: dict[str, Any], extra: dict[str, Any]) -> None:
    """Add to `data` what a new measurement `extra` has that it lacks: GEMM points, models,
    engine-loop and disk figures, the decode-attention rate."""
    def row_key(r):
        return r["inp"], r["out"], r["tokens"], r["dtype_bytes"], gemm_storage_of(r)

    for table in ("gemm", "cpu_gemm"):  # cpu_gemm: the packed kernels' rows on a CUDA machine
        have = {row_key(r) for r in data.get(table) or ()}
        data[table] = list(data.get(table) or ()) + [r for r in extra.get(table) or ()
                                                     if row_key(r) not in have]
    data["models"] = sorted(set(data.get("models") or ()) | set(extra["models"]))
    if any(key not in data for key in HOST_KEYS):
        # The engine-loop figures come from one measurement: an older profile's are replaced
        # (the per-logit split and the evicted caches changed what the others mean), and the
        # in-run factors measured against the old ones go with them.
        data.update({key: extra[key] for key in HOST_KEYS})
        data.pop(CALIBRATION_KEY, None)
    if data.get("cpu_attention_gbps") is None:
        data["cpu_attention_gbps"] = extra["cpu_attention_gbps"]
        data["attention_kernel"] = extra["attention_kernel"]


def _default_model() -> ModelSpec:
    """The benchmark model's shapes (small-mixtral), profiled when no model is named."""
    from moe_engine.tools.presets import PRESETS, hf_config

    return ModelSpec.from_hf_config(hf_config(PRESETS["small-mixtral"]), name="small-mixtral")


def resolve_model(arg: str, dtype: str | None = None) -> ModelSpec:
    """A built-in preset name or a checkpoint directory / config.json path."""
    from moe_engine.tools.presets import PRESETS, hf_config

    if arg in PRESETS:
        return ModelSpec.from_hf_config(hf_config(PRESETS[arg]), dtype=dtype, name=arg)
    return ModelSpec.from_hf_config(arg, dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_engine.tools.profile_hardware", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="profile YAML to write (default: the machine cache, "
                        "~/.cache/moe-batch/hardware/<fingerprint>.yaml, which hardware.profile=auto reads)")
    parser.add_argument("--model", action="append", default=[],
                        help="built-in preset or checkpoint dir whose GEMM shapes to measure (repeatable)")
    parser.add_argument("--dtype", default=None, help="override the model dtype (bfloat16, float32)")
    parser.add_argument("--expert-storage", default=None,
                        choices=sorted(EXPERT_STORAGE_BITS) + [MODEL_DTYPE_STORAGE],
                        help="the storage the engine holds the routed experts in when it is not "
                             "the checkpoint's (engine.expert_dtype=int8/int4, matmul_precision="
                             f"medium's bf16p, high's bf16x3; '{MODEL_DTYPE_STORAGE}': the model dtype, as an "
                             "MXFP4 checkpoint's experts widened for torch's GEMMs): their call "
                             "is profiled in it")
    parser.add_argument("--weight-storage", default=None,
                        choices=[PAIR_STORAGE, BF16X3_STORAGE, TORCH_GEMM_STORAGE],
                        help="the storage the engine holds the dense projections and the LM head "
                             "in when it is not the dtype's (matmul_precision=medium's bf16p, "
                             "high's bf16x3; "
                             f"'{TORCH_GEMM_STORAGE}': the whole model on torch's GEMMs in its "
                             "dtype, engine.gemm=torch): their GEMMs, and for torch the layer's "
                             "other work, are profiled so")
    parser.add_argument("--fast", action="store_true", help="fewer token counts and shorter timings (tests)")
    parser.add_argument("--threads", type=int, default=0, help="threads to measure with (0 = all cores)")
    parser.add_argument("--ensure", action="store_true",
                        help="keep the profile at --out and measure only what it lacks for the models")
    args = parser.parse_args(argv)
    from moe_engine.tools.presets import PRESETS

    models = [resolve_model(m, args.dtype) for m in args.model] or [_default_model()]
    # A checkpoint directory (not a preset) is run by the engine to calibrate its layout.
    checkpoints = [None if m in PRESETS or not Path(m).is_dir() else Path(m) for m in args.model] or [None]
    if args.expert_storage:
        held = None if args.expert_storage == MODEL_DTYPE_STORAGE else args.expert_storage
        models = [m.with_expert_storage(held) for m in models]
    if args.weight_storage:
        models = [m.with_weight_storage(args.weight_storage) for m in models]
    out = args.out or hardware_cache_dir() / f"{machine_fingerprint()}.yaml"
    if args.ensure:
        for m, checkpoint in zip(models, checkpoints):
            ensure_profile(out, model=m, fast=args.fast, checkpoint=checkpoint)
        print(f"profile at {out} covers {', '.join(m.name for m in models)}")
        return 0
    data = profile_machine(models, fast=args.fast, threads=args.threads)
    calibrate(data, list(zip(models, checkpoints)), args.fast, args.threads)
    write_profile(data, out)
    print(f"profile written to {out} in {data['profile_seconds']} s: read {data['cpu_bw_gbps']} GB/s, "
          f"copy {data['link_gbps']} GB/s, GEMM peak {data['device_tflops'] * 1e3:.0f} GFLOP/s, "
          f"decode attention {data['cpu_attention_gbps']} GB/s ({data['attention_kernel']} kernel), "
          f"op overhead {data['op_overhead_us']} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
