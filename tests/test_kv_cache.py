"""Paged KV cache: sizing from a byte budget, allocator, write + decode attention vs a dense reference."""
import math

import pytest
import torch

from moe_engine.model.attention import (DecodeAttention, prefill_attention, torch_paged_decode_attention,
                                  torch_write_kv)
from moe_engine.engine.block_manager import BlockAllocator
from moe_engine.model.kv_cache import (KVCache, blocks_for_budget, kv_bytes_per_token, kv_pool_blocks)
from moe_engine.model.spec import ModelSpec, RopeSpec


def _spec(layers=2, kv_heads=2, head_dim=32) -> ModelSpec:
    return ModelSpec(architecture="MixtralForCausalLM", model_type="mixtral", vocab_size=100,
                     hidden_size=128, intermediate_size=64, num_layers=layers, num_heads=4,
                     num_kv_heads=kv_heads, head_dim=head_dim, num_experts=4, top_k=2,
                     rms_norm_eps=1e-5, max_position_embeddings=512, rope=RopeSpec())


def test_block_count_follows_byte_budget():
    spec = _spec()
    per_token = kv_bytes_per_token(spec, torch.float32)
    assert per_token == 2 * 2 * 2 * 32 * 4
    n = blocks_for_budget(spec, torch.float32, 0.001, 16)
    assert n == int(0.001 * 1e9 // (per_token * 16))  # kv_cache_gb is decimal GB, as every *_gb knob
    assert blocks_for_budget(spec, torch.bfloat16, 0.001, 16) == pytest.approx(2 * n, abs=1)
    cache = KVCache.allocate(spec, n, 16, torch.float32)
    assert cache.key[0].shape == (n, 2, 16, 32) and len(cache.value) == 2


def test_kv_bytes_per_token_is_the_specs_at_the_engine_dtype():
    spec = _spec()
    assert kv_bytes_per_token(spec, torch.float32) == spec.kv_bytes_per_token  # spec default fp32
    assert kv_bytes_per_token(spec, torch.bfloat16) == spec.with_dtype("bfloat16").kv_bytes_per_token


def test_policy_kv_budget_allocates_the_blocks_the_policy_planned():
    """apply_policy writes kv_cache_gb in decimal GB; reading it as GiB would give 7% more."""
    from moe_engine.config import EngineConfig
    from moe_engine.perf import apply_policy, choose_policy, load_preset, workload_spec_from_lengths
    from moe_engine.tools.presets import PRESETS, hf_config

    m = ModelSpec.from_hf_config(hf_config(PRESETS["small-mixtral"]))
    result = choose_policy(m, load_preset("cpu"), workload_spec_from_lengths([600] * 64, 32), backend="cpu")
    planned = result.to_json()["policy"]
    per_block = m.kv_bytes_per_token * planned["block_size"]
    planned_blocks = round(planned["kv_cache_bytes"] / per_block)
    engine = apply_policy(EngineConfig(), result)
    n = blocks_for_budget(m, torch.bfloat16, engine.kv_cache_gb, engine.block_size)
    slack = math.ceil(1e6 / per_block)  # apply_policy rounds the budget up to whole MB
    assert planned_blocks > 20 * slack  # a 7% error would exceed the rounding slack
    assert planned_blocks <= n <= planned_blocks + slack


def test_allocator_tracks_free_blocks_and_high_water():
    alloc = BlockAllocator(10, 16)
    assert alloc.blocks_needed(1) == 1 and alloc.blocks_needed(16) == 1 and alloc.blocks_needed(17) == 2
    a = alloc.allocate(4)
    b = alloc.allocate(5)
    assert len(set(a) | set(b)) == 9 and alloc.num_free == 1
    alloc.free(a)
    assert alloc.num_free == 5 and alloc.high_water == 9
    assert not alloc.can_allocate(6)
    with pytest.raises(RuntimeError):
        alloc.allocate(6)


def _dense_reference(q, ks, vs, scale):
    """Attention of one query token over its whole context, GQA expanded explicitly."""
    nq, nkv = q.shape[0], ks.shape[1]
    k = ks.repeat_interleave(nq // nkv, dim=1).transpose(0, 1)  # [nq, L, d]
    v = vs.repeat_interleave(nq // nkv, dim=1).transpose(0, 1)
    w = torch.softmax((q[:, None, :] @ k.transpose(1, 2)).squeeze(1) * scale, dim=-1)
    return (w[:, None, :] @ v).squeeze(1)


@pytest.mark.parametrize("impl", ["torch", "auto"])
def test_paged_decode_matches_dense_attention(impl):
    torch.manual_seed(0)
    nkv, nq, d, bs, nblocks = 2, 8, 32, 4, 40
    kc = torch.zeros(nblocks, nkv, bs, d)
    vc = torch.zeros(nblocks, nkv, bs, d)
    lens = [1, 5, 13, 8]
    perm = torch.randperm(nblocks).tolist()  # scattered blocks, as after churn
    tables, contexts = [], []
    for n in lens:
        table = [perm.pop() for _ in range(math.ceil(n / bs))]
        k, v = torch.randn(n, nkv, d), torch.randn(n, nkv, d)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        torch_write_kv(kc, vc, k, v, slots)
        tables.append(table)
        contexts.append((k, v))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), nq, d)
    scale = d ** -0.5
    out = DecodeAttention(impl)(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), scale)
    for i, (k, v) in enumerate(contexts):
        torch.testing.assert_close(out[i], _dense_reference(q[i], k, v, scale), atol=1e-5, rtol=1e-5)


def test_prefill_attention_is_causal_per_sequence_without_padding():
    torch.manual_seed(1)
    nq, nkv, d = 4, 2, 16
    lens = [3, 7, 1]
    q, k, v = torch.randn(11, nq, d), torch.randn(11, nkv, d), torch.randn(11, nkv, d)
    out = prefill_attention(q, k, v, lens, d ** -0.5)
    start = 0
    for n in lens:
        for t in range(n):
            ref = _dense_reference(q[start + t], k[start:start + t + 1], v[start:start + t + 1],
                                   d ** -0.5)
            torch.testing.assert_close(out[start + t], ref, atol=1e-5, rtol=1e-5)
        start += n


def test_torch_decode_writes_into_out_buffer():
    kc = torch.randn(4, 1, 4, 8)
    vc = torch.randn(4, 1, 4, 8)
    q = torch.randn(1, 2, 8)
    out = torch.empty(1, 2, 8)
    res = torch_paged_decode_attention(q, kc, vc, torch.tensor([[2, 3]], dtype=torch.int32),
                                       torch.tensor([6], dtype=torch.int32), 0.3, out=out)
    assert res is out
    ref = _dense_reference(q[0], torch.cat([kc[2, :, :, :].transpose(0, 1), kc[3, :, :2].transpose(0, 1)]),
                           torch.cat([vc[2].transpose(0, 1), vc[3, :, :2].transpose(0, 1)]), 0.3)
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)


def test_unknown_or_unbuilt_attention_impl_is_an_error():
    with pytest.raises(ValueError):
        DecodeAttention("flash")
    from moe_engine.model import paged_attention as kernels

    if not kernels.HAS_CYTHON_KERNELS:
        with pytest.raises(RuntimeError):
            DecodeAttention("cython")
    else:
        assert DecodeAttention("cython").name == "cython"


def test_windowed_layers_get_a_pool_of_their_own():
    """GPT-OSS-like: layers 0 and 2 windowed to 8 tokens. Their pool holds max_num_seqs
    sequences' windows (3 blocks of 4 each) within half the budget, the full layer the rest;
    each layer's cache tensor has its pool's block count."""
    import dataclasses

    spec = dataclasses.replace(_spec(layers=3), sliding_window=8, layer_types=(
        "sliding_attention", "full_attention", "sliding_attention"))
    layer_block = spec.kv_bytes_per_token_layer * 4
    budget = 1000 * layer_block / 1e9
    full, window = kv_pool_blocks(spec, torch.float32, budget, 4, max_num_seqs=10)
    assert window == 10 * spec.window_blocks_per_sequence(4) == 30
    assert full == 1000 - 2 * 30
    # A budget too small for max_num_seqs windows: half of it, at least one sequence's.
    assert kv_pool_blocks(spec, torch.float32, budget, 4, max_num_seqs=1000)[1] == 250
    cache = KVCache.allocate(spec, full, 4, torch.float32, window)
    assert [t.shape[0] for t in cache.key] == [30, 940, 30] == [t.shape[0] for t in cache.value]
    assert cache.num_blocks == 940
    # Without windowed layers (or with every layer windowed) one pool, as before.
    assert kv_pool_blocks(_spec(), torch.float32, budget, 4, 10)[1] is None
