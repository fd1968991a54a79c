/* Linear layers of a few rows: out[m, n] = x[m, :] . w[n, :] + bias[n] summed in fp32, reading the weight as it is
 * stored: fp32 (rollout_small_matmul), or bf16 (rollout_small_matmul_bf16: a bf16 model on a CPU without bf16 dot
 * products streams half the bytes of an fp32 copy). The bf16 entry widens the input rows once into fp32 scratch and
 * the weights in registers, and rounds each output (sum plus bias) to bf16, as a bf16 matmul rounds its fp32 sums: no
 * casts around the call, which at a few rows cost as much as the call.
 *
 * Why a kernel: a decode step of a few sequences reads every weight once and does a few FMAs per value, so its
 * linears are bound by how fast the weights stream from memory. oneDNN's matmul on the packed copies and MKL's sgemm
 * both stream them well under the machine's bandwidth at 3-8 rows (benchmarks/RESULTS.md). Here each thread walks its own run of weight
 * rows front to back with a software prefetch a few KiB ahead, two weight rows at a time against up to 8 input rows
 * kept in L1 (2 where the vector registers are AVX2's or fewer). The engine uses it on AVX-512 builds only
 * (cpu/features.py, SMALL_MATMUL_ISAS).
 *
 * Layout: x [M, K] with row stride ldx (unit stride within a row); w [N, K] contiguous; bias [N] or NULL; out [M, N]
 * with row stride ldo; all fp32, or all bf16 (uint16_t bits). Portable C with GCC/Clang vector types (lowered to the
 * target's registers); the one intrinsic is the fused multiply-add.
 *
 * Same bits on every target, by construction: each output is one dot product whose operations are fixed by the
 * source, never by the compiler or the tiling. Lane l accumulates the products at k = 16 i + l with an explicit fused
 * multiply-add (fma_lanes); the 16 lanes are then summed in a written pairwise tree (sum_lanes); the K % 16 tail is
 * added front to back, again with fmaf; the bias last. The file is compiled without -ffast-math and with
 * -ffp-contract=off (cpu_kernel.SOURCE_FLAGS), so no sum is reassociated, vectorized into another order or contracted.
 * The result therefore depends on K only: not on the thread count, the number of rows, the vector width (AVX-512,
 * AVX2, SSE) or whether the CPU has FMA (fmaf is exact in software too). bf16 values widen exactly (their bits shifted
 * up 16), so the bf16 entry gives the fp32 entry's sums on the widened values, rounded to bf16 as torch rounds.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* A step over K covers 16 floats, held as SPLIT vectors of WIDTH floats: one register on AVX-512, two on AVX2 (a
 * 16-float vector type there is split by the compiler and spilled to the stack). Lane l of a step always accumulates
 * the products at k = 16 i + l, so the sums are the same on every ISA. */
#ifdef __AVX512F__
#define WIDTH 16
#define ROWS 8 /* input rows per tile: 8 x 2 accumulators stay in the 32 vector registers */
#else
#define WIDTH 8
#define ROWS 2 /* 2 x 2 x 2 accumulators of 8 floats: 8 of AVX2's 16 registers */
#endif
#define STEP 16
#define SPLIT (STEP / WIDTH)
#define PAIR 2 /* weight rows walked together: each input vector loaded serves two FMAs */
#define PREFETCH_BYTES 4096 /* ahead of the weight rows being read: memory latency hidden */
#define PAIRS_PER_GRAB 16 /* weight-row pairs a thread takes at a time (dynamic: a preempted thread's share moves) */

#include "fma_lanes.h"

static inline vec_t load(const float *p) {
    vec_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef uint16_t halves_t __attribute__((vector_size(WIDTH * sizeof(uint16_t))));
typedef uint32_t words_t __attribute__((vector_size(WIDTH * sizeof(uint32_t))));

/* WIDTH weights from element `i` of `w`: fp32, or bf16 widened (`bf16`, a constant at every call site). */
static inline vec_t load_weights(const void *w, int64_t i, const int bf16) {
    if (!bf16) return load((const float *)w + i);
    halves_t h;
    memcpy(&h, (const uint16_t *)w + i, sizeof h);
    const words_t u = __builtin_convertvector(h, words_t) << 16;
    vec_t v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* Element `i` of an fp32 or bf16 (`bf16`) array as fp32, and `value` stored there (rounded to bf16 for bf16). */
static inline float value_at(const void *a, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)a)[i]) : ((const float *)a)[i];
}

static inline void store(void *a, int64_t i, float value, const int bf16) {
    if (bf16)
        ((uint16_t *)a)[i] = f32_to_bf16(value);
    else
        ((float *)a)[i] = value;
}

/* The 16 lanes of one accumulator (its SPLIT vectors in order) summed pairwise in a fixed order. */
static inline float sum_lanes(const vec_t *parts) {
    float lane[STEP], half[8], quarter[4];
    memcpy(lane, parts, sizeof lane);
    for (int i = 0; i < 8; i++) half[i] = lane[i] + lane[i + 8];
    for (int i = 0; i < 4; i++) quarter[i] = half[i] + half[i + 4];
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

/* Outputs (m, n) for m < rows and n in {n0, n0 + 1}: `rows` and `bf16` are compile-time constants at every call site,
 * so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const void *w, const void *bias,
                                                       void *out, int64_t ldo, int64_t n0, int64_t k_len,
                                                       const int rows, const int bf16) {
    vec_t acc[ROWS][PAIR][SPLIT];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < PAIR; j++)
            for (int h = 0; h < SPLIT; h++) acc[m][j][h] = (vec_t){0};
    const int64_t r0 = n0 * k_len, r1 = r0 + k_len; /* the pair's first elements */
    const char *bytes = (const char *)w + r0 * (bf16 ? 2 : 4);
    int64_t k = 0;
    for (; k + STEP <= k_len; k += STEP) {
        /* the pair's two rows are adjacent: 2 * k_len weights read front to back, two lines (fp32) per step */
        __builtin_prefetch(bytes + PREFETCH_BYTES + 2 * k * (bf16 ? 2 : 4));
        __builtin_prefetch(bytes + PREFETCH_BYTES + 2 * k * (bf16 ? 2 : 4) + 64);
        for (int h = 0; h < SPLIT; h++) {
            const vec_t a = load_weights(w, r0 + k + h * WIDTH, bf16), b = load_weights(w, r1 + k + h * WIDTH, bf16);
            for (int m = 0; m < rows; m++) {
                const vec_t xv = load(x + m * ldx + k + h * WIDTH);
                acc[m][0][h] = fma_lanes(xv, a, acc[m][0][h]);
                acc[m][1][h] = fma_lanes(xv, b, acc[m][1][h]);
            }
        }
    }
    for (int m = 0; m < rows; m++) {
        float s0 = sum_lanes(acc[m][0]), s1 = sum_lanes(acc[m][1]);
        for (int64_t i = k; i < k_len; i++) {
            s0 = __builtin_fmaf(x[m * ldx + i], value_at(w, r0 + i, bf16), s0);
            s1 = __builtin_fmaf(x[m * ldx + i], value_at(w, r1 + i, bf16), s1);
        }
        if (bias) s0 += value_at(bias, n0, bf16), s1 += value_at(bias, n0 + 1, bf16);
        store(out, m * ldo + n0, s0, bf16);
        store(out, m * ldo + n0 + 1, s1, bf16);
    }
}

/* The pair (n0, n0 + 1) for all `m_len` rows: tiles of ROWS, then of 4, 2 and 1 below it. */
static inline __attribute__((always_inline)) void pair_all_rows(const float *x, int64_t ldx, const void *w,
                                                                const void *bias, void *out, int64_t ldo,
                                                                int64_t n0, int64_t m_len, int64_t k_len,
                                                                const int bf16) {
    const int64_t out_bytes = bf16 ? 2 : 4;
#define TILE_AT(m, rows) \
    tile(x + (m) * ldx, ldx, w, bias, (char *)out + (m) * ldo * out_bytes, ldo, n0, k_len, rows, bf16)
    int64_t m = 0;
    for (; m + ROWS <= m_len; m += ROWS) TILE_AT(m, ROWS);
#if ROWS > 4
    if (m_len - m >= 4) TILE_AT(m, 4), m += 4;
#endif
#if ROWS > 2
    if (m_len - m >= 2) TILE_AT(m, 2), m += 2;
#endif
    if (m_len - m >= 1) TILE_AT(m, 1);
#undef TILE_AT
}

/* The last output column of an odd N, one dot product per row (the same lanes and sum as a tile's). */
static void last_column(const float *x, int64_t ldx, const void *w, const void *bias, void *out, int64_t ldo,
                        int64_t n, int64_t m_len, int64_t k_len, const int bf16) {
    const int64_t row = n * k_len;
    for (int64_t m = 0; m < m_len; m++) {
        vec_t acc[SPLIT];
        for (int h = 0; h < SPLIT; h++) acc[h] = (vec_t){0};
        int64_t k = 0;
        for (; k + STEP <= k_len; k += STEP)
            for (int h = 0; h < SPLIT; h++)
                acc[h] = fma_lanes(load(x + m * ldx + k + h * WIDTH), load_weights(w, row + k + h * WIDTH, bf16),
                                   acc[h]);
        float s = sum_lanes(acc);
        for (; k < k_len; k++) s = __builtin_fmaf(x[m * ldx + k], value_at(w, row + k, bf16), s);
        store(out, m * ldo + n, bias ? s + value_at(bias, n, bf16) : s, bf16);
    }
}

void rollout_small_matmul(const float *x, int64_t ldx, const float *w, const float *bias, float *out, int64_t ldo,
                          int64_t m_len, int64_t n_len, int64_t k_len, int num_threads) {
    const int64_t pairs = n_len / PAIR;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, PAIRS_PER_GRAB)
    for (int64_t p = 0; p < pairs; p++) pair_all_rows(x, ldx, w, bias, out, ldo, p * PAIR, m_len, k_len, 0);
    if (n_len % PAIR) last_column(x, ldx, w, bias, out, ldo, n_len - 1, m_len, k_len, 0);
}

/* The same in bf16 (uint16_t bits): the input rows widened once into fp32 scratch (a few rows: L1-sized), the weights
 * in registers, each output rounded to bf16. Returns 0, or 1 where the scratch could not be allocated. */
int rollout_small_matmul_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                              int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len, int num_threads) {
    float *wide = widened_rows(x, ldx, m_len, k_len, num_threads);
    if (!wide) return 1;
    const int64_t pairs = n_len / PAIR;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, PAIRS_PER_GRAB)
    for (int64_t p = 0; p < pairs; p++) pair_all_rows(wide, k_len, w, bias, out, ldo, p * PAIR, m_len, k_len, 1);
    if (n_len % PAIR) last_column(wide, k_len, w, bias, out, ldo, n_len - 1, m_len, k_len, 1);
    free(wide);
    return 0;
}
