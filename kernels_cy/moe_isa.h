/* Run-time ISA dispatch for the CPU kernels: the interface every ISA build implements.
 *
 * kernels_cy/isa_<name>.c compiles the same templates (packed_gemm_impl.h,
 * paged_attention_impl.h) once per instruction set with that set's flags (setup.py), each
 * defining one moe_isa_ops table (isa_ops_table.h);
 * isa_dispatch.c picks the best table the running CPU supports (CPUID) when the extension loads,
 * so one build runs at the machine's roofs on an AVX2-only EPYC and on an AVX-512 Xeon alike,
 * and never executes an instruction the CPU lacks.
 *
 * Packed weight layout (see moe_engine/model/packed.py, which packs): a weight W [N, K] (out x in)
 * is cut into panels of MOE_NR = 32 output columns, padded with zero rows; panel p stores, for
 * each k, one "k-row" of 32 elements, so the inner loop streams the panel contiguously.
 *   f32, f16, i8: element c of a k-row is W[32p + c, k] (natural order)
 *   bf16: element 2i is W[32p + i, k] and 2i+1 is W[32p + 16 + i, k] (i < 16): one 32-bit word
 *         then holds columns i and 16+i, and a shift and a mask widen 32 of them to fp32
 *   i8 also has a per-output-channel fp32 scale, in packed column order: scale[32p + c]
 *   i4: byte i (i < 16) of a k-row holds column i in its low nibble and column 16+i in its high
 *       one, each q in [0, 15] for W = (q - 8) * scale; scale is [P, k/G, 32] fp32 per group of
 *       G = MOE_I4_GROUP inputs and output column (Klotski's group-wise 4-bit)
 *   fp4 (MXFP4, the OCP microscaling format GPT-OSS ships its experts in): nibbles placed as i4,
 *       each an E2M1 code (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6
 *       and their negatives), W = value * 2^(e - 127) with e the group's E8M0 scale byte;
 *       scale is [P, k/32, 32] uint8 (groups of 32 inputs, as the format has them). Decoded
 *       in registers by a table lookup (a permute), never widened in memory.
 *   bf16p (bf16 pairs, engine.matmul_precision=medium): k is taken in pairs (k odd: padded with
 *       a zero input); a panel holds ceil(k/2) "pair-rows" of 32 32-bit words, word c of pair-row
 *       j holding W[32p + c, 2j] (low half) and W[32p + c, 2j + 1] (high half). The activations
 *       are rounded to bf16 (to nearest even) and paired the same way, so one AVX512-BF16
 *       vdpbf16ps does both multiply-adds of a pair in each lane; builds without it widen both
 *       halves and do the two FMAs (the odd product first, as the instruction's definition),
 *       which matches the instruction up to its last bit (its rounding inside the pair is the
 *       hardware's: ~1% of lanes differ by an ulp on AMD Zen 4) and subnormals (vdpbf16ps
 *       flushes them to zero, the emulation keeps them).
 *   i8q (int8 quads, engine.matmul_precision=medium on int8 experts): the int8 values and
 *       per-output-channel scales of i8, with k taken in quads (k padded with zero inputs to a
 *       multiple of 4): a panel holds ceil(k/4) "quad-rows" of 32 32-bit words, byte i of word
 *       c of quad-row j holding W[32p + c, 4j + i]. scale is [P*32] fp32 column scales, then
 *       [P*32] int32 column corrections 128 * sum_k W[c, k] (in packed column order). The
 *       GEMM quantizes each activation row to int8, symmetric (s = max|x| / 127, q =
 *       rint(x * (127 / max|x|))), offset to unsigned bytes q + 128, so that one AVX512-VNNI
 *       vpdpbusd does four multiply-adds a lane into int32; other builds compute the same
 *       integer sums exactly (vpmaddwd, or plain multiplies).
 *       An output is (float)(sum - correction) * s_row * scale_col (+ bias): the integer sum
 *       is exact in any order, so a row's result depends on nothing but the row, and the
 *       sums are the same on every build (what follows them, a SwiGLU's exp, is the same on
 *       the FMA builds).
 * Every ISA computes each output as one fp32 FMA chain over k in increasing order, so a row's
 * result does not depend on the other rows of the call (batch invariance) nor on the ISA when
 * the ISA has FMA (bf16p: the FMA builds agree with each other; vdpbf16ps differs by its own
 * rounding, above).
 */
#ifndef MOE_ISA_H
#define MOE_ISA_H

#include <stdint.h>

#define MOE_NR 32
#define MOE_I4_GROUP 32
/* Spare rows after the activations a bf16p, bf16x3 or i8q GEMM reads (its own scratch, sized
 * here): AMX tiles load whole 16-row tiles, up to 31 rows past a call's last. */
#define MOE_PAD_ROWS 32

/* Storage dtypes of packed weights; KV caches use the first three. */
enum moe_wdtype {
    MOE_W_F32 = 0, MOE_W_BF16 = 1, MOE_W_F16 = 2, MOE_W_I8 = 3, MOE_W_I4 = 4, MOE_W_FP4 = 5,
    MOE_W_BF16P = 6, MOE_W_BF16X3 = 7, MOE_W_I8Q = 8
};
/* bf16p and bf16x3 hold the same panels (bf16 weights in pairs of k). bf16p's GEMMs round each
 * activation to bf16 (one term); bf16x3's split it into three bf16 terms whose sum is the fp32
 * value exactly (8 + 8 + 8 significand bits), so their products, each exact in fp32, add up to
 * fp32 GEMM results at three times bf16p's multiply-adds. The activation rows then hold three
 * planes of pair words: term t of pair j at word t * (row stride / 3) + j. */
static inline int moe_pair_terms(int dtype) {
    return dtype == MOE_W_BF16P ? 1 : dtype == MOE_W_BF16X3 ? 3 : 0;
}
/* i8q: the most inputs a GEMM may have, so that a sum of k products of bytes (up to 255 *
 * 127 each) stays within int32. */
#define MOE_I8Q_MAX_K 65536
enum moe_act { MOE_ACT_NONE = 0, MOE_ACT_SIGMOID = 1 };
enum moe_probe { MOE_PROBE_FMA = 0, MOE_PROBE_BF16_DOT = 1, MOE_PROBE_I8_DOT = 2 };
/* The experts' gated activation: SiLU(gate) * up, or GPT-OSS's clamped form
 * (up + 1) * g * sigmoid(alpha * g) with g = min(gate, limit), up clamped to [-limit, limit]. */
enum moe_glu_kind { MOE_GLU_SILU = 0, MOE_GLU_CLAMPED = 1 };
typedef struct {
    int kind;
    float alpha, limit; /* MOE_GLU_CLAMPED only */
} moe_glu;
/* AVX512BF16: the AVX-512 build plus vdpbf16ps for bf16p weights (every other path as AVX512).
 * AMX: AVX512BF16 with bf16p and bf16x3 weights on AMX tiles (tdpbf16ps), and i8q weights too
 * (tdpbusd; amx_tiles.h). */
/* AVXVNNI: the AVX2 build plus the VEX vpdpbusd for i8q weights (every other path as AVX2).
 * AVX512VNNI: the AVX-512 build plus the EVEX vpdpbusd for i8q weights (likewise).
 * The codes are in order of preference (moe_isa_best takes the highest the CPU runs). */
enum moe_isa {
    MOE_ISA_GENERIC = 0, MOE_ISA_AVX2 = 1, MOE_ISA_AVXVNNI = 2, MOE_ISA_AVX512 = 3,
    MOE_ISA_AVX512VNNI = 4, MOE_ISA_AVX512BF16 = 5, MOE_ISA_AMX = 6, MOE_ISA_COUNT = 7
};

/* A packed weight: data in the layout above, n true output columns, k inputs. */
typedef struct {
    const void *data;
    const void *scale; /* i8: [P*32] fp32; i4: [P, k/G, 32] fp32; fp4: [P, k/32, 32] uint8;
                        * else NULL */
    int64_t n, k;
    int dtype;
} moe_packed;

/* One SwiGLU expert as the kernels hold it: w13 packs gate|up so that panel p's columns 0-15
 * are gate rows 16p..16p+15 and its columns 16-31 the up rows of the same indices (n = 2*I
 * padded to a multiple of 32); w2 is down [H, I]. Biases (GPT-OSS; NULL: none) follow the
 * packed columns and are padded to whole panels: b13 [P13*32] (gate then up per panel), b2
 * [P2*32]. */
typedef struct {
    moe_packed w13, w2;
    const float *b13, *b2;
} moe_expert;

/* One decode-attention call (paged_attention_impl.h): one new query token per sequence against
 * its cached keys and values. Cache layout, one layer: [num_blocks, n_kv_heads, block_size,
 * head_dim], so a (block, KV head) is one contiguous run. Query heads h*G..h*G+G-1 share KV
 * head h (G = n_q_heads / n_kv_heads). */
typedef struct {
    const float *query; /* [num_seqs, n_q_heads, head_dim] fp32 */
    float *out;         /* [num_seqs, n_q_heads, head_dim] fp32 */
    const void *key_cache, *value_cache;
    const int32_t *block_tables; /* [num_seqs, max_blocks_per_seq] */
    const int32_t *context_lens; /* [num_seqs] */
    int num_seqs, n_q_heads, n_kv_heads, head_dim, block_size, max_blocks_per_seq;
    int dtype; /* MOE_W_F32, MOE_W_BF16 or MOE_W_F16 */
    float scale; /* multiplies q.k */
    /* GPT-OSS: per query head, a logit that joins the softmax denominator with no value
     * (NULL: none); window > 0 attends only the last `window` tokens of each context. */
    const float *sinks; /* [n_q_heads] fp32 or NULL */
    int window;
} moe_attn_args;

typedef struct {
    const char *name;
    int lanes; /* fp32 lanes of one vector */
    /* y[t, :n] = act(x[t, :k] @ W^T (+ bias)) for t < T; x row stride ldx, y row stride ldy;
     * act is MOE_ACT_*, applied per element in scalar code (torch's vectorized sigmoid rounds
     * differently in a vector's tail, so a row's result would depend on its position).
     * Returns 0, -2 when its scratch (the bf16 pairs of x for bf16p weights, the bias
     * padded to whole panels) could not be allocated, or -4 for i8q weights of more than
     * MOE_I8Q_MAX_K inputs. */
    int (*linear)(const float *x, int64_t ldx, int64_t T, const moe_packed *w, const float *bias,
                   int act, float *y, int64_t ldy, int nthreads);
    /* Routed SwiGLU experts over T tokens with top_k choices each: out[t] = sum over s < top_k
     * (in s order) of weight[t, s] * expert[idx[t, s]](x[t]), an expert computing
     * down(glu(gate|up(x) + b13)) + b2. experts[e].w13.data NULL means
     * the expert is absent (its rows must not occur). work and iwork are scratch of
     * moe_ffn_work_floats and moe_ffn_iwork_ints. Returns 0, -1 for an index naming an absent or
     * out-of-range expert, -2 when out of memory, -3 when the present experts mix bf16p with
     * other storage, -4 for i8q weights of more than MOE_I8Q_MAX_K inputs. */
    int (*moe_ffn)(const float *x, int64_t T, int64_t H, const int64_t *idx, const float *weight,
                    int top_k, const moe_expert *experts, int num_experts, const moe_glu *glu,
                    float *out, float *work, int32_t *iwork, int nthreads);
    /* FLOP/s probe: n iterations of 12 chains per thread of fp32 FMAs (MOE_PROBE_FMA), of
     * bf16 pair dot products (MOE_PROBE_BF16_DOT: vdpbf16ps, two multiply-adds a lane, where
     * the build has it; elsewhere the two FMAs bf16p weights cost; on the amx build four
     * tdpbf16ps on tiles) or of int8 quad dot products (MOE_PROBE_I8_DOT: vpdpbusd, four
     * multiply-adds a lane, where the build has it; elsewhere i8q's vpmaddwd; on the amx build
     * four tdpbusd on tiles); returns a checksum. */
    double (*fma_probe)(int64_t n, int nthreads, int kind);
    /* FLOPs one iteration of fma_probe(kind) does on one thread. */
    int64_t (*probe_flops)(int kind);
    /* Paged decode attention, one task per (sequence, KV head) on nthreads threads; head_dim a
     * multiple of `lanes`; block ids and context lengths already checked by the caller (they
     * index memory). fp32 online softmax and accumulation; a sequence with no context gets
     * zeros; a sequence's result does not depend on the others of the call nor on nthreads.
     * Returns 0, or -2 when per-thread scratch could not be allocated. */
    int (*decode_attention)(const moe_attn_args *args, int nthreads);
    /* Read-bandwidth probe: sum of n floats (n a multiple of 65536) on nthreads threads. */
    double (*read_sum)(const float *p, int64_t n, int nthreads);
    /* The inputs of the k-blocks in which linear and moe_ffn walk `rows` rows against weights
     * of k inputs in storage dtype (k: walked whole); results do not depend on it. For tests
     * and benchmarks. */
    int64_t (*gemm_k_block)(int64_t rows, int64_t k, int dtype);
} moe_isa_ops;

extern const moe_isa_ops moe_ops_generic;
extern const moe_isa_ops moe_ops_avx2;
extern const moe_isa_ops moe_ops_avxvnni;
extern const moe_isa_ops moe_ops_avx512;
extern const moe_isa_ops moe_ops_avx512vnni;
extern const moe_isa_ops moe_ops_avx512bf16;
extern const moe_isa_ops moe_ops_amx;

/* The row stride (in 4-byte words) of the kernels' own activation buffers of n words a row: n
 * rounded up to whole 64-byte lines, then to an odd number of lines, so that the 16 rows an AMX
 * tile (or a register tile) reads fall into different L1 sets. Rows 4 KB apart (a 1024-wide
 * fp32 row, or its bf16 pairs at 2048) would all map to one set and evict each other. */
static inline int64_t moe_row_stride(int64_t n) { return (((n + 15) / 16) | 1) * 16; }

/* The row stride (4-byte words) of i8q activations for k inputs: the quads, then at least one
 * word, the last of the row, which holds the row's scale. The moe_ffn work rows (fp32 row
 * strides) meet it too: moe_row_stride(n) > (n + 3) / 4 for every n >= 1. */
static inline int64_t moe_q8_stride(int64_t k) { return moe_row_stride((k + 3) / 4 + 1); }

/* The row stride of activations of n inputs as a GEMM on weights of `terms` (moe_pair_terms)
 * reads them: fp32 or bf16 pairs (0, 1) at the fp32 row's stride, three planes of pair words
 * (3) each at moe_row_stride(ceil(n/2)), still an odd number of lines in all. */
static inline int64_t moe_act_stride(int64_t n, int terms) {
    return terms == 3 ? 3 * moe_row_stride((n + 1) / 2) : moe_row_stride(n);
}

/* Scratch the moe_ffn of T tokens x top_k needs, in floats and int32s, for experts whose
 * weights take `terms` (moe_pair_terms). */
static inline int64_t moe_ffn_work_floats(int64_t T, int top_k, int64_t H, int64_t I,
                                          int terms) {
    int64_t rows = T * top_k;
    return (rows + MOE_PAD_ROWS) * moe_act_stride(H, terms) /* gathered x */
           + (rows + MOE_PAD_ROWS) * moe_act_stride(I, terms) /* SwiGLU activations */
           /* bf16x3: the SwiGLU outputs in fp32, before they are split into the planes */
           + (terms == 3 ? rows * moe_row_stride(I) : 0)
           + rows * H /* slots */;
}
static inline int64_t moe_ffn_iwork_ints(int64_t T, int top_k, int num_experts) {
    return T * top_k /* rows by expert */ + num_experts + 1 /* offsets */;
}

/* Dispatch (isa_dispatch.c). */
int moe_isa_supported(int isa);
/* Whether the compiler produced the build (setup.py leaves out what it cannot compile). */
int moe_isa_built(int isa);
int moe_isa_best(void);
/* "generic", "avx2", "avxvnni", "avx512", "avx512vnni", "avx512bf16", "amx" (built or not) */
const char *moe_isa_name(int isa);
const moe_isa_ops *moe_isa_get(int isa);

#endif
