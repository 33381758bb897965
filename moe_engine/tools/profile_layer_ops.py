"""Times a decoder layer's work outside the GEMMs on the engine's own code and the model's shapes.

The GEMMs are timed per weight shape (profile_hardware.measure_gemms). What runs around them
was a count of operator launches, which is right for a decode step of a few tokens and wrong for
a prefill pass of ~2000: there each norm, RoPE, residual add and the router's softmax/top-k is a
pass over [tokens, hidden], prefill attention is a causal SDPA call and its slicing per prompt
(docs/benchmarks.md, "Default run"), and a decode step's attention call costs several times its
cache reads on a small model. All three are measured here, each at several sizes, by
calling the functions the engine's ModelRunner calls (model/layers.py, model/attention.py) on
tensors of the model's layout, in the activations' dtype the engine would use. Each figure is
the fastest of batches taken in turn with the others' over the whole measurement
(`interleaved_best_times`): these are runs of short parallel regions, which another process on
the machine slows by 2-100x for as long as it runs, and a quiet machine's figure is what the
model is for.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from moe_engine.model.spec import TORCH_GEMM_STORAGE
from moe_engine.perf.specs import ModelSpec, layer_layout
from moe_engine.tools.timing import interleaved_best_times, rotation_copies

# Dense where prompts usually are: SDPA's time per prompt is step-like in the length.
PROMPT_LENGTHS = (8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512, 768, 1024, 2048)
FAST_PROMPT_LENGTHS = (16, 128, 512)
# Tokens of one timed prefill-attention call: a pass of the engine's default token budget.
PASS_TOKENS = 2048


def _best_times(makers: list[Callable[[], Callable[[], None]]], fast: bool) -> list[float]:
    """`interleaved_best_times` with the mode's batch length and rounds."""
    batch, rounds = (0.005, 3) if fast else (0.01, 9)
    return interleaved_best_times(makers, batch, rounds)


def on_packed_kernels(weight_storage: Optional[str]) -> bool:
    """Whether the engine runs a model held in `weight_storage` (ModelSpec.weight_storage) on
    the packed kernels: where they are built, unless it is held for torch's GEMMs
    (engine.gemm=torch: TORCH_GEMM_STORAGE)."""
    from moe_engine.model import packed

    return packed.HAS_PACKED_KERNELS and weight_storage != TORCH_GEMM_STORAGE


def activation_dtype(m: ModelSpec):
    """The engine's activations: fp32 over the packed kernels, else the weights' dtype
    (LLMEngine: act_dtype)."""
    import torch

    return torch.float32 if on_packed_kernels(m.weight_storage) else getattr(torch, m.torch_dtype)


def kv_cache_dtype(m: ModelSpec):
    """The engine's KV cache: the model's dtype (engine.kv_dtype=auto), whatever the GEMMs run
    in; the step's fp32 keys and values are converted as they are written."""
    from moe_engine.model.loader import resolve_dtype

    return resolve_dtype("auto", m)


def _dense_stub(m: ModelSpec, dtype):
    """A layer's dense weights as far as the element-wise parts read them: the norms, q/k
    norms and the attention sinks (the GEMM weights are never multiplied here)."""
    import torch

    from moe_engine.model.weights import DenseLayerWeights

    h = m.hidden_size
    # Qwen3 normalises each head ([head_dim]), OLMoE the whole projection ([q_size], [kv_size]).
    widths = {"head": (m.head_dim, m.head_dim), "projection": (m.q_size, m.kv_size)}
    q_norm = k_norm = None
    if m.qk_norm is not None:
        q_norm, k_norm = (torch.ones(w, dtype=dtype) for w in widths[m.qk_norm])
    return DenseLayerWeights(
        input_norm=torch.ones(h, dtype=dtype), post_norm=torch.ones(h, dtype=dtype),
        wqkv=torch.empty(0), wo=torch.empty(0), q_norm=q_norm, k_norm=k_norm,
        sinks=torch.zeros(m.num_heads, dtype=torch.float32) if m.attention_sinks else None,
        score_correction_bias=(torch.zeros(m.num_experts, dtype=torch.float32)
                               if m.router_score_correction else None))


def measure_layer_ops(m: ModelSpec, tokens: tuple[int, ...], fast: bool) -> list[dict[str, Any]]:
    """Seconds per call, at each token count, of a layer's element-wise work as the ModelRunner
    runs it: before attention the input norm and `qkv_heads` (split, q/k norm, RoPE); after it
    the O projection's residual add, the post norm, `select_experts` on fp32 router logits and
    the FFN's residual add. Positions are a prefill's (0..T-1 folded into the RoPE table)."""
    import torch

    from moe_engine.model.layers import RotaryTable, qkv_heads, rms_norm, select_experts

    dtype = activation_dtype(m)
    dense = _dense_stub(m, dtype)
    rope = RotaryTable(m, max(tokens) + 1, dtype)
    eps = m.rms_norm_eps

    def inputs(n: int) -> dict[str, Any]:
        return {"x": torch.randn(n, m.hidden_size, dtype=dtype),
                "qkv": torch.randn(n, m.qkv_out_features, dtype=dtype),
                "o": torch.randn(n, m.hidden_size, dtype=dtype),
                "ffn_out": torch.randn(n, m.hidden_size, dtype=dtype),
                "logits": torch.randn(n, max(1, m.num_experts), dtype=torch.float32),
                "positions": torch.arange(n, dtype=torch.int64)}

    def pre_maker(n: int) -> Callable[[], Callable[[], None]]:
        def make() -> Callable[[], None]:
            t = inputs(n)
            return lambda: (qkv_heads(t["qkv"], dense, m, rope, t["positions"]),
                            rms_norm(t["x"], dense.input_norm, eps))
        return make

    def post_maker(n: int) -> Callable[[], Callable[[], None]]:
        def make() -> Callable[[], None]:
            t = inputs(n)

            def post() -> None:
                y = t["x"] + t["o"]
                rms_norm(y, dense.post_norm, eps)
                if m.num_experts:
                    select_experts(t["logits"], dtype, m, dense.score_correction_bias)
                y + t["ffn_out"]
            return post
        return make

    makers = [maker(n) for n in tokens for maker in (pre_maker, post_maker)]
    best = _best_times(makers, fast)
    return [{"layout": layer_layout(m), "tokens": n, "pre_attention_us": round(best[2 * i] * 1e6, 3),
             "post_attention_us": round(best[2 * i + 1] * 1e6, 3)} for i, n in enumerate(tokens)]


def measure_prefill_attention(m: ModelSpec, fast: bool) -> list[dict[str, Any]]:
    """Seconds per prompt of the attention a prefill pass runs, at several prompt lengths: a
    pass of PASS_TOKENS tokens in prompts of that length (one prompt when longer) has its K/V
    written into a paged cache and runs `prefill_attention` (one causal SDPA call per prompt,
    sinks and the first layer's window where the model has them); the time is divided by the
    prompt count."""
    import torch

    from moe_engine.model.attention import DecodeAttention, prefill_attention

    dtype = activation_dtype(m)
    kv_dtype = kv_cache_dtype(m)
    dense = _dense_stub(m, dtype)
    heads, d_k, d_v = m.kv_cache_layout
    attention = DecodeAttention("auto", head_dim=d_k, features=m.attention_features)
    block = 16
    lengths = FAST_PROMPT_LENGTHS if fast else PROMPT_LENGTHS

    def maker(p: int) -> Callable[[], Callable[[], None]]:
        def make() -> Callable[[], None]:
            n = max(1, PASS_TOKENS // p)
            t = n * p
            q = torch.randn(t, m.num_heads, m.head_dim, dtype=dtype)
            k = torch.randn(t, m.num_kv_heads, m.head_dim, dtype=dtype)
            v = torch.randn(t, m.num_kv_heads, m.v_head_dim, dtype=dtype)
            nblocks = -(-t // block) + 1
            # The cache is in the model's dtype, as the engine's: the write converts fp32 K/V.
            kc = torch.zeros(nblocks, heads, block, d_k, dtype=kv_dtype)
            vc = torch.zeros(nblocks, heads, block, d_v, dtype=kv_dtype)
            slots = torch.arange(t, dtype=torch.int64)

            def attend() -> None:
                attention.write_kv(kc, vc, k, v, slots)
                prefill_attention(q, k, v, [p] * n, m.attention_scale, sinks=dense.sinks,
                                  window=m.attention_window(0))
            return attend
        return make

    best = _best_times([maker(p) for p in lengths], fast)
    return [{"layout": layer_layout(m), "prompt": p,
             "us_per_prompt": round(sec / max(1, PASS_TOKENS // p) * 1e6, 3)}
            for p, sec in zip(lengths, best)]


# Decode batches the per-call cost of decode attention is timed at (the engine's steps run from
# one sequence to N); the context is one block, so the figure is the call's cost apart from
# streaming the cache, which the KV rate (profile_hardware.measure_attention) prices.
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FAST_DECODE_BATCHES = (1, 16, 256)
DECODE_CONTEXT = 16


def measure_decode_attention(m: ModelSpec, fast: bool) -> list[dict[str, Any]]:
    """Seconds per call of a decode step's attention at several batch sizes, as the ModelRunner
    runs it (`attend`): the new K/V written into the paged cache, the kernel called on each
    sequence's block table (sinks and the first layer's window where the model has them), and
    the query made contiguous and the output sliced into the step's buffer. On a small model the
    call costs several times what its cache reads do."""
    import torch

    from moe_engine.model.attention import DecodeAttention

    dtype = activation_dtype(m)
    kv_dtype = kv_cache_dtype(m)
    dense = _dense_stub(m, dtype)
    heads, d_k, d_v = m.kv_cache_layout
    attention = DecodeAttention("auto", head_dim=d_k, features=m.attention_features)
    block = 16
    blocks_per_seq = -(-DECODE_CONTEXT // block)
    batches = FAST_DECODE_BATCHES if fast else DECODE_BATCHES

    def maker(b: int) -> Callable[[], Callable[[], None]]:
        def make() -> Callable[[], None]:
            q = torch.randn(b, m.num_heads, m.head_dim, dtype=dtype)
            k = torch.randn(b, m.num_kv_heads, m.head_dim, dtype=dtype)
            v = torch.randn(b, m.num_kv_heads, m.v_head_dim, dtype=dtype)
            kc = torch.randn(b * blocks_per_seq, heads, block, d_k, dtype=kv_dtype)
            vc = torch.randn(b * blocks_per_seq, heads, block, d_v, dtype=kv_dtype)
            tables = torch.arange(b * blocks_per_seq, dtype=torch.int32).reshape(b, blocks_per_seq)
            lens = torch.full((b,), DECODE_CONTEXT, dtype=torch.int32)
            slots = torch.arange(b, dtype=torch.int64) * (blocks_per_seq * block) + DECODE_CONTEXT - 1

            def attend() -> None:
                attention.write_kv(kc, vc, k, v, slots)
                out = q.new_empty(b, m.num_heads, d_v)
                out[:] = attention(q.contiguous(), kc, vc, tables, lens, m.attention_scale,
                                   sinks=dense.sinks, window=m.attention_window(0))
            return attend
        return make

    best = _best_times([maker(b) for b in batches], fast)
    return [{"layout": layer_layout(m), "batch": b, "context": DECODE_CONTEXT, "us_per_call": round(sec * 1e6, 3)}
            for b, sec in zip(batches, best)]


def measure_moe_ffn(m: ModelSpec, tokens: tuple[int, ...], fast: bool, cache_bytes: int,
                    max_call_s: float = 0.25) -> list[dict[str, Any]]:
    """Seconds per call of a MoE layer's routed experts at each token count, as the ModelRunner
    runs them (`layers.moe_ffn`: on the packed kernels one fused call over every expert, in the
    storage the engine holds them in), each token routed to top_k distinct experts uniformly
    at random. Copies of the experts are taken in turn until they add up to twice
    `cache_bytes` (the last-level cache), as the GEMMs are profiled: even a model that fits
    the cache finds its experts evicted between steps (the LM head, the KV cache, the step's
    activations and, on a shared machine, other tenants pass through the LLC): tiny-mixtral's
    engine calls took 133 us at 8 tokens, 73 with one copy in the cache, 97 rotated.
    Token counts stop growing once a call takes over `max_call_s` (the model extrapolates the
    affine tail)."""
    import torch

    from moe_engine.model import packed
    from moe_engine.model.layers import moe_ffn
    from moe_engine.model.loader import expert_clamp
    from moe_engine.model.weights import ExpertWeights

    if not m.num_experts:
        return []
    dtype = activation_dtype(m)
    h, inter, e, k = m.hidden_size, m.intermediate_size, m.num_experts, m.top_k
    weight_dtype = getattr(torch, m.torch_dtype)
    storage = m.expert_storage or packed.storage_name(weight_dtype)
    g = torch.Generator().manual_seed(0)

    # GPT-OSS's experts add biases and the clamped activation: a few passes more per expert on
    # every path (on torch's, launches each).
    clamp, bias = expert_clamp(m), m.expert_bias
    packed_path = on_packed_kernels(m.weight_storage)

    def expert() -> ExpertWeights:
        w = ExpertWeights((torch.randn(2 * inter, h, generator=g) * 0.02).to(weight_dtype),
                          (torch.randn(h, inter, generator=g) * 0.02).to(weight_dtype),
                          b13=torch.zeros(2 * inter, dtype=weight_dtype) if bias else None,
                          b2=torch.zeros(h, dtype=weight_dtype) if bias else None, clamp=clamp)
        return packed.pack_expert(w, storage) if packed_path else w.map(lambda t: t.to(dtype))

    copies = rotation_copies(e * m.expert_bytes, cache_bytes, max_copies=64)
    sets = [[expert() for _ in range(e)] for _ in range(copies)]
    rows = []
    for n in tokens:
        turn = [0]
        x = torch.randn(n, h, generator=g).to(dtype)
        idx = torch.rand(n, e, generator=g).argsort(dim=1)[:, :k].contiguous()
        w = torch.softmax(torch.randn(n, k, generator=g), dim=1).to(dtype)

        def make() -> Callable[[], None]:
            def call() -> None:
                turn[0] = (turn[0] + 1) % copies
                moe_ffn(sets[turn[0]], x, w, idx)
            return call

        sec = _best_times([make], fast)[0]
        rows.append({"layout": layer_layout(m), "tokens": n, "us_per_call": round(sec * 1e6, 3)})
        if sec > max_call_s:
            break
    return rows
