/* AVX-512 build with AVX512-BF16 and AVX512-VNNI: the AVX-512 kernels (isa_avx512.c) plus
 * vdpbf16ps for bf16p weights (engine.matmul_precision=medium), two multiply-adds per lane and
 * instruction, the weights never widened, and vpdpbusd for i8q weights (int8 experts at
 * medium), four. Every other path is the AVX-512 code. */
#define MOE_VW 16
#define MOE_MR 14
#define MOE_MR_Q8 8
#define MOE_ATTN_TILE 8
#define MOE_OPS_NAME moe_ops_avx512bf16
#define MOE_ISA_LABEL "avx512bf16"
#include "packed_gemm_impl.h"
#include "paged_attention_impl.h"
#include "isa_ops_table.h"
