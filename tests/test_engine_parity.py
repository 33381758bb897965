"""Token and logit parity with transformers on the built-in tiny checkpoint of every supported
architecture (fp32)."""
from __future__ import annotations

import dataclasses
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moe_engine.tools.checkpoints as ck
from moe_engine.config import EngineConfig
from moe_engine.engine.llm_engine import LLMEngine
from moe_engine.model.kv_cache import kv_bytes_per_token
from moe_engine.model.loader import load_weights
from moe_engine.model.spec import GB, load_spec
from moe_engine.engine.request import Request, SamplingParams

NEW_TOKENS = 12
# One per supported architecture (test_checkpoints checks that).
TINY_PRESETS = sorted(p for p in ck.PRESETS if p.startswith("tiny-"))
PROMPTS = [
    "Explain how a mixture of experts layer routes tokens.",
    "hi",
    "Write a short story about a cat who learns to fly over the city at night, "
    "with a twist ending that nobody expects and a moral about patience.",
    "What is 2 + 2?",
    "List three uses of a paged key value cache in batch inference systems.",
    "Translate to French: the weather is nice today",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "Why is the sky blue?",
    "Summarize the history of the printing press in two sentences, focusing on its impact "
    "on science, religion and politics in early modern Europe.",
    "Q",
    "Describe bandwidth-bound versus compute-bound kernels.",
    "Give me a recipe for pancakes.",
    "How do I reverse a linked list in Python? Show the code and explain each step.",
]


@pytest.fixture(scope="module", params=TINY_PRESETS)
def model_dir(request, builtin_dir):
    return builtin_dir(request.param)


def _hf_model(model_dir):
    """transformers' model of the checkpoint in fp32; MXFP4 experts dequantized as transformers
    does on a machine without its Triton kernels (exactly: E2M1 times a power of two)."""
    import json

    from transformers import AutoModelForCausalLM, Mxfp4Config

    quant = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config")
    extra = ({"quantization_config": Mxfp4Config(dequantize=True)}
             if quant and quant.get("quant_method") == "mxfp4" else {})
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                **extra).eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(model_dir, EngineConfig(threads=2, kv_cache_gb=0.02,
                                             num_micro_batches=2), dtype="float32")


def _hf_generate(hf_model, tokenizer, prompts) -> dict[str, tuple]:
    """Greedy tokens and per-step logits of transformers' generate, one prompt at a time."""
    refs = {}
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode_prompt(prompt)
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(ids):].tolist()
        refs[str(i)] = (ids, tokens, [lg[0].float() for lg in out.logits])
    return refs


@pytest.fixture(scope="module")
def hf_reference(model_dir, engine):
    return _hf_generate(_hf_model(model_dir), engine.tokenizer, PROMPTS)


def _requests(indices, **sampling):
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, **sampling)
    return [Request(str(i), prompt=PROMPTS[i], sampling=sp) for i in indices]


def _run(engine, requests):
    results = {r.request_id: r for r in engine.generate(requests)}
    assert all(r.status == "ok" for r in results.values()), results
    return results


def _assert_matches(engine, hf_reference, requests) -> None:
    """The engine's greedy tokens equal transformers', and every step's logits are within 1e-4."""
    captured: dict[str, list[torch.Tensor]] = {}

    def observe(seqs, logits):
        for seq, row in zip(seqs, logits):
            captured.setdefault(seq.request_id, []).append(row.clone())

    engine.logits_observer = observe
    try:
        results = _run(engine, requests)
    finally:
        engine.logits_observer = None
    for rid, (ids, tokens, logits) in hf_reference.items():
        assert results[rid].prompt_token_ids == ids
        assert results[rid].token_ids == tokens, rid
        assert len(captured[rid]) == len(logits)
        for step, (mine, ref) in enumerate(zip(captured[rid], logits)):
            diff = (mine - ref).abs().max().item()
            assert diff <= 1e-4, f"request {rid} step {step}: max |logit diff| {diff}"


def test_greedy_tokens_and_step_logits_match_transformers(engine, hf_reference):
    assert len(PROMPTS) >= 12
    assert len({len(ids) for ids, _, _ in hf_reference.values()}) >= 8  # varied lengths
    _assert_matches(engine, hf_reference, _requests(range(len(PROMPTS))))


def test_same_tokens_alone_and_in_another_batch(engine, hf_reference):
    alone = _run(engine, _requests([2]))
    other = _run(engine, _requests([2, 5, 9, 0, 11]))
    assert alone["2"].token_ids == other["2"].token_ids == hf_reference["2"][1]
    assert other["9"].token_ids == hf_reference["9"][1]


def test_same_tokens_when_kv_budget_forces_preemption(model_dir, hf_reference):
    spec = load_spec(model_dir)
    block_size = 4
    longest = max(len(ids) for ids, _, _ in hf_reference.values()) + NEW_TOKENS
    num_blocks = (longest + block_size - 1) // block_size + 6  # room for ~2 sequences
    budget = num_blocks * block_size * kv_bytes_per_token(spec, torch.float32) / GB
    windowed = spec.num_windowed_layers
    if 0 < windowed < spec.num_layers:
        # GPT-OSS: the windowed layers' pool takes half the budget (kv_pool_blocks), the full
        # layers num_blocks of the other half.
        full = spec.num_layers - windowed
        budget = 2 * num_blocks * block_size * full * spec.kv_bytes_per_token_layer / GB
    small = LLMEngine(model_dir, EngineConfig(threads=2, kv_cache_gb=budget,
                                              block_size=block_size), dtype="float32")
    assert small.allocator.num_blocks == num_blocks
    results = _run(small, _requests(range(len(PROMPTS))))
    assert small.stats.preemptions > 0
    assert small.stats.kv_blocks_high_water <= num_blocks
    if small.window_pool is not None:
        assert small.window_pool.allocator.high_water <= small.window_blocks
    for rid, (_, tokens, _) in hf_reference.items():
        assert results[rid].token_ids == tokens, rid


def test_sliding_layers_hold_only_the_window_of_a_long_generation(builtin_dir):
    """GPT-OSS's windowed layers keep the blocks of the last `window` positions only: over 40
    new tokens a sequence never holds more than window_blocks_per_sequence of them (blocks
    leaving the window are freed and reused by the same and other sequences), and the tokens
    and logits stay transformers'."""
    model_dir = builtin_dir("tiny-gpt-oss")
    spec = load_spec(model_dir)
    engine = LLMEngine(model_dir, EngineConfig(threads=2, kv_cache_gb=0.02, block_size=4),
                       dtype="float32")
    indices = [2, 8, 1]
    new_tokens = 40
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys.modules[__name__], "NEW_TOKENS", new_tokens)
        reference = _hf_generate(_hf_model(model_dir), engine.tokenizer,
                                 [PROMPTS[i] for i in indices])
        reference = {str(i): reference[str(k)] for k, i in enumerate(indices)}
        assert all(len(tokens) == new_tokens for _, tokens, _ in reference.values())
        _assert_matches(engine, reference, _requests(indices))
    per_seq = spec.window_blocks_per_sequence(4)
    assert engine.window_pool.allocator.high_water <= len(indices) * per_seq
    longest = max(len(ids) for ids, _, _ in reference.values()) + new_tokens
    assert engine.allocator.high_water >= longest // 4  # the full layers keep everything
    assert engine.window_pool.allocator.num_used == 0  # all returned at the end


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = dict(temperature=0.9, top_p=0.95, top_k=50)
    reqs = [Request(str(i), prompt=PROMPTS[i], sampling=SamplingParams(
        max_new_tokens=NEW_TOKENS, seed=100 + i, **params)) for i in range(6)]
    first = _run(engine, reqs)
    second = _run(engine, reqs)
    alone = _run(engine, [reqs[3]])
    assert {k: v.token_ids for k, v in first.items()} == {k: v.token_ids for k, v in second.items()}
    assert alone["3"].token_ids == first["3"].token_ids
    reseeded = _run(engine, [Request("3", prompt=PROMPTS[3], sampling=SamplingParams(
        max_new_tokens=NEW_TOKENS, seed=999, **params))])
    assert reseeded["3"].token_ids != first["3"].token_ids


def test_sharded_checkpoint_loads_the_same_weights(tiny_mixtral_dir, tiny_mixtral_sharded_dir):
    spec = load_spec(tiny_mixtral_dir)
    a = load_weights(tiny_mixtral_dir, spec, torch.float32)
    b = load_weights(tiny_mixtral_sharded_dir, spec, torch.float32)
    assert len(list(Path(tiny_mixtral_sharded_dir).glob("*.safetensors"))) == 2
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.dense.wqkv, lb.dense.wqkv)
        assert all(torch.equal(x.w13, y.w13) and torch.equal(x.w2, y.w2)
                   for x, y in zip(la.experts, lb.experts))


_EXPERT_TENSOR = re.compile(
    r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_PROJECTION = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
               "down_proj": "down"}


def test_fused_expert_layout_of_transformers5_loads_the_same(model_dir, tmp_path):
    """Checkpoints saved with the in-memory names (mlp.experts.gate_up_proj) load identically."""
    src = Path(model_dir)
    if load_spec(src).model_type in ("gpt_oss", "llama4_text"):
        pytest.skip("GPT-OSS and Llama-4 checkpoints only exist in the fused layout (the built "
                    "one is)")
    state = load_file(str(src / "model.safetensors"))
    spec = load_spec(src)
    fused, experts = {}, {}
    for name, t in state.items():
        m = _EXPERT_TENSOR.fullmatch(name)
        if m:
            experts.setdefault(int(m[1]), {})[(_PROJECTION[m[3]], int(m[2]))] = t
        else:
            fused[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = t
    for layer, w in experts.items():
        def stack(proj):
            return torch.stack([w[(proj, e)] for e in range(spec.num_experts)])

        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat(
            [stack("gate"), stack("up")], dim=1)
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = stack("down")
    assert len(experts) == spec.num_layers - len(spec.dense_layers)
    save_file(fused, str(tmp_path / "model.safetensors"))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    a = load_weights(src, spec, torch.float32)
    b = load_weights(tmp_path, spec, torch.float32)
    for la, lb in zip(a.layers, b.layers):
        assert all(torch.equal(x, y) for x, y in zip(la.dense.tensors(), lb.dense.tensors()))
        assert len(la.experts) == len(lb.experts)
        assert all(torch.equal(x.w13, y.w13) and torch.equal(x.w2, y.w2)
                   for x, y in zip(la.experts, lb.experts))


@pytest.mark.parametrize("preset", ["tiny-glm4-moe", "tiny-deepseek-v3"])
def test_multi_token_prediction_layer_past_the_last_layer_is_not_loaded(preset, builtin_dir,
                                                                        tmp_path):
    """GLM-4.5 and DeepSeek-V3 checkpoints carry an MTP module as
    model.layers.<num_hidden_layers>.* (a whole MoE layer plus eh_proj/enorm/hnorm); generation
    never runs it, so it is never read."""
    src = builtin_dir(preset)
    spec = load_spec(src)
    state = load_file(str(src / "model.safetensors"))
    last, mtp = f"model.layers.{spec.num_layers - 1}.", f"model.layers.{spec.num_layers}."
    extra = {mtp + name[len(last):]: t.clone() for name, t in state.items() if name.startswith(last)}
    extra[mtp + "eh_proj.weight"] = torch.zeros(spec.hidden_size, 2 * spec.hidden_size)
    extra[mtp + "enorm.weight"] = torch.ones(spec.hidden_size)
    _assert_extra_tensors_are_not_read(src, state, extra, tmp_path)


def _assert_extra_tensors_are_not_read(src: Path, state: dict, extra: dict, tmp_path) -> None:
    """The checkpoint `src` (tensors `state`) saved again with `extra` beside them loads the
    same weights."""
    spec = load_spec(src)
    save_file({**state, **extra}, str(tmp_path / "model.safetensors"))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    a, b = load_weights(src, spec, torch.float32), load_weights(tmp_path, spec, torch.float32)
    assert len(b.layers) == spec.num_layers
    for la, lb in zip(a.layers, b.layers):
        assert all(torch.equal(x, y) for x, y in zip(la.dense.tensors(), lb.dense.tensors()))
        assert all(torch.equal(x.w13, y.w13) and torch.equal(x.w2, y.w2)
                   for x, y in zip(la.experts, lb.experts))


def test_ernie_multi_token_prediction_tensors_are_not_loaded(builtin_dir, tmp_path):
    """ERNIE-4.5 checkpoints carry their MTP module as model.mtp_block.0.* (a whole MoE layer),
    mtp_emb_norm, mtp_hidden_norm and mtp_linear_proj; transformers ignores every "mtp" key,
    and so does the loader."""
    src = builtin_dir("tiny-ernie45-moe")
    spec = load_spec(src)
    state = load_file(str(src / "model.safetensors"))
    last = f"model.layers.{spec.num_layers - 2}."  # a MoE layer
    extra = {"model.mtp_block.0." + name[len(last):]: t.clone()
             for name, t in state.items() if name.startswith(last)}
    h = spec.hidden_size
    extra.update({"model.mtp_emb_norm.0.weight": torch.ones(h),
                  "model.mtp_hidden_norm.0.weight": torch.ones(h),
                  "model.mtp_linear_proj.0.weight": torch.zeros(h, 2 * h)})
    _assert_extra_tensors_are_not_read(src, state, extra, tmp_path)


# Flags the tiny presets leave at their hub values, switched: Qwen3 with q/k/v/o biases and
# decoder_sparse_step=2 (layer 0 dense), OLMoE with clip_qkv low enough to clip and with
# q/k/v/o biases, Qwen2-MoE without its q/k/v biases (qkv_bias false), GLM-4.5 as GLM-4.5-Air
# sets it (no q/k norm, one expert group, no routed scaling) and with a quarter of each head
# rotated, two dense layers and no q/k/v biases. Each with the spec fields the config must set.
VARIANTS = {
    "qwen3-bias-sparse-step": ("tiny-qwen3-moe", dict(attention_bias=True, decoder_sparse_step=2),
                               dict(qkv_bias=True, o_bias=True, dense_layers=(0,))),
    "olmoe-clip-qkv": ("tiny-olmoe", dict(clip_qkv=1.5), dict(clip_qkv=1.5)),
    "olmoe-attention-bias": ("tiny-olmoe", dict(attention_bias=True), dict(qkv_bias=True, o_bias=True)),
    "qwen2-moe-no-qkv-bias": ("tiny-qwen2-moe", dict(attention_bias=False),
                              dict(qkv_bias=False, o_bias=False)),
    "glm4-moe-air-like": ("tiny-glm4-moe",
                          dict(qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0),
                          dict(qk_norm=None, router_groups=1, routed_scaling_factor=1.0)),
    "glm4-moe-quarter-rotary-two-dense": (
        "tiny-glm4-moe", dict(partial_rotary_factor=0.25, first_k_dense_replace=2,
                              attention_bias=False),
        dict(rotary_dim=8, dense_layers=(0, 1), qkv_bias=False)),
    # GPT-OSS with a clamp the activations reach (7.0 never binds on these weights), every
    # layer windowed (window 5), no attention biases and a truncated YaRN; and with no
    # windowed layer and no RoPE keys (GptOssConfig's own YaRN then, which the engine fills in).
    "gpt-oss-tight-clamp-all-windowed": (
        "tiny-gpt-oss", dict(swiglu_limit=0.3, sliding_window=5, sliding_layers=(0, 1, 2),
                             attention_bias=False,
                             rope_scaling=(("rope_type", "yarn"), ("factor", 8.0),
                                           ("original_max_position_embeddings", 64))),
        dict(swiglu_limit=0.3, sliding_window=5, num_windowed_layers=3, qkv_bias=False,
             o_bias=False)),
    "gpt-oss-full-attention": ("tiny-gpt-oss", dict(sliding_layers=(), rope_scaling=None),
                               dict(num_windowed_layers=0, sliding_window=None)),
    # DeepSeek-V3 with a full q projection, two dense layers, a wider latent and rope key and
    # value heads wider than the nope part; DeepSeek-V2 with a low-rank q and V2-Lite's greedy
    # router (one group).
    "deepseek-v3-full-q-wide-latent-two-dense": (
        "tiny-deepseek-v3", dict(q_lora_rank=None, first_k_dense_replace=2, kv_lora_rank=48,
                                 qk_rope_head_dim=16, v_head_dim=24),
        dict(dense_layers=(0, 1), head_dim=32, v_head_dim=24, rotary_dim=16)),
    "deepseek-v2-low-rank-q-greedy": (
        "tiny-deepseek-v2", dict(q_lora_rank=24, n_group=1, topk_group=1),
        dict(router_groups=1, router_topk_groups=1)),
    # ERNIE-4.5 with its LM head tied to the embedding (no lm_head tensor, as the hub's) and
    # MoE layers every second layer up to the last (moe_layer_interval 2, end index -1); and
    # with every layer but the last MoE and a moe_norm_min above every sum of top-k softmax
    # scores (so the floor divides).
    "ernie45-moe-tied-interval-2": (
        "tiny-ernie45-moe", dict(tie_word_embeddings=True, decoder_sparse_step=2,
                                 last_moe_layer=-1),
        dict(tie_word_embeddings=True, dense_layers=(0, 2))),
    "ernie45-moe-norm-floor": (
        "tiny-ernie45-moe", dict(moe_norm_min=2.0, first_k_dense_replace=0),
        dict(router_norm_min=2.0, dense_layers=(3,))),
    # Llama-4 with top-2 routing (each chosen expert on its own scaled input, the outputs
    # summed), every layer MoE (Scout's interleaving), an explicit no_rope_layers making a dense
    # and a MoE layer NoPE, q/k/v/o biases; and as Maverick sets it, no q/k norm, with the
    # default RoPE.
    "llama4-top2-every-layer-moe-nope-0-3-bias": (
        "tiny-llama4", dict(num_experts_per_tok=2, decoder_sparse_step=1,
                            no_rope_layers=(0, 1, 1, 0), attention_bias=True),
        dict(top_k=2, dense_layers=(), nope_layers=(0, 3), qkv_bias=True, o_bias=True)),
    "llama4-no-qk-norm-default-rope": (
        "tiny-llama4", dict(qk_norm=False, rope_scaling=None),
        dict(qk_l2_norm=False, nope_layers=(3,))),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_architecture_flags_match_transformers(variant, tmp_path):
    base, changes, expected = VARIANTS[variant]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ck.PRESETS, variant, dataclasses.replace(ck.PRESETS[base], **changes))
        model_dir = ck.build_checkpoint(variant, tmp_path / variant, seed=0)
    spec = load_spec(model_dir)
    assert {k: getattr(spec, k) for k in expected} == expected
    engine = LLMEngine(model_dir, EngineConfig(threads=2, kv_cache_gb=0.01), dtype="float32")
    indices = [0, 1, 6]
    reference = _hf_generate(_hf_model(model_dir), engine.tokenizer, [PROMPTS[i] for i in indices])
    reference = {str(i): reference[str(k)] for k, i in enumerate(indices)}
    _assert_matches(engine, reference, _requests(indices))


def _llama4_multimodal_copy(src: Path, out: Path) -> Path:
    """tiny-llama4 as the released Llama4ForConditionalGeneration checkpoints hold a text
    model: its config under text_config, its tensors under language_model., beside vision
    tensors and keys the engine must not read."""
    import json

    out.mkdir()
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    text = json.loads((src / "config.json").read_text())
    del text["architectures"]
    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
              "text_config": text, "torch_dtype": "float32", "image_token_index": 200092,
              "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 8,
                                "num_hidden_layers": 1}}
    (out / "config.json").write_text(json.dumps(config))
    text_state = load_file(str(src / "model.safetensors"))
    state = {"language_model." + name: t for name, t in text_state.items()}
    state["vision_model.patch_embedding.linear.weight"] = torch.ones(8, 12)
    state["multi_modal_projector.linear_1.weight"] = torch.ones(64, 8)
    save_file(state, str(out / "model.safetensors"))
    return out


def test_llama4_multimodal_checkpoint_runs_its_text_model(builtin_dir, tmp_path):
    """Llama4ForConditionalGeneration (how Scout and Maverick are released): the text config
    and language_model.* tensors load as the text model's; the vision ones are never read."""
    src = builtin_dir("tiny-llama4")
    multimodal = _llama4_multimodal_copy(src, tmp_path / "multimodal")
    text_spec, spec = load_spec(src), load_spec(multimodal)
    assert spec.architecture == "Llama4ForConditionalGeneration"
    assert dataclasses.replace(spec, architecture=text_spec.architecture,
                               name=text_spec.name) == text_spec
    a = load_weights(src, text_spec, torch.float32)
    b = load_weights(multimodal, spec, torch.float32)
    assert torch.equal(a.lm_head, b.lm_head) and torch.equal(a.embed, b.embed)
    for la, lb in zip(a.layers, b.layers):
        assert all(torch.equal(x, y) for x, y in zip(la.dense.tensors(), lb.dense.tensors()))
        assert all(torch.equal(x.w13, y.w13) and torch.equal(x.w2, y.w2)
                   for x, y in zip(la.experts, lb.experts))
    engine = LLMEngine(multimodal, EngineConfig(threads=2, kv_cache_gb=0.01), dtype="float32")
    indices = [2, 3]
    reference = _hf_generate(_hf_model(src), engine.tokenizer, [PROMPTS[i] for i in indices])
    _assert_matches(engine, {str(i): reference[str(k)] for k, i in enumerate(indices)},
                    _requests(indices))


def test_llama4_context_is_capped_at_the_attention_chunk(tmp_path):
    """Within one chunk, chunked attention is causal attention: the engine caps the context at
    attention_chunk_size (the RoPE layers' chunk), matches transformers up to it, and refuses a
    prompt that would reach past it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ck.PRESETS, "llama4-chunk-24",
                   dataclasses.replace(ck.PRESETS["tiny-llama4"], attention_chunk_size=24))
        model_dir = ck.build_checkpoint("llama4-chunk-24", tmp_path / "chunk", seed=0)
    spec = load_spec(model_dir)
    assert spec.attention_chunk_size == 24 and spec.max_position_embeddings == 24
    engine = LLMEngine(model_dir, EngineConfig(threads=2, kv_cache_gb=0.01), dtype="float32")
    assert engine.max_model_len == 24
    short = [3]  # 8 tokens: 20 with its new ones, inside the chunk
    reference = _hf_generate(_hf_model(model_dir), engine.tokenizer, [PROMPTS[3]])
    _assert_matches(engine, {"3": reference["0"]}, _requests(short))
    [long] = engine.generate(_requests([2]))  # 36 tokens
    assert long.status == "rejected" and "context limit is 24" in long.error
