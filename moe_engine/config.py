"""Configuration schema and composition.

Hydra is the single source of configuration. The dataclasses below are registered as Hydra
structured-config schemas, so an unknown key or a wrongly typed value fails while the config is
composed, with the key named. `validate` adds the range checks a type cannot express. Every
workflow rule reads the resolved YAML that `compose` + `save_resolved` write, never the YAML tree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and the value."""


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class DeviceKind(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class InputFormat(str, Enum):
    auto = "auto"
    jsonl = "jsonl"
    parquet = "parquet"
    openai = "openai"


class AttentionImpl(str, Enum):
    auto = "auto"
    cython = "cython"
    torch = "torch"


class GemmImpl(str, Enum):
    auto = "auto"  # the packed CPU kernels on the CPU backend when built, else torch
    packed = "packed"
    torch = "torch"


class ExpertDType(str, Enum):
    """Storage of the routed experts on the packed path (auto: as the checkpoint stores them:
    its dtype, or MXFP4 for GPT-OSS as released)."""

    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    int8 = "int8"  # per output channel
    int4 = "int4"  # group-wise (32 inputs), Klotski's 4-bit experts
    mxfp4 = "mxfp4"  # E2M1 codes, a power-of-two scale per 32 inputs (OCP microscaling)

    @property
    def quantized(self) -> bool:
        return self in (ExpertDType.int8, ExpertDType.int4, ExpertDType.mxfp4)


class MatmulPrecision(str, Enum):
    """How the packed CPU kernels multiply, in torch.set_float32_matmul_precision's words.
    highest: fp32 activations against the weights widened to fp32 in registers (transformers'
    fp32 logits within 1e-4, its greedy tokens). medium: activations rounded to bf16 before each
    GEMM, against weights held in bf16 (an fp32 checkpoint's rounded; fp16, int4 and MXFP4
    storage unchanged), so a CPU with AVX512-BF16 does two multiply-adds per lane and
    instruction (~2x the GEMMs); other CPUs compute the same products in fp32 FMAs, no faster.
    int8 experts (expert_dtype=int8) under medium take int8 activations instead (each row
    quantized to int8 with its own scale, the products summed exactly in int32), so a CPU with
    AVX512-VNNI does four multiply-adds per lane and instruction (2-3.5x int8's expert GEMMs
    at highest); elsewhere the same integer sums run no faster.
    high: bf16 weights held as bf16x3, whose GEMMs split each fp32 activation into three bf16s
    summing to it exactly, so every product is exact and the sums are fp32's (within 1e-6 of
    fp64, as highest) where the CPU has AMX tiles, which do the 3x work 1.4-3x faster than
    highest's FMAs; elsewhere high runs as highest (emulated, bf16x3 would be slower), as do
    fp32, fp16 and quantized weights. All three are batch invariant."""

    highest = "highest"
    high = "high"
    medium = "medium"


class PolicySource(str, Enum):
    search = "search"
    config = "config"


class FfnGrouping(str, Enum):
    layer = "layer"  # one GEMM pair per expert over every micro-batch of the layer (Klotski 5)
    micro_batch = "micro_batch"  # Lightning's order: each micro-batch's FFN on its own


@dataclass
class ModelConfig:
    """Which checkpoint to run. `builtin` names a generated preset; `path` a HF checkpoint dir."""

    name: str = "tiny-mixtral"
    builtin: Optional[str] = "tiny-mixtral"
    path: Optional[str] = None
    dtype: DType = DType.auto
    seed: int = 0
    num_shards: int = 1


@dataclass
class HardwareConfig:
    """What the performance model assumes about the machine (datasheet or profiled figures).

    On a CPU-only machine the "device" is the CPU itself and there is no link (link_gbps is the
    host memory bandwidth: moving a weight to the device is then a memory copy).
    """

    name: str = "cpu"
    device: DeviceKind = DeviceKind.cpu
    device_memory_gb: float = 16.0
    host_memory_gb: float = 24.0
    link_gbps: float = 20.0
    device_bw_gbps: float = 20.0
    cpu_bw_gbps: float = 20.0
    device_tflops: float = 0.27
    cpu_tflops: float = 0.27
    cpu_cores: int = 2
    disk_read_gbps: float = 2.0  # the disk tier's reads (O_DIRECT) from the experts' disk
    profile: Optional[str] = None


@dataclass
class WorkloadConfig:
    """The corpus to run and the default sampling parameters for its rows."""

    name: str = "sample"
    inputs: list[str] = field(default_factory=lambda: ["data/sample_prompts.jsonl"])
    format: InputFormat = InputFormat.auto
    id_column: Optional[str] = "id"
    prompt_column: str = "prompt"
    messages_column: str = "messages"
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    max_prompt_tokens: Optional[int] = None
    num_shards: int = 1  # generate jobs that can run at once (config/workload/sample.yaml)
    limit: Optional[int] = None


@dataclass
class EngineConfig:
    """How the engine runs: backend, KV cache budget, batching, and the policy's knobs."""

    backend: DeviceKind = DeviceKind.cpu
    threads: int = 0
    kv_cache_gb: float = 0.5
    block_size: int = 16
    max_num_seqs: int = 256
    max_prefill_tokens: int = 2048
    num_micro_batches: int = 2
    attention: AttentionImpl = AttentionImpl.auto
    # Packed CPU kernels (model/packed.py): fp32 activations over weights kept in model.dtype
    # (experts in expert_dtype), instead of torch GEMMs in model.dtype.
    gemm: GemmImpl = GemmImpl.auto
    expert_dtype: ExpertDType = ExpertDType.auto
    matmul_precision: MatmulPrecision = MatmulPrecision.highest  # medium: bf16 (int8) activations
    kv_dtype: DType = DType.auto  # KV cache storage; auto = model.dtype
    policy: PolicySource = PolicySource.search
    resident_ratio: float = 1.0
    attention_on_device: bool = False
    ffn_on_device: bool = True
    # Offloading (docs/offload.md). The offload pipeline runs on CUDA, when r_w < 1, with an
    # emulated link, or when asked for; a fully resident CPU run keeps the plain runner.
    offload_pipeline: bool = False
    cpu_experts: bool = True  # Twiddler: a streamed expert may run on the CPU instead
    group_ffn: FfnGrouping = FfnGrouping.layer
    device_memory_gb: Optional[float] = None  # the pager's budget; null = unlimited
    packet_mb: float = 32.0  # largest weight copy in the link at once (MoE-Lens 6.5)
    emulated_link_gbps: Optional[float] = None  # CPU backend only: simulate a slower link
    # Disk tier (docs/offload.md): experts beyond the host tier stay on disk and are read on
    # demand. host_resident_ratio (r_host) is the hottest fraction of each layer's experts held
    # in host memory; host_memory_gb the host weight budget (dense + host experts + read ring),
    # which sizes r_host when that is null. Both null: every expert in host memory.
    host_resident_ratio: Optional[float] = None
    host_memory_gb: Optional[float] = None
    disk_read_mb: float = 16.0  # largest disk read in flight (one packet)
    disk_direct_io: bool = True  # O_DIRECT reads; false: buffered reads dropped from the cache
    checkpoint_every: int = 32


@dataclass
class AppConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    results_dir: str = "results"
    resources_dir: str = "resources"

    @property
    def model_dir(self) -> Path:
        """Where the checkpoint lives: for a built-in, resources/models/<preset>-seed<seed>-<hash
        of its definition> (shared by every results dir, see presets.builtin_model_key); else
        model.path."""
        if self.model.builtin is not None:
            from moe_engine.tools.presets import builtin_model_key

            m = self.model
            return Path(self.resources_dir) / "models" / builtin_model_key(m.builtin, m.seed, m.num_shards)
        return Path(self.model.path)


def register_schemas() -> None:
    """Register the schemas with Hydra's ConfigStore (idempotent: storing again overwrites)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=AppConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="hardware", name="base_hardware", node=HardwareConfig)
    cs.store(group="workload", name="base_workload", node=WorkloadConfig)
    cs.store(group="engine", name="base_engine", node=EngineConfig)


def parse_overrides(overrides: str | list[str] | None) -> list[str]:
    """Overrides as given to `snakemake --config overrides="a=1 b.c=[x,y]"`.

    Words split on whitespace outside brackets, so a Hydra list (`workload.inputs=[a.jsonl,
    b.parquet]`) or dict needs no quoting of its own; inside brackets everything is kept for
    Hydra's parser (quoted strings with spaces included). Outside brackets quotes group a word
    with spaces, as in a shell. Snakemake strips a quote at either end of a --config value, so
    an unbalanced quote is first repaired by restoring that end's quote.
    """
    if overrides is None:
        return []
    if not isinstance(overrides, str):
        return [str(o) for o in overrides]
    words = _split_words(overrides)
    if words is None:
        words = _split_words(_restore_stripped_quote(overrides))
    if words is None:
        raise ConfigError(f"overrides={overrides!r}: unbalanced quote or bracket")
    return words


_OPEN, _CLOSE, _QUOTES = "[{(", "]})", "'\""


def _split_words(text: str) -> list[str] | None:
    """Whitespace-separated words, brackets and quotes respected; None when unbalanced."""
    words: list[str] = []
    word: list[str] = []
    started = False
    depth, quote = 0, None
    for ch in text:
        if quote is not None:
            if ch == quote:
                quote = None
                if depth:
                    word.append(ch)
            else:
                word.append(ch)
        elif ch in _QUOTES:
            quote, started = ch, True
            if depth:
                word.append(ch)
        elif ch.isspace() and depth == 0:
            if started:
                words.append("".join(word))
            word, started = [], False
        else:
            depth += (ch in _OPEN) - (ch in _CLOSE)
            if depth < 0:
                return None
            word.append(ch)
            started = True
    if quote is not None or depth:
        return None
    if started:
        words.append("".join(word))
    return words


def _restore_stripped_quote(text: str) -> str:
    """Put back the quote Snakemake stripped from one end of `text`: `A' B` was `'A' B` (the
    stray quote closes the first word), `B 'A` was `B 'A'` (it opens the last word)."""
    for q in _QUOTES:
        if text.count(q) % 2:
            first = text.index(q)
            closes_first_word = first > 0 and (first + 1 == len(text) or text[first + 1].isspace())
            return q + text if closes_first_word else text + q
    return text


def compose(overrides: str | list[str] | None = None, config_dir: Path | str | None = None) -> AppConfig:
    """Compose config/ with Hydra plus overrides, validate, and return the typed config.

    Raises ConfigError naming the offending key for unknown keys, bad types and bad ranges.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_schemas()
    config_dir = Path(config_dir or CONFIG_DIR).resolve()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=parse_overrides(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(f"invalid configuration: {_describe(exc)}") from exc
    app = OmegaConf.to_object(cfg)
    assert isinstance(app, AppConfig)
    validate(app)
    check_model_files(app)
    check_model_fields(app)
    check_kv_budget(app)
    return app


def check_model_files(cfg: AppConfig) -> None:
    """A checkpoint directory (model.path) must hold what the engine loads: config.json and
    safetensors weights. Checked when the workflow composes its config, so a wrong path fails
    before any rule runs instead of as a missing input or at generate. Built-in presets are
    built by the workflow and skipped."""
    m = cfg.model
    if m.builtin is not None:
        return
    path = Path(m.path)
    _check(path.is_dir(), "model.path", m.path, "no such checkpoint directory")
    _check((path / "config.json").is_file(), "model.path", m.path,
           "the directory has no config.json (expected a Hugging Face checkpoint)")
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        why = (f"only pickle weights ({', '.join(pickles[:3])}); moe-batch loads safetensors "
               "only and never unpickles: convert the checkpoint to safetensors"
               if pickles else "the directory has no *.safetensors weights")
        _check(False, "model.path", m.path, why)


def check_model_fields(cfg: AppConfig) -> None:
    """A checkpoint whose config.json sets a field the engine does not compute (a sliding
    window shorter than the context, another activation, an unsupported RoPE type...) is refused
    when the workflow composes, before shard and policy run. Torch-free."""
    m = cfg.model
    if m.builtin is not None:
        return
    from moe_engine.model.config_audit import UnhonouredFieldError
    from moe_engine.model.spec import ModelSpec, UnsupportedModelError

    try:
        ModelSpec.from_hf_config(Path(m.path))
    except UnhonouredFieldError as exc:
        _check(False, "model.path", m.path, str(exc))
    except (UnsupportedModelError, KeyError, ValueError):
        return  # anything else is named when the engine loads


def check_kv_budget(cfg: AppConfig) -> None:
    """With engine.policy=config the configured KV budget is what generate allocates: it must
    hold at least one block of engine.block_size tokens, or every shard would fail after shard
    and policy ran. (With policy=search the search sizes the cache itself.) Torch-free: the
    spec comes from config.json or, for a built-in not built yet, from its preset."""
    e = cfg.engine
    if e.policy is not PolicySource.config:
        return
    from moe_engine.model.spec import GB, ModelSpec, UnsupportedModelError

    m = cfg.model
    if m.builtin is not None:
        from moe_engine.tools.presets import PRESETS, hf_config

        source: Any = hf_config(PRESETS[m.builtin])
    else:
        source = Path(m.path)
    try:
        spec = ModelSpec.from_hf_config(source, dtype=None if m.dtype is DType.auto else m.dtype.value)
    except (UnsupportedModelError, KeyError, ValueError):
        return  # an unsupported checkpoint is refused at load, naming what it lacks
    block_gb = spec.kv_bytes_per_token * e.block_size / GB
    _check(e.kv_cache_gb >= block_gb, "engine.kv_cache_gb", e.kv_cache_gb,
           f"below one KV block of {e.block_size} tokens for {m.name} "
           f"({spec.kv_bytes_per_token} bytes/token): the minimum is {block_gb:.6g} GB")


def _describe(exc: BaseException) -> str:
    """Hydra wraps the OmegaConf error that names the key and reason; show the whole chain."""
    parts = []
    while exc is not None:
        text = str(exc).strip()
        if text and text not in parts:
            parts.append(text)
        exc = exc.__cause__
    return " <- ".join(parts)


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def validate(cfg: AppConfig) -> None:
    """Range and consistency checks that types alone cannot express."""
    m, hw, w, e = cfg.model, cfg.hardware, cfg.workload, cfg.engine
    _check(m.builtin is not None or m.path is not None, "model.path", m.path,
           "set model.path to a checkpoint directory or model.builtin to a preset")
    if m.builtin is not None:
        from moe_engine.tools.presets import PRESETS

        _check(m.builtin in PRESETS, "model.builtin", m.builtin,
               f"unknown preset; choose one of {sorted(PRESETS)}")
    _check(m.num_shards >= 1, "model.num_shards", m.num_shards, "must be >= 1")
    for key in ("device_memory_gb", "host_memory_gb", "link_gbps", "device_bw_gbps",
                "cpu_bw_gbps", "device_tflops", "cpu_tflops", "disk_read_gbps"):
        value = getattr(hw, key)
        _check(value > 0, f"hardware.{key}", value, "must be > 0")
    _check(hw.cpu_cores >= 1, "hardware.cpu_cores", hw.cpu_cores, "must be >= 1")
    _check(len(w.inputs) > 0, "workload.inputs", w.inputs, "need at least one input file")
    _check(w.max_new_tokens >= 1, "workload.max_new_tokens", w.max_new_tokens, "must be >= 1")
    _check(w.temperature >= 0, "workload.temperature", w.temperature, "must be >= 0")
    _check(0 < w.top_p <= 1, "workload.top_p", w.top_p, "must be in (0, 1]")
    _check(w.top_k >= 0, "workload.top_k", w.top_k, "must be >= 0 (0 disables top-k)")
    _check(w.num_shards >= 1, "workload.num_shards", w.num_shards, "must be >= 1")
    _check(w.limit is None or w.limit >= 0, "workload.limit", w.limit, "must be >= 0")
    _check(w.max_prompt_tokens is None or w.max_prompt_tokens >= 1, "workload.max_prompt_tokens",
           w.max_prompt_tokens, "must be >= 1")
    _check(e.threads >= 0, "engine.threads", e.threads, "must be >= 0 (0 = all cores)")
    _check(e.kv_cache_gb > 0, "engine.kv_cache_gb", e.kv_cache_gb, "must be > 0")
    _check(e.block_size >= 1 and (e.block_size & (e.block_size - 1)) == 0, "engine.block_size",
           e.block_size, "must be a power of two")
    _check(e.max_num_seqs >= 1, "engine.max_num_seqs", e.max_num_seqs, "must be >= 1")
    _check(e.max_prefill_tokens >= 1, "engine.max_prefill_tokens", e.max_prefill_tokens,
           "must be >= 1")
    _check(e.num_micro_batches >= 1, "engine.num_micro_batches", e.num_micro_batches,
           "must be >= 1")
    _check(0.0 <= e.resident_ratio <= 1.0, "engine.resident_ratio", e.resident_ratio,
           "must be in [0, 1]")
    _check(e.device_memory_gb is None or e.device_memory_gb > 0, "engine.device_memory_gb",
           e.device_memory_gb, "must be > 0 (or null for no limit)")
    _check(e.packet_mb > 0, "engine.packet_mb", e.packet_mb, "must be > 0")
    _check(e.emulated_link_gbps is None or e.emulated_link_gbps > 0, "engine.emulated_link_gbps",
           e.emulated_link_gbps, "must be > 0 (or null for no emulated link)")
    _check(e.emulated_link_gbps is None or e.backend == DeviceKind.cpu,
           "engine.emulated_link_gbps", e.emulated_link_gbps,
           "an emulated link exists only on the cpu backend (CUDA has a real one)")
    _check(e.checkpoint_every >= 1, "engine.checkpoint_every", e.checkpoint_every, "must be >= 1")
    _check(e.host_resident_ratio is None or 0.0 <= e.host_resident_ratio <= 1.0,
           "engine.host_resident_ratio", e.host_resident_ratio,
           "must be in [0, 1] (or null: every expert in host memory unless host_memory_gb is set)")
    _check(e.host_memory_gb is None or e.host_memory_gb > 0, "engine.host_memory_gb",
           e.host_memory_gb, "must be > 0 (or null for no host weight budget)")
    _check(e.disk_read_mb > 0, "engine.disk_read_mb", e.disk_read_mb, "must be > 0")
    _check(not (e.backend is not DeviceKind.cpu and e.host_resident_ratio is not None
                and e.resident_ratio > e.host_resident_ratio), "engine.resident_ratio",
           e.resident_ratio, "the device tier lies inside the host tier: must be <= "
           "engine.host_resident_ratio")
    on_cpu = e.backend is DeviceKind.cpu
    _check(not (e.gemm is GemmImpl.packed and not on_cpu), "engine.gemm",
           e.gemm.value, "the packed kernels run on the CPU backend; use auto or torch with cuda")
    packed_path = on_cpu and e.gemm is not GemmImpl.torch
    _check(packed_path or not e.expert_dtype.quantized,
           "engine.expert_dtype", e.expert_dtype.value,
           "quantized experts run on the packed CPU kernels (engine.backend=cpu, engine.gemm "
           "auto or packed)")
    _check(packed_path or e.matmul_precision is MatmulPrecision.highest,
           "engine.matmul_precision", e.matmul_precision.value,
           f"{e.matmul_precision.value} (bf16 activation terms) runs on the packed CPU kernels "
           "(engine.backend=cpu, engine.gemm auto or packed)")


def to_yaml(cfg: AppConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_resolved(cfg: AppConfig, path: Path | str) -> Path:
    """Write the resolved config; rules read this file so every job sees the same values."""
    from moe_engine.io import write_text_atomic

    return write_text_atomic(path, to_yaml(cfg))


def save_resolved_if_changed(cfg: AppConfig, path: Path | str) -> Path:
    """Like save_resolved, but leave the file (and its mtime) alone when nothing changed, so
    Snakemake does not rerun every job just because the workflow was parsed again."""
    path = Path(path)
    if path.exists() and path.read_text() == to_yaml(cfg):
        return path
    return save_resolved(cfg, path)


def load_resolved(path: Path | str) -> AppConfig:
    """Read a resolved config file back into the typed schema (validated again)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged = OmegaConf.merge(OmegaConf.structured(AppConfig), OmegaConf.load(str(path)))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"invalid configuration in {path}: {_describe(exc)}") from exc
    app = OmegaConf.to_object(merged)
    assert isinstance(app, AppConfig)
    validate(app)
    return app
