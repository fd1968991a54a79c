/* Linear layers over weights packed in panels of 32 output columns: out[m, n] = x[m, :] . w[n, :] + bias[n], summed
 * in fp32, for any row count. The weights are fp32, or bf16 kept at 2 bytes (a bf16 model on a CPU without bf16 dot
 * products: no fp32 copy of its weights, and half the bytes to stream).
 *
 * Why: the small-rows kernel (small_matmul.c) ends each output in a horizontal sum and reloads its inputs for every
 * weight pair, so it falls behind packed copies from about 8 rows up. Here a tile of up to ROWS input rows by the 32
 * columns of a panel keeps its outputs in registers for the whole of K: each step broadcasts one input value per row
 * and multiplies it into the panel's 32 weights of that k, which it loads (and widens, for bf16) once for all rows.
 * The weights stream front to back, panel by panel; a thread takes a few panels at a time.
 *
 * Layout: panel p holds the weight rows 32 p .. 32 p + 31 (zeros past N), k-major: for each k, the 32 values in
 * column order, so a panel is a plain transpose of its 32 rows (matmuls.pack_panels writes it with the weight-sync
 * transpose, weight_sync.c). bf16 values are read as 32-bit words of two columns: a shift widens the even columns to
 * fp32 and a mask the odd ones, no shuffle; their sums are put back in column order once per tile. Inputs: x [M, K]
 * with row stride ldx; out [M, N] with row stride ldo; bias [N] or NULL; all in the weights' dtype (bf16 as uint16_t
 * bits).
 *
 * Same bits on every target, by construction: each output is the fused multiply-add chain over k = 0, 1, ..., K - 1
 * in order, starting at 0, then plus the bias, then (bf16) rounded to nearest even. The order is fixed by the source,
 * not the tiling, the vector width or the thread count, and the file is compiled without -ffast-math and with
 * -ffp-contract=off (kernel.SOURCE_FLAGS). So a row's outputs do not depend on the other rows of the call or on
 * which weights were stacked into the same panels, and every ISA gives the same bits.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define PANEL 32 /* output columns per panel */
#define HALF 16  /* bf16 panels: 32-bit words per k, each two columns */
#ifdef __AVX512F__
#define WIDTH 16
#define ROWS 12 /* 12 rows x 2 accumulators: 24 of the 32 vector registers */
#elif defined(__AVX__)
#define WIDTH 8
#define ROWS 3 /* 3 rows x 4 accumulators: 12 of the 16 */
#else
#define WIDTH 4
#define ROWS 1
#endif
#define VECS (PANEL / WIDTH) /* accumulators per row */
#define PANELS_PER_GRAB 2   /* panels a thread takes at a time (dynamic: a preempted thread's share moves) */
/* The panel is fetched into L2 this far ahead of the k being read, every cache line of it (fp32: two per k). Into L2
 * (prefetcht1), not L1: an L1 prefetch holds one of the core's few line-fill buffers until its line arrives, and at
 * 4-12 rows, when the arithmetic per line leaves the out-of-order window few loads ahead, that capped the stream well
 * below what one row reaches (benchmarks/RESULTS.md, "bf16 panels"). */
#define PREFETCH_BYTES 4096

#include "fma_lanes.h"

typedef uint32_t words_t __attribute__((vector_size(WIDTH * sizeof(uint32_t))));

static inline vec_t splat(float v) {
#if WIDTH == 16
    return (vec_t)_mm512_set1_ps(v);
#elif WIDTH == 8
    return (vec_t)_mm256_set1_ps(v);
#else
    return (vec_t){v, v, v, v};
#endif
}

/* The panel's 32 weights at one k as VECS vectors: fp32 loaded as they are, in column order; bf16 widened, the even
 * columns in the first VECS / 2 vectors and the odd ones in the rest (`sum_index` says where each column went). */
static inline void panel_weights(const void *panel, int64_t k, const int bf16, vec_t *w) {
    if (!bf16) {
#pragma GCC unroll 16
        for (int j = 0; j < VECS; j++) memcpy(&w[j], (const float *)panel + k * PANEL + j * WIDTH, sizeof(vec_t));
        return;
    }
#pragma GCC unroll 16
    for (int h = 0; h < VECS / 2; h++) {
        words_t words, low, high;
        memcpy(&words, (const uint32_t *)panel + k * HALF + h * WIDTH, sizeof words);
        low = words << 16;
        high = words & 0xFFFF0000u;
        memcpy(&w[h], &low, sizeof low);
        memcpy(&w[VECS / 2 + h], &high, sizeof high);
    }
}

/* Where column c of a panel sits among a row's VECS accumulators, read as one array of 32 floats. */
static inline int sum_index(int c, const int bf16) { return bf16 ? (c & 1) * HALF + c / 2 : c; }

/* Outputs (m, n0 .. n0 + cols - 1) for m < rows: `rows` and `bf16` are compile-time constants at every call site, so
 * the accumulators live in registers. x is fp32 here (bf16 inputs were widened once into scratch). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const void *panel,
                                                       const void *bias, void *out, int64_t ldo, int64_t n0,
                                                       int cols, int64_t k_len, const int rows, const int bf16) {
    vec_t acc[ROWS][VECS];
#pragma GCC unroll 16
    for (int m = 0; m < rows; m++)
#pragma GCC unroll 16
        for (int j = 0; j < VECS; j++) acc[m][j] = (vec_t){0};
    for (int64_t k = 0; k < k_len; k++) {
        /* hints, never faults: past the last panel's end they read nothing */
        const char *ahead = (const char *)panel + k * PANEL * (bf16 ? 2 : 4) + PREFETCH_BYTES;
        __builtin_prefetch(ahead, 0, 2);
        if (!bf16) __builtin_prefetch(ahead + 64, 0, 2);
        vec_t w[VECS];
        panel_weights(panel, k, bf16, w);
#pragma GCC unroll 16
        for (int m = 0; m < rows; m++) {
            const vec_t xv = splat(x[m * ldx + k]);
#pragma GCC unroll 16
            for (int j = 0; j < VECS; j++) acc[m][j] = fma_lanes(xv, w[j], acc[m][j]);
        }
    }
    for (int m = 0; m < rows; m++) {
        float sums[PANEL];
        memcpy(sums, acc[m], sizeof sums);
        for (int c = 0; c < cols; c++) {
            const int64_t n = n0 + c;
            float s = sums[sum_index(c, bf16)];
            if (bias) s += bf16 ? bf16_to_f32(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
            if (bf16)
                ((uint16_t *)out)[m * ldo + n] = f32_to_bf16(s);
            else
                ((float *)out)[m * ldo + n] = s;
        }
    }
}

/* One panel for all `m_len` rows, in tiles of at most ROWS rows of near-equal sizes (64 rows on AVX-512: 6 tiles of
 * 10-11, not 5 of 12 and one of 4, whose broadcasts would not cover the panel's loads). */
static inline __attribute__((always_inline)) void panel_all_rows(const float *x, int64_t ldx, const void *panel,
                                                                 const void *bias, void *out, int64_t ldo,
                                                                 int64_t n0, int cols, int64_t m_len, int64_t k_len,
                                                                 const int bf16) {
    const int64_t tiles = (m_len + ROWS - 1) / ROWS;
    const int64_t out_bytes = bf16 ? 2 : 4;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; t++) {
        const int rows = (int)((m_len - m) / (tiles - t)); /* the rest shared evenly by the tiles left */
#define TILE(r) \
    case r: \
        tile(x + m * ldx, ldx, panel, bias, (char *)out + m * ldo * out_bytes, ldo, n0, cols, k_len, r, bf16); \
        break;
        switch (rows) {
            TILE(1)
#if ROWS > 1
            TILE(2) TILE(3)
#endif
#if ROWS > 3
            TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)
#endif
            default: break;
        }
#undef TILE
        m += rows;
    }
}

static void run_panels(const float *x, int64_t ldx, const void *panels, const void *bias, void *out, int64_t ldo,
                       int64_t m_len, int64_t n_len, int64_t k_len, const int bf16, int num_threads) {
    const int64_t count = (n_len + PANEL - 1) / PANEL;
    const int64_t panel_elems = k_len * PANEL;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, PANELS_PER_GRAB)
    for (int64_t p = 0; p < count; p++) {
        const int cols = (int)(n_len - p * PANEL < PANEL ? n_len - p * PANEL : PANEL);
        if (bf16)
            panel_all_rows(x, ldx, (const uint16_t *)panels + p * panel_elems, bias, out, ldo, p * PANEL, cols, m_len,
                           k_len, 1);
        else
            panel_all_rows(x, ldx, (const float *)panels + p * panel_elems, bias, out, ldo, p * PANEL, cols, m_len,
                           k_len, 0);
    }
}

void rollout_panel_matmul(const float *x, int64_t ldx, const float *panels, const float *bias, float *out,
                          int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len, int num_threads) {
    run_panels(x, ldx, panels, bias, out, ldo, m_len, n_len, k_len, 0, num_threads);
}

/* bf16 (uint16_t bits): the input rows widened once into fp32 scratch. Returns 0, or 1 where the scratch could not
 * be allocated. */
int rollout_panel_matmul_bf16(const uint16_t *x, int64_t ldx, const uint16_t *panels, const uint16_t *bias,
                              uint16_t *out, int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len,
                              int num_threads) {
    float *wide = widened_rows(x, ldx, m_len, k_len, num_threads);
    if (!wide) return 1;
    run_panels(wide, k_len, panels, bias, out, ldo, m_len, n_len, k_len, 1, num_threads);
    free(wide);
    return 0;
}
