"""Built-in checkpoints: deterministic bytes, HF-loadable, sharded form, tokenizer behaviour."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moe_engine.io import atomic_path
from moe_engine.tools.checkpoints import (INDEX_NAME, PRESETS, build_checkpoint, ensure_builtin,
                                    generate_state_dict)
from moe_engine.tools.presets import builtin_model_key
from moe_engine.model.arch import ARCHITECTURES
from moe_engine.model.spec import load_spec
from moe_engine.engine.tokenizer import load_tokenizer
from moe_engine.tools.build_tokenizer import corpus_texts

REPO = Path(__file__).resolve().parent.parent
TINY_PRESETS = sorted(p for p in PRESETS if p.startswith("tiny-"))
EXPECTED_FILES = {"config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "builtin.json"}


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_same_seed_gives_identical_bytes(tiny_mixtral_dir, tmp_path):
    again = build_checkpoint("tiny-mixtral", tmp_path / "again", seed=0)
    assert _file_bytes(again) == _file_bytes(tiny_mixtral_dir)


def test_other_seed_changes_weights_not_tokenizer(tiny_mixtral_dir, tmp_path):
    other = build_checkpoint("tiny-mixtral", tmp_path / "other", seed=1)
    a, b = _file_bytes(tiny_mixtral_dir), _file_bytes(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_directory_has_hf_layout(tiny_mixtral_dir):
    names = {p.name for p in tiny_mixtral_dir.iterdir()}
    assert EXPECTED_FILES | {"model.safetensors"} <= names
    config = json.loads((tiny_mixtral_dir / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["num_local_experts"] == 8 and config["num_experts_per_tok"] == 2
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    size_mb = (tiny_mixtral_dir / "model.safetensors").stat().st_size / 2**20
    assert size_mb < 16, f"tiny checkpoint should be a few MB, is {size_mb:.1f} MB"


def test_every_architecture_has_one_tiny_preset():
    """One float preset per architecture (and quantized variants of some: GPT-OSS's MXFP4).
    A multimodal architecture read as its text model (Llama4ForConditionalGeneration) is the
    text architecture's preset in another layout (tests/test_engine_parity.py loads it)."""
    tiny = [PRESETS[p].architecture for p in TINY_PRESETS if not PRESETS[p].expert_quantization]
    assert sorted(tiny) == sorted(a for a, arch in ARCHITECTURES.items() if not arch.text_config)


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_transformers_loads_every_tensor(builtin_dir, preset):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model_dir = builtin_dir(preset)
    quantized = PRESETS[preset].expert_quantization is not None
    # MXFP4 experts load dequantized on a machine without transformers' Triton kernels
    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if quantized else {}
    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), output_loading_info=True,
                                                       **extra)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == PRESETS[preset].architecture
    assert model.dtype == torch.float32
    # The loaded weights are the generated ones (not a fresh random init that happens to load).
    state = generate_state_dict(PRESETS[preset], seed=0,
                                text_vocab=load_tokenizer(model_dir).hf.vocab_size)
    # state_dict: GLM-4.5's e_score_correction_bias is a (persistent) buffer, not a parameter
    stored = (load_spec(model_dir).total_params if quantized  # codes pack two to a byte
              else sum(t.numel() for t in state.values()))
    assert sum(t.numel() for t in model.state_dict().values()) == stored
    torch.testing.assert_close(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    torch.testing.assert_close(model.lm_head.weight, state["lm_head.weight"])
    size_mb = (model_dir / "model.safetensors").stat().st_size / 2**20
    assert size_mb < 16, f"tiny checkpoint should be a few MB, is {size_mb:.1f} MB"


def test_tiny_presets_have_their_architecture_features(builtin_dir):
    qwen2 = load_spec(builtin_dir("tiny-qwen2-moe"))
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.norm_topk_prob
    assert qwen2.shared_expert_intermediate_size > 0 and qwen2.dense_layers == (1,)
    qwen3 = load_spec(builtin_dir("tiny-qwen3-moe"))
    assert qwen3.qk_norm == "head" and qwen3.norm_topk_prob and not qwen3.qkv_bias
    assert qwen3.q_size != qwen3.hidden_size  # head_dim comes from the config
    olmoe = load_spec(builtin_dir("tiny-olmoe"))
    assert olmoe.qk_norm == "projection" and not olmoe.norm_topk_prob
    assert (olmoe.num_experts, olmoe.top_k) == (64, 8)
    glm = load_spec(builtin_dir("tiny-glm4-moe"))
    assert glm.dense_layers == (0,) and glm.qk_norm == "head" and glm.qkv_bias and not glm.o_bias
    assert glm.rotary_dim == glm.head_dim // 2 and glm.norm_topk_prob
    assert glm.shared_expert_intermediate_size == glm.intermediate_size
    assert not glm.shared_expert_gate
    assert (glm.router_scoring, glm.router_score_correction, glm.router_logits_fp32) == \
        ("sigmoid", True, True)
    assert 1 < glm.router_topk_groups < glm.router_groups and glm.routed_scaling_factor != 1.0
    oss = load_spec(builtin_dir("tiny-gpt-oss"))
    assert oss.attention_sinks and oss.router_bias and oss.expert_bias and oss.qkv_bias and oss.o_bias
    assert oss.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert oss.sliding_window == 8 and oss.attention_window(1) is None
    assert (oss.router_scoring, oss.expert_activation) == ("topk_softmax", "clamped_swiglu")
    assert (oss.rope.rope_type, oss.rope.truncate) == ("yarn", False)
    v3 = load_spec(builtin_dir("tiny-deepseek-v3"))
    assert v3.mla.q_lora_rank and v3.rope_interleave and v3.dense_layers == (0,)
    assert (v3.router_scoring, v3.router_score_correction, v3.router_group_score) == \
        ("sigmoid", True, "top2_sum")
    assert v3.router_groups > v3.router_topk_groups and v3.routed_scaling_factor != 1.0
    v2 = load_spec(builtin_dir("tiny-deepseek-v2"))
    assert v2.mla.q_lora_rank is None and v2.rope_interleave and not v2.norm_topk_prob
    assert (v2.router_scoring, v2.router_score_correction, v2.router_group_score) == \
        ("softmax", False, "max")
    assert v2.router_groups > v2.router_topk_groups and v2.routed_scaling_factor != 1.0
    ernie = load_spec(builtin_dir("tiny-ernie45-moe"))
    assert ernie.dense_layers == (0, 3) and ernie.rope_interleave and ernie.rope.theta == 5e5
    assert ernie.shared_expert_intermediate_size == 2 * ernie.intermediate_size
    assert (ernie.router_scoring, ernie.router_score_correction, ernie.router_logits_fp32,
            ernie.router_weights_fp32, ernie.router_norm_min) == ("softmax", True, True, False, 1e-12)
    assert not ernie.shared_expert_gate and ernie.norm_topk_prob and not ernie.qkv_bias
    for mla in (v3, v2):
        assert mla.shared_expert_intermediate_size == mla.intermediate_size
        assert mla.head_dim == mla.mla.qk_nope_head_dim + mla.mla.qk_rope_head_dim


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_performance_model_counts_the_tiny_checkpoint(builtin_dir, preset):
    from moe_engine.perf import ModelSpec as PerfSpec

    model_dir = builtin_dir(preset)
    spec = load_spec(model_dir)
    # One spec: the performance model reads the checkpoint exactly as the engine does.
    assert PerfSpec.from_hf_config(model_dir) == spec and spec.dtype_bytes == 4
    assert spec.num_moe_layers == spec.num_layers - len(spec.dense_layers)
    state = generate_state_dict(PRESETS[preset], seed=0,
                                text_vocab=PRESETS[preset].tokenizer_vocab_size)
    # bytes as stored (MXFP4 experts: codes and scales at 4.25 bits a weight)
    assert spec.total_bytes == sum(t.nbytes for t in state.values())
    if spec.expert_storage is None:
        assert spec.total_params == sum(t.numel() for t in state.values())
    moe_layers = [i for i in range(spec.num_layers) if PRESETS[preset].is_moe_layer(i)]
    assert moe_layers == [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]


def test_sharded_checkpoint_loads_with_same_logits(tiny_mixtral_dir, tiny_mixtral_sharded_dir):
    from transformers import AutoModelForCausalLM

    index = json.loads((tiny_mixtral_sharded_dir / INDEX_NAME).read_text())
    files = set(index["weight_map"].values())
    assert len(files) == 2 and all((tiny_mixtral_sharded_dir / f).exists() for f in files)
    assert not (tiny_mixtral_sharded_dir / "model.safetensors").exists()
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    single = AutoModelForCausalLM.from_pretrained(str(tiny_mixtral_dir))
    sharded = AutoModelForCausalLM.from_pretrained(str(tiny_mixtral_sharded_dir))
    with torch.no_grad():
        torch.testing.assert_close(single(ids).logits, sharded(ids).logits, rtol=0, atol=0)


def test_vocab_padding_rows_are_zero():
    preset = replace(PRESETS["tiny-mixtral"], vocab_size=512, hidden_size=32, intermediate_size=16,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    state = generate_state_dict(preset, seed=0, text_vocab=300)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.count_nonzero(state[name][300:]) == 0
        assert torch.count_nonzero(state[name][:300]) == 300 * 32
    with pytest.raises(ValueError, match="more than vocab_size"):
        generate_state_dict(preset, seed=0, text_vocab=600)


def test_unknown_preset_is_named(tmp_path):
    with pytest.raises(ValueError, match="giant"):
        build_checkpoint("giant", tmp_path / "x")


def test_ensure_builtin_reuses_the_folder_keyed_by_preset_and_seed(tmp_path):
    first = ensure_builtin("tiny-mixtral", tmp_path, seed=3)
    assert first.name.startswith("tiny-mixtral-seed3-")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin("tiny-mixtral", tmp_path, seed=3) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    other = ensure_builtin("tiny-mixtral", tmp_path, seed=4)
    # Another seed is another folder: the first build stays as it was.
    assert other != first and json.loads((other / "builtin.json").read_text())["seed"] == 4
    assert json.loads((first / "builtin.json").read_text())["seed"] == 3
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_model_key_changes_with_the_preset_definition_only(monkeypatch):
    key = builtin_model_key("tiny-mixtral", 0)
    assert key == builtin_model_key("tiny-mixtral", 0)
    assert key != builtin_model_key("tiny-mixtral", 1) != builtin_model_key("tiny-mixtral", 0, 2)
    monkeypatch.setitem(PRESETS, "tiny-mixtral", replace(PRESETS["tiny-mixtral"], num_hidden_layers=3))
    assert builtin_model_key("tiny-mixtral", 0) != key


def test_concurrent_builds_of_one_checkpoint_both_succeed(tiny_mixtral_dir, tmp_path):
    out = tmp_path / "models" / builtin_model_key("tiny-mixtral", 0)
    cmd = [sys.executable, "-m", "moe_engine.cli", "prepare-model", "--preset", "tiny-mixtral",
           "--seed", "0", "--out", str(out)]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert _file_bytes(out) == _file_bytes(tiny_mixtral_dir)
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporary left


def test_a_finished_copy_is_kept_when_a_second_writer_completes(tmp_path):
    """The race the concurrent builds hit, in order: B finishes after A renamed its copy."""
    out = tmp_path / "model"
    with atomic_path(out, keep_existing=True) as tmp:
        tmp.mkdir()
        (tmp / "f").write_text("B")
        out.mkdir()
        (out / "f").write_text("A")  # A finished first; a reader may be loading it now
        inode = (out / "f").stat().st_ino
    assert (out / "f").read_text() == "A" and (out / "f").stat().st_ino == inode
    assert not tmp.exists()
    with atomic_path(out) as tmp:  # without keep_existing the new copy replaces it
        tmp.mkdir()
        (tmp / "f").write_text("C")
    assert (out / "f").read_text() == "C"


@pytest.mark.parametrize("text", [
    "Plain English prompt, with punctuation!",
    "def add(a, b):\n    return a + b\n",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e \u2014 \u6771\u4eac\u306e\u5929\u6c17 \U0001f680",
    "  leading and trailing spaces  ",
    "word " * 200,
])
def test_tokenizer_round_trips_text(tiny_mixtral_dir, text):
    tok = load_tokenizer(tiny_mixtral_dir)
    ids = tok.encode_prompt(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == text


def test_transformers_autotokenizer_matches(tiny_mixtral_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_mixtral_dir))
    tok = load_tokenizer(tiny_mixtral_dir)
    text = "How many experts does Mixtral route each token to?"
    assert hf(text)["input_ids"] == tok.encode_prompt(text)
    assert tok.eos_token_ids == {2} and hf.eos_token == "</s>"


def test_chat_template_renders_mixtral_format(tiny_mixtral_dir):
    tok = load_tokenizer(tiny_mixtral_dir)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"}]
    rendered = tok.hf.decode(tok.encode_messages(messages))
    assert rendered == "<s>[INST] Be brief.\n\nHi [/INST] Hello.</s>[INST] Bye [/INST]"
    with pytest.raises(Exception, match="unsupported chat role"):
        tok.encode_messages([{"role": "tool", "content": "x"}])


def test_bundled_corpus_lengths_resemble_mtbench(tiny_mixtral_dir):
    from moe_engine.tools.build_tokenizer import DATA_DIR

    tok = load_tokenizer(tiny_mixtral_dir)
    lengths = []
    with open(DATA_DIR / "sample_prompts.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert len(rows) >= 300
    assert any("messages" in r for r in rows) and any("prompt" in r for r in rows)
    for row in rows:
        ids = tok.encode_messages(row["messages"]) if "messages" in row else tok.encode_prompt(row["prompt"])
        lengths.append(len(ids))
    mean = sum(lengths) / len(lengths)
    assert 75 <= mean <= 105, f"mean prompt length {mean:.1f} tokens"
    assert 300 <= max(lengths) <= 480, f"max prompt length {max(lengths)} tokens"


def test_corpus_texts_reads_prompts_messages_and_openai_bodies(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "a"}, {"messages": [{"role": "user", "content": "b"}]},
        {"custom_id": "x", "body": {"messages": [{"role": "user", "content": "c"}]}}]) + "\n\n")
    assert list(corpus_texts([path])) == ["a", "b", "c"]
