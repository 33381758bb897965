/* Portable build of the packed kernels: 4-lane vectors, which every x86-64 (SSE2) and most
 * other targets have; the fallback when the CPU offers neither AVX2+FMA nor AVX-512. */
#define MOE_VW 4
#define MOE_MR 6
#define MOE_OPS_NAME moe_ops_generic
#define MOE_ISA_LABEL "generic"
#include "packed_gemm_impl.h"
