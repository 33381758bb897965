/* AVX2 build with AVX-VNNI (the VEX-encoded vpdpbusd of AVX2-class cores: Intel Alder Lake on,
 * Sierra Forest; AMD Zen 5): the AVX2 kernels (isa_avx2.c) plus vpdpbusd for i8q weights (int8
 * experts under engine.matmul_precision=medium), four multiply-adds a lane. Every other path is
 * the AVX2 code. */
#define MOE_VW 8
#define MOE_MR 6
#define MOE_ATTN_TILE 4
#define MOE_OPS_NAME moe_ops_avxvnni
#define MOE_ISA_LABEL "avxvnni"
#include "packed_gemm_impl.h"
#include "paged_attention_impl.h"
#include "isa_ops_table.h"
