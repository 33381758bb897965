"""DeepSeek's multi-head latent attention: the latent KV cache and its size, checkpoints as
transformers saves them, and the paths that do not run it. Token and logit parity on the tiny
presets is in test_engine_parity (parametrized over every tiny preset)."""
from __future__ import annotations

import pytest
import torch

from moe_engine.config import EngineConfig
from moe_engine.engine.llm_engine import LLMEngine
from moe_engine.engine.request import Request, SamplingParams
from moe_engine.model import paged_attention
from moe_engine.model.attention import DecodeAttention
from moe_engine.model.kv_cache import blocks_for_budget, kv_bytes_per_token
from moe_engine.model.spec import load_spec

MLA_PRESETS = ["tiny-deepseek-v2", "tiny-deepseek-v3"]


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_latent_cache_holds_latent_and_rope_key_per_token(preset, builtin_dir):
    model_dir = builtin_dir(preset)
    spec = load_spec(model_dir)
    latent = spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
    assert latent == 24 + 8
    # Per token and layer: the latent and the shared rope key, not per-head K and V
    # (4 heads x (16 + 8 + 16) = 160 values would be).
    assert kv_bytes_per_token(spec, torch.float32) == spec.num_layers * latent * 4
    assert kv_bytes_per_token(spec, torch.bfloat16) == spec.num_layers * latent * 2
    engine = LLMEngine(model_dir, EngineConfig(threads=1, kv_cache_gb=0.001, block_size=16),
                       dtype="float32")
    cache = engine.runner.cache
    num_blocks = blocks_for_budget(spec, torch.float32, 0.001, 16)
    assert cache.num_blocks == engine.allocator.num_blocks == num_blocks
    assert cache.value == [] and len(cache.key) == spec.num_layers
    assert all(k.shape == (num_blocks, 1, 16, latent) for k in cache.key)
    allocated = sum(k.nbytes for k in cache.key)
    assert allocated == num_blocks * 16 * kv_bytes_per_token(spec, torch.float32)
    expected = "cython" if paged_attention.kernel_unavailable(latent) is None else "torch"
    assert engine.runner.attention.name == expected


@pytest.mark.skipif(not paged_attention.HAS_CYTHON_KERNELS, reason="kernels not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_decode_on_the_kernel_equals_the_torch_reference(dtype):
    """The GQA kernel over the latent cache, handed over as keys and values, with the rope
    dims dropped, against the reference reading the values as the keys' first rank dims."""
    torch.manual_seed(0)
    rank, rope, heads, block = 48, 16, 8, 16
    cache = torch.randn(40, 1, block, rank + rope).to(dtype)
    query = torch.randn(5, heads, rank + rope)
    tables = torch.randperm(40, dtype=torch.int32).reshape(5, 8)
    lens = torch.tensor([1, 17, 128, 0, 64], dtype=torch.int32)
    kernel = DecodeAttention("cython", head_dim=rank + rope, latent_value_dim=rank)
    torch_path = DecodeAttention("torch", head_dim=rank + rope, latent_value_dim=rank)
    got = kernel(query, cache, None, tables, lens, 0.125)
    want = torch_path(query, cache, None, tables, lens, 0.125)
    assert got.shape == want.shape == (5, heads, rank)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_latent_width_the_kernel_cannot_run_falls_back_to_torch_or_is_refused():
    # 28 + 2 dims: a multiple of no ISA's vector width (4, 8, 16)
    attention = DecodeAttention("auto", head_dim=30, latent_value_dim=28)
    assert attention.name == "torch" and "head_dim 30" in attention.describe()
    with pytest.raises(RuntimeError, match="engine.attention=cython"):
        DecodeAttention("cython", head_dim=30, latent_value_dim=28)


@pytest.mark.parametrize("model_type, q_lora_rank", [("deepseek_v3", None), ("deepseek_v2", 12)])
def test_deepseek_checkpoint_saved_by_transformers_loads_and_matches(tmp_path, model_type,
                                                                     q_lora_rank):
    """What transformers' save_pretrained writes (its config keys, head_dim = the rope dim,
    the fp32 score-correction bias, per-expert names) runs with transformers' logits; the
    q projection kinds are swapped from the tiny presets'."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moe_engine.engine.tokenizer import load_tokenizer
    from moe_engine.tools.checkpoints import build_checkpoint

    extra = {"topk_method": "group_limited_greedy"} if model_type == "deepseek_v2" else {}
    cfg = AutoConfig.for_model(
        model_type, vocab_size=8192, hidden_size=32, intermediate_size=48,
        moe_intermediate_size=16, n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=1, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=q_lora_rank,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, routed_scaling_factor=2.0,
        max_position_embeddings=256, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    for layer in model.model.layers:  # spread weights so every part changes the logits
        for p in layer.parameters():
            p.data.normal_(0, 0.3)
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    tokenizer_dir = build_checkpoint("tiny-mixtral", tmp_path / "tok", seed=0)
    for f in tokenizer_dir.glob("tokenizer*.json"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    spec = load_spec(tmp_path)
    assert spec.head_dim == 12 and spec.v_head_dim == 12 and spec.mla.q_lora_rank == q_lora_rank
    assert spec.dense_layers == (0,) and spec.shared_expert_intermediate_size == 32
    engine = LLMEngine(tmp_path, EngineConfig(threads=2, kv_cache_gb=0.01), dtype="float32")
    prompt = "Explain how a mixture of experts layer routes tokens to experts."
    ids = load_tokenizer(tmp_path).encode_prompt(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    captured = []
    engine.logits_observer = lambda seqs, logits: captured.extend(r.clone() for r in logits)
    [result] = engine.generate([Request("0", prompt=prompt,
                                        sampling=SamplingParams(max_new_tokens=6))])
    assert result.token_ids == out.sequences[0, len(ids):].tolist()
    for mine, ref in zip(captured, out.logits):
        assert (mine - ref[0]).abs().max().item() <= 1e-4


def test_hardware_profile_times_the_latent_decode_path(builtin_dir):
    from moe_engine.tools.profile_hardware import measure_attention

    spec = load_spec(builtin_dir("tiny-deepseek-v3"))
    rate, path = measure_attention(spec, fast=True)
    engine_path = DecodeAttention("auto", head_dim=spec.kv_cache_layout[1],
                                  latent_value_dim=spec.mla.kv_lora_rank)
    assert rate > 0 and path == engine_path.describe()


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_latent_cache_placed_on_a_device_apart_from_the_host_gives_the_same_tokens(preset,
                                                                                   builtin_dir):
    """With attention on the device the KV cache moves there and decode switches to the torch
    path (the CUDA path's placement, with memcpys on a CPU backend declaring its device apart):
    that path must still read the latent cache's values from its keys."""
    from moe_engine.offload.backend import CpuBackend
    from moe_engine.offload.build import OffloadSettings, build_offload_pipeline

    class DeviceApart(CpuBackend):
        device_is_host = False

    model_dir = builtin_dir(preset)
    config = EngineConfig(threads=2, kv_cache_gb=0.02, num_micro_batches=2)
    requests = [Request(str(i), prompt=p, sampling=SamplingParams(max_new_tokens=8))
                for i, p in enumerate(["Why is the sky blue?", "hi", "a b c d e f g h"])]
    plain = {r.request_id: r.token_ids
             for r in LLMEngine(model_dir, config, dtype="float32").generate(requests)}
    engine = LLMEngine(model_dir, config, dtype="float32")
    engine.runner = build_offload_pipeline(
        engine.runner, OffloadSettings(resident_ratio=0.5, attention_on_device=True,
                                       cpu_experts=False), backend=DeviceApart())
    try:
        assert engine.runner.runner.attention.name == "torch"
        assert {r.request_id: r.token_ids for r in engine.generate(requests)} == plain
    finally:
        engine.runner.close()
