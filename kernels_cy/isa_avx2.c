/* AVX2 + FMA + F16C build of the kernels (compiled with -mavx2 -mfma -mf16c): 8-lane vectors in
 * 16 ymm registers. GEMM: a 6-row x 16-column register tile (12 accumulators). Attention: tiles
 * of up to 4 query heads (8 accumulators in q.k and in P.V), chunks of 8 tokens. */
#define MOE_VW 8
#define MOE_MR 6
#define MOE_ATTN_TILE 4
#define MOE_OPS_NAME moe_ops_avx2
#define MOE_ISA_LABEL "avx2"
#include "packed_gemm_impl.h"
#include "paged_attention_impl.h"
#include "isa_ops_table.h"
