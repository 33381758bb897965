/* AVX2 + FMA + F16C build of the packed kernels (compiled with -mavx2 -mfma -mf16c):
 * 8-lane vectors, a 6-row x 16-column register tile (12 accumulators of the 16 ymm registers). */
#define MOE_VW 8
#define MOE_MR 6
#define MOE_OPS_NAME moe_ops_avx2
#define MOE_ISA_LABEL "avx2"
#include "packed_gemm_impl.h"
