/* Chooses the ISA build of the packed kernels for the running CPU (moe_isa.h). Compiled without
 * ISA flags, so this file runs on any x86-64; it only reads CPUID (through the compiler's
 * __builtin_cpu_supports, which also checks that the OS saves the wider registers). setup.py
 * defines MOE_BUILT_<ISA> for each ISA build the compiler could produce. */
#include "moe_isa.h"

#include <stddef.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(MOE_BUILT_AMX)
/* Whether AMX tiles with bf16 and int8 products can run: CPUID says AMX-TILE, AMX-BF16 and
 * AMX-INT8 (every AMX CPU so far has all three: Sapphire Rapids on), and Linux
 * grants the process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16 on; the
 * first tile instruction faults without it). The grant is for the whole process and for good,
 * so the answer is asked once and kept: the syscall is not made on every kernel call. */
static int amx_usable(void) {
    static int usable = -1; /* not asked yet; a race only asks twice */
    if (usable < 0) {
        int ok = 0;
#if defined(__linux__)
        unsigned a, b, c, d;
        if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 22 & 1) &&
            (d >> 25 & 1)) {
            const long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
            ok = syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0;
        }
#endif
        usable = ok;
    }
    return usable;
}
#endif

int moe_isa_supported(int isa) {
    switch (isa) {
        case MOE_ISA_GENERIC:
            return 1;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(MOE_BUILT_AVX2)
        case MOE_ISA_AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
#endif
#if defined(MOE_BUILT_AVXVNNI)
        case MOE_ISA_AVXVNNI: { /* CPUID leaf 7 sub-leaf 1, EAX bit 4 (the VEX encoding) */
            unsigned a, b, c, d;
            return moe_isa_supported(MOE_ISA_AVX2) && __get_cpuid_count(7, 1, &a, &b, &c, &d) &&
                   (a >> 4 & 1);
        }
#endif
#if defined(MOE_BUILT_AVX512)
        case MOE_ISA_AVX512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                   __builtin_cpu_supports("fma");
#endif
#if defined(MOE_BUILT_AVX512VNNI)
        case MOE_ISA_AVX512VNNI:
            return moe_isa_supported(MOE_ISA_AVX512) && __builtin_cpu_supports("avx512vnni");
#endif
#if defined(MOE_BUILT_AVX512BF16)
        case MOE_ISA_AVX512BF16: /* asked of the CPU, not of the avx512vnni build */
            return moe_isa_supported(MOE_ISA_AVX512) && __builtin_cpu_supports("avx512bf16") &&
                   __builtin_cpu_supports("avx512vnni");
#endif
#if defined(MOE_BUILT_AMX)
        case MOE_ISA_AMX:
            return moe_isa_supported(MOE_ISA_AVX512BF16) && amx_usable();
#endif
#endif
        default:
            return 0;
    }
}

int moe_isa_best(void) {
    for (int isa = MOE_ISA_COUNT - 1; isa > MOE_ISA_GENERIC; isa--)
        if (moe_isa_supported(isa)) return isa;
    return MOE_ISA_GENERIC;
}

const char *moe_isa_name(int isa) {
    static const char *const names[MOE_ISA_COUNT] = {"generic", "avx2", "avxvnni", "avx512",
                                                        "avx512vnni", "avx512bf16", "amx"};
    return isa >= 0 && isa < MOE_ISA_COUNT ? names[isa] : "unknown";
}

/* The table of a build the compiler produced, whether this CPU runs it or not; NULL for one
 * it left out (setup.py). */
static const moe_isa_ops *built_ops(int isa) {
    switch (isa) {
        case MOE_ISA_GENERIC: return &moe_ops_generic;
#if defined(MOE_BUILT_AVX2)
        case MOE_ISA_AVX2: return &moe_ops_avx2;
#endif
#if defined(MOE_BUILT_AVXVNNI)
        case MOE_ISA_AVXVNNI: return &moe_ops_avxvnni;
#endif
#if defined(MOE_BUILT_AVX512)
        case MOE_ISA_AVX512: return &moe_ops_avx512;
#endif
#if defined(MOE_BUILT_AVX512VNNI)
        case MOE_ISA_AVX512VNNI: return &moe_ops_avx512vnni;
#endif
#if defined(MOE_BUILT_AVX512BF16)
        case MOE_ISA_AVX512BF16: return &moe_ops_avx512bf16;
#endif
#if defined(MOE_BUILT_AMX)
        case MOE_ISA_AMX: return &moe_ops_amx;
#endif
        default: return NULL;
    }
}

int moe_isa_built(int isa) { return built_ops(isa) != NULL; }

const moe_isa_ops *moe_isa_get(int isa) {
    return moe_isa_supported(isa) ? built_ops(isa) : NULL;
}
