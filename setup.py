"""Build the Cython kernels in kernels_cy/ as extensions of the moe_engine package.

OpenMP is probed with a tiny compile: where the compiler lacks it (e.g. Apple clang without
libomp) the kernels still build, single-threaded, and `moe_engine.model.paged_attention.HAS_OPENMP` says so.
Set MOE_BATCH_NO_OPENMP=1 to force that fallback, MOE_BATCH_NATIVE=0 to drop -march=native
(for wheels that must run on other CPUs).
"""
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, setup


def _compiler_accepts(flags: list[str]) -> bool:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() < 1;}\n"
                    if "-fopenmp" in flags else "int main(void){return 0;}\n")
        result = subprocess.run([cc, *flags, src, "-o", os.path.join(tmp, "probe")],
                                capture_output=True)
        return result.returncode == 0


def _extensions():
    from Cython.Build import cythonize
    import numpy

    compile_args = ["-O3", "-fno-math-errno"]
    link_args: list[str] = []
    if os.environ.get("MOE_BATCH_NATIVE", "1") == "1" and _compiler_accepts(["-march=native"]):
        compile_args.append("-march=native")
    use_openmp = os.environ.get("MOE_BATCH_NO_OPENMP") != "1" and _compiler_accepts(["-fopenmp"])
    if use_openmp:
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")
    else:
        print("moe-batch: building kernels WITHOUT OpenMP (single-threaded)", file=sys.stderr)
    sources = sorted(f for f in os.listdir("kernels_cy") if f.endswith(".pyx")) \
        if os.path.isdir("kernels_cy") else []
    exts = [
        Extension(
            f"moe_engine._kernels.{os.path.splitext(name)[0]}",
            [os.path.join("kernels_cy", name)],
            include_dirs=[numpy.get_include(), "kernels_cy"],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            define_macros=[("MOE_HAS_OPENMP", "1" if use_openmp else "0"),
                           ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        )
        for name in sources
    ]
    return cythonize(exts, language_level=3, compile_time_env={"HAS_OPENMP": use_openmp},
                     compiler_directives={"boundscheck": False, "wraparound": False,
                                          "cdivision": True, "initializedcheck": False})


setup(ext_modules=_extensions())
