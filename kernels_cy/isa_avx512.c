/* AVX-512 (F, BW, VL, DQ) build of the kernels: 16-lane vectors in 32 zmm registers. GEMM: an
 * 8-row x 32-column register tile (16 accumulators). Attention: tiles of up to 8 query heads
 * (16 accumulators in q.k and in P.V), chunks of 16 tokens. */
#define MOE_VW 16
#define MOE_MR 8
#define MOE_ATTN_TILE 8
#define MOE_OPS_NAME moe_ops_avx512
#define MOE_ISA_LABEL "avx512"
#include "packed_gemm_impl.h"
#include "paged_attention_impl.h"
#include "isa_ops_table.h"
