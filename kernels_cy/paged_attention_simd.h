/* SIMD step of the CPU decode-attention kernel (kernels_cy/paged_attention.pyx).
 *
 * paged_attention.pyx owns the structure (tasks, block tables, blocks, head tiles); this header
 * owns the one step that must run at memory speed: fold a chunk of <= 16 cached tokens into the
 * online-softmax state of a tile of T query heads that share one KV head.
 *
 * Why GCC/Clang vector extensions and not plain loops: the q.k dot product is a reduction, which
 * GCC only vectorizes with -ffast-math (reassociation), and the T accumulators must stay in
 * registers across the chunk, which the auto-vectorizer does not guarantee (see the report of
 * -fopt-info-vec in docs/benchmarks.md). Vector types give both while staying portable: on a
 * CPU without AVX-512 the compiler splits a 16-lane vector into narrower ones. Intrinsics are
 * used only for the two storage conversions where GCC's generic code is poor (bf16: it emits a
 * 6-instruction widen instead of vpmovzxwd; fp16: it scalarizes _Float16 vectors without
 * AVX512-FP16), each with a portable fallback.
 */
#ifndef MOE_PAGED_ATTENTION_SIMD_H
#define MOE_PAGED_ATTENTION_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* Without AVX-512, GCC notes that 64-byte vector arguments have a different ABI; every function
 * here is static inline, so no call crosses an ABI boundary. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#define MOE_LANES 16
/* Storage dtype codes shared with paged_attention.pyx. */
#define MOE_DT_F32 0
#define MOE_DT_BF16 1
#define MOE_DT_F16 2

typedef float moe_v16f __attribute__((vector_size(64)));
typedef int32_t moe_v16i __attribute__((vector_size(64)));
typedef uint32_t moe_v16u __attribute__((vector_size(64)));
typedef uint16_t moe_v16h __attribute__((vector_size(32)));
typedef float moe_v8f __attribute__((vector_size(32)));
typedef float moe_v4f __attribute__((vector_size(16)));

static inline moe_v16f moe_load_f32(const void *p) {
    moe_v16f v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline void moe_store_f32(float *p, moe_v16f v) { memcpy(p, &v, sizeof v); }

/* bf16 is the top half of an fp32: widen to 32 bits and shift left by 16. */
static inline moe_v16f moe_load_bf16(const void *p) {
#if defined(__AVX512F__)
    __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    return (moe_v16f)_mm512_castsi512_ps(w);
#else
    moe_v16h h;
    memcpy(&h, p, sizeof h);
    return (moe_v16f)(__builtin_convertvector(h, moe_v16u) << 16);
#endif
}

static inline moe_v16f moe_load_f16(const void *p) {
#if defined(__AVX512F__)
    return (moe_v16f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    const __m128i *q = (const __m128i *)p;
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(q)), hi = _mm256_cvtph_ps(_mm_loadu_si128(q + 1));
    moe_v8f a = (moe_v8f)lo, b = (moe_v8f)hi;
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    /* Exponent rebias by multiplication: shifting the 15 exponent+mantissa bits into fp32
     * position and scaling by 2^112 yields the exact value for normal and subnormal halves;
     * only inf/nan (exponent all ones) need their exponent forced to all ones. */
    moe_v16h raw;
    memcpy(&raw, p, sizeof raw);
    moe_v16u h = __builtin_convertvector(raw, moe_v16u);
    moe_v16u em = (h & 0x7fffu) << 13;
    moe_v16u bits = (moe_v16u)((moe_v16f)em * 0x1p112f);
    moe_v16u special = (moe_v16u)((h & 0x7c00u) == 0x7c00u);
    bits = (bits & ~special) | ((em | 0x7f800000u) & special);
    return (moe_v16f)(bits | ((h & 0x8000u) << 16));
#endif
}

static inline float moe_hsum(moe_v16f v) {
    moe_v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    moe_v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    b = b + __builtin_shufflevector(b, b, 2, 3, 0, 1);
    b = b + __builtin_shufflevector(b, b, 1, 0, 3, 2);
    return b[0];
}

/* exp(x) for x <= 0 (scores minus their running max). Cephes-style: x = n*ln2 + r with
 * |r| <= ln2/2, a degree-7 polynomial for e^r (relative error ~1e-7), 2^n built in the exponent
 * bits. Inputs below -87 are clamped there (result ~1e-38 instead of 0, far below fp32 resolution
 * of the running sum, which is >= 1). */
static inline moe_v16f moe_vexp(moe_v16f x) {
    const moe_v16f lo = (moe_v16f){0} - 87.0f;
    moe_v16i below = (moe_v16i)(x < lo);
    x = (moe_v16f)(((moe_v16i)lo & below) | ((moe_v16i)x & ~below));
    /* round to nearest by the 1.5*2^23 trick: exact for |t| < 2^22 */
    moe_v16f n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    moe_v16f r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    moe_v16f p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    moe_v16i e = (__builtin_convertvector(n, moe_v16i) + 127) << 23;
    return p * (moe_v16f)e;
}

/* Softmax reference max moves only when a score exceeds it by this much (natural-log units). */
#define MOE_RESCALE_MARGIN 8.0f

/* Any lane of a comparison result set. */
static inline int moe_any(moe_v16i mask) {
#if defined(__AVX512F__)
    return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask) != 0;
#else
    int any = 0;
    for (int i = 0; i < MOE_LANES; i++) any |= mask[i];
    return any != 0;
#endif
}

static inline moe_v16f moe_vmax(moe_v16f a, moe_v16f b) {
    moe_v16i gt = (moe_v16i)(a > b);
    return (moe_v16f)(((moe_v16i)a & gt) | ((moe_v16i)b & ~gt));
}

/* Max over the lanes, broadcast to every lane (full-width permutes: no narrow vector types). */
static inline moe_v16f moe_hmax_all(moe_v16f v) {
    v = moe_vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = moe_vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = moe_vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    return moe_vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
}

/* Loads of 32 consecutive stored elements as two fp32 vectors (LOAD2) and of 16 (LOAD1, for a
 * head_dim that ends in a half group). bf16 uses its lane order: a 32-bit word holds elements
 * 2i (low half) and 2i+1 (high half), so one 64-byte load gives the even elements by a shift and
 * the odd ones by a mask, two ALU operations per 32 elements instead of four with widening.
 * The caller stores q and the accumulator in the same order (moe_bf16_order) and undoes it at
 * the end; f32 and f16 keep the natural order. */
static inline void moe_load2_f32(const void *p, moe_v16f *lo, moe_v16f *hi) {
    *lo = moe_load_f32(p);
    *hi = moe_load_f32((const char *)p + 64);
}
static inline void moe_load2_f16(const void *p, moe_v16f *lo, moe_v16f *hi) {
    *lo = moe_load_f16(p);
    *hi = moe_load_f16((const char *)p + 32);
}
static inline void moe_load2_bf16(const void *p, moe_v16f *even, moe_v16f *odd) {
    moe_v16u w;
    memcpy(&w, p, sizeof w);
    *even = (moe_v16f)(w << 16);
    *odd = (moe_v16f)(w & 0xffff0000u);
}

/* r[j] = sum of the lanes of a[j], j < 16: a transposing reduction (4 levels of two-input
 * shuffles and adds, 45 operations) instead of 16 separate horizontal sums (128). */
static inline moe_v16f moe_sum16x16(const moe_v16f *a) {
    moe_v16f r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; i++)
        r1[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                        19, 20, 21, 22, 23) +
                __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                        26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        r2[i] = __builtin_shufflevector(r1[2 * i], r1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                        18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(r1[2 * i], r1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                        22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        r3[i] = __builtin_shufflevector(r2[2 * i], r2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                        20, 21, 24, 25, 28, 29) +
                __builtin_shufflevector(r2[2 * i], r2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                        22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(r3[0], r3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                   28, 30) +
           __builtin_shufflevector(r3[0], r3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31);
}

/* One chunk of ntok (1..16) consecutive cached tokens for a tile of T query heads:
 *   q    [T, d]  fp32, multiplied by the softmax scale, in the storage's lane order
 *   k, v [ntok, d] rows of one (block, KV head) in storage dtype, row stride d
 *   m    [T]     reference max: exponents are taken as exp(s - m)
 *   l    [T, 16] running sum of exp, kept per lane (summed once at the end)
 *   acc  [T, d]  running unnormalized output, in the storage's lane order
 * d is a multiple of 16. The q.k partial sums of each token stay vectors until the transposing
 * reduction turns 16 of them into one vector of scores. The first loop takes two tokens at a
 * time so that 2*T independent FMA chains hide the FMA latency.
 * Lazy rescaling: m only moves when a score exceeds it by MOE_RESCALE_MARGIN, so most chunks
 * skip the horizontal max, the exp of the correction and the pass over acc; exponents stay below
 * e^MOE_RESCALE_MARGIN, far from fp32 overflow. */
#define MOE_DEFINE_CHUNK(NAME, LOAD2, LOAD1, ESIZE, T)                                            \
    static inline void NAME(const float *q, const void *k, const void *v, int ntok, int d,     \
                            float *m, float *l, float *acc, const char *pfk, const char *pfv,  \
                            int pf_bytes) {                                                    \
        const char *kc = (const char *)k, *vc = (const char *)v;                               \
        /* prefetches spread over the 8 token pairs: a burst would stall on fill buffers */     \
        const int pf_step = (((pf_bytes + 7) >> 3) + 63) & ~63;                                 \
        const int64_t row = (int64_t)d * ESIZE;                                                \
        const int d32 = d & ~31;                                                                \
        moe_v16f part[T][MOE_LANES];                                                            \
        float p[T][MOE_LANES] __attribute__((aligned(64)));                                    \
        for (int j = 0; j < MOE_LANES; j += 2) {                                                \
            moe_v16f a[T], b[T];                                                                \
            for (int t = 0; t < T; t++) a[t] = b[t] = (moe_v16f){0};                            \
            for (int o = (j >> 1) * pf_step; o < pf_bytes && o < ((j >> 1) + 1) * pf_step; o += 64) { \
                __builtin_prefetch(pfk + o, 0, 3);                                            \
                __builtin_prefetch(pfv + o, 0, 3);                                            \
            }                                                                                   \
            if (j < ntok) {                                                                     \
                /* a row past ntok is never read: the odd token of the last pair reuses row j */ \
                const char *k0 = kc + j * row, *k1 = kc + (j + 1 < ntok ? j + 1 : j) * row;     \
                int c = 0;                                                                      \
                for (; c < d32; c += 2 * MOE_LANES) {                                           \
                    moe_v16f k0a, k0b, k1a, k1b;                                                \
                    LOAD2(k0 + c * ESIZE, &k0a, &k0b);                                          \
                    LOAD2(k1 + c * ESIZE, &k1a, &k1b);                                          \
                    for (int t = 0; t < T; t++) {                                               \
                        moe_v16f qa = moe_load_f32(q + t * d + c);                              \
                        moe_v16f qb = moe_load_f32(q + t * d + c + MOE_LANES);                  \
                        a[t] += qa * k0a;                                                       \
                        b[t] += qa * k1a;                                                       \
                        a[t] += qb * k0b;                                                       \
                        b[t] += qb * k1b;                                                       \
                    }                                                                           \
                }                                                                               \
                if (c < d) {                                                                    \
                    moe_v16f k0a = LOAD1(k0 + c * ESIZE), k1a = LOAD1(k1 + c * ESIZE);          \
                    for (int t = 0; t < T; t++) {                                               \
                        moe_v16f qa = moe_load_f32(q + t * d + c);                              \
                        a[t] += qa * k0a;                                                       \
                        b[t] += qa * k1a;                                                       \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            for (int t = 0; t < T; t++) {                                                       \
                part[t][j] = a[t];                                                              \
                part[t][j + 1] = b[t];                                                          \
            }                                                                                   \
        }                                                                                       \
        const moe_v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};           \
        const moe_v16i live = (moe_v16i)(lane < ntok);                                          \
        const moe_v16f ninf = (moe_v16f){0} - INFINITY;                                         \
        for (int t = 0; t < T; t++) {                                                           \
            moe_v16f sv = moe_sum16x16(part[t]);                                                \
            sv = (moe_v16f)(((moe_v16i)sv & live) | ((moe_v16i)ninf & ~live));                 \
            if (moe_any(sv > (moe_v16f){0} + (m[t] + MOE_RESCALE_MARGIN))) {                    \
                float mx = moe_hmax_all(sv)[0];                                                 \
                float alpha = expf(m[t] - mx); /* 0 on the first chunk, where m = -inf */      \
                m[t] = mx;                                                                      \
                moe_store_f32(l + t * MOE_LANES, moe_load_f32(l + t * MOE_LANES) * alpha);      \
                for (int c = 0; c < d; c += MOE_LANES)                                          \
                    moe_store_f32(acc + t * d + c, moe_load_f32(acc + t * d + c) * alpha);      \
            }                                                                                   \
            moe_v16f e = moe_vexp(sv - m[t]); /* padding lanes: exp(-inf) -> ~0, then masked */ \
            e = (moe_v16f)((moe_v16i)e & live);                                                 \
            moe_store_f32(p[t], e);                                                             \
            moe_store_f32(l + t * MOE_LANES, moe_load_f32(l + t * MOE_LANES) + e);              \
        }                                                                                       \
        int c = 0;                                                                              \
        for (; c < d32; c += 2 * MOE_LANES) {                                                   \
            moe_v16f oa[T], ob[T];                                                              \
            for (int t = 0; t < T; t++) {                                                       \
                oa[t] = moe_load_f32(acc + t * d + c);                                          \
                ob[t] = moe_load_f32(acc + t * d + c + MOE_LANES);                              \
            }                                                                                   \
            for (int j = 0; j < ntok; j++) {                                                    \
                moe_v16f va, vb;                                                                \
                LOAD2(vc + j * row + c * ESIZE, &va, &vb);                                      \
                for (int t = 0; t < T; t++) {                                                   \
                    oa[t] += p[t][j] * va;                                                      \
                    ob[t] += p[t][j] * vb;                                                      \
                }                                                                               \
            }                                                                                   \
            for (int t = 0; t < T; t++) {                                                       \
                moe_store_f32(acc + t * d + c, oa[t]);                                          \
                moe_store_f32(acc + t * d + c + MOE_LANES, ob[t]);                              \
            }                                                                                   \
        }                                                                                       \
        if (c < d) {                                                                            \
            moe_v16f oa[T];                                                                     \
            for (int t = 0; t < T; t++) oa[t] = moe_load_f32(acc + t * d + c);                  \
            for (int j = 0; j < ntok; j++) {                                                    \
                moe_v16f va = LOAD1(vc + j * row + c * ESIZE);                                  \
                for (int t = 0; t < T; t++) oa[t] += p[t][j] * va;                              \
            }                                                                                   \
            for (int t = 0; t < T; t++) moe_store_f32(acc + t * d + c, oa[t]);                  \
        }                                                                                       \
    }

#define MOE_DEFINE_DTYPE(DT, ESIZE)                                                   \
    MOE_DEFINE_CHUNK(moe_chunk_##DT##_1, moe_load2_##DT, moe_load_##DT, ESIZE, 1) \
    MOE_DEFINE_CHUNK(moe_chunk_##DT##_2, moe_load2_##DT, moe_load_##DT, ESIZE, 2) \
    MOE_DEFINE_CHUNK(moe_chunk_##DT##_4, moe_load2_##DT, moe_load_##DT, ESIZE, 4) \
    MOE_DEFINE_CHUNK(moe_chunk_##DT##_8, moe_load2_##DT, moe_load_##DT, ESIZE, 8)

MOE_DEFINE_DTYPE(f32, 4)
MOE_DEFINE_DTYPE(bf16, 2)
MOE_DEFINE_DTYPE(f16, 2)

/* Position, in bf16 lane order, of element i of a row of d elements: inside each full group of
 * 32, even elements come first, then odd ones (see moe_load2_bf16); a final half group of 16
 * keeps its order. */
static inline int moe_bf16_order(int i, int d) {
    int base = i & ~31, r = i & 31;
    if (base + 32 > d) return i;
    return base + (r & 1) * 16 + (r >> 1);
}

/* Sum of n floats (n a multiple of 64) with four independent vector chains: a pure streaming
 * read used by the benchmark as the machine's read-bandwidth roof. */
static inline double moe_read_sum(const float *p, int64_t n) {
    moe_v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t i = 0; i < n; i += 4 * MOE_LANES) {
        a0 += moe_load_f32(p + i);
        a1 += moe_load_f32(p + i + MOE_LANES);
        a2 += moe_load_f32(p + i + 2 * MOE_LANES);
        a3 += moe_load_f32(p + i + 3 * MOE_LANES);
    }
    return (double)moe_hsum((a0 + a1) + (a2 + a3));
}

/* Largest tile (8, 4, 2, 1 heads) that fits in the remaining heads of a GQA group. */
static inline int moe_tile_heads(int remaining) {
    return remaining >= 8 ? 8 : remaining >= 4 ? 4 : remaining >= 2 ? 2 : 1;
}

static inline void moe_attend_chunk(int dtype, int tile, const float *q, const void *k,
                                    const void *v, int ntok, int d, float *m, float *l,
                                    float *acc, const char *pfk, const char *pfv, int pf_bytes) {
#define MOE_CASE(DTC, DT)                                                        \
    case DTC:                                                                    \
        switch (tile) {                                                          \
            case 8: moe_chunk_##DT##_8(q, k, v, ntok, d, m, l, acc, pfk, pfv, pf_bytes); return;     \
            case 4: moe_chunk_##DT##_4(q, k, v, ntok, d, m, l, acc, pfk, pfv, pf_bytes); return;     \
            case 2: moe_chunk_##DT##_2(q, k, v, ntok, d, m, l, acc, pfk, pfv, pf_bytes); return;     \
            default: moe_chunk_##DT##_1(q, k, v, ntok, d, m, l, acc, pfk, pfv, pf_bytes); return;    \
        }
    switch (dtype) {
        MOE_CASE(MOE_DT_F32, f32)
        MOE_CASE(MOE_DT_BF16, bf16)
        MOE_CASE(MOE_DT_F16, f16)
    }
#undef MOE_CASE
}

#endif
