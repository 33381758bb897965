"""Model math pieces against transformers: RoPE variants from config, dtype handling."""
from __future__ import annotations

import json

import pytest
import torch

from moe_engine.config import EngineConfig
from moe_engine.engine import LLMEngine
from moe_engine.model.layers import rope_inv_freq
from moe_engine.model.spec import load_spec
from moe_engine.request import Request, SamplingParams


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
])
def test_rope_frequencies_match_transformers(tmp_path, scaling):
    from transformers import MixtralConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 500000.0, "rope_type": "default", **(scaling or {})}
    cfg = MixtralConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, num_hidden_layers=1, vocab_size=32, head_dim=64,
                        max_position_embeddings=16384, rope_parameters=params)
    cfg.save_pretrained(tmp_path)
    spec = load_spec(tmp_path)
    mine, mine_scale = rope_inv_freq(spec.rope, spec.head_dim)
    if scaling is None:
        ref = 1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg)
    torch.testing.assert_close(mine, ref.float(), rtol=1e-6, atol=0)
    assert mine_scale == pytest.approx(ref_scale)


def test_legacy_rope_theta_and_scaling_keys_are_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 10,
        "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "rope_theta": 1e6,
        "rope_scaling": {"type": "linear", "factor": 2.0}}))
    spec = load_spec(tmp_path)
    assert spec.rope.theta == 1e6 and spec.rope.rope_type == "linear" and spec.rope.factor == 2.0
    assert spec.head_dim == 16


def test_bfloat16_engine_tracks_float32_logits(tiny_mixtral_dir):
    logits = {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(tiny_mixtral_dir, EngineConfig(threads=2, kv_cache_gb=0.01), dtype=dtype)
        assert engine.runner.cache.key[0].dtype == getattr(torch, dtype)
        engine.logits_observer = lambda seqs, lg, d=dtype: logits.setdefault(d, lg.clone())
        [r] = engine.generate([Request("a", prompt="Explain the router.",
                                       sampling=SamplingParams(max_new_tokens=3))])
        assert r.status == "ok"
    diff = (logits["float32"] - logits["bfloat16"]).abs().max().item()
    assert diff < 0.1 * logits["float32"].abs().max().item()
