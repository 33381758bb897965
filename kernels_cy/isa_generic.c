/* Portable build of the kernels: 4-lane vectors, which every x86-64 (SSE2) and most other
 * targets have; the fallback when the CPU offers neither AVX2+FMA nor AVX-512. 16 registers:
 * the same tiles as AVX2. */
#define MOE_VW 4
#define MOE_MR 6
#define MOE_ATTN_TILE 4
#define MOE_OPS_NAME moe_ops_generic
#define MOE_ISA_LABEL "generic"
#include "packed_gemm_impl.h"
#include "paged_attention_impl.h"
#include "isa_ops_table.h"
