"""Importing the compiled kernels with an OpenMP pool that sleeps between calls.

The extensions in moe_engine._kernels link the system libgomp beside torch's own copy: two
OpenMP pools on the same cores. A pool whose idle threads spin after a parallel region starves
the other's threads (measured: a 20-70x slower decode step), so the extensions' pool must sleep,
not spin. libgomp reads OMP_WAIT_POLICY once, when it loads, and every extension shares the one
system libgomp: whichever extension is imported first decides. So each is imported here, with
the variable set for that import only; torch's runtime is already initialised and keeps its own.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional


def import_kernel(module: str) -> Optional[ModuleType]:
    """The module, imported with OMP_WAIT_POLICY=PASSIVE unless the user set a policy; None
    when it is not built."""
    key = "OMP_WAIT_POLICY"
    previous = os.environ.get(key)
    if previous is None:
        os.environ[key] = "PASSIVE"
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
    finally:
        if previous is None:
            os.environ.pop(key, None)
