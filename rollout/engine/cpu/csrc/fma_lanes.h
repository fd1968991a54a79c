/* What the matmul kernels share (small_matmul.c, panel_matmul.c): `vec_t`, a vector of WIDTH floats (WIDTH defined by
 * the includer before this header), and an explicit fused multiply-add over it. kernel.py hashes it with them. */
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

#endif
