/* RMSNorm in one call: out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), as transformers' RMSNorm modules
 * (LlamaRMSNorm, Qwen3RMSNorm, ...) compute it.
 *
 * Why a kernel: in eager PyTorch one norm is about eight small ops (two casts, pow, mean, add, rsqrt and two
 * products), each a dispatch, an allocation and a pass over the rows. A decode step of a real model runs a hundred or
 * more norms on a few rows each (Qwen3 has four per layer, two of them over every head), so their time is almost all
 * per-op overhead. Here a row is read twice (its sum of squares, then the output) in one call.
 *
 * The same numbers as the module, step by step: x is widened to fp32; each square is rounded to fp32 and the squares
 * are summed in fp32 in the order of torch's CPU sum over a row (sum_squares); the mean is the sum divided by dim;
 * rstd = 1 / sqrtf(mean + eps) (both correctly rounded, as torch's rsqrt on the CPU); h = x * rstd in fp32. fp32:
 * out = weight * h. bf16: h is rounded to bf16 (nearest even), then weight * h is computed in fp32 and rounded to
 * bf16, which is what torch's bf16 product does. The order of torch's sum depends on the width of its vectors, which
 * the caller passes (`lanes`, found once by comparing with torch: kernel.norm_sum_order); with it the outputs are
 * torch's bit for bit. With another order a mean could differ in its last bit, and an output by an ulp or two in rare
 * elements. The file is compiled without -ffast-math and with -ffp-contract=off (kernel.py, SOURCE_FLAGS), so no
 * operation is reassociated or fused, and a row never depends on the others or on the thread count.
 *
 * Layout: x [rows, dim] with row stride ldx (unit stride within a row), weight [dim] contiguous, out [rows, dim]
 * contiguous, all of one dtype (0 fp32, 1 bf16). Portable C; the vectors are plain loops over lanes, which the
 * compiler vectorizes for the target. Rows are split over OpenMP threads only when there are enough
 * elements to pay for a parallel region; a decode step's norms run in the calling thread.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_LANES 16 /* floats in one of torch's vectors, at most (AVX-512) */
#define ILP 4 /* vector accumulators of torch's row sum */
#define LEVELS 4 /* levels of its cascade */
#define PARALLEL_MIN_ELEMENTS 65536 /* below this a parallel region costs more than the work it splits */

/* Round to nearest even, as torch does: bf16.h's f32_to_bf16 without its NaN case, which this file never
 * needs: every value it rounds is a product of bf16 values and fp32 results of them (h = x * rstd, weight * h), so a
 * NaN among them is a bf16 input's, quieted, or the default NaN (inf * 0), and has the low 16 bits zero. The rounding
 * add then cannot carry out of them, and the upper half is the same quiet NaN. (The NaN case, even as a select, costs
 * the output loop several vector instructions per element.) */
static inline uint16_t round_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* f rounded to bf16 the same way, kept as a float (round_to_bf16 then bf16_to_f32, without the trip through 16 bits). */
static inline float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float square(const void *x, int64_t k, const int dtype) {
    float v = dtype == DTYPE_F32 ? ((const float *)x)[k] : bf16_to_f32(((const uint16_t *)x)[k]);
    return v * v;
}

/* acc[l] += x[v * lanes + l]^2 for each lane: one vector of torch's sum. */
static inline __attribute__((always_inline)) void add_squares(float *acc, const void *x, int64_t v, const int lanes,
                                                              const int dtype) {
#pragma omp simd
    for (int l = 0; l < lanes; l++) acc[l] += square(x, v * lanes + l, dtype);
}

static inline int64_t ceil_log2(int64_t n) {
    int64_t bits = 1;
    while (n > 2 && ((int64_t)1 << bits) < n) bits++;
    return bits;
}

/* The sum of x[k]^2 over k < dim in the order of torch's CPU sum over a contiguous row of fp32 values (cascade_sum's
 * vectorized_inner_sum, aten/src/ATen/native/cpu/SumKernel.cpp), for its vectors of `lanes` floats: the row as
 * `vecs` vectors, read four at a time into four vector accumulators (multi_row_sum with ILP 4); after every
 * 2^level_power such groups the accumulators are added into a next level, up to LEVELS; then the levels, the vectors
 * past the last full group and accumulators 1-3 go into accumulator 0; last, the dim % lanes tail front to back and
 * the lanes of accumulator 0 in order. */
static inline __attribute__((always_inline)) float sum_squares(const void *x, int64_t dim, const int lanes,
                                                               const int dtype) {
    float acc[LEVELS][ILP][MAX_LANES];
    int64_t vecs = dim / lanes, groups = vecs / ILP, i = 0;
    int64_t level_power = ceil_log2(groups) / LEVELS;
    if (level_power < 4) level_power = 4;
    int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    /* a row of fewer groups never reaches the levels above 0: adding their zeros changes no sum of squares (x + 0 is
     * x for x >= +0 and for NaN), so they are neither cleared nor added */
    int levels = groups >= level_step ? LEVELS : 1;
    memset(acc, 0, (size_t)levels * sizeof acc[0]);
    while (i + level_step <= groups) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < ILP; k++) add_squares(acc[0][k], x, i * ILP + k, lanes, dtype);
        for (int level = 1; level < LEVELS; level++) {
            for (int k = 0; k < ILP; k++) {
#pragma omp simd
                for (int l = 0; l < lanes; l++) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0.f;
                }
            }
            if (i & (level_mask << (level * level_power))) break;
        }
    }
    for (; i < groups; i++)
        for (int k = 0; k < ILP; k++) add_squares(acc[0][k], x, i * ILP + k, lanes, dtype);
    for (int level = 1; level < levels; level++)
        for (int k = 0; k < ILP; k++) {
#pragma omp simd
            for (int l = 0; l < lanes; l++) acc[0][k][l] += acc[level][k][l];
        }
    for (int64_t v = groups * ILP; v < vecs; v++) add_squares(acc[0][0], x, v, lanes, dtype);
    for (int k = 1; k < ILP; k++) {
#pragma omp simd
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    }
    float sum = 0.f;
    for (int64_t k = vecs * lanes; k < dim; k++) sum += square(x, k, dtype);
    for (int l = 0; l < lanes; l++) sum += acc[0][0][l];
    return sum;
}

/* 1 / sqrt(mean(x^2) + eps) of one row, its sum in the order of torch's vectors of `lanes` floats (4, 8 or 16). */
static inline __attribute__((always_inline)) float rstd(const void *x, int64_t dim, float eps, int lanes,
                                                        const int dtype) {
    float sum = lanes == 16 ? sum_squares(x, dim, 16, dtype)
              : lanes == 8  ? sum_squares(x, dim, 8, dtype)
                            : sum_squares(x, dim, 4, dtype);
    return 1.0f / sqrtf(sum / (float)dim + eps);
}

static void row_f32(const float *x, const float *w, float *out, int64_t dim, float eps, int lanes) {
    float r = rstd(x, dim, eps, lanes, DTYPE_F32);
#pragma omp simd
    for (int64_t k = 0; k < dim; k++) out[k] = w[k] * (x[k] * r);
}

static void row_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t dim, float eps, int lanes) {
    float r = rstd(x, dim, eps, lanes, DTYPE_BF16);
#pragma omp simd
    for (int64_t k = 0; k < dim; k++) {
        float h = bf16_round(bf16_to_f32(x[k]) * r);
        out[k] = round_to_bf16(bf16_to_f32(w[k]) * h);
    }
}

void rollout_rms_norm(const void *x, int64_t ldx, const void *weight, void *out, int64_t rows, int64_t dim,
                      float eps, int dtype, int lanes, int threads) {
    int parallel = threads > 1 && rows > 1 && rows * dim > PARALLEL_MIN_ELEMENTS;
    if (dtype == DTYPE_F32) {
        const float *xs = (const float *)x, *w = (const float *)weight;
        float *o = (float *)out;
#pragma omp parallel for schedule(static) if (parallel) num_threads(threads)
        for (int64_t r = 0; r < rows; r++) row_f32(xs + r * ldx, w, o + r * dim, dim, eps, lanes);
    } else {
        const uint16_t *xs = (const uint16_t *)x, *w = (const uint16_t *)weight;
        uint16_t *o = (uint16_t *)out;
#pragma omp parallel for schedule(static) if (parallel) num_threads(threads)
        for (int64_t r = 0; r < rows; r++) row_bf16(xs + r * ldx, w, o + r * dim, dim, eps, lanes);
    }
}
