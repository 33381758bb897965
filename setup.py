"""Build the Cython kernels in kernels_cy/ as extensions of the moe_engine package.

The packed GEMM / expert kernels and the decode-attention kernel are compiled once per
instruction set (kernels_cy/isa_*.c, each with its own -m flags) and linked into the extensions
that dispatch on the ISA; kernels_cy/isa_dispatch.c picks the build the running CPU supports, so
the result runs on any x86-64 whatever machine built it. Everything else is compiled for the
baseline ISA (no -march=native).

OpenMP is probed with a tiny compile: where the compiler lacks it (e.g. Apple clang without
libomp) the kernels still build, single-threaded, and `moe_engine.model.paged_attention.HAS_OPENMP` says so.
Set MOE_BATCH_NO_OPENMP=1 to force that fallback.
"""
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
# ISA builds of the kernels: (source, compiler flags, macro telling isa_dispatch.c it exists)
ISA_BUILDS = [
    ("isa_generic.c", [], None),
    ("isa_avx2.c", ["-mavx2", "-mfma", "-mf16c"], "MOE_BUILT_AVX2"),
    # AVX2 plus the VEX vpdpbusd (AVX-VNNI: Alder Lake on, Zen 5) for i8q weights; dropped where
    # the compiler or its assembler lacks it (GCC < 11, binutils < 2.36)
    ("isa_avxvnni.c", ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"], "MOE_BUILT_AVXVNNI"),
    ("isa_avx512.c", AVX512_FLAGS, "MOE_BUILT_AVX512"),
    # AVX-512 plus vpdpbusd (Cascade Lake, Ice Lake; VMs that hide AVX512-BF16 but not VNNI)
    # for i8q weights; dropped where the compiler lacks -mavx512vnni (GCC < 8)
    ("isa_avx512vnni.c", AVX512_FLAGS + ["-mavx512vnni"], "MOE_BUILT_AVX512VNNI"),
    # AVX-512 plus vdpbf16ps and vpdpbusd (Cooper Lake, Zen 4, Sapphire Rapids on: every CPU
    # with AVX512-BF16 has AVX512-VNNI): bf16p and i8q weights only; dropped where the
    # compiler lacks -mavx512bf16 (GCC < 10)
    ("isa_avx512bf16.c", AVX512_FLAGS + ["-mavx512bf16", "-mavx512vnni"], "MOE_BUILT_AVX512BF16"),
    # AVX512-BF16 plus AMX tiles (Sapphire Rapids on) for bf16p, bf16x3 (tdpbf16ps) and i8q
    # (tdpbusd) weights; dropped where the compiler lacks -mamx-bf16 or -mamx-int8 (GCC < 11)
    ("isa_amx.c", AVX512_FLAGS + ["-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16",
                                  "-mamx-int8"],
     "MOE_BUILT_AMX"),
]
# Extensions that link the ISA builds and the dispatcher.
ISA_EXTENSIONS = {"packed_gemm", "paged_attention"}
# Headers the ISA builds include: a change rebuilds them.
ISA_HEADERS = ["moe_isa.h", "isa_vec.h", "isa_ops_table.h", "packed_gemm_impl.h",
               "paged_attention_impl.h", "amx_tiles.h"]


def _compiler_accepts(flags: list[str]) -> bool:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            if "-fopenmp" in flags:
                f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() < 1;}\n")
            elif "-mamx-tile" in flags:
                # a compiler can take -mamx-* before its assembler knows the instructions
                # (GCC 11 with binutils < 2.36): the probe has to emit them
                f.write("#include <immintrin.h>\nint main(int c, char **v)"
                        "{if (c > 5) {_tile_dpbf16ps(0, 1, 2); _tile_dpbusd(3, 4, 5);"
                        " _tile_release();} return v == 0;}\n")
            elif "-mavx512vnni" in flags:  # likewise (avx512vnni, avx512bf16)
                f.write("#include <immintrin.h>\nint main(int c, char **v){__m512i a = "
                        "_mm512_set1_epi32(c); a = _mm512_dpbusd_epi32(a, a, a); "
                        "return _mm_cvtsi128_si32(_mm512_castsi512_si128(a)) == 7 && v == 0;}\n")
            elif "-mavxvnni" in flags:  # as for AMX: the assembler has to know it
                f.write("#include <immintrin.h>\nint main(int c, char **v){__m256i a = "
                        "_mm256_set1_epi32(c); a = _mm256_dpbusd_avx_epi32(a, a, a); "
                        "return _mm256_extract_epi32(a, 0) == 7 && v == 0;}\n")
            else:
                f.write("int main(void){return 0;}\n")
        result = subprocess.run([cc, *flags, src, "-o", os.path.join(tmp, "probe")],
                                capture_output=True)
        return result.returncode == 0


def _isa_builds() -> list[tuple[str, list[str], str | None]]:
    """The ISA builds this compiler can produce (x86 flags are refused elsewhere)."""
    return [(src, flags, macro) for src, flags, macro in ISA_BUILDS
            if not flags or _compiler_accepts(flags)]


class IsaBuildExt(build_ext):
    """Compiles each ISA source with its own flags before linking the extensions that use it
    (distutils would compile every source of an extension with the same flags)."""

    # module name -> (ISA builds, base compile flags), filled by _extensions(); cythonize
    # returns new Extension objects, so the plan cannot ride on them.
    isa_plans: dict[str, tuple[list, list[str]]] = {}

    def build_extension(self, ext):
        plan = self.isa_plans.get(ext.name)
        if plan:
            builds, base_args = plan
            objects = []
            for src, flags, _ in builds:
                objects += self.compiler.compile(
                    [os.path.join("kernels_cy", src)], output_dir=self.build_temp,
                    include_dirs=ext.include_dirs, macros=ext.define_macros,
                    extra_postargs=base_args + flags, depends=ext.depends)
            ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extension(ext)


def _extensions():
    from Cython.Build import cythonize
    import numpy

    # -ffp-contract=fast is GCC's default in GNU C, but a -std=c11 in the user's CFLAGS turns it
    # off: the kernels' a * b + c are meant as single FMAs (their FMA chains, int4's (q - 8) * s
    # as q * s + -8s), and their bitwise results across builds rest on it
    base_args = ["-O3", "-fno-math-errno", "-ffp-contract=fast"]
    link_args: list[str] = []
    use_openmp = os.environ.get("MOE_BATCH_NO_OPENMP") != "1" and _compiler_accepts(["-fopenmp"])
    if use_openmp:
        base_args.append("-fopenmp")
        link_args.append("-fopenmp")
    else:
        print("moe-batch: building kernels WITHOUT OpenMP (single-threaded)", file=sys.stderr)
    sources = sorted(f for f in os.listdir("kernels_cy") if f.endswith(".pyx")) \
        if os.path.isdir("kernels_cy") else []
    builds = _isa_builds()
    isa_macros = [(macro, "1") for _, _, macro in builds if macro]
    headers = [os.path.join("kernels_cy", f) for f in ISA_HEADERS] \
        + [os.path.join("kernels_cy", src) for src, _, _ in builds]
    exts = []
    for name in sources:
        module = os.path.splitext(name)[0]
        with_isa = module in ISA_EXTENSIONS
        ext = Extension(
            f"moe_engine._kernels.{module}",
            [os.path.join("kernels_cy", name)]
            + ([os.path.join("kernels_cy", "isa_dispatch.c")] if with_isa else []),
            include_dirs=[numpy.get_include(), "kernels_cy"],
            # Built for the baseline ISA: only the ISA objects use wider instructions, behind
            # the CPUID check.
            extra_compile_args=base_args,
            extra_link_args=link_args,
            define_macros=[("MOE_HAS_OPENMP", "1" if use_openmp else "0"),
                           ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
            + (isa_macros if with_isa else []),
            depends=headers if with_isa else [],
        )
        if with_isa:
            IsaBuildExt.isa_plans[ext.name] = (builds, base_args)
        exts.append(ext)
    return cythonize(exts, language_level=3, compile_time_env={"HAS_OPENMP": use_openmp},
                     include_path=["kernels_cy"],
                     compiler_directives={"boundscheck": False, "wraparound": False,
                                          "cdivision": True, "initializedcheck": False})


setup(ext_modules=_extensions(), cmdclass={"build_ext": IsaBuildExt})
