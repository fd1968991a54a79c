/* Paged attention on CPU for the engine's packed batch: one call per layer serves every query token of the step
 * (decode rows and prefill chunks alike), reading each token's keys and values straight out of the paged cache.
 *
 * Why a kernel: in PyTorch ops the pages must first be gathered into a contiguous buffer (a read and a write of every
 * key and value), then read again by SDPA. Here each key and value is read once, where it lies.
 *
 * Layout: q [T, H, D] with any token and head strides (unit stride within a head); out [T, H, D] contiguous;
 * k_cache and v_cache [slots, KVH, D] with slot = block * P + offset; tables [R, max_blocks] (int64 block ids per
 * row), token_rows [T] (row of each token), positions [T] (the token's position: it attends to keys 0..position of
 * its row, or the last `window` of them).
 *
 * Built at first use by rollout/engine/cpu_kernel.py with the system C compiler and OpenMP (the library shares
 * torch's OpenMP runtime: libgomp is already loaded under the same soname when this library is opened).
 *
 * Portable C only, no intrinsics: the vector ISA is whatever -march the build asks for (native by default, or
 * ROLLOUT_KERNEL_MARCH, e.g. x86-64-v2 / x86-64-v3), reached through auto-vectorization. Without OpenMP (a compiler
 * that rejects -fopenmp) the pragmas are ignored and the kernel runs single-threaded with the same results: the
 * work items and their arithmetic do not depend on the thread count. rollout_kernel_features() reports what this
 * build has, so the loader can refuse a library whose ISA the running CPU lacks (it would die on SIGILL).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DTYPE_F32 0
#define DTYPE_BF16 1

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* D values starting at element `offset`, as floats: fp32 rows are used in place, bf16 rows are widened into `tmp`. */
static inline const float *row_f32(const void *base, int64_t offset, int64_t d, int dtype, float *tmp) {
    if (dtype == DTYPE_F32) return (const float *)base + offset;
    const uint16_t *src = (const uint16_t *)base + offset;
    for (int64_t i = 0; i < d; i++) tmp[i] = bf16_to_f32(src[i]);
    return tmp;
}

static inline float dot(const float *a, const float *b, int64_t d) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t d) {
#pragma omp simd
    for (int64_t i = 0; i < d; i++) y[i] += a * x[i];
}

/* Positions [pos, returned stop) of a row lie on one page; their slots are `*base + position`. */
static inline int64_t page_run(const int64_t *table, int64_t pos, int64_t end, int64_t page, int64_t *base) {
    const int64_t index = pos / page, page_end = (index + 1) * page;
    *base = table[index] * page - index * page;
    return page_end < end ? page_end : end;
}

/* Attention of token t for the query heads of kv heads [kv_first, kv_first + kv_count) (G query heads each). Keys
 * and values are walked position by position across those kv heads, so a whole-token item streams each page front to
 * back. Scratch: `scores` kv_count * G * (position + 1) floats, `qf` and `acc` kv_count * G * D, `tmp` D. */
static inline __attribute__((always_inline)) void attend(
    const void *q, int64_t q_offset, int64_t q_head_stride, void *out, const void *k_cache, const void *v_cache,
    const int64_t *table, int64_t t, int64_t kv_first, int64_t kv_count, int64_t position, int64_t num_heads,
    int64_t num_kv_heads, int64_t d, int64_t page, float scale, int64_t window, float softcap, int dtype,
    float *scores, float *qf, float *acc, float *tmp) {
    const int64_t g_heads = num_heads / num_kv_heads;
    const int64_t heads = kv_count * g_heads; /* query heads served here, from kv_first * g_heads on */
    const int64_t first_head = kv_first * g_heads;
    const int64_t end = position + 1;
    const int64_t begin = (window > 0 && end > window) ? end - window : 0;
    const int64_t n = end - begin;

    for (int64_t h = 0; h < heads; h++) {
        const float *src = row_f32(q, q_offset + (first_head + h) * q_head_stride, d, dtype, tmp);
        for (int64_t i = 0; i < d; i++) qf[h * d + i] = src[i] * (softcap > 0.f ? 1.f : scale);
    }
    /* scores: walk the row's pages */
    for (int64_t pos = begin, base, stop; pos < end;)
        for (stop = page_run(table, pos, end, page, &base); pos < stop; pos++)
            for (int64_t kv = 0; kv < kv_count; kv++) {
                const float *k = row_f32(k_cache, ((base + pos) * num_kv_heads + kv_first + kv) * d, d, dtype, tmp);
                for (int64_t g = 0; g < g_heads; g++) {
                    const int64_t h = kv * g_heads + g;
                    float score = dot(qf + h * d, k, d);
                    if (softcap > 0.f) score = softcap * tanhf(score * scale / softcap);
                    scores[h * n + (pos - begin)] = score;
                }
            }
    /* softmax per head; the normaliser is applied at the end */
    float sums[heads];
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * n;
        float m = s[0];
        for (int64_t i = 1; i < n; i++) m = s[i] > m ? s[i] : m;
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < n; i++) {
            s[i] = expf(s[i] - m);
            total += s[i];
        }
        sums[h] = total;
    }
    /* weighted values */
    memset(acc, 0, sizeof(float) * heads * d);
    for (int64_t pos = begin, base, stop; pos < end;)
        for (stop = page_run(table, pos, end, page, &base); pos < stop; pos++)
            for (int64_t kv = 0; kv < kv_count; kv++) {
                const float *v = row_f32(v_cache, ((base + pos) * num_kv_heads + kv_first + kv) * d, d, dtype, tmp);
                for (int64_t h = kv * g_heads; h < (kv + 1) * g_heads; h++)
                    axpy(acc + h * d, scores[h * n + (pos - begin)], v, d);
            }
    for (int64_t h = 0; h < heads; h++) {
        const float inv = 1.f / sums[h];
        const int64_t o = (t * num_heads + first_head + h) * d;
        if (dtype == DTYPE_F32) {
            float *dst = (float *)out + o;
            for (int64_t i = 0; i < d; i++) dst[i] = acc[h * d + i] * inv;
        } else {
            uint16_t *dst = (uint16_t *)out + o;
            for (int64_t i = 0; i < d; i++) dst[i] = f32_to_bf16(acc[h * d + i] * inv);
        }
    }
}

/* Bits of rollout_kernel_features(): what the compiler targeted for this build (its predefined macros). */
#define FEATURE_OPENMP 1
#define FEATURE_SSE4_2 2
#define FEATURE_AVX 4
#define FEATURE_AVX2 8
#define FEATURE_FMA 16
#define FEATURE_AVX512F 32
#define FEATURE_AVX512BF16 64
#define FEATURE_NEON 128

int rollout_kernel_features(void) {
    int features = 0;
#ifdef _OPENMP
    features |= FEATURE_OPENMP;
#endif
#ifdef __SSE4_2__
    features |= FEATURE_SSE4_2;
#endif
#ifdef __AVX__
    features |= FEATURE_AVX;
#endif
#ifdef __AVX2__
    features |= FEATURE_AVX2;
#endif
#ifdef __FMA__
    features |= FEATURE_FMA;
#endif
#ifdef __AVX512F__
    features |= FEATURE_AVX512F;
#endif
#ifdef __AVX512BF16__
    features |= FEATURE_AVX512BF16;
#endif
#if defined(__ARM_NEON) || defined(__ARM_NEON__)
    features |= FEATURE_NEON;
#endif
    return features;
}

/* Returns 0, or -1 when a thread could not get its scratch memory. */
int rollout_paged_attention(const void *q, int64_t q_token_stride, int64_t q_head_stride, void *out,
                            const void *k_cache, const void *v_cache,
                            const int64_t *positions, const int64_t *token_rows, const int64_t *tables,
                            int64_t num_tokens, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t page_size, float scale, int64_t window, float softcap,
                            int dtype, int num_threads) {
    int64_t longest = 1;
    for (int64_t t = 0; t < num_tokens; t++) longest = positions[t] + 1 > longest ? positions[t] + 1 : longest;
    /* One item per token (all its kv heads: pages are read front to back) when there are enough tokens to keep every
     * thread busy; otherwise one item per (token, kv head). */
    const int64_t kv_per_item = num_tokens >= 4 * num_threads ? num_kv_heads : 1;
    const int64_t items_per_token = num_kv_heads / kv_per_item;
    const int64_t items = num_tokens * items_per_token;
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * num_heads * longest);
        float *qf = malloc(sizeof(float) * num_heads * head_dim);
        float *acc = malloc(sizeof(float) * num_heads * head_dim);
        float *tmp = malloc(sizeof(float) * head_dim);
        if (!scores || !qf || !acc || !tmp) failed = 1;
        /* every thread takes part in the loop (a worksharing construct must be met by all of them) */
#pragma omp for schedule(dynamic, 2)
        for (int64_t item = 0; item < items; item++) {
            if (failed) continue;
            const int64_t t = item / items_per_token;
            const int64_t kv_first = (item % items_per_token) * kv_per_item;
            const int64_t *table = tables + token_rows[t] * max_blocks;
            /* a constant head_dim lets the compiler unroll the dot products and axpys completely */
#define ATTEND(D)                                                                                                 \
    attend(q, t * q_token_stride, q_head_stride, out, k_cache, v_cache, table, t, kv_first, kv_per_item,           \
           positions[t], num_heads, num_kv_heads, D, page_size, scale, window, softcap, dtype, scores, qf, acc, tmp)
            if (head_dim == 64)
                ATTEND(64);
            else if (head_dim == 128)
                ATTEND(128);
            else
                ATTEND(head_dim);
#undef ATTEND
        }
        free(scores);
        free(qf);
        free(acc);
        free(tmp);
    }
    return failed ? -1 : 0;
}
