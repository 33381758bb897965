/* AVX-512 (F, BW, VL, DQ) build of the kernels: 16-lane vectors in 32 zmm registers. GEMM: a
 * 14-row x 32-column register tile (28 accumulators; i8q's 8 rows, 16). 14 rows take 1.75x the
 * multiply-adds of 8 from each panel line: a decode-sized item's first tile, which streams its
 * panel from DRAM at what one core drains (~9-10 GB/s on the AMX Xeon), does that much more
 * work, and a tile from cache has more FMAs for its two widenings (expert kernel 1.07-1.11x
 * at 24-64 tokens, 1.03x at 128-1024; tiles alone 1.25x at four tiles a DRAM panel).
 * Attention: tiles of up to 8 query heads (16 accumulators in q.k and in P.V), chunks of 16
 * tokens. */
#define MOE_VW 16
#define MOE_MR 14
#define MOE_MR_Q8 8
#define MOE_ATTN_TILE 8
#define MOE_OPS_NAME moe_ops_avx512
#define MOE_ISA_LABEL "avx512"
#include "packed_gemm_impl.h"
#include "paged_attention_impl.h"
#include "isa_ops_table.h"
