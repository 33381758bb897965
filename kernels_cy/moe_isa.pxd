# Cython declarations of kernels_cy/moe_isa.h, shared by the extensions that dispatch on the ISA
# (packed_gemm.pyx, paged_attention.pyx), and the lookup of an ISA's table that both use.
from libc.stdint cimport int32_t, int64_t

cdef extern from "moe_isa.h" nogil:
    int MOE_NR
    int MOE_I4_GROUP
    int MOE_I8Q_MAX_K
    int MOE_W_F32, MOE_W_BF16, MOE_W_F16, MOE_W_I8, MOE_W_I4, MOE_W_FP4, MOE_W_BF16P, MOE_W_BF16X3, MOE_W_I8Q
    int MOE_ISA_GENERIC, MOE_ISA_AVX2, MOE_ISA_AVXVNNI, MOE_ISA_AVX512, MOE_ISA_AVX512VNNI, MOE_ISA_AVX512BF16, MOE_ISA_AMX
    int MOE_ISA_COUNT
    int MOE_ACT_NONE, MOE_ACT_SIGMOID
    int MOE_PROBE_FMA, MOE_PROBE_BF16_DOT, MOE_PROBE_I8_DOT
    int MOE_GLU_SILU, MOE_GLU_CLAMPED
    ctypedef struct moe_glu:
        int kind
        float alpha
        float limit
    ctypedef struct moe_packed:
        const void *data
        const void *scale
        int64_t n
        int64_t k
        int dtype
    ctypedef struct moe_expert:
        moe_packed w13
        moe_packed w2
        const float *b13
        const float *b2
    ctypedef struct moe_attn_args:
        const float *query
        float *out
        const void *key_cache
        const void *value_cache
        const int32_t *block_tables
        const int32_t *context_lens
        int num_seqs, n_q_heads, n_kv_heads, head_dim, block_size, max_blocks_per_seq
        int dtype
        float scale
        const float *sinks
        int window
    ctypedef struct moe_isa_ops:
        const char *name
        int lanes
        int (*linear)(const float *x, int64_t ldx, int64_t T, const moe_packed *w,
                       const float *bias, int act, float *y, int64_t ldy,
                       int nthreads) noexcept nogil
        int (*moe_ffn)(const float *x, int64_t T, int64_t H, const int64_t *idx,
                       const float *weight, int top_k, const moe_expert *experts, int num_experts,
                       const moe_glu *glu, float *out, float *work, int32_t *iwork, int nthreads) noexcept nogil
        double (*fma_probe)(int64_t n, int nthreads, int kind) noexcept nogil
        int64_t (*probe_flops)(int kind) noexcept nogil
        int (*decode_attention)(const moe_attn_args *args, int nthreads) noexcept nogil
        double (*read_sum)(const float *p, int64_t n, int nthreads) noexcept nogil
        int64_t (*gemm_k_block)(int64_t rows, int64_t k, int dtype) noexcept nogil
    int moe_pair_terms(int dtype)
    int64_t moe_ffn_work_floats(int64_t T, int top_k, int64_t H, int64_t I, int terms)
    int64_t moe_ffn_iwork_ints(int64_t T, int top_k, int num_experts)
    int moe_isa_supported(int isa)
    int moe_isa_built(int isa)
    int moe_isa_best()
    const char *moe_isa_name(int isa)
    const moe_isa_ops *moe_isa_get(int isa)


cdef inline const moe_isa_ops *isa_ops(int isa) except NULL:
    """The table of ISA code `isa`; a code the CPU lacks is refused (it would fault)."""
    cdef const moe_isa_ops *ops = moe_isa_get(isa)
    if ops == NULL:
        supported = [moe_isa_name(i).decode() for i in range(MOE_ISA_COUNT) if moe_isa_supported(i)]
        name = moe_isa_name(isa).decode() if 0 <= isa < MOE_ISA_COUNT else isa
        raise ValueError(f"ISA {name!r} is not supported by this CPU (supported: {supported})")
    return ops
