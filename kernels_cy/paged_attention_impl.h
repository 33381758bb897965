/* CPU decode attention over a paged KV cache: the template every ISA build instantiates.
 *
 * Included by kernels_cy/isa_<name>.c after defining MOE_VW (isa_vec.h) and MOE_ATTN_TILE (the
 * most query heads per register tile); kernels_cy/paged_attention.pyx checks the arguments and
 * calls the table's decode_attention. The call and cache layout are described in moe_isa.h
 * (moe_attn_args).
 *
 * A task handles one (sequence, KV head) and all query heads of its GQA group, so it streams,
 * per block, one contiguous run of K and one of V, each read from memory once. For each chunk
 * of CH = 16 consecutive tokens and tile of T query heads (attn_chunk):
 *   q.k  each token's partial products stay a vector, two tokens at a time (2T independent FMA
 *        chains hide the FMA latency); a transposing reduction turns VW such vectors of a head
 *        into one vector of VW scores, a lane per token (16 / VW score vectors per chunk);
 *   softmax  online, in fp32, on those score vectors;
 *   P.V  the accumulators of T heads x two vectors of dimensions stay in registers across the
 *        chunk, each V row widened once for all T heads.
 * Registers: q.k holds 2T accumulators, 4 K vectors and 2 q vectors, P.V 2T accumulators, 2 V
 * vectors and a broadcast. AVX-512 has 32 registers: T = 8 (up to 22 live). AVX2 and SSE have
 * 16: T = 4 (up to 14); T = 8 would spill accumulators in the inner loops. The chunk is 16
 * tokens on every ISA (two score vectors on AVX2, four on SSE) so that the softmax step, which
 * is short on arithmetic and long on latency, and the accumulator loads and stores of P.V, are
 * paid once per 16 tokens: 8-token chunks on AVX2 ran at 0.7x the rate.
 *
 * Why vector extensions and not plain loops: the q.k dot product is a reduction, which GCC only
 * vectorizes with -ffast-math (reassociation), and a tile's accumulators must stay in registers
 * across a chunk, which the auto-vectorizer does not guarantee. The storage conversions (bf16
 * shift, fp16 vcvtph2ps) come from isa_vec.h.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa_vec.h"
#include "moe_isa.h"

#if !defined(MOE_ATTN_TILE)
#error "define MOE_ATTN_TILE before including paged_attention_impl.h"
#endif

#define AT MOE_ATTN_TILE
/* Prefetches of the next block go to L2 (prefetcht1): on Zen 4 prefetcht0 into L1 held the
 * line-fill buffers and read the paged cache at half the rate (fp32: 8 vs 16 GB/s, 1 thread);
 * the lines move on to L1 with a second prefetch just before their chunk is used. */
#define PF_L2 2
#define PF_L1 3
/* Keeps a vector in a register: GCC would otherwise fold a q vector used by two FMAs into both
 * as a memory operand, loading it twice, and the q.k loop is then bound by L1 loads (AVX-512:
 * 20 loads of 64 bytes per 16 FMAs; pinned, 12). */
#if defined(__x86_64__) || defined(__i386__)
#define PIN(x) __asm__("" : "+v"(x))
#else
#define PIN(x) ((void)0)
#endif
#define CH 16         /* tokens per chunk, on every ISA */
#define NSV (CH / VW) /* score vectors per chunk */
/* The softmax reference max moves only when a score exceeds it by this much (natural-log
 * units), so most chunks skip the horizontal max, the correction's exp and the pass over the
 * accumulator; exponents stay below e^8, far from fp32 overflow. */
#define RESCALE_MARGIN 8.0f

static inline int attn_esize(int dt) { return dt == MOE_W_F32 ? 4 : 2; }

/* 2*VW consecutive stored elements as two fp32 vectors. bf16 comes in its lane order: the even
 * elements, then the odd ones (cvt_bf16_halves); q and the accumulator use the same order
 * (attn_to_lanes), so the loads need no shuffles. */
static inline __attribute__((always_inline)) void attn_load2(const int dt, const char *p, vf *lo,
                                                            vf *hi) {
    if (dt == MOE_W_F32) {
        *lo = ldf(p);
        *hi = ldf(p + VW * 4);
    } else if (dt == MOE_W_BF16) {
        cvt_bf16_halves(p, lo, hi);
    } else {
        *lo = cvt_f16(p);
        *hi = cvt_f16(p + VW * 2);
    }
}

/* VW elements in natural order: the last half group of a head_dim that is an odd multiple of VW. */
static inline __attribute__((always_inline)) vf attn_load1(const int dt, const char *p) {
    return dt == MOE_W_F32 ? ldf(p) : dt == MOE_W_BF16 ? cvt_bf16(p) : cvt_f16(p);
}

/* y = x * scale for a row of d, x in natural order and y in the loads' lane order (to_lanes),
 * or back (from_lanes): inside each full group of 2*VW bf16 elements, even elements first, then
 * odd ones; a final half group, and every f32/f16 row, keep their order. */
static void attn_to_lanes(int dt, const float *x, float *y, int d, float scale) {
    int i = 0;
    if (dt == MOE_W_BF16)
        for (; i + 2 * VW <= d; i += 2 * VW)
            for (int r = 0; r < VW; r++) {
                y[i + r] = x[i + 2 * r] * scale;
                y[i + VW + r] = x[i + 2 * r + 1] * scale;
            }
    for (; i < d; i++) y[i] = x[i] * scale;
}

static void attn_from_lanes(int dt, const float *x, float *y, int d, float scale) {
    int i = 0;
    if (dt == MOE_W_BF16)
        for (; i + 2 * VW <= d; i += 2 * VW)
            for (int r = 0; r < VW; r++) {
                y[i + 2 * r] = x[i + r] * scale;
                y[i + 2 * r + 1] = x[i + VW + r] * scale;
            }
    for (; i < d; i++) y[i] = x[i] * scale;
}

/* r[j] = sum of the lanes of a[j], j < VW: a transposing reduction (log2(VW) levels of
 * two-input shuffles and adds, 3(VW-1) operations) instead of VW horizontal sums. The first
 * levels shuffle within 128-bit lanes (unpck, shufps: one cheap uop each); the cross-lane
 * shuffles come last, when few vectors are left. */
static inline vf attn_sum_lanes(const vf *a) {
#if VW == 16
    vf x[8], y[4], z[2];
    for (int i = 0; i < 8; i++)
        x[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24,
                                       9, 25, 12, 28, 13, 29) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 18, 3, 19, 6, 22, 7, 23, 10, 26,
                                       11, 27, 14, 30, 15, 31);
    for (int i = 0; i < 4; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                       24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                       26, 27, 14, 15, 30, 31);
    /* y[i], 128-bit group g: the sums over group g of a[4i..4i+3] */
    for (int i = 0; i < 2; i++)
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(y[2 * i], y[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                       22, 23, 28, 29, 30, 31);
    return __builtin_shufflevector(z[0], z[1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                                   26, 27) +
           __builtin_shufflevector(z[0], z[1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                                   30, 31);
#elif VW == 8
    vf x[4], y[2];
    for (int i = 0; i < 4; i++)
        x[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    for (int i = 0; i < 2; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(y[0], y[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(y[0], y[1], 4, 5, 6, 7, 12, 13, 14, 15);
#elif VW == 4
    vf x[2];
    for (int i = 0; i < 2; i++)
        x[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 4, 1, 5) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 6, 3, 7);
    return __builtin_shufflevector(x[0], x[1], 0, 1, 4, 5) +
           __builtin_shufflevector(x[0], x[1], 2, 3, 6, 7);
#else
#error "MOE_VW must be 4, 8 or 16"
#endif
}

/* Any lane of a comparison result set. */
static inline int attn_any(vi mask) {
#if VW == 16 && defined(__AVX512F__)
    return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask) != 0;
#elif VW == 8 && defined(__AVX__)
    return _mm256_movemask_ps((__m256)mask) != 0;
#elif VW == 4 && defined(__SSE__)
    return _mm_movemask_ps((__m128)mask) != 0;
#else
    int any = 0;
    for (int i = 0; i < VW; i++) any |= mask[i];
    return any != 0;
#endif
}

/* Fold a chunk of ntok (1..CH) consecutive cached tokens into the online-softmax state of a
 * tile of T query heads sharing one KV head:
 *   q    [T, d]  fp32, multiplied by the softmax scale, in the loads' lane order
 *   k, v [ntok, d] rows of one (block, KV head) in storage dtype dt, row stride d
 *   m    [T]     reference max: exponents are taken as exp(s - m)
 *   l    [T, VW] running sum of exp, kept per lane (summed once at the end)
 *   acc  [T, d]  running unnormalized output, in the loads' lane order
 * pf_bytes bytes at pfk and at pfv (the next block) are prefetched, spread over the chunk. */
static inline __attribute__((always_inline)) void attn_chunk(
    const int dt, const int T, const float *q, const char *k, const char *v, int ntok, int d,
    float *m, float *l, float *acc, const char *pfk, const char *pfv, int pf_bytes) {
    const int esz = attn_esize(dt);
    const int64_t row = (int64_t)d * esz;
    const int d2 = d & ~(2 * VW - 1);
    /* one share per token pair: a burst of prefetches would stall on the line-fill buffers */
    const int pf_step = ((pf_bytes + CH / 2 - 1) / (CH / 2) + 63) & ~63;
    vf part[AT][CH];
    float p[AT][CH] __attribute__((aligned(64)));
    for (int j = 0; j < CH; j += 2) {
        vf a[AT], b[AT];
        for (int t = 0; t < T; t++) a[t] = b[t] = (vf){0};
        for (int o = (j >> 1) * pf_step; o < pf_bytes && o < ((j >> 1) + 1) * pf_step; o += 64) {
            __builtin_prefetch(pfk + o, 0, PF_L2);
            __builtin_prefetch(pfv + o, 0, PF_L2);
        }
        /* the next pair's K rows and this pair's V rows, from L2 into L1 while q.k runs (the
         * V rows are read by P.V below, column by column, a pattern L1 does not prefetch) */
        for (int64_t o = (j + 2) * row; o < (j + 4 < ntok ? j + 4 : ntok) * row; o += 64)
            __builtin_prefetch(k + o, 0, PF_L1);
        for (int64_t o = j * row; o < (j + 2 < ntok ? j + 2 : ntok) * row; o += 64)
            __builtin_prefetch(v + o, 0, PF_L1);
        if (j < ntok) {
            /* a row past ntok is never read: the odd token of the last pair reuses row j */
            const char *k0 = k + j * row, *k1 = k + (j + 1 < ntok ? j + 1 : j) * row;
            int c = 0;
            for (; c < d2; c += 2 * VW) {
                vf k0a, k0b, k1a, k1b;
                attn_load2(dt, k0 + c * esz, &k0a, &k0b);
                attn_load2(dt, k1 + c * esz, &k1a, &k1b);
                PIN(k0a); PIN(k0b); PIN(k1a); PIN(k1b);
                for (int t = 0; t < T; t++) {
                    vf qa = ldf(q + t * d + c), qb = ldf(q + t * d + c + VW);
                    PIN(qa); PIN(qb);
                    a[t] += qa * k0a;
                    b[t] += qa * k1a;
                    a[t] += qb * k0b;
                    b[t] += qb * k1b;
                }
            }
            if (c < d) {
                const vf k0a = attn_load1(dt, k0 + c * esz), k1a = attn_load1(dt, k1 + c * esz);
                for (int t = 0; t < T; t++) {
                    const vf qa = ldf(q + t * d + c);
                    a[t] += qa * k0a;
                    b[t] += qa * k1a;
                }
            }
        }
        for (int t = 0; t < T; t++) {
            part[t][j] = a[t];
            part[t][j + 1] = b[t];
        }
    }
    vi live[NSV];
    for (int i = 0; i < VW; i++)
        for (int u = 0; u < NSV; u++) live[u][i] = -(u * VW + i < ntok);
    const vf ninf = bcast(-INFINITY);
    for (int t = 0; t < T; t++) {
        vf s[NSV];
        vi over = {0};
        const vf bar = bcast(m[t] + RESCALE_MARGIN);
        for (int u = 0; u < NSV; u++) {
            s[u] = attn_sum_lanes(&part[t][u * VW]);
            s[u] = (vf)(((vi)s[u] & live[u]) | ((vi)ninf & ~live[u]));
            over |= (vi)(s[u] > bar);
        }
        if (attn_any(over)) {
            float mx = -INFINITY;
            for (int u = 0; u < NSV; u++)
                for (int i = 0; i < VW; i++) mx = s[u][i] > mx ? s[u][i] : mx;
            const float alpha = expf(m[t] - mx); /* 0 on the first chunk, where m = -inf */
            m[t] = mx;
            stf(l + t * VW, ldf(l + t * VW) * alpha);
            for (int c = 0; c < d; c += VW) stf(acc + t * d + c, ldf(acc + t * d + c) * alpha);
        }
        vf sum = ldf(l + t * VW);
        for (int u = 0; u < NSV; u++) {
            /* padding lanes: exp(-inf) -> ~0, then masked */
            const vf e = (vf)((vi)vexp(s[u] - bcast(m[t])) & live[u]);
            stf(&p[t][u * VW], e);
            sum += e;
        }
        stf(l + t * VW, sum);
    }
    int c = 0;
    for (; c < d2; c += 2 * VW) {
        vf oa[AT], ob[AT];
        for (int t = 0; t < T; t++) {
            oa[t] = ldf(acc + t * d + c);
            ob[t] = ldf(acc + t * d + c + VW);
        }
        for (int j = 0; j < ntok; j++) {
            vf va, vb;
            attn_load2(dt, v + j * row + c * esz, &va, &vb);
            for (int t = 0; t < T; t++) {
                const vf pj = bcast(p[t][j]);
                oa[t] += pj * va;
                ob[t] += pj * vb;
            }
        }
        for (int t = 0; t < T; t++) {
            stf(acc + t * d + c, oa[t]);
            stf(acc + t * d + c + VW, ob[t]);
        }
    }
    if (c < d) {
        vf oa[AT];
        for (int t = 0; t < T; t++) oa[t] = ldf(acc + t * d + c);
        for (int j = 0; j < ntok; j++) {
            const vf va = attn_load1(dt, v + j * row + c * esz);
            for (int t = 0; t < T; t++) oa[t] += bcast(p[t][j]) * va;
        }
        for (int t = 0; t < T; t++) stf(acc + t * d + c, oa[t]);
    }
}

typedef void (*attn_chunk_fn)(const float *q, const char *k, const char *v, int ntok, int d,
                              float *m, float *l, float *acc, const char *pfk, const char *pfv,
                              int pf_bytes);

/* One function per (storage dtype, tile): dt and T are constants inside, so the tile's loops
 * unroll and its vectors become registers. */
#define ATTN_CHUNK_FN(DT, T)                                                                  \
    static void attn_chunk_##DT##_##T(const float *q, const char *k, const char *v, int ntok, \
                                      int d, float *m, float *l, float *acc, const char *pfk, \
                                      const char *pfv, int pf_bytes) {                        \
        attn_chunk(DT, T, q, k, v, ntok, d, m, l, acc, pfk, pfv, pf_bytes);                   \
    }
#if AT == 8
#define ATTN_CHUNK_FNS(DT) ATTN_CHUNK_FN(DT, 1) ATTN_CHUNK_FN(DT, 2) ATTN_CHUNK_FN(DT, 4) \
    ATTN_CHUNK_FN(DT, 8)
#define ATTN_TILE_CASES(DT) case 8: return attn_chunk_##DT##_8; \
    case 4: return attn_chunk_##DT##_4; case 2: return attn_chunk_##DT##_2; \
    default: return attn_chunk_##DT##_1;
#elif AT == 4
#define ATTN_CHUNK_FNS(DT) ATTN_CHUNK_FN(DT, 1) ATTN_CHUNK_FN(DT, 2) ATTN_CHUNK_FN(DT, 4)
#define ATTN_TILE_CASES(DT) case 4: return attn_chunk_##DT##_4; \
    case 2: return attn_chunk_##DT##_2; default: return attn_chunk_##DT##_1;
#else
#error "MOE_ATTN_TILE must be 4 or 8"
#endif
ATTN_CHUNK_FNS(MOE_W_F32)
ATTN_CHUNK_FNS(MOE_W_BF16)
ATTN_CHUNK_FNS(MOE_W_F16)

static attn_chunk_fn attn_chunk_for(int dt, int tile) {
    switch (dt) {
        case MOE_W_BF16: switch (tile) { ATTN_TILE_CASES(MOE_W_BF16) }
        case MOE_W_F16: switch (tile) { ATTN_TILE_CASES(MOE_W_F16) }
        default: switch (tile) { ATTN_TILE_CASES(MOE_W_F32) }
    }
    return attn_chunk_MOE_W_F32_1; /* not reached */
}

/* Largest tile (AT, ..., 2, 1 heads) that fits in the remaining heads of a GQA group. */
static inline int attn_tile_heads(int remaining) {
    int tile = AT;
    while (tile > remaining) tile >>= 1;
    return tile;
}

/* One (sequence, KV head) task; qs, acc [group*d], m [group], l [group*VW] are the thread's
 * scratch. */
static void attn_task(const moe_attn_args *a, int64_t task, float *qs, float *acc, float *m,
                      float *l) {
    const int n_kv = a->n_kv_heads, group = a->n_q_heads / n_kv, d = a->head_dim;
    const int dt = a->dtype, bs = a->block_size, esz = attn_esize(dt);
    const int64_t s = task / n_kv;
    const int h = (int)(task - s * n_kv);
    const int64_t first = (s * a->n_q_heads + (int64_t)h * group) * d;
    const float *q = a->query + first;
    float *out = a->out + first;
    const int32_t *table = a->block_tables + s * a->max_blocks_per_seq;
    const int ctx = a->context_lens[s];
    const char *kcache = (const char *)a->key_cache, *vcache = (const char *)a->value_cache;
    const int64_t run = (int64_t)bs * d * esz; /* bytes of one (block, KV head) run */
    const int nblocks = (ctx + bs - 1) / bs;
    /* chunks of CH tokens per block; each prefetches its share of the next block */
    const int nchunks = (bs + CH - 1) / CH;
    const int64_t pf_share = (run + nchunks - 1) / nchunks;
    for (int g = 0; g < group; g++) {
        attn_to_lanes(dt, q + g * d, qs + g * d, d, a->scale);
        m[g] = -INFINITY;
    }
    memset(acc, 0, sizeof(float) * group * d);
    memset(l, 0, sizeof(float) * group * VW);
    /* A window starts the walk at the first token it keeps (blocks before it are never read,
     * so their table entries may be freed). */
    const int from = a->window > 0 && ctx > a->window ? ctx - a->window : 0;
    for (int b = from / bs; b < nblocks; b++) {
        const int64_t here = ((int64_t)table[b] * n_kv + h) * run;
        /* Blocks are scattered, so the hardware prefetcher restarts at every block; fetching
         * the next block during this one overlaps its DRAM latency with this block's work. */
        const int64_t next = b + 1 < nblocks ? ((int64_t)table[b + 1] * n_kv + h) * run : 0;
        const int ntok = ctx - b * bs < bs ? ctx - b * bs : bs;
        for (int j0 = b == from / bs ? from - b * bs : 0; j0 < ntok; j0 += CH) {
            const int64_t pf_off = (j0 / CH) * pf_share;
            int64_t pf_bytes = b + 1 < nblocks ? run - pf_off : 0;
            pf_bytes = pf_bytes < 0 ? 0 : pf_bytes < pf_share ? pf_bytes : pf_share;
            for (int g = 0; g < group;) {
                const int tile = attn_tile_heads(group - g);
                attn_chunk_for(dt, tile)(qs + g * d, kcache + here + (int64_t)j0 * d * esz,
                                         vcache + here + (int64_t)j0 * d * esz,
                                         ntok - j0 < CH ? ntok - j0 : CH, d, m + g, l + g * VW,
                                         acc + g * d, kcache + next + pf_off,
                                         vcache + next + pf_off, (int)pf_bytes);
                pf_bytes = 0; /* the first tile of the group prefetches for all */
                g += tile;
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float sum = 0.0f;
        for (int i = 0; i < VW; i++) sum += l[g * VW + i];
        /* ctx == 0 leaves l == 0: the output is defined as zeros (no keys, nothing to attend) */
        float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        if (a->sinks != NULL && sum > 0.0f) {
            /* the sink's term at the same reference max; in double, so a sink far above the
             * scores gives an output near 0, not inf/inf */
            const double sink = a->sinks[h * group + g];
            inv = (float)(1.0 / ((double)sum + exp(sink - (double)m[g])));
        }
        attn_from_lanes(dt, acc + g * d, out + g * d, d, inv);
    }
}

static int decode_attention_impl(const moe_attn_args *a, int nthreads) {
    const int group = a->n_q_heads / a->n_kv_heads, d = a->head_dim;
    const int64_t ntasks = (int64_t)a->num_seqs * a->n_kv_heads;
    const int64_t per_thread = 2 * (int64_t)group * d + group + (int64_t)group * VW;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *scratch = (float *)malloc(sizeof(float) * per_thread);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* dynamic: context lengths differ, so equal task counts are unequal work */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < ntasks; t++)
            if (scratch != NULL)
                attn_task(a, t, scratch, scratch + group * d, scratch + 2 * group * d,
                          scratch + 2 * group * d + group);
        free(scratch);
    }
    return failed ? -2 : 0;
}

/* Sum of n floats in pieces of 2^16, four independent vector chains each: a pure streaming
 * read, the benchmark's read-bandwidth roof, built with the kernels' compiler, flags and
 * OpenMP runtime so the two are comparable. */
static double read_sum_impl(const float *p, int64_t n, int nthreads) {
    const int64_t piece = 1 << 16, npieces = n / piece;
    double total = 0.0;
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(+ : total)
    for (int64_t i = 0; i < npieces; i++) {
        const float *x = p + i * piece;
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t j = 0; j < piece; j += 4 * VW) {
            a0 += ldf(x + j);
            a1 += ldf(x + j + VW);
            a2 += ldf(x + j + 2 * VW);
            a3 += ldf(x + j + 3 * VW);
        }
        const vf s = (a0 + a1) + (a2 + a3);
        for (int k = 0; k < VW; k++) total += s[k];
    }
    return total;
}
