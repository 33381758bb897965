"""Compiled Cython kernels (built from kernels_cy/ by setup.py)."""
