"""The engine on the packed CPU kernels: a bf16 checkpoint runs with its weights kept in bf16 and
fp32 activations, and matches transformers run in fp32 on the same (upcast) weights; torch's
GEMM path stays at parity too; a row's logits are bitwise the same alone and inside batches of
7 and 64 (batch invariance); quantized experts run and stay close to bf16; medium matmul
precision (bf16 activations on bf16 pairs) runs every GEMM in that storage, stays close to
highest and is batch invariant too; high precision (bf16x3: each activation as three bf16 terms
summing to it exactly) holds the same parity with transformers as highest, batch invariant."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import moe_engine.tools.checkpoints as ck
from moe_engine.config import EngineConfig, ExpertDType
from moe_engine.engine.llm_engine import LLMEngine
from moe_engine.engine.request import Request, SamplingParams
from moe_engine.model import packed
from tests.test_engine_parity import (PROMPTS, TINY_PRESETS, _assert_matches, _hf_generate,
                                      _hf_model, _requests, _run)

pytestmark = pytest.mark.skipif(not packed.HAS_PACKED_KERNELS, reason="kernels not built")
INDICES = [0, 1, 2, 6, 9, 11]


@pytest.fixture(scope="module", params=TINY_PRESETS)
def bf16_dir(request, tmp_path_factory):
    """The preset saved as a bf16 checkpoint, as real MoE checkpoints ship."""
    name = request.param
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ck.PRESETS, name, dataclasses.replace(ck.PRESETS[name], dtype="bfloat16"))
        return ck.build_checkpoint(name, tmp_path_factory.mktemp(name) / name, seed=0)


def _subset(reference, indices):
    return {str(i): reference[str(k)] for k, i in enumerate(indices)}


@pytest.fixture
def bf16_tiles(monkeypatch):
    """The engine told the CPU has AMX tiles, so high holds bf16x3 on every machine: the
    kernels emulate its products on the builds without tiles (slower, the same precision)."""
    monkeypatch.setattr("moe_engine.engine.llm_engine.bf16_tiles", lambda: True)


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_bf16_checkpoint_on_packed_kernels_matches_fp32_transformers(bf16_dir, precision,
                                                                     bf16_tiles):
    engine = LLMEngine(bf16_dir, EngineConfig(threads=2, kv_cache_gb=0.02, kv_dtype="float32",
                                              matmul_precision=precision))
    assert engine.gemm == "packed" and engine.dtype == torch.bfloat16
    # the experts stay as stored: bf16 (high: as bf16x3's panels of bf16 pairs), or MXFP4 as
    # GPT-OSS is released (never widened)
    held = "bf16" if precision == "highest" else "bf16x3"
    stored = engine.spec.expert_storage or held
    assert f"weights {held}, experts {stored}" in engine.gemm_path
    expert = next(layer.experts[0] for layer in engine.runner.weights.layers if layer.experts)
    assert packed.is_packed(expert)
    assert expert.w13.dtype == {"mxfp4": torch.uint8, "bf16": torch.bfloat16,
                                "bf16x3": torch.uint32}[stored]
    reference = _hf_generate(_hf_model(bf16_dir), engine.tokenizer, [PROMPTS[i] for i in INDICES])
    _assert_matches(engine, _subset(reference, INDICES), _requests(INDICES))


# GLM-4.5 too: its router runs on an fp32 copy of the weight there and its shared expert is
# ungated, neither of which the packed path shares; ERNIE-4.5's router weight is fp32 as stored.
# tiny-gpt-oss-mxfp4: torch's GEMMs widen the MXFP4 experts at load (exactly). Llama-4: its
# input-scaled rows through torch's per-expert GEMMs.
@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-glm4-moe", "tiny-deepseek-v3",
                                    "tiny-deepseek-v2", "tiny-gpt-oss", "tiny-gpt-oss-mxfp4",
                                    "tiny-ernie45-moe", "tiny-llama4"])
def test_torch_gemm_path_stays_at_parity(preset, builtin_dir):
    model_dir = builtin_dir(preset)
    engine = LLMEngine(model_dir, EngineConfig(threads=2, kv_cache_gb=0.02, gemm="torch"),
                       dtype="float32")
    assert engine.gemm == "torch" and engine.gemm_path.startswith("torch")
    reference = _hf_generate(_hf_model(model_dir), engine.tokenizer,
                             [PROMPTS[i] for i in INDICES])
    _assert_matches(engine, _subset(reference, INDICES), _requests(INDICES))


def _logits_of(engine, requests, rid):
    rows = []

    def observe(seqs, logits):
        rows.extend(row.clone() for seq, row in zip(seqs, logits) if seq.request_id == rid)

    engine.logits_observer = observe
    try:
        _run(engine, requests)
    finally:
        engine.logits_observer = None
    return torch.stack(rows)


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen2-moe", "tiny-glm4-moe",
                                    "tiny-deepseek-v3", "tiny-deepseek-v2", "tiny-gpt-oss",
                                    "tiny-ernie45-moe", "tiny-llama4"])
def test_row_logits_are_bitwise_identical_alone_and_in_batches_of_7_and_64(preset, builtin_dir):
    _assert_batch_invariant(LLMEngine(builtin_dir(preset), EngineConfig(
        threads=2, kv_cache_gb=0.05, num_micro_batches=3)), new_tokens=6)


def _assert_batch_invariant(engine: LLMEngine, new_tokens: int) -> None:
    """One prompt's logits alone, and inside batches of 7 and 64 (3 micro-batches), bitwise."""
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    target = Request("target", prompt=PROMPTS[4], sampling=sp)
    alone = _logits_of(engine, [target], "target")
    for size in (7, 64):
        others = [Request(f"o{i}", prompt=PROMPTS[i % len(PROMPTS)] + " x" * (i % 5), sampling=sp)
                  for i in range(size - 1)]
        batch = others[: size // 2] + [target] + others[size // 2:]
        assert torch.equal(_logits_of(engine, batch, "target"), alone), size


@pytest.mark.parametrize("expert_dtype", ["int8", "int4"])
def test_quantized_experts_generate_close_to_bf16(expert_dtype, tiny_mixtral_dir):
    def run(dtype):
        engine = LLMEngine(tiny_mixtral_dir, EngineConfig(threads=2, kv_cache_gb=0.02,
                                                          expert_dtype=dtype), dtype="bfloat16")
        return engine, _logits_of(engine, _requests([0]), "0")

    base_engine, base = run(ExpertDType.auto)
    quant_engine, quant = run(ExpertDType(expert_dtype))
    assert f"experts {expert_dtype}" in quant_engine.gemm_path
    assert quant_engine.weights_bytes < base_engine.weights_bytes
    assert not torch.equal(quant, base)  # the quantized weights really run
    # The first step sees the same tokens in both runs (later ones follow each run's own greedy
    # choices). Random weights are the worst case for quantization, so the bound is loose: it
    # catches a wrong scale or layout (errors of the logits' own size), not the rounding: 16
    # levels per group leave int4 ~10% off on Gaussian weights, 255 levels int8 ~0.2%.
    bound = {"int8": 0.05, "int4": 0.25}[expert_dtype]
    assert (quant[0] - base[0]).abs().max().item() < bound * base[0].abs().max().item()


def _medium_and_highest(model_dir, **knobs):
    """The engine under medium, its logits of request "0" (beside request 3) and the same
    logits under highest, both with `knobs`."""
    def run(precision):
        engine = LLMEngine(model_dir, EngineConfig(threads=2, kv_cache_gb=0.05,
                                                   matmul_precision=precision, **knobs),
                           dtype="bfloat16")
        return engine, _logits_of(engine, _requests([0, 3]), "0")

    _, highest = run("highest")
    engine, medium = run("medium")
    return engine, medium, highest


def test_medium_precision_holds_bf16_pairs_and_stays_close_to_highest(tiny_mixtral_dir):
    engine, medium, highest = _medium_and_highest(tiny_mixtral_dir)
    assert "weights bf16p, experts bf16p" in engine.gemm_path
    assert engine.spec.expert_storage == "bf16p"  # the model prices the bf16p kernel
    layer = next(layer for layer in engine.runner.weights.layers if layer.experts)
    assert layer.dense.wqkv.storage == "bf16p" and layer.experts[0].w13.dtype == torch.int32
    assert layer.dense.router.storage == "fp32"  # routing decisions keep fp32 logits
    assert not torch.equal(medium, highest)  # the activations really are rounded
    # first step, same tokens in both: bf16 activations (8 mantissa bits) leave the logits
    # within ~1% of their range on random weights; a wrong layout would be off by their size
    assert (medium[0] - highest[0]).abs().max().item() < 0.03 * highest[0].abs().max().item()


def test_medium_on_int8_experts_takes_int8_activations(tiny_mixtral_dir):
    """int8 experts under medium hold int8 quads (int8q): activation rows quantized to int8,
    integer sums (vpdpbusd on AVX512-VNNI); the dense weights bf16 pairs as for any bf16
    model. The logits stay near int8's at highest, and a row's are bitwise the same alone and
    in batches (a row's scale is its own)."""
    engine, medium, highest = _medium_and_highest(tiny_mixtral_dir, num_micro_batches=3,
                                                  expert_dtype=ExpertDType.int8)
    assert "experts int8q" in engine.gemm_path
    assert engine.spec.expert_storage == "int8q"  # the model prices the int8q kernel
    layer = next(layer for layer in engine.runner.weights.layers if layer.experts)
    assert layer.experts[0].w13.dtype == torch.int8 and layer.experts[0].w13.shape[-1] == 128
    assert not torch.equal(medium, highest)
    # first step: int8 activations (per-row scales) and bf16 ones in the dense part leave the
    # logits within a few % of their range on random weights; a wrong layout or scale would
    # be off by their size
    assert (medium[0] - highest[0]).abs().max().item() < 0.05 * highest[0].abs().max().item()
    _assert_batch_invariant(engine, new_tokens=4)


@pytest.mark.parametrize("precision", ["medium", "high"])
def test_bf16_term_precisions_rows_are_bitwise_identical_alone_and_in_batches(tiny_mixtral_dir,
                                                                              precision,
                                                                              bf16_tiles):
    engine = LLMEngine(tiny_mixtral_dir, EngineConfig(
        threads=2, kv_cache_gb=0.05, num_micro_batches=3, matmul_precision=precision),
        dtype="bfloat16")
    assert {"medium": "bf16p", "high": "bf16x3"}[precision] in engine.gemm_path
    _assert_batch_invariant(engine, new_tokens=4)


def test_high_without_amx_tiles_runs_as_highest(tiny_mixtral_dir, monkeypatch, caplog):
    """torch's "high": the faster algorithm where there is one. Without AMX tiles bf16x3's
    three products a weight would be emulated at 0.2-0.3x highest's speed, so the engine holds
    bf16 as highest does (the policy stage prices the same, cpu_features.bf16_tiles)."""
    monkeypatch.setattr("moe_engine.engine.llm_engine.bf16_tiles", lambda: False)

    def run(precision):
        engine = LLMEngine(tiny_mixtral_dir, EngineConfig(threads=2, kv_cache_gb=0.02,
                                                          matmul_precision=precision),
                           dtype="bfloat16")
        return engine, _logits_of(engine, _requests([0]), "0")

    with caplog.at_level("INFO", logger="moe_engine.engine.llm_engine"):
        engine, high = run("high")
    assert "weights bf16, experts bf16" in engine.gemm_path
    assert "runs as highest here" in caplog.text
    assert torch.equal(high, run("highest")[1])


def test_medium_names_each_product_the_build_emulates(tiny_mixtral_dir, monkeypatch, caplog):
    """int8 experts under medium on a bf16 model hold bf16 pairs and int8 quads at once: a
    build with neither vdpbf16ps nor vpdpbusd says so of both (it said only the first)."""
    bare = next(isa for isa in ("avx2", "generic") if isa in packed.supported_isas())
    monkeypatch.setattr(packed, "ISA", bare)
    with caplog.at_level("WARNING", logger="moe_engine.engine.llm_engine"):
        engine = LLMEngine(tiny_mixtral_dir, EngineConfig(
            threads=2, kv_cache_gb=0.02, matmul_precision="medium", expert_dtype=ExpertDType.int8),
            dtype="bfloat16")
    assert "weights bf16p, experts int8q" in engine.gemm_path
    assert f"on the {bare} kernel build, which has no vdpbf16ps" in caplog.text
    assert f"on int8 experts on the {bare} kernel build, which has no vpdpbusd" in caplog.text


def test_packed_gemm_on_cuda_is_a_config_error():
    from moe_engine.config import ConfigError, compose

    with pytest.raises(ConfigError, match="engine.gemm"):
        compose(["engine.backend=cuda", "engine.gemm=packed"])
    with pytest.raises(ConfigError, match="engine.expert_dtype"):
        compose(["engine.expert_dtype=int4", "engine.gemm=torch"])
    with pytest.raises(ConfigError, match="engine.matmul_precision.*medium"):
        compose(["engine.matmul_precision=medium", "engine.gemm=torch"])
    with pytest.raises(ConfigError, match="engine.matmul_precision.*high"):
        compose(["engine.matmul_precision=high", "engine.backend=cuda"])
    with pytest.raises(ConfigError, match="engine.matmul_precision"):
        compose(["engine.matmul_precision=low"])
    # Quantized experts page like any other now (the pager moves their scales with them).
    compose(["engine.expert_dtype=int4", "engine.resident_ratio=0.5", "engine.policy=config"])
