/* Packed-weight GEMM and fused MoE expert FFN: the template every ISA build instantiates.
 *
 * Included by kernels_cy/isa_<name>.c after defining MOE_VW (fp32 lanes per vector: 4, 8 or 16)
 * and MOE_MR (token rows per register tile); setup.py compiles each of those files with its ISA's
 * flags, and isa_vec.h gives the vectors of that width. Layouts and the batch-invariance
 * contract are described in moe_isa.h.
 *
 * Register tile: MOE_MR token rows x 2 vectors of output columns. For a k-row of a panel, pass s
 * (of 16 / MOE_VW) loads two weight vectors, columns [s*VW, s*VW+VW) and [16+s*VW, 16+s*VW+VW),
 * widens them to fp32 in registers and does 2*MR FMAs with broadcast activations; the panel is
 * read from memory once per call and from cache for the following row tiles.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa_vec.h"
#include "moe_isa.h"

#if !defined(MOE_MR)
#error "define MOE_MR before including packed_gemm_impl.h"
#endif

#define MR MOE_MR
/* i8q's register tile: vpdpbusd's tiles ran 0.7x as fast at 64-256 rows with 14 rows as with
 * 8 (avx512bf16 build, AMX Xeon, 2026-12-06), where the FMA storages gained */
#if defined(MOE_MR_Q8)
#define MR_Q8 MOE_MR_Q8
#else
#define MR_Q8 MR
#endif
#define NPASS (16 / VW)
/* Token rows per work item, at least (plan_gemm): the weight panel stays in cache across an
 * item's row tiles, and the item's activations are re-read from cache once per panel. */
#define TC 96
/* Activation bytes an item may take (plan_gemm), and its most rows. 1 MB: the core's L2 is 1-2
 * MB on the Xeons and EPYCs seen; 2 MB measured no better on AMX. */
#define ITEM_BYTES (1 << 20)
#define ITEM_ROWS_MAX (4 * TC)
#define SMALL_WORK (1 << 17) /* multiply-adds below which a call stays on one thread */

/* VW signed (int8) or unsigned (int4 byte pairs) bytes widened to int32 lanes: one vpmovsxbd /
 * vpmovzxbd where the build has it (GCC scalarizes __builtin_convertvector of byte vectors). */
static inline vi widen_i8(const void *p) {
#if VW == 16 && defined(__AVX512F__)
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VW == 8 && defined(__AVX2__)
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vb q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(q, vi);
#endif
}

static inline vi widen_u8(const void *p) {
#if VW == 16 && defined(__AVX512F__)
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VW == 8 && defined(__AVX2__)
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vub q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(q, vi);
#endif
}

/* Bytes of one k-row (32 columns) per weight dtype; bf16p, bf16x3: of one pair-row (two k);
 * i8q: of one quad-row (four k). */
static inline int64_t krow_bytes(int dt) {
    return (dt == MOE_W_F32 || moe_pair_terms(dt) || dt == MOE_W_I8Q) ? 128
           : dt == MOE_W_I8 ? 32 : (dt == MOE_W_I4 || dt == MOE_W_FP4) ? 16 : 64;
}

/* k-rows a panel holds: k, ceil(k/2) pair-rows for bf16p and bf16x3, ceil(k/4) quad-rows for
 * i8q. */
static inline int64_t panel_rows(int dt, int64_t k) {
    return moe_pair_terms(dt) ? (k + 1) / 2 : dt == MOE_W_I8Q ? (k + 3) / 4 : k;
}

/* The 4-byte words of an activation row that its first k0 inputs take, as the tiles read the
 * row: one a float, bf16 pairs two a word (in each plane), i8q quads four. k0 is a multiple of
 * 4 (KC). */
static inline int64_t act_words(int dt, int64_t k0) {
    return moe_pair_terms(dt) ? k0 / 2 : dt == MOE_W_I8Q ? k0 / 4 : k0;
}

/* How the activations of a GEMM on weights of dtype dt are held: fp32 (0), bf16 pairs or
 * bf16x3 planes (moe_pair_terms: 1, 3), or i8q's quantized quads (ACT_Q8). One moe_ffn call
 * gathers its rows in one form for every expert. */
#define ACT_Q8 4
static inline int act_form(int dt) { return dt == MOE_W_I8Q ? ACT_Q8 : moe_pair_terms(dt); }

static inline vf vmin(vf a, vf b) {
    const vi lt = (vi)(a < b);
    return (vf)((lt & (vi)a) | (~lt & (vi)b));
}

static inline vf vmax(vf a, vf b) {
    const vi gt = (vi)(a > b);
    return (vf)((gt & (vi)a) | (~gt & (vi)b));
}

/* Keeps a vector in a register, opaque to the compiler: what it holds is computed here (not
 * fused into a later operation, not hoisted out of a loop). */
#if defined(__x86_64__) || defined(__i386__)
#define PIN_VEC(x) __asm__("" : "+v"(x))
#else
#define PIN_VEC(x) ((void)0)
#endif

/* VW int32 lanes holding 0..255 as VW bytes, in lane order, at p. */
static inline void store_bytes(void *p, vi q) {
#if VW == 16 && defined(__AVX512F__)
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8((__m512i)q));
#elif VW == 8 && defined(__AVX2__)
    /* per 128-bit half: q0..3 (q4..7) as u16, then as bytes; words 0 and 4 hold them */
    const __m256i w = _mm256_packus_epi32((__m256i)q, (__m256i)q);
    const __m256i b = _mm256_packus_epi16(w, w);
    const __m256i both = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64((__m128i *)p, _mm256_castsi256_si128(both));
#else
    uint8_t t[VW];
    for (int i = 0; i < VW; i++) t[i] = (uint8_t)q[i];
    memcpy(p, t, sizeof t);
#endif
}

/* i8q: a row of k fp32 activations at src as ceil(k/4) words of unsigned bytes q + 128 at dst
 * (q = rint(x * (127 / max|x|)) in [-127, 127], a last quad padded with q = 0) and the row's
 * scale max|x| / 127 in word ld - 1 of dst. A row of zeros has scale 0, and so has a row whose
 * max|x| is below 127 / FLT_MAX (~3.7e-37, where 127 / max|x| overflows): it quantizes as
 * zeros. A row with an inf or a NaN gets a NaN scale (and q = 0), so its outputs are NaN as
 * an fp32 GEMM's would not be finite either. Every build
 * quantizes to the same bytes: the max is exact, and each value is one fp32 multiply (never
 * fused with the rounding's add: the product is pinned in a register first) rounded to
 * nearest even, by adding and subtracting 1.5 * 2^23 in vectors, rintf in the tail. dst may be
 * src: a vector's bytes go to words [i/4, (i+VW)/4), whose floats that vector or an earlier
 * one read, and the scale goes after the last quad ((k + 3) / 4 <= ld - 1). */
static inline void q8_row(const float *src, int64_t k, void *dst, int64_t ld) {
    float amax = 0.0f;
    int finite = 1;
    int64_t i = 0;
    {
        vf m = {0};
        vi bad = {0};
        for (; i + VW <= k; i += VW) {
            const vf a = (vf)((vi)ldf(src + i) & 0x7fffffff);
            bad |= ~(vi)(a <= FLT_MAX); /* inf and NaN */
            m = vmax(a, m);
        }
        for (int l = 0; l < VW; l++) {
            finite &= bad[l] == 0;
            amax = m[l] > amax ? m[l] : amax;
        }
    }
    for (; i < k; i++) {
        const float a = fabsf(src[i]);
        finite &= a <= FLT_MAX;
        amax = a > amax ? a : amax;
    }
    char *out = (char *)dst;
    if (!finite) { /* q = 0 throughout: the NaN scale alone decides the outputs */
        memset(out, 128, (size_t)(4 * ((k + 3) / 4)));
        const float nan = NAN;
        memcpy(out + 4 * (ld - 1), &nan, sizeof nan);
        return;
    }
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const float scale = inv <= FLT_MAX ? amax / 127.0f : 0.0f;
    inv = inv <= FLT_MAX ? inv : 0.0f; /* below ~3.7e-37: zeros */
    i = 0;
#if defined(__x86_64__) || defined(__i386__)
    {
        const vf vinv = bcast(inv), top = bcast(127.0f), magic = bcast(12582912.0f);
        for (; i + VW <= k; i += VW) {
            vf v = ldf(src + i) * vinv;
            PIN_VEC(v); /* rounded here, as the scalar rintf(x * inv) */
            v = vmax(vmin((v + magic) - magic, top), -top);
            store_bytes(out + i, __builtin_convertvector(v, vi) + 128);
        }
    }
#endif
    for (int64_t j = i / 4; 4 * j < k; j++) { /* i is a multiple of 4 */
        uint32_t word = 0;
        for (int b = 0; b < 4; b++) {
            int q = 0;
            if (4 * j + b < k) {
                const float r = rintf(src[4 * j + b] * inv);
                q = r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r;
            }
            word |= (uint32_t)(q + 128) << (8 * b);
        }
        memcpy(out + 4 * j, &word, sizeof word);
    }
    memcpy(out + 4 * (ld - 1), &scale, sizeof scale);
}

/* fp32 bits -> bf16 bits, rounded to nearest even (NaN stays a quiet NaN): what the
 * activations of bf16p weights become, the same on every ISA. */
static inline uint32_t bf16_round(uint32_t u) {
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

/* k fp32 values at src as ceil(k/2) bf16 pair words at dst (k odd: the last paired with zero).
 * dst may be src (the down GEMM converts its activations in place): word j is written after
 * floats 2j and 2j+1 were read, j <= 2j, and every access is a memcpy, so the compiler
 * assumes the aliasing it has. */
static inline void bf16_pairs(const void *src, int64_t k, void *dst) {
    const char *in = (const char *)src;
    char *out = (char *)dst;
    for (int64_t j = 0; 2 * j < k; j++) {
        uint32_t lo, hi = 0, w;
        memcpy(&lo, in + 8 * j, 4);
        if (2 * j + 1 < k) memcpy(&hi, in + 8 * j + 4, 4);
        w = bf16_round(lo) | (2 * j + 1 < k ? bf16_round(hi) << 16 : 0u);
        memcpy(out + 4 * j, &w, 4);
    }
}

static inline float bf16_value(uint32_t b) {
    const uint32_t u = b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 value f as three bf16s (bf16x3) whose sum is f exactly: each term is the top 8
 * significand bits of what the previous ones left (truncated, so every term has f's sign and
 * none overflows: FLT_MAX would round to inf), and a 24-bit significand takes three. Below
 * the normal range (|f| < 2^-110) the last terms are fp32 subnormals, which lose bits here
 * and which tdpbf16ps reads as zero. inf and NaN are the first term alone (NaN kept quiet). */
static inline void bf16_split3(float f, uint32_t t[3]) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u) {
        t[0] = bf16_round(u);
        t[1] = t[2] = 0;
        return;
    }
    t[0] = u >> 16;
    const float r1 = f - bf16_value(t[0]);
    memcpy(&u, &r1, sizeof u);
    t[1] = u >> 16;
    const float r2 = r1 - bf16_value(t[1]);
    memcpy(&u, &r2, sizeof u);
    t[2] = u >> 16;
}

/* k fp32 values at src as the three planes of bf16x3 pair words at dst, plane t at word
 * t * ldt (k odd: the last paired with zero). dst must not overlap src. */
static inline void bf16_pairs3(const float *src, int64_t k, uint32_t *dst, int64_t ldt) {
    for (int64_t j = 0; 2 * j < k; j++) {
        uint32_t lo[3], hi[3] = {0, 0, 0};
        bf16_split3(src[2 * j], lo);
        if (2 * j + 1 < k) bf16_split3(src[2 * j + 1], hi);
        for (int t = 0; t < 3; t++) dst[t * ldt + j] = lo[t] | hi[t] << 16;
    }
}

/* A row of k fp32 activations as the GEMM on weights of `terms` (moe_pair_terms) reads it, at
 * dst: bf16 pairs (1; dst may be src) or bf16x3 planes in a row of stride ldx words (3; dst
 * must not overlap src). */
static inline void to_terms(const float *src, int64_t k, float *dst, int64_t ldx, int terms) {
    if (terms == 3)
        bf16_pairs3(src, k, (uint32_t *)dst, ldx / 3);
    else
        bf16_pairs(src, k, dst);
}

/* A row of k fp32 activations in form `form` (act_form) at dst, row stride ldx words: bf16
 * pairs or bf16x3 planes (to_terms), or i8q quads and scale (q8_row). */
static inline void to_form(const float *src, int64_t k, float *dst, int64_t ldx, int form) {
    if (form == ACT_Q8)
        q8_row(src, k, dst, ldx);
    else
        to_terms(src, k, dst, ldx, form);
}

/* The E2M1 (FP4) values by code: sign bit 3, then 2 exponent bits and 1 mantissa bit. */
static const float fp4_values[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                     -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

/* The FP4 values of the codes in bits 0-3 of each lane (higher bits ignored): one permute of
 * a table held in a register (AVX-512: all 16 codes; AVX2: the 8 magnitudes, then the sign
 * bit moved into place), a scalar lookup in the generic build. */
static inline __attribute__((always_inline)) vf fp4_decode(vi q) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_permutexvar_ps((__m512i)q, _mm512_loadu_ps(fp4_values));
#elif VW == 8 && defined(__AVX2__)
    const vf mag = (vf)_mm256_permutevar8x32_ps(_mm256_loadu_ps(fp4_values), (__m256i)q);
    return (vf)((vu)mag | ((vu)(q << 28) & 0x80000000u));
#else
    vf r;
    for (int i = 0; i < VW; i++) r[i] = fp4_values[q[i] & 15];
    return r;
#endif
}

/* VW E8M0 scale bytes -> 2^(e - 127) as fp32: the byte is the fp32 exponent field (e = 0,
 * 2^-127 in the format, becomes 0). */
static inline vf e8m0_decode(const uint8_t *p) { return (vf)(widen_u8(p) << 23); }

/* The two weight vectors of pass s of a k-row, widened to fp32 (i4: raw q, not yet scaled). */
static inline __attribute__((always_inline)) void load_pair(const int dt, const char *row, int s,
                                                           vf *a, vf *b) {
    if (dt == MOE_W_F32) {
        *a = ldf(row + s * VW * 4);
        *b = ldf(row + (16 + s * VW) * 4);
    } else if (dt == MOE_W_BF16) {
        /* word i holds column i (low half) and column 16+i (high half) */
        cvt_bf16_halves(row + s * VW * 4, a, b);
    } else if (dt == MOE_W_F16) {
        *a = cvt_f16(row + s * VW * 2);
        *b = cvt_f16(row + (16 + s * VW) * 2);
    } else if (dt == MOE_W_I8) {
        *a = __builtin_convertvector(widen_i8(row + s * VW), vf);
        *b = __builtin_convertvector(widen_i8(row + 16 + s * VW), vf);
    } else if (dt == MOE_W_I4) { /* byte i holds column i (low nibble) and 16+i (high) */
        vi w = widen_u8(row + s * VW);
        *a = __builtin_convertvector(w & 15, vf);
        *b = __builtin_convertvector(w >> 4, vf);
    } else { /* MOE_W_FP4: nibbles as i4, E2M1 codes (not yet scaled) */
        vi w = widen_u8(row + s * VW);
        *a = fp4_decode(w);
        *b = fp4_decode(w >> 4);
    }
}

/* How far ahead the register tiles prefetch their panel (from DRAM for an item's first row
 * tile, a decode step's only one): the hardware prefetchers alone left one 8-row tile of bf16
 * at 5-7 GB/s a core on an Emerald Rapids VM; 2 KB ahead gave 1.5x, 4 KB 1.07-1.13x more,
 * 8 KB no more; on Zen 4 tiles alone from DRAM ran the same from 2 to 16 KB. Overridable
 * (-DPANEL_AHEAD=...) for bench/tile_loop.py --cflags. */
#ifndef PANEL_AHEAD
#define PANEL_AHEAD 4096
#endif
/* Prefetches k-row k of a panel (rows of rb bytes) PANEL_AHEAD bytes ahead: each of its lines,
 * or, for rows shorter than a line, the line that starts with it (each line once). */
static inline __attribute__((always_inline)) void prefetch_krow(const char *panel, int64_t k,
                                                               int64_t rb) {
    if (rb >= 64) {
        for (int64_t l = 0; l < rb; l += 64) PREFETCH_T0(panel + k * rb + l + PANEL_AHEAD);
    } else if (k % (64 / rb) == 0) {
        PREFETCH_T0(panel + k * rb + PANEL_AHEAD);
    }
}

/* The next panel of an item, prefetched into L2 while the row tiles of this one compute. An
 * item's first row tile reads its panel from memory and the later tiles find it in cache, so
 * at decode sizes (a few tiles a panel) memory idles through the later tiles and the next
 * panel's first tile then waits on it. Each walk of the panel (a tile's pass) fetches
 * `per_walk` lines of the next one, spread evenly over its k steps, so the next panel arrives
 * over the whole of this one's compute. */
typedef struct {
    const char *at, *end; /* the next line to fetch; the end of what to fetch */
    int64_t per_walk;     /* lines a walk fetches */
} panel_stream;

/* One walk's share of a stream, fetched at the start of each block of STREAM_BLOCK k steps
 * (the k loops run in such blocks, so the per-step loop stays as it was: a test in it cost
 * the 6-row tiles 10-25%); without a stream the steps run as one loop, as before. */
#define STREAM_BLOCK 16
typedef struct {
    const char *at, *end;
    int64_t per_block;
} stream_walk;

static inline __attribute__((always_inline)) stream_walk walk_begin(const panel_stream *st,
                                                                   int64_t blocks) {
    stream_walk w = {NULL, NULL, 0};
    if (st && st->at < st->end && st->per_walk > 0 && blocks > 0) {
        w.at = st->at;
        w.end = st->end;
        w.per_block = (st->per_walk + blocks - 1) / blocks;
    }
    return w;
}

static inline __attribute__((always_inline)) void walk_block(stream_walk *w) {
    for (int64_t i = 0; i < w->per_block && w->at < w->end; i++, w->at += 64) PREFETCH_T1(w->at);
}

static inline __attribute__((always_inline)) void walk_end(panel_stream *st,
                                                          const stream_walk *w) {
    if (w->at) st->at = w->at;
}

/* Pass s's accumulators of M rows from zero, or from the raw sums of the k-blocks before
 * (init: MOE_NR a row). */
static inline __attribute__((always_inline)) void acc_start(const int M, int s, vf acc[][2],
                                                           const float *init) {
    for (int r = 0; r < M; r++) {
        acc[r][0] = init ? ldf(init + r * MOE_NR + s * VW) : (vf){0};
        acc[r][1] = init ? ldf(init + r * MOE_NR + 16 + s * VW) : (vf){0};
    }
}

/* One k step of M rows: acc[r] += x[r, k] * (a, b), the pass's two weight vectors. `again`:
 * the broadcasts are loaded anew (bcast_again), not taken from registers an earlier step of
 * the same k filled. */
static inline __attribute__((always_inline)) void fma_rows(const int M, const float *x,
                                                          int64_t ldx, int64_t k, vf a, vf b,
                                                          vf acc[][2], const int again) {
    for (int r = 0; r < M; r++) {
        const vf xb = again ? bcast_again(x + r * ldx + k) : bcast(x[r * ldx + k]);
        acc[r][0] += a * xb;
        acc[r][1] += b * xb;
    }
}

/* i8q: the pairs of signed 16-bit halves of a and b multiplied and summed per 32-bit lane
 * (vpmaddwd). Exact for the bytes it is given (|product| <= 255 * 127). */
typedef int16_t vs16 __attribute__((vector_size(VW * 4)));
static inline vi madd16(vi a, vi b) {
#if VW == 16 && defined(__AVX512BW__)
    return (vi)_mm512_madd_epi16((__m512i)a, (__m512i)b);
#elif VW == 8 && defined(__AVX2__)
    return (vi)_mm256_madd_epi16((__m256i)a, (__m256i)b);
#elif VW == 4 && defined(__SSE2__)
    return (vi)_mm_madd_epi16((__m128i)a, (__m128i)b);
#else
    return ((vi)((vu)a << 16) >> 16) * ((vi)((vu)b << 16) >> 16) + (a >> 16) * (b >> 16);
#endif
}

static inline vi bcast_word(uint32_t w) {
    vi r = (vi){0} + (int32_t)w;
    return r;
}

/* acc + per lane, the four products of x's unsigned bytes with w's signed ones: vpdpbusd,
 * where the build has it (AVX512-VNNI at 16 lanes, AVX-VNNI's VEX form at 8). */
#if VW == 16 && defined(__AVX512VNNI__)
#define HAVE_DPBUSD 1
static inline vi dpbusd(vi acc, vi x, vi w) {
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)x, (__m512i)w);
}
#elif VW == 8 && defined(__AVXVNNI__)
#define HAVE_DPBUSD 1
static inline vi dpbusd(vi acc, vi x, vi w) {
    return (vi)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)x, (__m256i)w);
}
#endif

/* i8q quad-rows [j0, j1) of pass s for M rows: acc[r][0..1] (int32 sums held in the vf
 * registers' bits) += per lane, the four products of row r's quad (unsigned bytes, x words of
 * row stride ldx) with the lane's four signed weights. AVX512-VNNI and AVX-VNNI: one vpdpbusd
 * a vector; elsewhere the same integer sums, bytes 0 and 2 then 1 and 3 through vpmaddwd. */
static inline __attribute__((always_inline)) void q8_steps(const int M, const float *x,
                                                          int64_t ldx, const char *panel, int s,
                                                          int64_t j0, int64_t j1, vf acc[][2]) {
    for (int64_t j = j0; j < j1; j++) {
        const char *row = panel + j * 128;
        if (s == 0) prefetch_krow(panel, j, 128);
        vi a, b;
        memcpy(&a, row + s * VW * 4, sizeof a);
        memcpy(&b, row + (16 + s * VW) * 4, sizeof b);
#if defined(HAVE_DPBUSD)
        for (int r = 0; r < M; r++) {
            uint32_t w;
            memcpy(&w, x + r * ldx + j, sizeof w);
            const vi xb = bcast_word(w);
            acc[r][0] = (vf)dpbusd((vi)acc[r][0], xb, a);
            acc[r][1] = (vf)dpbusd((vi)acc[r][1], xb, b);
        }
#else
        /* each lane's weight bytes 0, 2 (even) and 1, 3 (odd) as signed 16-bit halves */
        const vi ae = (vi)(((vs16)a << 8) >> 8), ao = (vi)((vs16)a >> 8);
        const vi be = (vi)(((vs16)b << 8) >> 8), bo = (vi)((vs16)b >> 8);
        for (int r = 0; r < M; r++) {
            uint32_t w;
            memcpy(&w, x + r * ldx + j, sizeof w);
            const vi xe = bcast_word(w & 0x00ff00ffu), xo = bcast_word((w >> 8) & 0x00ff00ffu);
            acc[r][0] = (vf)((vi)acc[r][0] + madd16(ae, xe) + madd16(ao, xo));
            acc[r][1] = (vf)((vi)acc[r][1] + madd16(be, xe) + madd16(bo, xo));
        }
#endif
    }
}

/* k steps [k0, k1) of pass s for the storages whose k-rows load alone (fp32, bf16, fp16,
 * int8), or i8q's quad-rows [k0, k1) (q8_steps). */
static inline __attribute__((always_inline)) void pass_steps(const int dt, const int M,
                                                            const float *x, int64_t ldx,
                                                            const char *panel, int s,
                                                            int64_t k0, int64_t k1,
                                                            vf acc[][2]) {
    if (dt == MOE_W_I8Q) {
        q8_steps(M, x, ldx, panel, s, k0, k1, acc);
        return;
    }
    const int64_t rb = krow_bytes(dt);
    for (int64_t k = k0; k < k1; k++) {
        vf a, b;
        if (s == 0) prefetch_krow(panel, k, rb); /* pass 0 only: the later passes find it */
        load_pair(dt, panel + k * rb, s, &a, &b);
        fma_rows(M, x, ldx, k, a, b, acc, 0);
    }
}

/* acc[r][0..1] = init[r] (zero when NULL) + sum over k of x[r, k] * (pass s columns of the
 * panel), one FMA chain per output in increasing k. A stream's walk (st) runs the steps in
 * blocks, its prefetches between them; without one the steps run as one loop. */
static inline __attribute__((always_inline)) void micro_kernel(
    const int dt, const int M, const float *x, int64_t ldx, int64_t K, const char *panel,
    const void *gscale, int s, vf acc[][2], const float *init, panel_stream *st) {
    const int64_t rb = krow_bytes(dt);
    acc_start(M, s, acc, init);
    /* the steps the k loop takes: k-rows, or i8q's quad-rows (x then holds quads of unsigned
     * bytes, ldx words a row) */
    const int64_t steps = panel_rows(dt, K);
    /* i4/fp4: a block a group (bf16 pairs never stream: plan_gemm) */
    stream_walk sw = walk_begin(st, dt == MOE_W_I4 || dt == MOE_W_FP4
                                        ? K / MOE_I4_GROUP
                                        : (steps + STREAM_BLOCK - 1) / STREAM_BLOCK);
    if (dt == MOE_W_I4 || dt == MOE_W_FP4) { /* both have groups of 32 (MOE_I4_GROUP) */
        for (int64_t g = 0; g < K; g += MOE_I4_GROUP) {
            vf sa, sb;
            if (dt == MOE_W_I4) {
                const float *sc = (const float *)gscale + (g / MOE_I4_GROUP) * MOE_NR;
                sa = ldf(sc + s * VW);
                sb = ldf(sc + 16 + s * VW);
            } else {
                const uint8_t *sc = (const uint8_t *)gscale + (g / MOE_I4_GROUP) * MOE_NR;
                sa = e8m0_decode(sc + s * VW);
                sb = e8m0_decode(sc + 16 + s * VW);
            }
            walk_block(&sw);
#if defined(__FMA__)
            /* i4's (q - 8) * s as one FMA, q * s + (-8 * s): -8 * s is exact and the FMA
             * rounds the same real number once, so the weights are bitwise those of the
             * subtract and multiply, one operation a vector fewer (1.1-1.2x at 1-8 tokens) */
            const vf za = sa * -8.0f, zb = sb * -8.0f;
#endif
            for (int64_t k = g; k < g + MOE_I4_GROUP; k++) {
                vf a, b;
                if (s == 0) prefetch_krow(panel, k, rb);
                load_pair(dt, panel + k * rb, s, &a, &b);
                if (dt == MOE_W_I4) { /* q - 8; FP4 codes decode to signed values */
#if defined(__FMA__)
                    a = a * sa + za;
                    b = b * sb + zb;
#else
                    a = (a - 8.0f) * sa;
                    b = (b - 8.0f) * sb;
#endif
                } else {
                    a = a * sa;
                    b = b * sb;
                }
                fma_rows(M, x, ldx, k, a, b, acc, 0);
            }
        }
        walk_end(st, &sw);
        return;
    }
    if (moe_pair_terms(dt)) { /* x holds bf16 pair words, ldx of them a row (bf16x3: in
                                 * three planes, ldx / 3 words apart; the terms of each pair in
                                 * order) */
        const int terms = moe_pair_terms(dt);
        const int64_t ldt = ldx / 3;
        for (int64_t j = 0; j < (K + 1) / 2; j++) {
            const char *row = panel + j * rb; /* loaded once for all the pair's terms */
            if (s == 0) prefetch_krow(panel, j, rb);
#if VW == 16 && defined(__AVX512BF16__)
            const __m512bh a = (__m512bh)_mm512_loadu_si512(row + s * VW * 4);
            const __m512bh b = (__m512bh)_mm512_loadu_si512(row + (16 + s * VW) * 4);
            for (int t = 0; t < terms; t++)
                for (int r = 0; r < M; r++) {
                    int32_t w;
                    memcpy(&w, x + r * ldx + t * ldt + j, sizeof w);
                    const __m512bh xb = (__m512bh)_mm512_set1_epi32(w);
                    acc[r][0] = (vf)_mm512_dpbf16_ps((__m512)acc[r][0], a, xb);
                    acc[r][1] = (vf)_mm512_dpbf16_ps((__m512)acc[r][1], b, xb);
                }
#else
            vf a_lo, a_hi, b_lo, b_hi; /* inputs 2j and 2j+1 of each column */
            cvt_bf16_halves(row + s * VW * 4, &a_lo, &a_hi);
            cvt_bf16_halves(row + (16 + s * VW) * 4, &b_lo, &b_hi);
            for (int t = 0; t < terms; t++)
                for (int r = 0; r < M; r++) {
                    uint32_t w;
                    memcpy(&w, x + r * ldx + t * ldt + j, sizeof w);
                    const uint32_t wl = w << 16, wh = w & 0xffff0000u;
                    float fl, fh;
                    memcpy(&fl, &wl, sizeof fl);
                    memcpy(&fh, &wh, sizeof fh);
                    const vf xl = bcast(fl), xh = bcast(fh);
                    /* products of bf16s are exact in fp32: FMA or not, each add rounds once */
                    acc[r][0] += a_hi * xh;
                    acc[r][0] += a_lo * xl;
                    acc[r][1] += b_hi * xh;
                    acc[r][1] += b_lo * xl;
                }
#endif
        }
        return;
    }
    if (!sw.per_block) {
        pass_steps(dt, M, x, ldx, panel, s, 0, steps, acc);
        return;
    }
    for (int64_t k0 = 0; k0 < steps; k0 += STREAM_BLOCK) {
        walk_block(&sw);
        pass_steps(dt, M, x, ldx, panel, s, k0,
                   k0 + STREAM_BLOCK < steps ? k0 + STREAM_BLOCK : steps, acc);
    }
    walk_end(st, &sw);
}

static inline vf vsigmoid(vf v) { return 1.0f / (1.0f + vexp(-v)); }

/* The gated activation of gate g and up u (moe_glu), per lane. */
static inline vf glu_apply(const moe_glu *glu, vf g, vf u) {
    if (glu && glu->kind == MOE_GLU_CLAMPED) { /* GPT-OSS, in transformers' order */
        const vf lim = bcast(glu->limit);
        g = vmin(g, lim);
        u = vmax(vmin(u, lim), -lim);
        return (u + 1.0f) * (g * vsigmoid(g * glu->alpha));
    }
    return g / (1.0f + vexp(-g)) * u;
}

/* What a register tile becomes (applied per pass on the accumulators, vectorized). Column
 * indices are the panel's (0..31); `ncol` of them are real (the last panel may be partial). */
enum { EPI_LINEAR, EPI_SWIGLU, EPI_SCATTER };
typedef struct {
    int mode;
    int ncol;              /* LINEAR/SCATTER: valid of 32 columns; SWIGLU: valid of 16 outputs */
    const float *cscale;   /* int8, i8q per-column scales of the panel [32], else NULL */
    /* i8q: the panel's column corrections [32] (int32), and the scale of each row: row r of
     * the item's matrix at rscale[r * rstride] (the last word of its activation row) */
    const int32_t *ccorr;
    const float *rscale;
    int64_t rstride;
    const float *bias;     /* bias of the panel's 32 columns (padded), else NULL */
    const moe_glu *glu;    /* SWIGLU: the activation (NULL: SiLU) */
    int act;               /* LINEAR: MOE_ACT_* */
    float *out;            /* row 0's first output of the panel */
    int64_t ldo;           /* output row stride */
    const int32_t *rows;   /* SCATTER: output row of each tile row */
    const float *weight;   /* SCATTER: routing weight by output row */
    /* k-blocked items (run_item): the raw sums of the item's rows for this panel wait in part
     * ([rows][MOE_NR], row 0 the item's row part_row0) between k-blocks */
    float *part;
    int64_t part_row0;
    int resume;            /* the accumulators start from part (a later k-block), not zero */
    int defer;             /* not the last k-block: the raw sums go to part, no epilogue */
    panel_stream *stream;  /* the item's next panel, fetched by the tile's walks (or NULL) */
} epilogue;

/* Row r of a tile starting at row0: its raw sums in the item's part buffer. */
static inline float *part_row(const epilogue *ep, int row0) {
    return ep->part + (int64_t)(row0 - ep->part_row0) * MOE_NR;
}

static inline vf ldpad(const float *p, int c) { return p ? ldf(p + c) : bcast(1.0f); }

/* Store lanes [0, VW) of v to dst[c0..] where c0 + lane < ncol. */
static inline void store_cols(float *dst, int c0, vf v, int ncol) {
    if (c0 + VW <= ncol) {
        memcpy(dst + c0, &v, sizeof v);
    } else if (c0 < ncol) {
        float t[VW];
        memcpy(t, &v, sizeof v);
        memcpy(dst + c0, t, sizeof(float) * (size_t)(ncol - c0));
    }
}

/* Out of line on purpose: inlined into a tile, GCC hoists its constants (the exp polynomial's,
 * the GLU's) out of the pass loop, and they hold registers across the k loop; on AVX2's 16 ymm
 * the 1-row tiles' two accumulators then lived on the stack, a store-to-load round trip in
 * every FMA chain (1.4x slower at one token). Its call costs a store and a load of the
 * accumulators per tile and pass: nothing against a k loop. */
static __attribute__((noinline)) void apply_epilogue(const int M, vf acc[][2], int s,
                                                     const epilogue *ep, int row0) {
    const int ca = s * VW, cb = 16 + s * VW; /* panel columns of acc[r][0] and acc[r][1] */
    if (ep->defer) {
        float *dst = part_row(ep, row0);
        for (int r = 0; r < M; r++) {
            stf(dst + r * MOE_NR + ca, acc[r][0]);
            stf(dst + r * MOE_NR + cb, acc[r][1]);
        }
        return;
    }
    if (ep->rscale) { /* i8q: the exact integer sums, corrected for the bytes' offset, to fp32 */
        vi ka, kb;
        memcpy(&ka, ep->ccorr + ca, sizeof ka);
        memcpy(&kb, ep->ccorr + cb, sizeof kb);
        for (int r = 0; r < M; r++) {
            const vf rs = bcast(ep->rscale[(int64_t)(row0 + r) * ep->rstride]);
            acc[r][0] = __builtin_convertvector((vi)acc[r][0] - ka, vf) * rs;
            acc[r][1] = __builtin_convertvector((vi)acc[r][1] - kb, vf) * rs;
        }
    }
    const vf sa = ldpad(ep->cscale, ca), sb = ldpad(ep->cscale, cb);
    for (int r = 0; r < M; r++) {
        vf a = ep->cscale ? acc[r][0] * sa : acc[r][0];
        vf b = ep->cscale ? acc[r][1] * sb : acc[r][1];
        if (ep->bias) {
            a = a + ldf(ep->bias + ca);
            b = b + ldf(ep->bias + cb);
        }
        if (ep->mode == EPI_SWIGLU) { /* a = gate, b = up of the same outputs ca.. */
            store_cols(ep->out + (int64_t)(row0 + r) * ep->ldo, ca, glu_apply(ep->glu, a, b),
                       ep->ncol);
        } else if (ep->mode == EPI_SCATTER) {
            const int32_t row = ep->rows[row0 + r];
            const vf w = bcast(ep->weight[row]);
            float *dst = ep->out + (int64_t)row * ep->ldo;
            store_cols(dst, ca, a * w, ep->ncol);
            store_cols(dst, cb, b * w, ep->ncol);
        } else {
            if (ep->act == MOE_ACT_SIGMOID) {
                a = vsigmoid(a);
                b = vsigmoid(b);
            }
            float *dst = ep->out + (int64_t)(row0 + r) * ep->ldo;
            store_cols(dst, ca, a, ep->ncol);
            store_cols(dst, cb, b, ep->ncol);
        }
    }
}

/* Both passes of AVX2 (NPASS 2) in one walk of the panel, for tiles of up to 3 rows and
 * storages whose k-row loads alone (fp32, bf16, fp16, int8): a pass reads half of each
 * 64-byte k-row, so two passes walk the panel twice, and a tile of few rows (a decode step's
 * expert, a tile's tail) streams it from memory in the first and from L2 in the second, with
 * two FMA chains a row. One walk with all 4M accumulators (12 of the 16 ymm at 3 rows) reads
 * each line once and keeps 4 chains a row in flight. Same FMAs in the same order per output:
 * the same bits as the two passes. */
static inline int fused_passes(int dt, int M) {
    return NPASS == 2 && M <= 3 &&
           (dt == MOE_W_F32 || dt == MOE_W_BF16 || dt == MOE_W_F16 || dt == MOE_W_I8);
}

static inline __attribute__((always_inline)) void fused_steps(const int dt, const int M,
                                                             const float *x, int64_t ldx,
                                                             const char *panel, int64_t k0,
                                                             int64_t k1, vf acc0[][2],
                                                             vf acc1[][2]) {
    const int64_t rb = krow_bytes(dt);
    for (int64_t k = k0; k < k1; k++) {
        vf a, b;
        prefetch_krow(panel, k, rb);
        /* pass 0's pair, then pass 1's into the same two registers (16 ymm at 3 rows) */
        load_pair(dt, panel + k * rb, 0, &a, &b);
        fma_rows(M, x, ldx, k, a, b, acc0, 0);
        /* the broadcasts again, from L1 (bcast_again): held over from the first half they
         * would take 3 registers more (GCC would keep them, and spill an accumulator) */
        load_pair(dt, panel + k * rb, 1, &a, &b);
        fma_rows(M, x, ldx, k, a, b, acc1, 1);
    }
}

static inline __attribute__((always_inline)) void micro_kernel_fused(
    const int dt, const int M, const float *x, int64_t ldx, int64_t K, const char *panel,
    vf acc0[][2], vf acc1[][2], const float *init, panel_stream *st) {
    acc_start(M, 0, acc0, init);
    acc_start(M, 1, acc1, init);
    stream_walk sw = walk_begin(st, (K + STREAM_BLOCK - 1) / STREAM_BLOCK);
    if (!sw.per_block) {
        fused_steps(dt, M, x, ldx, panel, 0, K, acc0, acc1);
        return;
    }
    for (int64_t k0 = 0; k0 < K; k0 += STREAM_BLOCK) {
        walk_block(&sw);
        fused_steps(dt, M, x, ldx, panel, k0, k0 + STREAM_BLOCK < K ? k0 + STREAM_BLOCK : K,
                    acc0, acc1);
    }
    walk_end(st, &sw);
}

/* M rows against a panel, all passes, each pass's accumulators through the epilogue. */
static inline __attribute__((always_inline)) void tile_m(const int dt, const int M, const float *x,
                                                        int64_t ldx, int64_t K, const char *panel,
                                                        const void *gscale, const epilogue *ep,
                                                        int row0) {
    if (fused_passes(dt, M)) {
        vf acc0[M][2], acc1[M][2];
        micro_kernel_fused(dt, M, x, ldx, K, panel, acc0, acc1,
                           ep->resume ? part_row(ep, row0) : NULL, ep->stream);
        apply_epilogue(M, acc0, 0, ep, row0);
        apply_epilogue(M, acc1, 1, ep, row0);
        return;
    }
    for (int s = 0; s < NPASS; s++) {
        vf acc[M][2];
        micro_kernel(dt, M, x, ldx, K, panel, gscale, s, acc,
                     ep->resume ? part_row(ep, row0) : NULL, ep->stream);
        apply_epilogue(M, acc, s, ep, row0);
    }
}

#define MOE_TILE_CASE(DT, M) \
    case M: tile_m(DT, M, x, ldx, K, panel, gscale, ep, row0); return;
#if MR == 8
#define MOE_TILE_CASES(DT) MOE_TILE_CASE(DT, 1) MOE_TILE_CASE(DT, 2) MOE_TILE_CASE(DT, 3) \
    MOE_TILE_CASE(DT, 4) MOE_TILE_CASE(DT, 5) MOE_TILE_CASE(DT, 6) MOE_TILE_CASE(DT, 7) \
    MOE_TILE_CASE(DT, 8)
#elif MR == 14
#define MOE_TILE_CASES(DT) MOE_TILE_CASE(DT, 1) MOE_TILE_CASE(DT, 2) MOE_TILE_CASE(DT, 3) \
    MOE_TILE_CASE(DT, 4) MOE_TILE_CASE(DT, 5) MOE_TILE_CASE(DT, 6) MOE_TILE_CASE(DT, 7) \
    MOE_TILE_CASE(DT, 8) MOE_TILE_CASE(DT, 9) MOE_TILE_CASE(DT, 10) MOE_TILE_CASE(DT, 11) \
    MOE_TILE_CASE(DT, 12) MOE_TILE_CASE(DT, 13) MOE_TILE_CASE(DT, 14)
#elif MR == 6
#define MOE_TILE_CASES(DT) MOE_TILE_CASE(DT, 1) MOE_TILE_CASE(DT, 2) MOE_TILE_CASE(DT, 3) \
    MOE_TILE_CASE(DT, 4) MOE_TILE_CASE(DT, 5) MOE_TILE_CASE(DT, 6)
#else
#error "MOE_MR must be 6, 8 or 14"
#endif
#define MOE_TILE_FN(NAME, DT)                                                                   \
    static void NAME(int m, const float *x, int64_t ldx, int64_t K, const char *panel,          \
                     const void *gscale, const epilogue *ep, int row0) {                        \
        switch (m) { MOE_TILE_CASES(DT) }                                                       \
    }
MOE_TILE_FN(tile_f32, MOE_W_F32)
MOE_TILE_FN(tile_bf16, MOE_W_BF16)
MOE_TILE_FN(tile_f16, MOE_W_F16)
MOE_TILE_FN(tile_i8, MOE_W_I8)
MOE_TILE_FN(tile_i4, MOE_W_I4)
MOE_TILE_FN(tile_fp4, MOE_W_FP4)
#if !defined(MOE_AMX) /* the amx build takes bf16p, bf16x3 and i8q on tiles (amx_tiles.h) */
MOE_TILE_FN(tile_i8q, MOE_W_I8Q)
MOE_TILE_FN(tile_bf16p, MOE_W_BF16P)
MOE_TILE_FN(tile_bf16x3, MOE_W_BF16X3)
#endif

typedef void (*tile_fn)(int, const float *, int64_t, int64_t, const char *, const void *,
                        const epilogue *, int);

#if defined(MOE_AMX)
#include "amx_tiles.h"
#endif

/* Whether GEMMs on weights of dtype dt run on AMX tiles: bf16p, bf16x3 and i8q in the amx
 * build, none elsewhere. */
static inline int on_tiles(int dt) {
#if defined(MOE_AMX)
    return moe_pair_terms(dt) || dt == MOE_W_I8Q;
#else
    (void)dt;
    return 0;
#endif
}

/* Token rows one tile call takes: AMX_ROWS on AMX tiles, MR in registers (MR_Q8 for i8q). */
static inline int tile_rows(int dt) {
#if defined(MOE_AMX)
    if (on_tiles(dt)) return AMX_ROWS;
#endif
    return dt == MOE_W_I8Q ? MR_Q8 : MR;
}

/* Sets up (and, at the end, releases) the calling thread's AMX tiles when `tiles` (on_tiles of
 * a GEMM's weights it runs); nothing on the other builds. Called by every thread of a parallel
 * region. */
static inline void tiles_begin(int tiles) {
#if defined(MOE_AMX)
    if (tiles) amx_tiles_begin();
#endif
    (void)tiles;
}

static inline void tiles_end(int tiles) {
#if defined(MOE_AMX)
    if (tiles) amx_tiles_end();
#endif
    (void)tiles;
}

static tile_fn tile_for(int dt) {
    switch (dt) {
        case MOE_W_BF16: return tile_bf16;
        case MOE_W_F16: return tile_f16;
        case MOE_W_I8: return tile_i8;
        case MOE_W_I4: return tile_i4;
        case MOE_W_FP4: return tile_fp4;
#if defined(MOE_AMX)
        case MOE_W_I8Q: return tile_i8q_amx;
        case MOE_W_BF16P: return tile_bf16p_amx;
        case MOE_W_BF16X3: return tile_bf16x3_amx;
#else
        case MOE_W_I8Q: return tile_i8q;
        case MOE_W_BF16P: return tile_bf16p;
        case MOE_W_BF16X3: return tile_bf16x3;
#endif
        default: return tile_f32;
    }
}

static inline const char *panel_ptr(const moe_packed *w, int64_t p) {
    return (const char *)w->data + p * panel_rows(w->dtype, w->k) * krow_bytes(w->dtype);
}

/* Group scales of panel p (i4: fp32, fp4: E8M0 bytes) from input k0 on (a multiple of
 * MOE_I4_GROUP), or NULL. */
static inline const void *panel_gscale(const moe_packed *w, int64_t p, int64_t k0) {
    const int64_t at = (p * (w->k / MOE_I4_GROUP) + k0 / MOE_I4_GROUP) * MOE_NR;
    if (w->dtype == MOE_W_I4) return (const float *)w->scale + at;
    if (w->dtype == MOE_W_FP4) return (const uint8_t *)w->scale + at;
    return NULL;
}

static inline int64_t num_panels(const moe_packed *w) { return (w->n + MOE_NR - 1) / MOE_NR; }

/* Per-column scale of panel p (i8, i8q) or NULL. */
static inline const float *panel_cscale(const moe_packed *w, int64_t p) {
    return w->dtype == MOE_W_I8 || w->dtype == MOE_W_I8Q ? (const float *)w->scale + p * MOE_NR
                                                         : NULL;
}

/* Column corrections of panel p (i8q: after the scales of every panel) or NULL. */
static inline const int32_t *panel_ccorr(const moe_packed *w, int64_t p) {
    return w->dtype == MOE_W_I8Q
               ? (const int32_t *)w->scale + (num_panels(w) + p) * MOE_NR
               : NULL;
}

/* Bytes of one activation input as the tiles read it: fp32 4, bf16 pairs 2, bf16x3's three
 * planes of them 6, i8q's bytes 1. */
static inline int64_t input_bytes(int dt) {
    return moe_pair_terms(dt) ? 2 * moe_pair_terms(dt) : dt == MOE_W_I8Q ? 1 : 4;
}

/* How a GEMM of `rows` activation rows against w is cut into work items, each rows [t0, t1)
 * of a chunk against a group of panels [p0, p1).
 *
 * An item reads each of its panels from memory once (the later row tiles find it in cache)
 * and its activations once per panel, so the activations must stay in the core's L2: up to
 * ITEM_BYTES of them. When its rows (TC, or fewer in all) of k inputs overflow that
 * (Mixtral-8x7B's down GEMM: 14336 inputs, 57 KB a row in fp32), the item walks k in blocks of
 * KC instead: each block of
 * its activations stays in L2 while it meets every panel of the group, and the raw sums wait
 * in a buffer of the thread's (`part`, up to PART_BYTES) between blocks. A store and a load
 * of an fp32 sum are exact and every sum keeps its order, so a row's result is bitwise the
 * same whatever the blocking (and the item size): work partitioning only. */
/* inputs of a k-block: a multiple of 64, so a block before the last is whole AMX steps for
 * both storages (16 bf16 pair-rows are 32 inputs, 16 i8q quad-rows 64; amx_finish adds no
 * tail on such a block) and whole i4 groups (32) */
#define KC 512
_Static_assert(KC % 64 == 0, "KC: a k-block before the last must be whole AMX i8q steps");
#define PART_BYTES (256 << 10)
typedef struct {
    tile_fn tile_of;
    int mr;            /* rows a tile call takes (tile_rows) */
    int64_t kb;        /* inputs of a k-block: w->k when unblocked */
    int64_t tc;        /* rows of an item */
    int64_t group;     /* panels of an item */
    int64_t pgroups;   /* panel groups */
    int64_t items;
    int stream;        /* items fetch their next panel while they compute (STREAM_ROWS) */
} gemm_plan;

/* Items of at most STREAM_ROWS rows (decode sizes: one or two row tiles a panel) stream
 * their next panel (panel_stream), and unblocked ones take up to STREAM_GROUP consecutive
 * panels, so only the first comes cold from memory. With more rows the memory time is small
 * beside the compute and the next panel would push the item's activations out of L2: in an
 * 8-expert call on the AVX2 EPYC, streaming gave +10-17% at 4-8 rows an expert, nothing at
 * 32 and -10% at 128. */
#define STREAM_ROWS 16
#define STREAM_GROUP 8

static inline gemm_plan plan_gemm(const moe_packed *w, int64_t rows, int nthreads) {
    gemm_plan g;
    g.tile_of = tile_for(w->dtype);
    g.mr = tile_rows(w->dtype);
    const int64_t k = w->k > 1 ? w->k : 1, ib = input_bytes(w->dtype);
    /* blocked when the item's rows (TC, or all when fewer) overflow ITEM_BYTES */
    g.kb = k > KC && (rows < TC ? rows : TC) * ib * k > ITEM_BYTES ? KC : k;
    /* rows whose activations fit ITEM_BYTES, then the chunks that takes, in whole tiles of
     * near-equal size: a chunk of a few rows left over would read every panel again for them */
    int64_t tc = ITEM_BYTES / (ib * g.kb);
    tc = tc < TC ? TC : tc > ITEM_ROWS_MAX ? ITEM_ROWS_MAX : tc;
    const int64_t P = num_panels(w), parts = rows > tc ? (rows + tc - 1) / tc : 1;
    const int64_t share = (rows + parts - 1) / parts;
    g.tc = share < 1 ? g.mr : (share + g.mr - 1) / g.mr * g.mr;
    const int64_t chunks = (rows + g.tc - 1) / g.tc;
    /* the part buffer holds an item's rows (in whole tiles) for each panel of its group */
    const int64_t per_panel = g.tc * MOE_NR * (int64_t)sizeof(float); /* g.tc: whole tiles */
    /* bf16 pairs (the AVX512-BF16 and AMX builds' storage, whose decode is compute-bound)
     * and AMX tiles (their steps prefetch the panel themselves) do not stream */
    g.stream = rows <= STREAM_ROWS && !moe_pair_terms(w->dtype) && !on_tiles(w->dtype);
    if (g.kb < k) {
        g.group = PART_BYTES / per_panel;
    } else if (g.stream) { /* as long as ~4 items a thread remain to balance */
        g.group = P / (4 * (int64_t)(nthreads > 1 ? nthreads : 1));
        g.group = g.group > STREAM_GROUP ? STREAM_GROUP : g.group;
    } else {
        g.group = 1;
    }
    g.group = g.group < 1 ? 1 : g.group > P ? P : g.group;
    g.pgroups = (P + g.group - 1) / g.group;
    g.items = g.pgroups * chunks;
    return g;
}

/* moe_isa_ops.gemm_k_block: the k-block plan_gemm picks. */
static int64_t gemm_k_block_impl(int64_t rows, int64_t k, int dtype) {
    const moe_packed w = {.data = NULL, .scale = NULL, .n = MOE_NR, .k = k, .dtype = dtype};
    return plan_gemm(&w, rows, 1).kb;
}

/* Rows [t0, t1) of an item against one panel's inputs from k0 on, `mr` rows (tile_rows) at a
 * time. Register tiles split a tail of mr+1 .. 2mr-1 rows in two near-equal tiles (7 rows: 4
 * and 3, not 6 and 1): a tile of few rows has too few FMA chains to cover the FMA latency
 * (one row: 2 chains a pass, where 2 ports x 4 cycles want 8), and a row's sums do not depend
 * on its tile. AMX tiles compute 16 rows whatever the count, so theirs stay whole. */
static inline int tile_split(int mr, int64_t left) {
    if (mr <= MR && left > mr && left < 2 * mr) return (int)(left + 1) / 2;
    return (int)(left < mr ? left : mr);
}

/* The tiles of rows [t0, t1) against a panel; with a stream (ep->stream), their walks of the
 * panel share the fetching of the next one evenly. */
static inline void run_tiles(tile_fn tile_of, int mr, int dt, const float *x, int64_t ldx,
                             int64_t K, const char *panel, const void *gscale,
                             const epilogue *ep, int64_t t0, int64_t t1) {
    if (ep->stream) {
        int64_t walks = 0;
        for (int64_t tb = t0; tb < t1;) {
            const int m = tile_split(mr, t1 - tb);
            walks += fused_passes(dt, m) ? 1 : NPASS;
            tb += m;
        }
        const int64_t lines = (ep->stream->end - ep->stream->at + 63) / 64;
        ep->stream->per_walk = walks > 0 ? (lines + walks - 1) / walks : 0;
    }
    for (int64_t tb = t0; tb < t1;) {
        const int m = tile_split(mr, t1 - tb);
        tile_of(m, x + tb * ldx, ldx, K, panel, gscale, ep, (int)tb);
        tb += m;
    }
}

/* Work item `it` of plan g for `rows` rows of x (row stride ldx; fp32, or bf16 pair words):
 * rows [t0, t1) of a chunk against the panels [p0, p1) of a group (consecutive items share
 * their rows, so a thread's next item finds them in cache), each panel through `base` made its
 * own. `out` advances `width` columns a panel and the biases (padded to whole panels) MOE_NR;
 * `nout` columns are real. `part` is the thread's PART_BYTES buffer for k-blocked plans; NULL
 * (no memory) walks k whole, with the same results. */
static void run_item(const gemm_plan *g, const moe_packed *w, int64_t rows, int64_t it,
                     const float *x, int64_t ldx, const epilogue *base, int64_t width,
                     int64_t nout, float *part) {
    const int64_t P = num_panels(w), c = it / g->pgroups;
    const int64_t p0 = (it % g->pgroups) * g->group, p1 = p0 + g->group < P ? p0 + g->group : P;
    const int64_t t0 = c * g->tc, t1 = (c + 1) * g->tc < rows ? (c + 1) * g->tc : rows;
    const int64_t K = w->k, rb = krow_bytes(w->dtype);
    const int64_t kb = part ? g->kb : K, prows = (t1 - t0 + g->mr - 1) / g->mr * g->mr;
    int64_t k0 = 0;
    do { /* once when K == 0: the epilogue still writes act(bias) */
        const int64_t k1 = k0 + kb < K ? k0 + kb : K;
        const float *xk = x + act_words(w->dtype, k0);
        for (int64_t p = p0; p < p1; p++) {
            /* what the item reads next: the next panel's k-block, or the first panel's next */
            const int64_t np = p + 1 < p1 ? p + 1 : p0, nk0 = p + 1 < p1 ? k0 : k1,
                          nk1 = p + 1 < p1 ? k1 : (k1 + kb < K ? k1 + kb : K);
            const char *next = panel_ptr(w, np) + panel_rows(w->dtype, nk0) * rb;
            panel_stream stream = {next, next + (panel_rows(w->dtype, nk1) -
                                                 panel_rows(w->dtype, nk0)) * rb, 0};
            epilogue ep = *base;
            ep.ncol = (int)(nout - p * width < width ? nout - p * width : width);
            ep.cscale = panel_cscale(w, p);
            ep.ccorr = panel_ccorr(w, p);
            ep.bias = base->bias ? base->bias + p * MOE_NR : NULL;
            ep.out = base->out + p * width;
            ep.part = part ? part + (p - p0) * prows * MOE_NR : NULL;
            ep.part_row0 = t0;
            ep.resume = k0 > 0;
            ep.defer = k1 < K;
            ep.stream = g->stream && nk1 > nk0 ? &stream : NULL;
            run_tiles(g->tile_of, g->mr, w->dtype, xk, ldx, k1 - k0,
                      panel_ptr(w, p) + panel_rows(w->dtype, k0) * rb, panel_gscale(w, p, k0),
                      &ep, t0, t1);
        }
        k0 += kb;
    } while (k0 < K);
}

static int linear_impl(const float *x, int64_t ldx, int64_t T, const moe_packed *w,
                       const float *bias, int act, float *y, int64_t ldy, int nthreads) {
    if (w->dtype == MOE_W_I8Q && w->k > MOE_I8Q_MAX_K) return -4; /* int32 sums would overflow */
    const int terms = moe_pair_terms(w->dtype), tiles = on_tiles(w->dtype);
    const int form = act_form(w->dtype);
    const int64_t P = num_panels(w);
    const int parallel = nthreads > 1 && T * w->n * w->k >= SMALL_WORK;
    const gemm_plan g = plan_gemm(w, T, parallel ? nthreads : 1);
    uint32_t *pairs = NULL;
    float *padded_bias = NULL; /* whole panels of it: the epilogue loads MOE_NR at a time */
    if (bias && P > 0) {
        padded_bias = (float *)calloc((size_t)(P * MOE_NR), sizeof(float));
        if (!padded_bias) return -2;
        memcpy(padded_bias, bias, sizeof(float) * (size_t)w->n);
    }
    if (form) { /* the rows as bf16 pairs, bf16x3 planes or i8q quads, once for every panel,
                 * MOE_PAD_ROWS rows spare */
        const int64_t ldp = form == ACT_Q8 ? moe_q8_stride(w->k)
                            : terms == 3   ? moe_act_stride(w->k, 3)
                                           : moe_row_stride((w->k + 1) / 2);
        pairs = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)((T + MOE_PAD_ROWS) * ldp));
        if (!pairs) {
            free(padded_bias);
            return -2;
        }
        memset(pairs + T * ldp, 0, sizeof(uint32_t) * (size_t)(MOE_PAD_ROWS * ldp));
#pragma omp parallel for schedule(static) num_threads(nthreads) if (parallel)
        for (int64_t t = 0; t < T; t++) to_form(x + t * ldx, w->k, (float *)(pairs + t * ldp), ldp, form);
        x = (const float *)pairs;
        ldx = ldp;
    }
    const epilogue base = {.mode = EPI_LINEAR, .bias = padded_bias, .act = act, .out = y,
                           .ldo = ldy, .rscale = form == ACT_Q8 ? x + ldx - 1 : NULL,
                           .rstride = ldx};
#pragma omp parallel num_threads(nthreads) if (parallel)
    {
    /* k-blocked plans: the thread's buffer of raw sums (without it, k is walked whole) */
    float *part = g.kb < w->k ? (float *)malloc(PART_BYTES) : NULL;
    tiles_begin(tiles);
#pragma omp for schedule(static)
    for (int64_t it = 0; it < g.items; it++)
        run_item(&g, w, T, it, x, ldx, &base, MOE_NR, w->n, part);
    tiles_end(tiles);
    free(part);
    }
    free(pairs);
    free(padded_bias);
    return 0;
}

/* The SwiGLU experts (see moe_isa_ops.moe_ffn). Returns 0, -1 when an index names an expert
 * that is out of range or absent, -2 when out of memory, -3 when the experts mix bf16p,
 * bf16x3 or i8q with other storage (the gathered rows are bf16 pairs, bf16x3 planes, i8q
 * quads or fp32 for all of them), or an expert holds i8q beside bf16p or bf16x3. */
static int moe_ffn_impl(const float *x, int64_t T, int64_t H, const int64_t *idx,
                        const float *weight, int top_k, const moe_expert *experts, int E,
                        const moe_glu *glu, float *out, float *work, int32_t *iwork,
                        int nthreads) {
    const int64_t rows = T * top_k;
    int64_t I = 0;
    /* the forms of w13 / w2's activations (act_form; -1: no expert yet) */
    int form13 = -1, form2 = -1;
    int tiles = 0; /* a GEMM runs on AMX tiles (on_tiles) */
    for (int e = 0; e < E; e++) {
        if (!experts[e].w13.data) continue;
        tiles |= on_tiles(experts[e].w13.dtype) | on_tiles(experts[e].w2.dtype);
        const int p13 = act_form(experts[e].w13.dtype), p2 = act_form(experts[e].w2.dtype);
        if ((p13 == ACT_Q8 && experts[e].w13.k > MOE_I8Q_MAX_K) ||
            (p2 == ACT_Q8 && experts[e].w2.k > MOE_I8Q_MAX_K))
            return -4; /* int32 sums would overflow */
        /* the work rows are laid out for one of bf16x3's planes and i8q's scale word */
        if ((p13 == ACT_Q8 && p2 > 0 && p2 != ACT_Q8) || (p2 == ACT_Q8 && p13 > 0 && p13 != ACT_Q8))
            return -3;
        if (I == 0) {
            I = experts[e].w2.k;
            form13 = p13;
            form2 = p2;
        } else if (p13 != form13 || p2 != form2) {
            return -3;
        }
    }
    int32_t *by_expert = iwork, *offset = iwork + rows; /* offset[E+1] */
    for (int e = 0; e <= E; e++) offset[e] = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t e = idx[r];
        if (e < 0 || e >= E || experts[e].w13.data == NULL) return -1;
        offset[e + 1]++;
    }
    for (int e = 0; e < E; e++) offset[e + 1] += offset[e];
    /* counting sort, stable: an expert's rows in increasing (token, slot) order */
    {
        int32_t *fill = (int32_t *)malloc(sizeof(int32_t) * (E > 0 ? E : 1));
        if (!fill) return -2;
        for (int e = 0; e < E; e++) fill[e] = offset[e];
        for (int64_t r = 0; r < rows; r++) by_expert[fill[idx[r]]++] = (int32_t)r;
        free(fill);
    }
    /* gathered rows and activations, each followed by MOE_PAD_ROWS spare rows (AMX tiles read
     * whole row tiles) */
    /* the pair terms (bf16p, bf16x3), as work_floats sized it; i8q rows fit fp32's strides */
    const int pairs13 = form13 == ACT_Q8 ? 0 : form13, pairs2 = form2 == ACT_Q8 ? 0 : form2;
    const int terms = pairs13 > pairs2 ? pairs13 : pairs2;
    const int64_t ldh = moe_act_stride(H, terms), ldi = moe_act_stride(I, terms);
    float *xg = work, *act = xg + (rows + MOE_PAD_ROWS) * ldh,
          *slots = act + (rows + MOE_PAD_ROWS) * ldi;
    const int parallel = nthreads > 1 && rows * H * I >= SMALL_WORK, team = parallel ? nthreads : 1;
    if (tiles) { /* the spare rows AMX tiles read past the last expert's: zeros, not whatever
                  * the caller's scratch held (their products are never stored either way) */
        memset(xg + rows * ldh, 0, sizeof(float) * (size_t)(MOE_PAD_ROWS * ldh));
        memset(act + rows * ldi, 0, sizeof(float) * (size_t)(MOE_PAD_ROWS * ldi));
    }
    /* bf16x3: the SwiGLU outputs go to fp32 rows of their own (the planes of a row would
     * overwrite its values before they are read), then are split into act's planes */
    const int64_t ld32 = pairs2 == 3 ? moe_row_stride(I) : ldi;
    float *act32 = pairs2 == 3 ? slots + rows * H : act;
    /* the k-blocked GEMMs' buffer of raw sums, if any expert's needs one */
    int blocked = 0;
    for (int e = 0; e < E; e++)
        if (experts[e].w13.data)
            blocked |= plan_gemm(&experts[e].w13, rows, 1).kb < experts[e].w13.k ||
                       plan_gemm(&experts[e].w2, rows, 1).kb < experts[e].w2.k;
#pragma omp parallel num_threads(nthreads) if (parallel)
    {
        /* the thread's (without it, k is walked whole, with the same results) */
        float *part = blocked ? (float *)malloc(PART_BYTES) : NULL;
        tiles_begin(tiles);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; i++) {
            const float *src = x + (by_expert[i] / top_k) * H;
            if (form13 > 0) /* bf16 pairs at the fp32 row stride, bf16x3 planes, i8q quads */
                to_form(src, H, xg + i * ldh, ldh, form13);
            else
                memcpy(xg + i * ldh, src, sizeof(float) * H);
        }
        /* gate|up GEMM and SiLU(gate) * up, per (expert, token chunk, panel group) */
        for (int e = 0; e < E; e++) {
            const int64_t n = offset[e + 1] - offset[e];
            if (n == 0) continue;
            const moe_packed *w = &experts[e].w13;
            const gemm_plan g = plan_gemm(w, n, team);
            const float *xe = xg + (int64_t)offset[e] * ldh;
            const epilogue base = {.mode = EPI_SWIGLU, .bias = experts[e].b13, .glu = glu,
                                   .out = act32 + (int64_t)offset[e] * ld32, .ldo = ld32,
                                   .rscale = form13 == ACT_Q8 ? xe + ldh - 1 : NULL,
                                   .rstride = ldh};
#pragma omp for schedule(dynamic, 1) nowait
            /* a panel's 16 gate and 16 up columns give 16 outputs */
            for (int64_t it = 0; it < g.items; it++)
                run_item(&g, w, n, it, xe, ldh, &base, 16, I, part);
        }
#pragma omp barrier
        if (form2 > 0) { /* the activations as bf16 pairs or i8q quads (in place: act32 is
                          * act, row stride kept) or bf16x3 planes (from act32's fp32 rows) */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < rows; i++)
                to_form(act32 + i * ld32, I, act + i * ldi, ldi, form2);
        }
        /* down GEMM, each row weighted by its routing weight into its (token, slot) row */
        for (int e = 0; e < E; e++) {
            const int64_t n = offset[e + 1] - offset[e];
            if (n == 0) continue;
            const moe_packed *w = &experts[e].w2;
            const gemm_plan g = plan_gemm(w, n, team);
            const float *ae = act + (int64_t)offset[e] * ldi;
            const epilogue base = {.mode = EPI_SCATTER, .bias = experts[e].b2, .out = slots,
                                   .ldo = H, .rows = by_expert + offset[e], .weight = weight,
                                   .rscale = form2 == ACT_Q8 ? ae + ldi - 1 : NULL,
                                   .rstride = ldi};
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t it = 0; it < g.items; it++)
                run_item(&g, w, n, it, ae, ldi, &base, MOE_NR, H, part);
        }
#pragma omp barrier
        tiles_end(tiles);
        free(part);
        /* each token's slots summed in slot order: fixed whatever the batch */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *dst = out + t * H;
            const float *src = slots + t * top_k * H;
            memcpy(dst, src, sizeof(float) * H);
            for (int s = 1; s < top_k; s++)
                for (int64_t j = 0; j < H; j++) dst[j] += src[s * H + j];
        }
    }
    return 0;
}

/* The FLOP/s probe (moe_isa_ops.fma_probe): 12 independent chains in named registers (an array
 * would be spilled), more than FMA latency x FMA ports on every core seen so far, and fitting
 * AVX2's 16 registers; each step of a chain is one fp32 FMA, or one bf16 pair dot product
 * (vdpbf16ps where the build has it, else the two FMAs per pair the bf16p micro-kernel does). */
static double fma_probe_impl(int64_t n, int nthreads, int kind) {
#if defined(MOE_AMX)
    if (kind == MOE_PROBE_BF16_DOT || kind == MOE_PROBE_I8_DOT)
        return amx_probe(n, nthreads, kind == MOE_PROBE_I8_DOT);
#endif
    double total = 0.0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        const vf m = bcast(0.999999f), c = bcast(1e-7f);
        /* bf16 pairs of ~1e-3: each dot step adds ~2e-6, far from overflow */
        const uint32_t pair = 0x3a833a83u;
#if VW == 16 && defined(__AVX512BF16__)
        const __m512bh mp = (__m512bh)_mm512_set1_epi32((int)pair);
#define DOT(a) a = (vf)_mm512_dpbf16_ps((__m512)a, mp, mp)
#else
        const uint32_t pl = pair << 16, ph = pair & 0xffff0000u;
        float fl, fh;
        memcpy(&fl, &pl, 4);
        memcpy(&fh, &ph, 4);
        const vf ml = bcast(fl), mh = bcast(fh);
#define DOT(a) a = (a + mh * mh) + ml * ml
#endif
#define FMA(a) a = a * m + c
        /* int8 quads (i8q): vpdpbusd where the build has it, else the two vpmaddwd and adds a
         * quad the i8q micro-kernel does; activations (1, 1, 1, 1) against weights (-1, 1, -1,
         * 1): each step adds 0, so the sums never overflow */
        vi qx = bcast_word(0x01010101u), qw = bcast_word(0x01ff01ffu);
#if defined(HAVE_DPBUSD)
#define QDOT(a) a = (vf)dpbusd((vi)a, qx, qw); PIN_VEC(qw)
#else
        vi qe = (vi)(((vs16)qw << 8) >> 8), qo = (vi)((vs16)qw >> 8), xe = qx & 0x00ff00ff,
           xo = (qx >> 8) & 0x00ff00ff;
        /* the operands made opaque at each step, or the compiler hoists the products, constant
         * in the loop, and the chain becomes adds */
#define QDOT(a) a = (vf)((vi)a + madd16(qe, xe) + madd16(qo, xo)); PIN_VEC(qe); PIN_VEC(qo); \
    PIN_VEC(xe); PIN_VEC(xo)
#endif
#define CHAINS(OP) \
    for (int64_t it = 0; it < n; it++) { \
        OP(a0); OP(a1); OP(a2); OP(a3); OP(a4); OP(a5); \
        OP(a6); OP(a7); OP(a8); OP(a9); OP(a10); OP(a11); \
    }
        vf a0 = (vf){0} + 0.f, a1 = (vf){0} + 1.f, a2 = (vf){0} + 2.f, a3 = (vf){0} + 3.f;
        vf a4 = (vf){0} + 4.f, a5 = (vf){0} + 5.f, a6 = (vf){0} + 6.f, a7 = (vf){0} + 7.f;
        vf a8 = (vf){0} + 8.f, a9 = (vf){0} + 9.f, a10 = (vf){0} + 10.f, a11 = (vf){0} + 11.f;
        if (kind == MOE_PROBE_BF16_DOT) {
            CHAINS(DOT)
        } else if (kind == MOE_PROBE_I8_DOT) {
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = (vf){0};
            CHAINS(QDOT)
        } else {
            CHAINS(FMA)
        }
#undef CHAINS
#undef FMA
#undef DOT
#undef QDOT
        vf s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) + ((a8 + a9) + (a10 + a11));
        for (int i = 0; i < VW; i++) total += s[i];
    }
    return total;
}

/* FLOPs one iteration of the probe does on one thread (moe_isa_ops.probe_flops). */
static int64_t probe_flops_impl(int kind) {
#if defined(MOE_AMX)
    if (kind == MOE_PROBE_BF16_DOT || kind == MOE_PROBE_I8_DOT)
        return amx_probe_flops(kind == MOE_PROBE_I8_DOT);
#endif
    return (int64_t)12 * VW * (kind == MOE_PROBE_I8_DOT ? 8 : kind == MOE_PROBE_BF16_DOT ? 4 : 2);
}
