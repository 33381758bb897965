"""The engine's malloc settings (moe_engine/host_alloc.py): a step's activations reuse freed
heap pages instead of faulting them in again, and the settings are named where they matter."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from moe_engine.host_alloc import allocator_fingerprint, allocator_name, tune_host_allocator

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# A step's largest temporary, as a prefill pass of a Mixtral-sized layer allocates one (the
# expert scratch of 2048 tokens is ~100 MiB): 36 MiB, above the 32 MiB glibc ever raises its
# mmap threshold to by itself. Prints the page faults of 20 steps after warm-up.
_STEP_FAULTS = """
import resource, sys, torch
if sys.argv[1] == "tuned":
    from moe_engine.host_alloc import tune_host_allocator
    tune_host_allocator()
torch.set_num_threads(1)
def step():
    return torch.empty(9 << 20).fill_(1.0).sum()
for _ in range(10):  # the heap settles within a few steps (faults in steps 3-6 seen)
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _step_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _STEP_FAULTS, mode], capture_output=True,
                         text=True, check=True).stdout
    return int(out.split()[-1])


@glibc
def test_tuned_steps_stop_faulting_their_activations_in():
    default, tuned = _step_faults("default"), _step_faults("tuned")
    # glibc's defaults map each one anew and fault all its pages in (9216 a step measured, 18
    # with transparent huge pages on every mapping); tuned, the heap keeps them (none seen
    # once it has settled).
    assert default > 20 * 18, default
    assert tuned < default / 5, (tuned, default)


@glibc
def test_tuning_says_what_it_set_and_is_idempotent(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    first = tune_host_allocator()
    assert first.startswith("glibc (mmap >= ") and "trim >= " in first, first
    assert tune_host_allocator() == first
    assert allocator_fingerprint().startswith("glibc-tuned-")


def test_a_preloaded_allocator_is_left_alone_and_changes_the_fingerprint(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert allocator_name() == "jemalloc (LD_PRELOAD)"
    assert tune_host_allocator() == "jemalloc (LD_PRELOAD)"
    assert allocator_fingerprint() == "jemalloc"
    from moe_engine.perf.hardware import machine_fingerprint

    preloaded = machine_fingerprint()
    monkeypatch.delenv("LD_PRELOAD")
    assert machine_fingerprint() != preloaded


def test_engine_stats_name_the_allocator(tiny_mixtral_dir):
    from moe_engine.config import EngineConfig
    from moe_engine.engine.llm_engine import LLMEngine
    from moe_engine.engine.request import Request, SamplingParams

    with LLMEngine(tiny_mixtral_dir, EngineConfig(threads=1)) as engine:
        results = list(engine.generate([Request("r0", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=2))]))
        assert len(results) == 1
        assert engine.stats.to_dict()["host_allocator"] == engine.host_allocator != ""


def _smaps_field(field: str, t, addr: int | None = None) -> list[str]:
    """The words after `field` (e.g. "VmFlags:", "Rss:") of the mapping that holds tensor t (or
    address `addr`), from /proc/self/smaps; [] when no mapping holds it."""
    addr = t.data_ptr() if addr is None else addr
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field:
                return line.split()[1:]
    return []


def _vm_flags(t, addr: int | None = None) -> list[str]:
    return _smaps_field("VmFlags:", t, addr)


linux = pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/smaps")
THP = pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                         reason="a kernel without transparent huge pages refuses the advice "
                                "(the cache then takes torch.zeros)")


@linux
@THP
def test_the_kv_cache_is_zero_and_advised_into_huge_pages(monkeypatch):
    """The KV cache's pools get their own 2 MiB aligned mapping advised MADV_HUGEPAGE (VmFlags
    'hg'; whether the kernel then backs it with huge pages is its THP mode), zero and resident
    as torch.zeros would make them, and stay valid through per-layer views once the pool's own
    tensor is gone; the mapping goes with the last view. A pool under one huge page, or
    MOE_BATCH_MALLOC=system, takes torch.zeros."""
    import gc

    import torch

    from moe_engine.host_alloc import HUGE_PAGE, huge_page_zeros
    from moe_engine.model.kv_cache import KVCache
    from moe_engine.model.spec import ModelSpec
    from moe_engine.tools.presets import PRESETS, hf_config

    monkeypatch.delenv("MOE_BATCH_MALLOC", raising=False)
    pool = huge_page_zeros((4, 64, 8, 16, 128), torch.bfloat16)
    assert pool.shape == (4, 64, 8, 16, 128) and pool.dtype == torch.bfloat16
    assert pool.data_ptr() % HUGE_PAGE == 0 and "hg" in _vm_flags(pool)
    # resident before anything reads or writes it: a run's first steps must not fault it in
    assert int(_smaps_field("Rss:", pool)[0]) * 1024 >= pool.numel() * pool.element_size()
    assert not pool.any()
    layers = pool.unbind(0)
    del pool
    gc.collect()
    layers[3].fill_(2.0)
    assert layers[3].float().mean().item() == 2.0 and not layers[2].any()
    addr = layers[0].data_ptr()
    del layers
    gc.collect()
    assert "hg" not in _vm_flags(None, addr)  # unmapped (or another, unadvised mapping there)

    spec = ModelSpec.from_hf_config(hf_config(PRESETS["tiny-mixtral"]))
    cache = KVCache.allocate(spec, 512, 16, torch.float32)
    assert all("hg" in _vm_flags(t) for t in cache.key + cache.value)
    assert not any(t.any() for t in cache.key + cache.value)
    small = huge_page_zeros((16, 16), torch.float32)
    assert "hg" not in _vm_flags(small) and not small.any()
    monkeypatch.setenv("MOE_BATCH_MALLOC", "system")
    assert "hg" not in _vm_flags(huge_page_zeros((4, 64, 8, 16, 128), torch.bfloat16))
