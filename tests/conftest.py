"""Shared fixtures: the built-in tiny checkpoints, generated once per test session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    parser.addoption(
        "--timing-tests", choices=("with", "without", "only"), default="with",
        help="tests marked `timing` assert on wall-clock time, so any other load beside them "
             "can fail them: `make test` runs the suite on two workers `without` them, then "
             "`only` them, alone")


# The test files that take longest, longest first (seconds of one worker, Zen 4, 2026-11-29:
# 147, 93, 83, 81, 75, 66, 54, 54, 50, 38, 37). `make test` hands whole files to two workers in
# collection order (--no-loadscope-reorder; xdist's own order, by number of tests, sent the
# one-test files of a minute each last, and a worker ran them alone at the end), so these
# start first and the many short files fill in around them. A file missing here only runs later.
LONGEST_FIRST = ("test_workflow.py", "test_perf_policy.py", "test_offload_parity.py",
                 "test_engine_parity.py", "test_disk_tier.py", "test_slurm.py",
                 "test_perf_profile.py", "test_scale.py", "test_packed_kernels.py",
                 "test_paged_attention_kernel.py", "test_packed_engine.py")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA; without it they are skipped, never faked. `--timing-tests` keeps
    or drops the `timing` tests. Files in LONGEST_FIRST come first, in its order."""
    import torch

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole

    mode = config.getoption("timing_tests")
    if mode != "with":
        keep, dropped = [], []
        for item in items:
            timed = item.get_closest_marker("timing") is not None
            (keep if timed == (mode == "only") else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def hermetic_machine_cache(tmp_path_factory):
    """Hardware and routing profiles go to a per-session cache, never the user's ~/.cache, and
    the workflows measure this machine in the profiler's fast mode (set in the environment so
    snakemake's subprocesses see it too)."""
    settings = {"MOE_BATCH_CACHE": str(tmp_path_factory.mktemp("machine-cache")),
                "MOE_BATCH_PROFILE": "fast"}
    before = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    yield Path(settings["MOE_BATCH_CACHE"])
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def builtin_dir(tmp_path_factory):
    """builtin_dir(preset): the built-in preset, seed 0, single safetensors file, built once."""
    from moe_engine.tools.checkpoints import build_checkpoint

    built: dict[str, Path] = {}

    def build(preset: str) -> Path:
        if preset not in built:
            built[preset] = build_checkpoint(preset, tmp_path_factory.mktemp("models") / preset,
                                             seed=0)
        return built[preset]

    return build


@pytest.fixture(scope="session")
def tiny_mixtral_dir(builtin_dir) -> Path:
    """The `tiny-mixtral` preset, seed 0, from the bundled corpus (single safetensors file)."""
    return builtin_dir("tiny-mixtral")


@pytest.fixture(scope="session")
def tiny_mixtral_sharded_dir(tmp_path_factory) -> Path:
    """The same checkpoint split into 2 safetensors shards with an index."""
    from moe_engine.tools.checkpoints import build_checkpoint

    return build_checkpoint("tiny-mixtral", tmp_path_factory.mktemp("models") / "tiny-sharded",
                            seed=0, num_shards=2)


@pytest.fixture(scope="session")
def tiny_three_layer_dir(tmp_path_factory) -> Path:
    """tiny-mixtral with 3 layers. With more layers than the page ring's two slots (and an odd
    count) a slot holds a different layer on each visit, so pages read at the wrong time give
    wrong numbers (with two layers a slot always gets the same layer's bytes back), and a failed
    step can leave both slots claimed."""
    import dataclasses

    import moe_engine.tools.checkpoints as ck

    preset = dataclasses.replace(ck.PRESETS["tiny-mixtral"], num_hidden_layers=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ck.PRESETS, "tiny-mixtral-3l", preset)
        return ck.build_checkpoint("tiny-mixtral-3l", tmp_path_factory.mktemp("models") / "t3",
                                   seed=0)
