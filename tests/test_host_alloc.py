"""The engine's malloc settings (moe_engine/host_alloc.py): a step's activations reuse freed
heap pages instead of faulting them in again, and the settings are named where they matter."""
from __future__ import annotations

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
