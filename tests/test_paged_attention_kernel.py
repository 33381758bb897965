"""CPU decode attention kernel (kernels_cy/paged_attention_impl.h, one build per ISA) against an
fp64 reference, on every ISA build this CPU can run.

The reference below is written independently of moe_engine.model.paged_attention: one sequence and one query
head at a time, in float64, from the same (dtype-rounded) cache contents the kernel reads. CI
builds the extension first, so a missing build fails here instead of being skipped.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from moe_engine.model import paged_attention as kernels
from moe_engine.model.attention import DecodeAttention, torch_paged_decode_attention
from moe_engine.model.paged_attention import paged_decode_attention, write_kv

BLOCK = 16
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
ISAS = kernels.supported_isas()
# empty, 1, block_size-1, block_size, block_size+1 and a few thousand tokens
CONTEXTS = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2500]


def fp64_attention(query, key_cache, value_cache, block_tables, context_lens, scale,
                   sinks=None, window=None):
    """Per (sequence, head) in fp64; sinks [n_q] join the softmax denominator, a window keeps
    the last `window` positions (GPT-OSS)."""
    num_seqs, n_q, d = query.shape
    _, n_kv, block_size, _ = key_cache.shape
    group = n_q // n_kv
    out = torch.zeros(num_seqs, n_q, d, dtype=torch.float64)
    for s in range(num_seqs):
        n = int(context_lens[s])
        if n == 0:
            continue
        blocks = block_tables[s, :(n + block_size - 1) // block_size].long()
        k = key_cache[blocks].double().permute(1, 0, 2, 3).reshape(n_kv, -1, d)[:, :n]
        v = value_cache[blocks].double().permute(1, 0, 2, 3).reshape(n_kv, -1, d)[:, :n]
        first = 0 if window is None else max(0, n - window)
        for h in range(n_q):
            logits = k[h // group, first:] @ query[s, h].double() * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks[h:h + 1].double()])
            w = torch.softmax(logits, dim=0)[:n - first]
            out[s, h] = w @ v[h // group, first:]
    return out


def make_inputs(contexts, n_kv, group, d, dtype, block_size=BLOCK, seed=0, q_std=2.0):
    """Cache with a shuffled pool of blocks (plus spare ones) and non-contiguous block tables;
    table entries past a sequence's last block hold -1, which the kernel must never read."""
    gen = torch.Generator().manual_seed(seed)
    need = [(c + block_size - 1) // block_size for c in contexts]
    num_blocks = sum(need) + 7
    key_cache = torch.randn(num_blocks, n_kv, block_size, d, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, n_kv, block_size, d, generator=gen).to(dtype)
    pool = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.full((len(contexts), max(need) + 2), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = pool[start:start + n]
        start += n
    query = torch.randn(len(contexts), n_kv * group, d, generator=gen) * q_std
    return query, key_cache, value_cache, tables, torch.tensor(contexts, dtype=torch.int32)


def run_poisoned(query, key_cache, value_cache, tables, lens, scale, num_threads=0, isa=None):
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    res = paged_decode_attention(query, key_cache, value_cache, tables, lens, scale, out=out,
                                 num_threads=num_threads, isa=isa)
    assert res is out
    return out


def test_kernel_extension_is_built():
    assert kernels.HAS_CYTHON_KERNELS, "build it: python setup.py build_ext --inplace"
    assert kernels.ISA in ISAS and ISAS[0] == "generic"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_matches_fp64_reference(isa, dtype, group, head_dim):
    query, kc, vc, tables, lens = make_inputs(CONTEXTS, n_kv=2, group=group, d=head_dim,
                                              dtype=dtype, seed=group * 1000 + head_dim)
    scale = head_dim ** -0.5
    out = run_poisoned(query, kc, vc, tables, lens, scale, isa=isa)
    ref = fp64_attention(query, kc, vc, tables, lens, scale)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no context: zeros, by definition
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size,width_multiple,group", [(8, 5, 2), (32, 3, 3), (48, 6, 6),
                                                             (16, 2, 5), (16, 4, 7)])
def test_odd_block_sizes_head_dims_and_groups(isa, dtype, block_size, width_multiple, group):
    # block_size 8 (less than one chunk of tokens on AVX-512), 32 and 48 (several chunks per
    # block); head_dims that are odd multiples of the ISA's vector width end in a half group;
    # groups 3, 5, 6, 7 split into several head tiles (2+1, 4+1, 4+2 or 8-wide, 4+2+1).
    head_dim = width_multiple * kernels.head_dim_multiple(isa)
    contexts = [1, block_size - 1, block_size, block_size + 1, 700]
    query, kc, vc, tables, lens = make_inputs(contexts, n_kv=2, group=group, d=head_dim,
                                              dtype=dtype, block_size=block_size, seed=block_size)
    out = run_poisoned(query, kc, vc, tables, lens, 0.3, isa=isa)
    ref = fp64_attention(query, kc, vc, tables, lens, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_one_and_two_threads_give_identical_results(isa, dtype):
    query, kc, vc, tables, lens = make_inputs([3, 17, 400, 1000, 33, 2] * 3, n_kv=4, group=4,
                                              d=128, dtype=dtype, seed=7)
    one = run_poisoned(query, kc, vc, tables, lens, 0.1, num_threads=1, isa=isa)
    two = run_poisoned(query, kc, vc, tables, lens, 0.1, num_threads=2, isa=isa)
    assert torch.equal(one, two)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_a_sequences_output_is_the_same_alone_and_in_a_batch(isa, dtype):
    contexts = [700, 0, 1, 17, 333, 16, 1200]
    query, kc, vc, tables, lens = make_inputs(contexts, n_kv=2, group=4, d=64, dtype=dtype,
                                              seed=13)
    batch = run_poisoned(query, kc, vc, tables, lens, 0.125, num_threads=2, isa=isa)
    for s in range(len(contexts)):
        alone = run_poisoned(query[s:s + 1].contiguous(), kc, vc, tables[s:s + 1].contiguous(),
                             lens[s:s + 1].contiguous(), 0.125, num_threads=1, isa=isa)
        assert torch.equal(alone[0], batch[s]), f"sequence {s} (context {contexts[s]})"


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_unavailable_says_truthfully_which_head_dims_run(isa):
    multiple = kernels.head_dim_multiple(isa)
    assert multiple == {"generic": 4, "avx2": 8, "avxvnni": 8, "avx512": 16, "avx512vnni": 16,
                        "avx512bf16": 16, "amx": 16}[isa]
    for head_dim in (4, 8, 12, 16, 24, 40, 48, 64, 72, 80):
        reason = kernels.kernel_unavailable(head_dim, isa)
        query, kc, vc, tables, lens = make_inputs([1, 40], n_kv=1, group=2, d=head_dim,
                                                  dtype=torch.bfloat16, seed=head_dim)
        if head_dim % multiple:
            assert reason is not None and f"head_dim {head_dim}" in reason
            with pytest.raises(RuntimeError, match=f"head_dim {head_dim}"):
                paged_decode_attention(query, kc, vc, tables, lens, 0.2, isa=isa)
        else:
            assert reason is None
            out = paged_decode_attention(query, kc, vc, tables, lens, 0.2, isa=isa)
            torch.testing.assert_close(out.double(), fp64_attention(query, kc, vc, tables, lens,
                                                                    0.2), rtol=1e-4, atol=2e-5)


def test_unsupported_isa_is_refused_not_run():
    query, kc, vc, tables, lens = make_inputs([5], n_kv=1, group=1, d=64, dtype=torch.float32)
    with pytest.raises(ValueError, match="not supported"):
        paged_decode_attention(query, kc, vc, tables, lens, 0.1, isa="sve")
    assert "not supported" in kernels.kernel_unavailable(64, "sve")


def test_moe_batch_isa_forces_the_build_that_runs_and_describe_names_it():
    # a fresh interpreter: the ISA is chosen once, at import
    code = ("from moe_engine.model.attention import DecodeAttention; "
            "from moe_engine.model import paged_attention as k; "
            "print(k.ISA, DecodeAttention('auto', head_dim=64).describe())")
    for isa in ISAS:
        env = dict(os.environ, MOE_BATCH_ISA=isa)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        assert out == [isa, "cython", isa]


@pytest.mark.parametrize("isa", ISAS)
def test_read_probe_sums_every_element(isa):
    assert kernels.read_sum(torch.ones(4 << 16), threads=2, isa=isa) == 4 << 16


@pytest.mark.parametrize("isa", ISAS)
def test_rising_scores_force_many_rescales(isa):
    # scores climb by ~150 across the context (|q| ~ 16), far more than the lazy-rescale
    # margin: the running max must move many times without overflow or lost mass
    n_kv, group, d, ctx = 1, 4, 64, 600
    query, kc, vc, tables, lens = make_inputs([ctx], n_kv, group, d, torch.float32, seed=3)
    direction = query[0, 0] / query[0, 0].norm()
    ramp = torch.linspace(-3.0, 6.0, ctx)
    blocks = tables[0, :(ctx + BLOCK - 1) // BLOCK].long()
    flat = torch.zeros(len(blocks) * BLOCK, d)
    flat[:ctx] = ramp[:, None] * direction + 0.01 * torch.randn(ctx, d)
    kc[blocks, 0] = flat.view(len(blocks), BLOCK, d)
    out = run_poisoned(query, kc, vc, tables, lens, 1.0, isa=isa)
    ref = fp64_attention(query, kc, vc, tables, lens, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_empty_context_gives_zeros(isa):
    query, kc, vc, tables, lens = make_inputs([0, 5], n_kv=2, group=2, d=64, dtype=torch.float32)
    out = run_poisoned(query, kc, vc, tables, lens, 0.125, isa=isa)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1].double(), fp64_attention(query, kc, vc, tables, lens,
                                                               0.125)[1], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_query_in_cache_dtype_returns_that_dtype(dtype):
    query, kc, vc, tables, lens = make_inputs([40, 300], n_kv=2, group=4, d=128, dtype=dtype)
    query = query.to(dtype)
    out = paged_decode_attention(query, kc, vc, tables, lens, 128 ** -0.5)
    assert out.dtype == dtype
    ref = fp64_attention(query, kc, vc, tables, lens, 128 ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_head_dim_off_the_vector_width_dispatches_to_the_torch_path_and_says_so():
    # 6 is a multiple of no ISA's vector width (4, 8, 16)
    query, kc, vc, tables, lens = make_inputs([1, 17, 90], n_kv=2, group=2, d=6,
                                              dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="head_dim 6"):  # the kernel never falls back itself
        paged_decode_attention(query, kc, vc, tables, lens, 0.2)
    with pytest.raises(RuntimeError, match="head_dim 6"):
        DecodeAttention("cython", head_dim=6)
    attention = DecodeAttention("auto", head_dim=6)
    assert attention.name == "torch" and "head_dim 6" in attention.describe()
    assert DecodeAttention("auto", head_dim=64).describe() == f"cython {kernels.ISA}"
    out = attention(query, kc, vc, tables, lens, 0.2)
    torch.testing.assert_close(out.double(), fp64_attention(query, kc, vc, tables, lens, 0.2),
                               rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_torch_reference_matches_fp64(dtype):
    query, kc, vc, tables, lens = make_inputs([0, 1, 16, 17, 500], n_kv=2, group=4, d=64,
                                              dtype=dtype, seed=11)
    out = torch_paged_decode_attention(query, kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(out.double(), fp64_attention(query, kc, vc, tables, lens, 0.125),
                               rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("window", [None, 1, 5, 16, 40])
def test_torch_reference_with_sinks_and_window_matches_fp64(window):
    """GPT-OSS's decode attention: a sink logit per query head in the denominator, and on
    windowed layers only the last `window` keys (the new token's included)."""
    query, kc, vc, tables, lens = make_inputs([0, 1, 16, 17, 50], n_kv=2, group=4, d=64,
                                              dtype=torch.float32, seed=5)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)) * 2
    out = torch_paged_decode_attention(query, kc, vc, tables, lens, 0.125, sinks=sinks,
                                       window=window)
    ref = fp64_attention(query, kc, vc, tables, lens, 0.125, sinks=sinks, window=window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=2e-5)
    plain = fp64_attention(query, kc, vc, tables, lens, 0.125)
    assert (ref - plain).abs().max() > 1e-2  # the sinks and the window change the result


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("window", [None, 1, 7, 16, 33, 5000])
def test_kernel_with_sinks_and_window_matches_fp64(isa, dtype, window):
    """GPT-OSS in the kernel: the sink is one more term of the running sum, the window starts
    the walk at its first token (mid-block too); the ids of blocks before the window are -1
    (freed), which the kernel must neither check nor read."""
    contexts = [0, 1, BLOCK - 1, BLOCK + 1, 50, 2500]
    query, kc, vc, tables, lens = make_inputs(contexts, n_kv=2, group=4, d=64, dtype=dtype,
                                              seed=3)
    # Sinks far above and below the scores too: the output then tends to 0 or to plain attention.
    sinks = torch.tensor([0.5, -1.0, 3.0, 40.0, -40.0, 0.0, 2.0, -3.0])
    if window is not None:
        for i, n in enumerate(contexts):
            tables[i, :max(0, n - window) // BLOCK] = -1
    out = paged_decode_attention(query, kc, vc, tables, lens, 0.125, isa=isa, sinks=sinks,
                                 window=window)
    ref = fp64_attention(query, kc, vc, tables.clamp(min=0), lens, 0.125, sinks=sinks,
                         window=window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=2e-5)
    assert out[:, 3].abs().max() < 1e-6  # the head whose sink dwarfs its scores


def test_sinks_and_windows_run_on_the_kernel_and_unknown_features_fall_back():
    features = ("attention sinks", "sliding-window layers")
    assert DecodeAttention("auto", head_dim=64, features=features).name == "cython"
    with pytest.raises(RuntimeError, match="does not compute latent attention"):
        DecodeAttention("cython", head_dim=64, features=("latent attention",))
    attention = DecodeAttention("auto", head_dim=64, features=("latent attention",))
    assert attention.name == "torch"
    assert "does not compute latent attention" in attention.describe()


def test_kernel_releases_the_gil():
    # a Python thread keeps counting while a long kernel call runs in another thread
    query, kc, vc, tables, lens = make_inputs([2500] * 16, n_kv=8, group=4, d=128,
                                              dtype=torch.float32)
    ticks = []
    done = threading.Event()

    def count():
        while not done.is_set():
            ticks.append(1)

    def attend():
        for _ in range(5):
            paged_decode_attention(query, kc, vc, tables, lens, 0.1, num_threads=1)
        done.set()

    counter, worker = threading.Thread(target=count), threading.Thread(target=attend)
    counter.start()
    worker.start()
    worker.join()
    counter.join()
    # with the GIL held for the whole call, the counter would get only switch-interval slices
    # between calls (a handful of ticks); released, it runs throughout
    assert len(ticks) > 1000


@pytest.mark.parametrize("cache_dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["src32", "src16"])
def test_write_kv_puts_rows_in_their_slots(cache_dtype, src_dtype):
    num_blocks, n_kv, d = 12, 2, 64
    gen = torch.Generator().manual_seed(5)
    kc = torch.full((num_blocks, n_kv, BLOCK, d), float("nan"), dtype=cache_dtype)
    vc = torch.full_like(kc, float("nan"))
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:37]
    slots[5] = -1  # padding token: skipped
    key = torch.randn(37, n_kv, d, generator=gen).to(src_dtype)
    value = torch.randn(37, n_kv, d, generator=gen).to(src_dtype)
    write_kv(kc, vc, key, value, slots)
    expected_k = torch.full_like(kc, float("nan"))
    expected_v = torch.full_like(vc, float("nan"))
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // BLOCK, :, slot % BLOCK] = key[t].to(cache_dtype)
            expected_v[slot // BLOCK, :, slot % BLOCK] = value[t].to(cache_dtype)
    torch.testing.assert_close(kc, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vc, expected_v, rtol=0, atol=0, equal_nan=True)


def test_written_tokens_are_attended_to():
    # decode loop in miniature: append one token per step, attend over everything so far
    n_kv, group, d, num_blocks = 2, 4, 64, 16
    gen = torch.Generator().manual_seed(9)
    kc = torch.zeros(num_blocks, n_kv, BLOCK, d, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[None, :]
    for step in range(40):
        slot = table[0, step // BLOCK].long() * BLOCK + step % BLOCK
        write_kv(kc, vc, torch.randn(1, n_kv, d, generator=gen),
                 torch.randn(1, n_kv, d, generator=gen), slot.view(1))
    lens = torch.tensor([40], dtype=torch.int32)
    query = torch.randn(1, n_kv * group, d, generator=gen)
    out = run_poisoned(query, kc, vc, table, lens, 0.125)
    torch.testing.assert_close(out.double(), fp64_attention(query, kc, vc, table, lens, 0.125),
                               rtol=1e-4, atol=2e-5)


def test_invalid_arguments_raise_value_error():
    query, kc, vc, tables, lens = make_inputs([5, 40], n_kv=2, group=4, d=64, dtype=torch.float32)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(query, kc, vc, tables.long(), lens, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_attention(query, kc, vc, tables.t().contiguous().t(), lens, 0.1)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        paged_decode_attention(query[:, :7].contiguous(), kc, vc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="must match"):
        paged_decode_attention(query, kc, vc.to(torch.bfloat16), tables, lens, 0.1)
    with pytest.raises(ValueError, match="query dtype"):
        paged_decode_attention(query.half(), kc, vc, tables, lens, 0.1)
    bad = tables.clone()
    bad[1, 1] = kc.shape[0]  # block id past the cache
    with pytest.raises(ValueError, match="out of range"):
        paged_decode_attention(query, kc, vc, bad, lens, 0.1)
    with pytest.raises(ValueError, match="out of range"):  # context longer than its table row
        paged_decode_attention(query, kc, vc, tables, lens * 100, 0.1)
    with pytest.raises(ValueError, match="outside the cache"):
        write_kv(kc, vc, torch.zeros(1, 2, 64), torch.zeros(1, 2, 64),
                 torch.tensor([kc.shape[0] * BLOCK]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(kc, vc, torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), torch.tensor([0.0]))
