/* The moe_isa_ops table of one ISA build, from the templates its kernels_cy/isa_<name>.c
 * included (packed_gemm_impl.h, paged_attention_impl.h). */
#if !defined(MOE_OPS_NAME) || !defined(MOE_ISA_LABEL)
#error "define MOE_OPS_NAME and MOE_ISA_LABEL before including isa_ops_table.h"
#endif

const moe_isa_ops MOE_OPS_NAME = {
    .name = MOE_ISA_LABEL,
    .lanes = VW,
    .linear = linear_impl,
    .moe_ffn = moe_ffn_impl,
    .fma_probe = fma_probe_impl,
    .probe_flops = probe_flops_impl,
    .decode_attention = decode_attention_impl,
    .read_sum = read_sum_impl,
    .gemm_k_block = gemm_k_block_impl,
};
