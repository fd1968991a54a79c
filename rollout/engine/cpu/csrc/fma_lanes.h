/* What the matmul kernels share (small_matmul.c, panel_matmul.c): `vec_t`, a vector of WIDTH floats (WIDTH defined by
 * the includer before this header), an explicit fused multiply-add over it, and the widening of bf16 input rows.
 * Included after bf16.h, stdint.h and stdlib.h; kernel.py hashes it with them. */
#ifndef ROLLOUT_FMA_LANES_H
#define ROLLOUT_FMA_LANES_H

#if defined(__AVX__)
#include <immintrin.h>
#endif

typedef float vec_t __attribute__((vector_size(WIDTH * sizeof(float))));

/* acc + a * b lane by lane, rounded once: an explicit fused multiply-add (the instruction where the target has it, C's
 * fmaf lane by lane where not), never a contraction left to the compiler. IEEE 754 defines fma exactly, so a lane's
 * sum has the same bits on every target. */
static inline vec_t fma_lanes(vec_t a, vec_t b, vec_t acc) {
#if WIDTH == 16 && defined(__AVX512F__)
    return (vec_t)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif WIDTH == 8 && defined(__FMA__)
    return (vec_t)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    vec_t r;
    for (int i = 0; i < WIDTH; i++) r[i] = __builtin_fmaf(a[i], b[i], acc[i]);
    return r;
#endif
}

/* The bf16 matmul entries' input: `m_len` rows of `k_len` bf16 values, `ldx` apart, widened (exactly) into fresh fp32
 * scratch of rows `k_len` apart, in parallel over rows where there are many (a prefill chunk); NULL where it cannot
 * be allocated. The caller frees it. */
static inline float *widened_rows(const uint16_t *x, int64_t ldx, int64_t m_len, int64_t k_len, int num_threads) {
    float *wide = malloc((size_t)(m_len * k_len > 0 ? m_len * k_len : 1) * sizeof(float));
    if (!wide) return NULL;
    (void)num_threads;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m_len >= 16)
    for (int64_t m = 0; m < m_len; m++)
        for (int64_t k = 0; k < k_len; k++) wide[m * k_len + k] = bf16_to_f32(x[m * ldx + k]);
    return wide;
}

#endif
