/* Vector types and loads shared by the kernel templates (packed_gemm_impl.h,
 * paged_attention_impl.h), at the width of the ISA build that includes them.
 *
 * kernels_cy/isa_<name>.c defines MOE_VW (fp32 lanes per vector: 4, 8 or 16) and is compiled
 * with that ISA's flags. GCC/Clang vector extensions keep one source for every width: the
 * compiler emits SSE, AVX2 or AVX-512 instructions from the same expressions; intrinsics appear
 * only where the generic code is poor, each with a portable fallback.
 */
#ifndef MOE_ISA_VEC_H
#define MOE_ISA_VEC_H

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if !defined(MOE_VW)
#error "define MOE_VW before including isa_vec.h"
#endif

/* 64-byte generic vectors without AVX-512 have another ABI; every vector function of the
 * templates is static, so no call crosses it. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#define VW MOE_VW

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef int8_t vb __attribute__((vector_size(VW)));
typedef uint8_t vub __attribute__((vector_size(VW)));

/* Unaligned load and store of one vector. */
static inline vf ldf(const void *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void stf(void *p, vf v) { memcpy(p, &v, sizeof v); }

/* A prefetch of p's line into L1. An asm statement, not __builtin_prefetch: GCC 12 took the
 * builtin in the register tile's k loop as a reason to keep the tile's accumulators in memory
 * (a load, an FMA and a store each), at half the speed. */
#if defined(__x86_64__) || defined(__i386__)
#define PREFETCH_T0(p) __asm__ volatile("prefetcht0 (%0)" : : "r"(p))
/* The same into L2 (prefetcht1): lines wanted a panel later, not in the next steps. */
#define PREFETCH_T1(p) __asm__ volatile("prefetcht1 (%0)" : : "r"(p))
#else
#define PREFETCH_T0(p) __builtin_prefetch((p), 0, 3)
#define PREFETCH_T1(p) __builtin_prefetch((p), 0, 2)
#endif

/* v in every lane: one vbroadcastss from memory. (`(vf){0} + v` also adds, since 0 + v is not
 * v for v = -0, and GCC builds a lane loop with inserts.) */
static inline vf bcast(float v) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_set1_ps(v);
#elif VW == 8 && defined(__AVX__)
    return (vf)_mm256_set1_ps(v);
#elif VW == 4 && defined(__SSE__)
    return (vf)_mm_set1_ps(v);
#else
    vf r;
    for (int i = 0; i < VW; i++) r[i] = v;
    return r;
#endif
}

/* *p in every lane, loaded again at each use: a volatile asm is neither merged with another
 * nor hoisted, so a loop that broadcasts the same value twice holds it in no register between
 * the uses. The asm takes the address, not the memory ("m"): told that it reads memory, GCC
 * stores every vector that might alias before it, a tile's accumulators included, and a
 * memory clobber also reloads them. So *p must be written before the call that reads it
 * (the activations of a GEMM are). */
static inline vf bcast_again(const float *p) {
#if VW == 8 && defined(__AVX__)
    vf r;
    __asm__ volatile("vbroadcastss (%1), %0" : "=x"(r) : "r"(p));
    return r;
#else
    return bcast(*p);
#endif
}

/* VW fp16 -> fp32: F16C/AVX-512 conversions where the build has them, else exponent rebias by
 * a multiplication (exact for normal and subnormal halves; inf/nan get an all-ones exponent). */
static inline vf cvt_f16(const void *p) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif VW == 8 && defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vh raw;
    memcpy(&raw, p, sizeof raw);
    vu h = __builtin_convertvector(raw, vu);
    vu em = (h & 0x7fffu) << 13;
    vu bits = (vu)((vf)em * 0x1p112f);
    vu special = (vu)((h & 0x7c00u) == 0x7c00u);
    bits = (bits & ~special) | ((em | 0x7f800000u) & special);
    return (vf)(bits | ((h & 0x8000u) << 16));
#endif
}

/* VW 32-bit words of bf16 pairs -> the low halves and the high halves as fp32: one load, a
 * shift and a mask, two ALU operations per 2*VW elements and no widening shuffles. Layouts put
 * the elements they want in the same vector into the same halves (packed GEMM: columns i and
 * 16+i in word i; the attention's K/V rows: elements 2i and 2i+1 as stored). */
static inline __attribute__((always_inline)) void cvt_bf16_halves(const void *p, vf *lo,
                                                                 vf *hi) {
    vu w;
    memcpy(&w, p, sizeof w);
#if defined(__x86_64__) || defined(__i386__)
    /* in a register: GCC otherwise folds the load into both users and loads the line twice
     * (the 6-row AVX2 tiles ran 10-25% slower when a change elsewhere tipped it that way) */
    __asm__("" : "+v"(w));
#endif
    *lo = (vf)(w << 16);
    *hi = (vf)(w & 0xffff0000u);
}

/* VW bf16 in natural order -> fp32: widen to 32 bits and shift left by 16. */
static inline vf cvt_bf16(const void *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

/* exp(x) for every lane, each lane computed alone (so a value does not depend on its lane or
 * its neighbours). The attention's exp(s - max) shares it: Cephes-style range reduction x = n*ln2 + r, a degree-7 polynomial for e^r
 * (relative error ~1e-7), 2^n built in the exponent bits; x clamped to [-87, 88]. */
static inline vf vexp(vf x) {
    const vf lo = bcast(-87.0f), hi = bcast(88.0f);
    x = (vf)(((vi)(x < lo) & (vi)lo) | (~(vi)(x < lo) & (vi)x));
    x = (vf)(((vi)(x > hi) & (vi)hi) | (~(vi)(x > hi) & (vi)x));
    vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}

#endif
