/* Chooses the ISA build of the packed kernels for the running CPU (moe_isa.h). Compiled without
 * ISA flags, so this file runs on any x86-64; it only reads CPUID (through the compiler's
 * __builtin_cpu_supports, which also checks that the OS saves the wider registers). setup.py
 * defines MOE_BUILT_<ISA> for each ISA build the compiler could produce. */
#include "moe_isa.h"

#include <stddef.h>

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
#if defined(MOE_BUILT_AVX512)
        case MOE_ISA_AVX512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                   __builtin_cpu_supports("fma");
#endif
#if defined(MOE_BUILT_AVX512BF16)
        case MOE_ISA_AVX512BF16:
            return moe_isa_supported(MOE_ISA_AVX512) && __builtin_cpu_supports("avx512bf16");
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
    static const char *const names[MOE_ISA_COUNT] = {"generic", "avx2", "avx512",
                                                        "avx512bf16"};
    return isa >= 0 && isa < MOE_ISA_COUNT ? names[isa] : "unknown";
}

const moe_isa_ops *moe_isa_get(int isa) {
    if (!moe_isa_supported(isa)) return NULL;
    switch (isa) {
#if defined(MOE_BUILT_AVX2)
        case MOE_ISA_AVX2: return &moe_ops_avx2;
#endif
#if defined(MOE_BUILT_AVX512)
        case MOE_ISA_AVX512: return &moe_ops_avx512;
#endif
#if defined(MOE_BUILT_AVX512BF16)
        case MOE_ISA_AVX512BF16: return &moe_ops_avx512bf16;
#endif
        default: return &moe_ops_generic;
    }
}
