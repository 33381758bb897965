/* AMX build (Sapphire Rapids on): the AVX512-BF16 build (isa_avx512bf16.c) with bf16p and
 * bf16x3 weights (engine.matmul_precision=medium, high) on AMX tiles, tdpbf16ps doing 16 x 16 x
 * 32 multiply-adds an instruction, and i8q weights (int8 experts under medium) on them too,
 * tdpbusd doing 16 x 16 x 64 (amx_tiles.h). Every other path is the AVX-512 code. */
#define MOE_VW 16
#define MOE_MR 14
#define MOE_MR_Q8 8
#define MOE_ATTN_TILE 8
#define MOE_AMX 1
#define MOE_OPS_NAME moe_ops_amx
#define MOE_ISA_LABEL "amx"
#include "packed_gemm_impl.h"
#include "paged_attention_impl.h"
#include "isa_ops_table.h"
