"""Packed-weight GEMM and fused MoE expert FFN, with the ISA build chosen at run time.

Called through moe_engine.model.packed, which packs weights, validates tensors and hands raw
pointers here. Every entry point takes the ISA code to run (ISA_* below); `best_isa()` is what
CPUID offers, and a code the CPU lacks is refused rather than run (it would fault).
"""
from libc.stdint cimport int32_t, int64_t, uintptr_t
from libc.stdlib cimport free, malloc

from moe_isa cimport *

NR = MOE_NR
I4_GROUP = MOE_I4_GROUP
W_F32, W_BF16, W_F16, W_I8, W_I4, W_FP4, W_BF16P, W_BF16X3, W_I8Q = (
    MOE_W_F32, MOE_W_BF16, MOE_W_F16, MOE_W_I8, MOE_W_I4, MOE_W_FP4, MOE_W_BF16P, MOE_W_BF16X3,
    MOE_W_I8Q)
I8Q_MAX_K = MOE_I8Q_MAX_K
GLU_SILU, GLU_CLAMPED = MOE_GLU_SILU, MOE_GLU_CLAMPED
TABLE_COLUMNS = 12  # moe_ffn's expert table: see its docstring
ISA_GENERIC, ISA_AVX2, ISA_AVXVNNI, ISA_AVX512, ISA_AVX512VNNI, ISA_AVX512BF16, ISA_AMX = (
    MOE_ISA_GENERIC, MOE_ISA_AVX2, MOE_ISA_AVXVNNI, MOE_ISA_AVX512, MOE_ISA_AVX512VNNI,
    MOE_ISA_AVX512BF16, MOE_ISA_AMX)
ACTIVATIONS = {None: MOE_ACT_NONE, "sigmoid": MOE_ACT_SIGMOID}
ISA_NAMES = {isa: moe_isa_name(isa).decode() for isa in range(MOE_ISA_COUNT)}


def supported_isas():
    """Codes of the ISA builds this CPU can run, best last."""
    return [isa for isa in range(MOE_ISA_COUNT) if moe_isa_supported(isa)]


def built_isas():
    """Codes of the ISA builds the compiler produced, whether this CPU runs them or not."""
    return [isa for isa in range(MOE_ISA_COUNT) if moe_isa_built(isa)]


def best_isa():
    return moe_isa_best()


def lanes(int isa):
    return isa_ops(isa).lanes


cdef moe_packed _packed(uintptr_t data, uintptr_t scale, int64_t n, int64_t k, int dtype):
    cdef moe_packed w
    w.data = <const void *>data
    w.scale = <const void *>scale
    w.n = n
    w.k = k
    w.dtype = dtype
    return w


def linear(uintptr_t x, int64_t ldx, int64_t T, uintptr_t w_data, uintptr_t w_scale, int64_t n,
           int64_t k, int dtype, uintptr_t bias, int act, uintptr_t y, int64_t ldy, int nthreads,
           int isa):
    """y[t, :n] = act(x[t, :k] @ W^T (+ bias)), fp32 x and y, W packed; releases the GIL."""
    cdef const moe_isa_ops *ops = isa_ops(isa)
    cdef moe_packed w = _packed(w_data, w_scale, n, k, dtype)
    cdef int rc
    nthreads = max(nthreads, 1)
    with nogil:
        rc = ops.linear(<const float *>x, ldx, T, &w, <const float *>bias, act, <float *>y, ldy,
                        nthreads)
    if rc == -4:
        raise ValueError(f"linear: int8q weights take at most {MOE_I8Q_MAX_K} inputs, got {k}")
    if rc != 0:
        raise MemoryError("linear: scratch (bf16 pairs of the activations, padded bias) could not be allocated")


def gemm_k_block(int64_t rows, int64_t k, int dtype, int isa):
    """Inputs of the k-blocks in which ISA `isa` walks a GEMM of `rows` rows against weights
    of k inputs in storage `dtype` (k: walked whole). Results do not depend on it."""
    return isa_ops(isa).gemm_k_block(rows, k, dtype)


def work_sizes(int64_t T, int top_k, int64_t H, int64_t I, int num_experts,
               int dtype13=MOE_W_F32, int dtype2=MOE_W_F32):
    """(floats, int32s) of scratch that moe_ffn needs for experts whose gate|up and down have
    storage codes dtype13 and dtype2: laid out, as the kernel does, for the wider of their
    activation terms."""
    return (moe_ffn_work_floats(T, top_k, H, I,
                                max(moe_pair_terms(dtype13), moe_pair_terms(dtype2))),
            moe_ffn_iwork_ints(T, top_k, num_experts))


def moe_ffn(uintptr_t x, int64_t T, int64_t H, uintptr_t idx, uintptr_t weight, int top_k,
            uintptr_t table, int num_experts, int glu, float alpha, float limit, uintptr_t out,
            uintptr_t work, uintptr_t iwork, int nthreads, int isa):
    """Routed SwiGLU experts (moe_isa.h). `table` is int64 [num_experts, TABLE_COLUMNS]: for
    w13 then w2, (data, scale, n, k, dtype), then the biases b13 and b2 (0: none); data 0 marks
    an absent expert. `glu` is GLU_SILU or GLU_CLAMPED (alpha, limit). Releases the GIL."""
    cdef const moe_isa_ops *ops = isa_ops(isa)
    cdef const int64_t *t = <const int64_t *>table
    cdef moe_expert *experts = <moe_expert *>malloc(sizeof(moe_expert) * max(num_experts, 1))
    cdef moe_glu act
    cdef int e, rc
    cdef int64_t c
    if experts == NULL:
        raise MemoryError("moe_ffn: expert table")
    act.kind = glu
    act.alpha = alpha
    act.limit = limit
    for e in range(num_experts):
        c = e * TABLE_COLUMNS
        experts[e].w13 = _packed(<uintptr_t>t[c], <uintptr_t>t[c + 1], t[c + 2], t[c + 3],
                                 <int>t[c + 4])
        experts[e].w2 = _packed(<uintptr_t>t[c + 5], <uintptr_t>t[c + 6], t[c + 7], t[c + 8],
                                <int>t[c + 9])
        experts[e].b13 = <const float *><uintptr_t>t[c + 10]
        experts[e].b2 = <const float *><uintptr_t>t[c + 11]
    nthreads = max(nthreads, 1)
    with nogil:
        rc = ops.moe_ffn(<const float *>x, T, H, <const int64_t *>idx, <const float *>weight,
                         top_k, experts, num_experts, &act, <float *>out, <float *>work,
                         <int32_t *>iwork, nthreads)
    free(experts)
    if rc == -1:
        raise ValueError("moe_ffn: a routed expert index is out of range or names an absent expert")
    if rc == -4:
        raise ValueError(f"moe_ffn: int8q weights take at most {MOE_I8Q_MAX_K} inputs")
    if rc == -3:
        raise ValueError("moe_ffn: the experts of one call mix bf16p, bf16x3 or i8q with other "
                         "storage")
    if rc != 0:
        raise MemoryError("moe_ffn: scratch allocation failed")


PROBE_FMA, PROBE_BF16_DOT, PROBE_I8_DOT = MOE_PROBE_FMA, MOE_PROBE_BF16_DOT, MOE_PROBE_I8_DOT


def probe_flops(int isa, int kind=MOE_PROBE_FMA):
    """FLOPs one iteration of fma_probe(kind) does on one thread of ISA `isa`."""
    return isa_ops(isa).probe_flops(kind)


def fma_probe(int64_t n, int nthreads, int isa, int kind=MOE_PROBE_FMA):
    """Checksum of n iterations per thread of the FLOP/s probe (probe_flops each): 12
    independent chains of fp32 FMAs (PROBE_FMA), bf16 pair dot products (PROBE_BF16_DOT; on
    the amx build, four independent tdpbf16ps) or int8 quad dot products (PROBE_I8_DOT)."""
    cdef const moe_isa_ops *ops = isa_ops(isa)
    cdef double r
    nthreads = max(nthreads, 1)
    with nogil:
        r = ops.fma_probe(n, nthreads, kind)
    return r
