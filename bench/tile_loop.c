/* The packed kernels' register tiles alone (bench/tile_loop.py compiles and runs this).
 *
 * Built with one ISA build's flags and source (-DISA_SOURCE='"isa_avx2.c"', -I kernels_cy), so
 * the tile functions, the FMA probe and the panel layout are the extension's own, compiled the
 * same way. Each run times the FMA probe of that build (fma_probe_impl: 12 chains in registers),
 * then `tiles` tile calls of `rows` rows per panel over `panels` panels of K k-rows (split among
 * the threads, each walking its share in turn, each panel with the next one streamed in when
 * `stream` is 1, as run_item does for decode-sized items), and prints the tiles' FMA rate over
 * the probe's. No item set-up, no activations gathered, one epilogue per tile: what is left of
 * the calls' loss beside the peak is the loop's and the memory's.
 *
 *   tile_loop <bf16|fp32> <rows> <panels> <stream 0|1> <threads> <tiles per panel> [K]
 * rows 0: the build's register tile (MOE_MR)
 * prints: fraction=<tile FLOP/s / probe FLOP/s> rows=<rows> tile_gflops=<x> probe_gflops=<y>
 */
#include ISA_SOURCE

#include <omp.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static volatile double sink; /* the probe's result, kept so its chains are not removed */

/* The best of three probe runs, after a parallel region that starts the OpenMP threads: timed
 * in a process's first region, their start-up read as a slow probe (fractions above 1). */
static double probe_flops_per_s(int nthreads) {
    const int64_t n = 10000000;
    double best = 0.0;
#pragma omp parallel num_threads(nthreads)
    { sink = 0.0; }
    for (int i = 0; i < 3; i++) {
        const double t0 = now();
        sink = fma_probe_impl(n, nthreads, MOE_PROBE_FMA);
        const double rate = (double)nthreads * (double)n * (double)probe_flops_impl(MOE_PROBE_FMA) /
                            (now() - t0);
        best = rate > best ? rate : best;
    }
    return best;
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s <bf16|fp32> <rows> <panels> <stream> <threads> <tiles> [K]\n",
                argv[0]);
        return 2;
    }
    const int dt = strcmp(argv[1], "fp32") == 0 ? MOE_W_F32 : MOE_W_BF16;
    const int rows = atoi(argv[2]) ? atoi(argv[2]) : MR, nth = atoi(argv[5]), tiles = atoi(argv[6]);
    const int stream = atoi(argv[4]);
    const int64_t panels = atol(argv[3]), K = argc > 7 ? atol(argv[7]) : 1024;
    if (rows < 1 || rows > MR || panels < nth || nth < 1 || tiles < 1 || K < 1) {
        fprintf(stderr, "rows 1..%d, panels >= threads >= 1, tiles >= 1\n", MR);
        return 2;
    }
    const int64_t pbytes = K * krow_bytes(dt);
    char *w = (char *)aligned_alloc(64, (size_t)(panels * pbytes));
    const int64_t ldx = moe_row_stride(K);
    float *x = (float *)aligned_alloc(64, sizeof(float) * (size_t)(ldx * MR));
    float *out = (float *)aligned_alloc(64, sizeof(float) * (size_t)(panels * MOE_NR * MR));
    if (!w || !x || !out) return 1;
    /* small values of either storage: bf16 words of ~1e-3, fp32 the same */
    for (int64_t i = 0; i < panels * pbytes / 4; i++) ((uint32_t *)w)[i] = dt == MOE_W_F32 ? 0x3a83126fu : 0x3a833a83u;
    for (int64_t i = 0; i < ldx * MR; i++) x[i] = 0.001f * (float)(i % 13);
    const tile_fn tile = tile_for(dt);
    /* at least 8192 panel walks a thread, and every panel once */
    const int64_t share = panels / nth, passes = 8192 / (share * tiles) > 1 ? 8192 / (share * tiles) : 1;
    const double peak = probe_flops_per_s(nth);
    int64_t steps = 0;
    const double t0 = now();
#pragma omp parallel num_threads(nth) reduction(+ : steps)
    {
        const int64_t p0 = omp_get_thread_num() * share, p1 = p0 + share;
        for (int64_t pass = 0; pass < passes; pass++)
            for (int64_t p = p0; p < p1; p++) {
                const char *next = w + (p + 1 < p1 ? p + 1 : p0) * pbytes;
                panel_stream st = {next, next + pbytes, ((pbytes + 63) / 64 + tiles - 1) / tiles};
                epilogue ep = {.mode = EPI_LINEAR, .ncol = MOE_NR, .out = out + p * MOE_NR,
                               .ldo = panels * MOE_NR, .stream = stream ? &st : NULL};
                for (int t = 0; t < tiles; t++) {
                    tile(rows, x, ldx, K, w + p * pbytes, NULL, &ep, 0);
                    steps += K;
                }
            }
    }
    const double flops = 2.0 * (double)steps * rows * MOE_NR / (now() - t0);
    printf("fraction=%.4f rows=%d tile_gflops=%.2f probe_gflops=%.2f\n", flops / peak, rows,
           flops / 1e9, peak / 1e9);
    free(w);
    free(x);
    free(out);
    return 0;
}
