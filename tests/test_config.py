"""The Hydra config tree: defaults compose, overrides apply, and errors name the key."""
from __future__ import annotations

import pytest

from moe_engine.tools.presets import PRESETS
from moe_engine.config import (AppConfig, ConfigError, DeviceKind, compose, load_resolved, parse_overrides,
                               save_resolved, save_resolved_if_changed)


def test_default_config_composes_to_typed_schema():
    cfg = compose()
    assert isinstance(cfg, AppConfig)
    assert cfg.model.builtin == "tiny-mixtral"
    assert cfg.hardware.device is DeviceKind.cpu
    assert cfg.workload.inputs == ["data/sample_prompts.jsonl"]


def test_overrides_string_is_split_like_a_shell():
    cfg = compose('model=small-mixtral engine.kv_cache_gb=2.5 "workload.stop=[\'END\',\'STOP\']"')
    assert cfg.model.builtin == "small-mixtral"
    assert cfg.engine.kv_cache_gb == 2.5
    assert cfg.workload.stop == ["END", "STOP"]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_builtin_preset_is_a_model_option(preset):
    cfg = compose(f"model={preset}")
    assert cfg.model.builtin == cfg.model.name == preset and cfg.model.path is None


@pytest.mark.parametrize("override, key", [
    ("engine.bogus=1", "engine.bogus"),
    ("engine.block_size=abc", "engine.block_size"),
    ("engine.backend=tpu", "engine.backend"),
    ("workload.max_new_tokens=1.5x", "workload.max_new_tokens"),
    ("engine.kv_cache_gb=-1", "engine.kv_cache_gb"),
    ("engine.block_size=12", "engine.block_size"),
    ("engine.resident_ratio=1.5", "engine.resident_ratio"),
    ("engine.packet_mb=0", "engine.packet_mb"),
    ("engine.device_memory_gb=-2", "engine.device_memory_gb"),
    ("engine.group_ffn=expert", "engine.group_ffn"),
    ("engine.backend=cuda engine.emulated_link_gbps=8", "engine.emulated_link_gbps"),
    ("workload.top_p=0", "workload.top_p"),
    ("model.builtin=giant-mixtral", "model.builtin"),
    ("model=hf", "model.path"),
    ("model=no-such-group-option", "model/no-such-group-option"),
])
def test_bad_override_fails_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        compose(override)
    assert key in str(err.value)


def test_real_checkpoint_path_is_accepted(tiny_mixtral_dir):
    cfg = compose(f"model=hf model.path={tiny_mixtral_dir}")
    assert cfg.model.builtin is None and cfg.model.path == str(tiny_mixtral_dir)
    assert cfg.model_dir == tiny_mixtral_dir


def test_missing_checkpoint_dir_fails_when_composed(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path=.*no such checkpoint directory"):
        compose(f"model=hf model.path={tmp_path / 'nope'}")


def test_checkpoint_without_config_json_fails_when_composed(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"model.path=.*no config.json"):
        compose(f"model=hf model.path={tmp_path}")


def test_pickle_only_checkpoint_fails_when_composed(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ConfigError, match=r"model.path=.*pytorch_model.bin.*safetensors only"):
        compose(f"model=hf model.path={tmp_path}")


@pytest.mark.parametrize("text, words", [
    ("model=small-mixtral  engine.kv_cache_gb=2", ["model=small-mixtral", "engine.kv_cache_gb=2"]),
    # Hydra lists need no quoting of their own
    ("workload.inputs=[a.jsonl,b.parquet] workload.limit=5",
     ["workload.inputs=[a.jsonl,b.parquet]", "workload.limit=5"]),
    # quoted strings inside brackets reach Hydra as written
    ("workload.stop=['a b', 'c'] workload.limit=5", ["workload.stop=['a b', 'c']", "workload.limit=5"]),
    # a quoted word groups spaces, as in a shell
    ('"model.path=/my models/x" workload.limit=5', ["model.path=/my models/x", "workload.limit=5"]),
    # Snakemake strips a quote at either end of a --config value: the word still parses
    ("workload.inputs=[a.jsonl,b.parquet]' workload.limit=5",
     ["workload.inputs=[a.jsonl,b.parquet]", "workload.limit=5"]),
    ("workload.limit=5 'workload.inputs=[a.jsonl,b.parquet]",
     ["workload.limit=5", "workload.inputs=[a.jsonl,b.parquet]"]),
])
def test_overrides_split_like_the_readme_writes_them(text, words):
    assert parse_overrides(text) == words


def test_unbalanced_override_fails_naming_overrides():
    with pytest.raises(ConfigError, match="overrides="):
        parse_overrides("workload.inputs=[a.jsonl")


def test_resolved_file_round_trips(tmp_path):
    cfg = compose("engine.max_num_seqs=17 workload.num_shards=3")
    path = save_resolved(cfg, tmp_path / "config.yaml")
    assert load_resolved(path) == cfg


def test_resolved_file_with_unknown_key_is_rejected(tmp_path):
    path = save_resolved(compose(), tmp_path / "config.yaml")
    path.write_text(path.read_text() + "surprise: 1\n")
    with pytest.raises(ConfigError, match="surprise"):
        load_resolved(path)


def test_unchanged_config_keeps_file_mtime(tmp_path):
    cfg = compose()
    path = save_resolved_if_changed(cfg, tmp_path / "config.yaml")
    before = path.stat().st_mtime_ns
    save_resolved_if_changed(cfg, path)
    assert path.stat().st_mtime_ns == before
    save_resolved_if_changed(compose("workload.max_new_tokens=9"), path)
    assert "max_new_tokens: 9" in path.read_text()


def test_kv_budget_below_one_block_fails_when_composed(tiny_mixtral_dir):
    # tiny-mixtral: 2 layers x 2 KV heads x (32 + 32) x 4 bytes = 1024 bytes/token, 16 KiB a block.
    with pytest.raises(ConfigError, match=r"engine.kv_cache_gb=1e-06: below one KV block .* minimum is 1.6384e-05 GB"):
        compose("engine.policy=config engine.kv_cache_gb=0.000001")
    with pytest.raises(ConfigError, match=r"engine.kv_cache_gb"):
        compose(f"model=hf model.path={tiny_mixtral_dir} engine.policy=config engine.kv_cache_gb=0.000001")
    assert compose("engine.policy=config engine.kv_cache_gb=0.00002").engine.kv_cache_gb == 0.00002
    # With the search, the policy sizes the cache; the configured figure is not used.
    assert compose("engine.policy=search engine.kv_cache_gb=0.000001").engine.kv_cache_gb == 0.000001
