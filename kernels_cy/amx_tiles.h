/* AMX tiles for bf16p and bf16x3 weights (engine.matmul_precision=medium and high; tdpbf16ps)
 * and for i8q weights (int8 experts under medium; tdpbusd): the amx build, included by
 * packed_gemm_impl.h when MOE_AMX is defined.
 *
 * A bf16p panel is already in the layout AMX's tdpbf16ps takes for its second operand: pair-row
 * j holds, for each of the panel's 32 columns, the 32-bit word (W[c, 2j], W[c, 2j+1]), so 16
 * pair-rows of columns 0-15 are one 16 x 64-byte tile at a stride of 128 bytes, and columns
 * 16-31 the tile 64 bytes further. The activations, rounded to bf16 pairs as every build rounds
 * them, are the first operand as they lie (a row's 16 pair words, at the row stride). One
 * tdpbf16ps does 16 x 16 x 32 multiply-adds, so the weights are never widened and a step's
 * compute is ~8x AVX512-BF16's. An i8q panel is the same for tdpbusd: quad-row j holds column
 * c's signed codes of inputs 4j..4j+3 in word c (16 quad-rows, 64 inputs, a tile), and the
 * activations' unsigned bytes q + 128 are the first operand; one tdpbusd does 16 x 16 x 64
 * multiply-adds into exact int32 sums, so its results are bitwise vpdpbusd's and vpmaddwd's.
 *
 * Tiles, configured once per thread and call (amx_tiles_begin) and all 16 rows x 64 bytes:
 * 0-3 the accumulators of (row tile r, column half h) = tile 2r + h, 4-5 the activations of the
 * two row tiles, 6-7 the weights' two column halves. A call of m < 32 rows still loads 16 or 32
 * activation rows: the rows past m compute on whatever follows the caller's rows (callers leave
 * MOE_PAD_ROWS readable rows after their buffers) and are never stored. Each row is still
 * computed from its own activations alone, so a row's result does not depend on its batch; the
 * pairs (quads) past the last whole tile (k/2 or k/4 not a multiple of 16) are added after the
 * tiles, in order, by vdpbf16ps (vpdpbusd). tdpbf16ps sums its 32 products with its own
 * rounding and flushes subnormals: results differ from the FMA builds' by about an ulp of the
 * sums (as vdpbf16ps's).
 */
#ifndef MOE_AMX_TILES_H
#define MOE_AMX_TILES_H

#include <immintrin.h>

#define AMX_ROWS 32 /* token rows per tile call: two row tiles of 16 */
/* k-steps (2 KB of panel each) the prefetches run ahead. On a 2-core Emerald Rapids VM (a
 * noisy host) 4 streamed panels at 19-27 GB/s in runs where none gave 11-22; 8 steps, and
 * hints to L2, did no better. */
#define AMX_PREFETCH 4
/* k-steps the activations' prefetches run ahead (their lines come from L2): +2-5% at 64-1024
 * rows on the same VM. */
#define AMX_PREFETCH_X 2

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* Configures the calling thread's eight tiles (palette 1). The OS must have granted the process
 * the tile data state (isa_dispatch.c did, before this build could be chosen). */
static inline void amx_tiles_begin(void) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Returns the tile state to init, so the thread's context switches and idle states do not
 * carry 8 KB of tiles between calls. */
static inline void amx_tiles_end(void) { _tile_release(); }

/* The accumulators of one row tile (0-1) or two (0-3): zero, or the raw sums the k-blocks
 * before left in the item's part buffer (ep->resume; rows of MOE_NR floats). */
static inline void amx_start_acc(int two, const epilogue *ep, int row0) {
    if (ep->resume) {
        const float *c = part_row(ep, row0);
        _tile_loadd(0, c, 4 * MOE_NR);
        _tile_loadd(1, c + 16, 4 * MOE_NR);
        if (two) {
            _tile_loadd(2, c + 16 * MOE_NR, 4 * MOE_NR);
            _tile_loadd(3, c + 16 * MOE_NR + 16, 4 * MOE_NR);
        }
        return;
    }
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
}

/* The end of a tile call: the accumulators stored, the steps past the last whole tile (whole
 * of k2) added in order, and the rows through the epilogue. k2 counts bf16 pair-rows, each
 * pair's `terms` planes (ldt words apart) through vdpbf16ps in turn, or for i8q (q8) quad-rows,
 * through vpdpbusd (q8_steps: the int32 sums stay in the accumulators' bits). */
static inline __attribute__((always_inline)) void amx_finish(const int q8, int m, const float *x,
                                                            int64_t ldx, int64_t ldt, int terms,
                                                            int64_t k2, int64_t whole,
                                                            const char *panel,
                                                            const epilogue *ep, int row0) {
    if (ep->defer) { /* a k-block before the last: whole steps only (KC), the raw sums kept */
        float *c = part_row(ep, row0);
        _tile_stored(0, c, 4 * MOE_NR);
        _tile_stored(1, c + 16, 4 * MOE_NR);
        if (m > 16) {
            _tile_stored(2, c + 16 * MOE_NR, 4 * MOE_NR);
            _tile_stored(3, c + 16 * MOE_NR + 16, 4 * MOE_NR);
        }
        return;
    }
    float c[AMX_ROWS][32];
    _tile_stored(0, &c[0][0], 128);
    _tile_stored(1, &c[0][16], 128);
    if (m > 16) {
        _tile_stored(2, &c[16][0], 128);
        _tile_stored(3, &c[16][16], 128);
    }
    for (int r0 = 0; r0 < m; r0 += MR) {
        const int mm = m - r0 < MR ? m - r0 : MR;
        vf acc[MR][2];
        for (int r = 0; r < mm; r++) {
            acc[r][0] = ldf(c[r0 + r]);
            acc[r][1] = ldf(c[r0 + r] + 16);
        }
        if (q8) {
            q8_steps(mm, x + r0 * ldx, ldx, panel, 0, whole, k2, acc);
        } else {
            for (int64_t j = whole; j < k2; j++) {
                const __m512bh a = (__m512bh)_mm512_loadu_si512(panel + j * 128);
                const __m512bh b = (__m512bh)_mm512_loadu_si512(panel + j * 128 + 64);
                for (int r = 0; r < mm; r++)
                    for (int t = 0; t < terms; t++) {
                        int32_t w;
                        memcpy(&w, x + (r0 + r) * ldx + t * ldt + j, sizeof w);
                        const __m512bh xb = (__m512bh)_mm512_set1_epi32(w);
                        acc[r][0] = (vf)_mm512_dpbf16_ps((__m512)acc[r][0], a, xb);
                        acc[r][1] = (vf)_mm512_dpbf16_ps((__m512)acc[r][1], b, xb);
                    }
            }
        }
        apply_epilogue(mm, acc, 0, ep, row0 + r0);
    }
}

/* Prefetches of one step ahead, shared by the step loops: the panel's 2 KB (32 lines) of the
 * step AMX_PREFETCH ahead, and 64 bytes of each activation row (16, or 32 for two row tiles)
 * from `ahead`, rows `stride` bytes apart. */
static inline __attribute__((always_inline)) void amx_prefetch_panel(const char *panel,
                                                                    int64_t j) {
    const char *ahead = panel + (j + 16 * AMX_PREFETCH) * 128;
    for (int l = 0; l < 32; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
}

static inline __attribute__((always_inline)) void amx_prefetch_rows(const char *ahead,
                                                                   int64_t stride, int two) {
    for (int l = 0; l < (two ? 32 : 16); l++) _mm_prefetch(ahead + l * stride, _MM_HINT_T0);
}

/* The whole steps of 16 pair-rows (bf16p) or quad-rows (i8q: q8) of one tile call, [0, whole):
 * m <= AMX_ROWS activation rows (row stride `stride` bytes) against the panel, into the
 * accumulator tiles. A tile load waits for all its 16 lines, so lines are asked for ahead of
 * their step: the panel's AMX_PREFETCH steps ahead (it streams from DRAM for an item's first
 * row tile, a decode step's only one, and from L2 for the others), the activations' (from L2)
 * AMX_PREFETCH_X steps ahead. A step is 64 bytes of every activation row and 2 KB of panel
 * for both storages. */
static inline __attribute__((always_inline)) void amx_steps(const int q8, int m, const char *xa,
                                                           int64_t stride, int64_t whole,
                                                           const char *panel) {
    const int two = m > 16;
    const int64_t fetch = whole - 16 * AMX_PREFETCH, fetch_x = whole - 16 * AMX_PREFETCH_X;
    /* (tile numbers are instruction operands: a macro, not an argument) */
#define AMX_DOT(C, A, B)          \
    do {                          \
        if (q8)                   \
            _tile_dpbusd(C, A, B); \
        else                      \
            _tile_dpbf16ps(C, A, B); \
    } while (0)
    for (int64_t j = 0; j < whole; j += 16) {
        if (j < fetch) amx_prefetch_panel(panel, j);
        if (j < fetch_x) amx_prefetch_rows(xa + 4 * (j + 16 * AMX_PREFETCH_X), stride, two);
        /* each load just before the first product that needs it: +2-5% at 64-1024 rows
         * against all three loads first (same VM, interleaved; the same products in the same
         * order, so the same results) */
        _tile_loadd(4, xa + 4 * j, stride);
        _tile_loadd(6, panel + j * 128, 128);
        AMX_DOT(0, 4, 6);
        _tile_loadd(7, panel + j * 128 + 64, 128);
        AMX_DOT(1, 4, 7);
        if (two) {
            _tile_loadd(5, xa + 16 * stride + 4 * j, stride);
            AMX_DOT(2, 5, 6);
            AMX_DOT(3, 5, 7);
        }
    }
#undef AMX_DOT
}

/* One tile call of bf16p (q8 = 0) or i8q (q8 = 1) weights: m <= AMX_ROWS rows of bf16 pair
 * words, or of quantized quads (unsigned bytes, the row's scale in its last word), row stride
 * ldx words, against one panel, through the epilogue (i8q: int32 sums, corrected and scaled
 * there). */
static inline __attribute__((always_inline)) void amx_tile_call(const int q8, int m,
                                                               const float *x, int64_t ldx,
                                                               int64_t K, const char *panel,
                                                               const epilogue *ep, int row0) {
    const int64_t steps = q8 ? (K + 3) / 4 : (K + 1) / 2, whole = steps / 16 * 16;
    amx_start_acc(m > 16, ep, row0);
    amx_steps(q8, m, (const char *)x, 4 * ldx, whole, panel);
    amx_finish(q8, m, x, ldx, 0, 1, steps, whole, panel, ep, row0);
}

/* The bf16p and i8q tile functions of the amx build (tile_fn). */
static void tile_bf16p_amx(int m, const float *x, int64_t ldx, int64_t K, const char *panel,
                           const void *gscale, const epilogue *ep, int row0) {
    (void)gscale;
    amx_tile_call(0, m, x, ldx, K, panel, ep, row0);
}

static void tile_i8q_amx(int m, const float *x, int64_t ldx, int64_t K, const char *panel,
                         const void *gscale, const epilogue *ep, int row0) {
    (void)gscale;
    amx_tile_call(1, m, x, ldx, K, panel, ep, row0);
}

/* The bf16x3 tile function of the amx build: as tile_bf16p_amx, with each activation tile
 * loaded three times, once per term plane (ldx / 3 words apart in a row), and multiplied by the
 * same weight tiles: per step of 16 pairs, the hi, lo and lo2 terms in that order into the same
 * accumulators. Two row tiles take 6 activation loads and 2 weight loads for 12 tdpbf16ps
 * (bf16p: 2 and 2 for 4), so the tiles wait less on loads. */
static void tile_bf16x3_amx(int m, const float *x, int64_t ldx, int64_t K, const char *panel,
                            const void *gscale, const epilogue *ep, int row0) {
    (void)gscale;
    const int64_t k2 = (K + 1) / 2, whole = k2 / 16 * 16, stride = 4 * ldx, ldt = ldx / 3;
    const char *xa = (const char *)x;
    const int two = m > 16;
    amx_start_acc(two, ep, row0);
    const int64_t fetch = whole - 16 * AMX_PREFETCH, fetch_x = whole - 16 * AMX_PREFETCH_X;
    for (int64_t j = 0; j < whole; j += 16) {
        if (j < fetch) amx_prefetch_panel(panel, j); /* as amx_steps', the activations' */
        if (j < fetch_x)                               /* in each plane */
            for (int t = 0; t < 3; t++)
                amx_prefetch_rows(xa + 4 * (t * ldt + j + 16 * AMX_PREFETCH_X), stride, two);
        _tile_loadd(6, panel + j * 128, 128);
        _tile_loadd(7, panel + j * 128 + 64, 128);
        /* one row tile's three planes into accumulators C0, C1 against the weight tiles 6, 7;
         * activation tiles TA and TB alternate, so a load need not wait for the products of
         * the last (tile numbers are instruction operands: a macro, not a function) */
#define AMX_X3_ROW_TILE(C0, C1, TA, TB, XR)                 \
    _tile_loadd(TA, (XR) + 4 * j, stride);                  \
    _tile_dpbf16ps(C0, TA, 6);                              \
    _tile_dpbf16ps(C1, TA, 7);                              \
    _tile_loadd(TB, (XR) + 4 * (ldt + j), stride);          \
    _tile_dpbf16ps(C0, TB, 6);                              \
    _tile_dpbf16ps(C1, TB, 7);                              \
    _tile_loadd(TA, (XR) + 4 * (2 * ldt + j), stride);      \
    _tile_dpbf16ps(C0, TA, 6);                              \
    _tile_dpbf16ps(C1, TA, 7);
        AMX_X3_ROW_TILE(0, 1, 4, 5, xa)
        if (two) {
            AMX_X3_ROW_TILE(2, 3, 5, 4, xa + 16 * stride)
        }
#undef AMX_X3_ROW_TILE
    }
    amx_finish(0, m, x, ldx, ldt, 3, k2, whole, panel, ep, row0);
}

/* The dot-product probes on tiles: n iterations of four independent tdpbf16ps (bf16 pairs) or
 * tdpbusd (int8 quads: q8) per thread, amx_probe_flops(q8) each iteration. */
static inline int64_t amx_probe_flops(int q8) { return (int64_t)4 * 16 * 16 * (q8 ? 64 : 32) * 2; }

static double amx_probe(int64_t n, int nthreads, const int q8) {
    double total = 0.0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        /* bf16 pairs of ~1e-3; int8: activations (1, 1, 1, 1) against weights (-1, 1, -1, 1),
         * each step adds 0, so the int32 sums never overflow */
        uint32_t src[16 * 16], wq[16 * 16];
        float c[16 * 16];
        for (int i = 0; i < 16 * 16; i++) {
            src[i] = q8 ? 0x01010101u : 0x3a833a83u;
            wq[i] = q8 ? 0x01ff01ffu : 0x3a833a83u;
        }
        amx_tiles_begin();
        _tile_loadd(4, src, 64);
        _tile_loadd(5, src, 64);
        _tile_loadd(6, wq, 64);
        _tile_loadd(7, wq, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        if (q8) {
            for (int64_t it = 0; it < n; it++) {
                _tile_dpbusd(0, 4, 6);
                _tile_dpbusd(1, 4, 7);
                _tile_dpbusd(2, 5, 6);
                _tile_dpbusd(3, 5, 7);
            }
        } else {
            for (int64_t it = 0; it < n; it++) {
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, c, 64);
        total += c[0];
        _tile_stored(3, c, 64);
        total += c[255];
        amx_tiles_end();
    }
    return total;
}

#endif
