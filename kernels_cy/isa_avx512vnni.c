/* AVX-512 build with AVX512-VNNI (Cascade Lake, Ice Lake, and VMs that expose AVX512-VNNI but
 * not AVX512-BF16): the AVX-512 kernels (isa_avx512.c) plus vpdpbusd for i8q weights (int8
 * experts at medium), four multiply-adds a lane. Every other path is the AVX-512 code; bf16p
 * weights stay emulated, as on avx512. */
#define MOE_VW 16
#define MOE_MR 14
#define MOE_MR_Q8 8
#define MOE_ATTN_TILE 8
#define MOE_OPS_NAME moe_ops_avx512vnni
#define MOE_ISA_LABEL "avx512vnni"
#include "packed_gemm_impl.h"
#include "paged_attention_impl.h"
#include "isa_ops_table.h"
