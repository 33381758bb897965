/* AVX-512 (F, BW, VL, DQ) build of the packed kernels: 16-lane vectors, an 8-row x 32-column
 * register tile (16 accumulators of the 32 zmm registers). */
#define MOE_VW 16
#define MOE_MR 8
#define MOE_OPS_NAME moe_ops_avx512
#define MOE_ISA_LABEL "avx512"
#include "packed_gemm_impl.h"
