/* Paged attention on CPU for the engine's packed batch: one call per layer serves every query token of the step
 * (decode rows and prefill chunks alike), reading each token's keys and values straight out of the paged cache.
 *
 * Why a kernel: in PyTorch ops the pages must first be gathered into a contiguous buffer (a read and a write of every
 * key and value), then read again by SDPA. Here each key and value is read once, where it lies.
 *
 * Tokens that read the same keys are served together (attend_group): the tokens of a prefill chunk, and decode tokens
 * of samples forked from one prompt, whose first pages are the same blocks. Then each key is loaded once for up to
 * 16 query heads and the dot products run across them, one FMA per dimension, with no horizontal sums. A token
 * alone (attend) walks its keys with one dot product per head.
 *
 * Layout: q [T, H, D] with any token and head strides (unit stride within a head); out [T, H, D] contiguous;
 * k_cache and v_cache [slots, KVH, D] with slot = block * P + offset; tables [R, max_blocks] (int64 block ids per
 * row), token_rows [T] (row of each token), positions [T] (the token's position: it attends to keys 0..position of
 * its row, or the last `window` of them).
 *
 * Built at first use by rollout/engine/cpu/kernel.py with the system C compiler and OpenMP (the library shares
 * torch's OpenMP runtime: libgomp is already loaded under the same soname when this library is opened).
 *
 * Portable C only, no intrinsics: the vector ISA is whatever -march the build asks for (native by default, or
 * ROLLOUT_KERNEL_MARCH, e.g. x86-64-v2 / x86-64-v3), reached through auto-vectorization and GCC/Clang vector
 * types (16 floats, lowered to whatever registers the target has). Without OpenMP (a compiler that rejects -fopenmp)
 * the pragmas are ignored and the kernel runs single-threaded with the same results: the groups, the work items and
 * their arithmetic depend on the batch, never on the thread count. rollout_kernel_features() reports what this build
 * has, so the loader can refuse a library whose ISA the running CPU lacks (it would die on SIGILL).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* A bf16 model's attention probabilities are rounded to bf16 before they weight the values, after the normaliser has
 * summed them in fp32: the order of roundings of PyTorch's CPU attention (sdpa) in bf16, so a bf16 engine reports the
 * logprobs a bf16 trainer recomputes, not more precise ones. */
static inline float bf16_rounded(float f) { return bf16_to_f32(f32_to_bf16(f)); }

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
        if (dtype == DTYPE_BF16)
            for (int64_t i = 0; i < n; i++) s[i] = bf16_rounded(s[i]);
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

/* ---------------------------------------------------------------------------------------------- shared-key tiles
 * Tokens that read the same keys are served together: the tokens of one row (a prefill chunk) and decode tokens of
 * rows whose first pages are the same blocks (samples forked from one prompt). Their query heads of one kv head are
 * laid side by side in LANES lanes, so each key is loaded once and meets all of them in one vector FMA per
 * dimension, with no horizontal sums; the scores are kept key-major, one vector per key, so the softmax and the
 * weighted values run across lanes too. What a member reads alone (a fork's own pages) goes through attend(). */
#define LANES 16
#define CHUNK 8 /* keys read at a time across an item's kv heads (and widened from bf16) */
#define NEG_SCORE (-1e30f) /* a masked key (finite: -ffast-math assumes no infinities) */
#ifdef __AVX512F__
#define KEY_BLOCK 8 /* keys scored at once: independent FMA chains, as many as the vector registers hold */
#else
#define KEY_BLOCK 4
#endif
#define DIM_BLOCK 8 /* dimensions of the weighted values accumulated in registers over a run of keys */

typedef float lanes_t __attribute__((vector_size(LANES * sizeof(float))));

static inline lanes_t splat(float x) {
    lanes_t v;
    for (int l = 0; l < LANES; l++) v[l] = x;
    return v;
}

typedef struct {
    int64_t first;   /* the group's members are order[first, first + count) */
    int64_t count;
    int64_t shared;  /* keys [0, shared) are the same slots for every member and seen by all of them */
    int64_t longest; /* the largest member position + 1 */
    int one_row;     /* all members in one row: every key is shared, later keys masked per member */
} group_t;

/* Rows of `n` keys (or values) of kv head `kv` from slot `base + pos` on, as floats with a row stride: fp32 rows in
 * place, bf16 rows widened into `buf` (CHUNK rows). */
static inline const float *key_rows(const void *cache, int64_t slot, int64_t n, int64_t kv, int64_t num_kv_heads,
                                    int64_t d, int dtype, float *buf, int64_t *stride) {
    if (dtype == DTYPE_F32) {
        *stride = num_kv_heads * d;
        return (const float *)cache + (slot * num_kv_heads + kv) * d;
    }
    for (int64_t r = 0; r < n; r++) row_f32(cache, ((slot + r) * num_kv_heads + kv) * d, d, dtype, buf + r * d);
    *stride = d;
    return buf;
}

/* scores[r] = qT . key r, for `n` keys: KEY_BLOCK keys at a time so their FMA chains overlap. */
static inline __attribute__((always_inline)) void score_keys(const lanes_t *qT, const float *rows, int64_t stride,
                                                             int64_t n, int64_t d, lanes_t *scores) {
    int64_t r = 0;
    for (; r + KEY_BLOCK <= n; r += KEY_BLOCK) {
        lanes_t a[KEY_BLOCK];
        for (int b = 0; b < KEY_BLOCK; b++) a[b] = splat(0.f);
        for (int64_t i = 0; i < d; i++) {
            const lanes_t qi = qT[i];
            for (int b = 0; b < KEY_BLOCK; b++) a[b] += qi * rows[(r + b) * stride + i];
        }
        for (int b = 0; b < KEY_BLOCK; b++) scores[r + b] = a[b];
    }
    for (; r < n; r++) {
        lanes_t a = splat(0.f);
        for (int64_t i = 0; i < d; i++) a += qT[i] * rows[r * stride + i];
        scores[r] = a;
    }
}

/* accT[i] += sum over keys r of probs[r] * value r [i]: DIM_BLOCK accumulators stay in registers across the keys. */
static inline __attribute__((always_inline)) void weigh_values(const lanes_t *probs, const float *rows,
                                                               int64_t stride, int64_t n, int64_t d, lanes_t *accT) {
    int64_t i0 = 0;
    for (; i0 + DIM_BLOCK <= d; i0 += DIM_BLOCK) {
        lanes_t a[DIM_BLOCK];
        for (int b = 0; b < DIM_BLOCK; b++) a[b] = accT[i0 + b];
        for (int64_t r = 0; r < n; r++) {
            const lanes_t p = probs[r];
            const float *v = rows + r * stride + i0;
            for (int b = 0; b < DIM_BLOCK; b++) a[b] += p * v[b];
        }
        for (int b = 0; b < DIM_BLOCK; b++) accT[i0 + b] = a[b];
    }
    for (; i0 < d; i0++)
        for (int64_t r = 0; r < n; r++) accT[i0] += probs[r] * rows[r * stride + i0];
}

/* One work item of a group: its members and kv heads [kv_first, kv_first + kv_count), and per-kv-head scratch. For
 * kv head k (counted from kv_first), lane j * G + g holds member j's head (kv_first + k) * G + g. */
typedef struct {
    const group_t *group;
    const int64_t *order, *tables, *token_rows, *positions;
    const void *k_cache, *v_cache;
    int64_t max_blocks, kv_first, kv_count, num_kv_heads, g_heads, page;
    float scale, softcap;
    int dtype;
    lanes_t *sc;   /* kv_count x longest: scores, then probabilities, key-major */
    lanes_t *qT;   /* kv_count x d: the queries, transposed into lanes */
    lanes_t *accT; /* kv_count x d: weighted shared values, transposed */
    float *qrows;  /* kv_count x LANES x d: the queries, one row per lane */
    float *tail;   /* kv_count x LANES x d: weighted own values, one row per lane */
    float *buf;    /* CHUNK x d: keys or values widened from bf16 */
    float *tmp;    /* d */
} group_item_t;

static inline lanes_t *item_scores(const group_item_t *it, int64_t k) { return it->sc + k * it->group->longest; }

/* The shared keys [0, shared), CHUNK slots at a time across the item's kv heads (each slot read front to back):
 * scores, one FMA per dimension for every lane (weigh = 0), or the probabilities' weighted values (weigh = 1). */
static inline __attribute__((always_inline)) void shared_pass(const group_item_t *it, int64_t d, int weigh) {
    const int64_t shared = it->group->shared;
    const int64_t *leader = it->tables + it->token_rows[it->order[it->group->first]] * it->max_blocks;
    for (int64_t pos = 0, base, stop; pos < shared; pos = stop) {
        stop = page_run(leader, pos, shared, it->page, &base);
        for (int64_t c = pos; c < stop; c += CHUNK) {
            const int64_t n = stop - c < CHUNK ? stop - c : CHUNK;
            for (int64_t k = 0; k < it->kv_count; k++) {
                int64_t stride;
                const float *rows = key_rows(weigh ? it->v_cache : it->k_cache, base + c, n, it->kv_first + k,
                                             it->num_kv_heads, d, it->dtype, it->buf, &stride);
                lanes_t *sc = item_scores(it, k) + c;
                if (weigh) {
                    weigh_values(sc, rows, stride, n, d, it->accT + k * d);
                    continue;
                }
                score_keys(it->qT + k * d, rows, stride, n, d, sc);
                if (it->softcap > 0.f)
                    for (int64_t r = 0; r < n; r++) {
                        float *s = (float *)(sc + r);
#pragma omp simd
                        for (int l = 0; l < LANES; l++) s[l] = it->softcap * tanhf(s[l] * it->scale / it->softcap);
                    }
            }
        }
    }
}

/* Each member's own keys past the shared ones, slot by slot across the item's kv heads: one dot product per head
 * (weigh = 0), or its probability times the value into the member's `tail` rows (weigh = 1). */
static inline __attribute__((always_inline)) void own_pass(const group_item_t *it, int64_t d, int weigh) {
    const group_t *group = it->group;
    for (int64_t j = 0; j < group->count && !group->one_row; j++) {
        const int64_t t = it->order[group->first + j], end = it->positions[t] + 1;
        const int64_t *table = it->tables + it->token_rows[t] * it->max_blocks;
        for (int64_t pos = group->shared, base, stop; pos < end;)
            for (stop = page_run(table, pos, end, it->page, &base); pos < stop; pos++)
                for (int64_t k = 0; k < it->kv_count; k++) {
                    const float *row = row_f32(weigh ? it->v_cache : it->k_cache,
                                               ((base + pos) * it->num_kv_heads + it->kv_first + k) * d, d,
                                               it->dtype, it->tmp);
                    lanes_t *sc = item_scores(it, k) + pos;
                    for (int64_t lane = j * it->g_heads; lane < (j + 1) * it->g_heads; lane++) {
                        if (weigh) {
                            axpy(it->tail + (k * LANES + lane) * d, (*sc)[lane], row, d);
                            continue;
                        }
                        const float score = dot(it->qrows + (k * LANES + lane) * d, row, d);
                        (*sc)[lane] = it->softcap > 0.f ? it->softcap * tanhf(score * it->scale / it->softcap)
                                                        : score;
                    }
                }
    }
}

/* Attention of a group's members for the item's kv heads. */
static inline __attribute__((always_inline)) void attend_group(const group_item_t *it, const void *q,
                                                               int64_t q_token_stride, int64_t q_head_stride,
                                                               void *out, int64_t d) {
    const group_t *group = it->group;
    const int64_t g_heads = it->g_heads, members = group->count, lanes = members * g_heads;
    const int64_t num_heads = it->num_kv_heads * g_heads, shared = group->shared, longest = group->longest;
    const float q_scale = it->softcap > 0.f ? 1.f : it->scale;

    for (int64_t k = 0; k < it->kv_count; k++) {
        lanes_t *qT = it->qT + k * d, *accT = it->accT + k * d;
        float *qrows = it->qrows + k * LANES * d;
        for (int64_t i = 0; i < d; i++) qT[i] = splat(0.f), accT[i] = splat(0.f);
        memset(it->tail + k * LANES * d, 0, sizeof(float) * lanes * d);
        for (int64_t j = 0; j < members; j++)
            for (int64_t g = 0; g < g_heads; g++) {
                const int64_t lane = j * g_heads + g, head = (it->kv_first + k) * g_heads + g;
                const float *src = row_f32(q, it->order[group->first + j] * q_token_stride + head * q_head_stride, d,
                                           it->dtype, it->tmp);
                for (int64_t i = 0; i < d; i++) {
                    qrows[lane * d + i] = src[i] * q_scale;
                    qT[i][lane] = src[i] * q_scale;
                }
            }
    }
    shared_pass(it, d, 0);
    /* keys past a member's position are masked; own keys are scored over the mask */
    for (int64_t k = 0; k < it->kv_count; k++) {
        lanes_t *sc = item_scores(it, k);
        if (group->one_row) {
            for (int64_t j = 0; j < members; j++)
                for (int64_t p = it->positions[it->order[group->first + j]] + 1; p < longest; p++)
                    for (int64_t g = 0; g < g_heads; g++) sc[p][j * g_heads + g] = NEG_SCORE;
        } else {
            for (int64_t p = shared; p < longest; p++) sc[p] = splat(NEG_SCORE);
        }
    }
    own_pass(it, d, 0);
    /* softmax per lane, across the lanes at once; the normaliser is applied at the end */
    float sums[it->kv_count][LANES];
    for (int64_t k = 0; k < it->kv_count; k++) {
        lanes_t *sc = item_scores(it, k);
        float top[LANES];
        for (int l = 0; l < LANES; l++) top[l] = sc[0][l], sums[k][l] = 0.f;
        for (int64_t p = 1; p < longest; p++) {
            const float *s = (const float *)(sc + p);
#pragma omp simd
            for (int l = 0; l < LANES; l++) top[l] = s[l] > top[l] ? s[l] : top[l];
        }
        for (int64_t p = 0; p < longest; p++) {
            float *s = (float *)(sc + p);
#pragma omp simd
            for (int l = 0; l < LANES; l++) {
                s[l] = expf(s[l] - top[l]);
                sums[k][l] += s[l];
            }
            if (it->dtype == DTYPE_BF16)
                for (int l = 0; l < LANES; l++) s[l] = bf16_rounded(s[l]);
        }
    }
    shared_pass(it, d, 1);
    own_pass(it, d, 1);
    for (int64_t k = 0; k < it->kv_count; k++)
        for (int64_t j = 0; j < members; j++)
            for (int64_t g = 0; g < g_heads; g++) {
                const int64_t lane = j * g_heads + g;
                const float inv = 1.f / sums[k][lane], *tail = it->tail + (k * LANES + lane) * d;
                const lanes_t *accT = it->accT + k * d;
                const int64_t o = (it->order[group->first + j] * num_heads + (it->kv_first + k) * g_heads + g) * d;
                if (it->dtype == DTYPE_F32) {
                    float *dst = (float *)out + o;
                    for (int64_t i = 0; i < d; i++) dst[i] = (accT[i][lane] + tail[i]) * inv;
                } else {
                    uint16_t *dst = (uint16_t *)out + o;
                    for (int64_t i = 0; i < d; i++) dst[i] = f32_to_bf16((accT[i][lane] + tail[i]) * inv);
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

/* ----------------------------------------------------------------------------------------------------- the call */
typedef struct {
    int64_t first_block, row, position, token;
} token_key_t;

static int compare_tokens(const void *a, const void *b) {
    const token_key_t *x = a, *y = b;
    if (x->first_block != y->first_block) return x->first_block < y->first_block ? -1 : 1;
    if (x->row != y->row) return x->row < y->row ? -1 : 1;
    if (x->position != y->position) return x->position < y->position ? -1 : 1;
    return x->token < y->token ? -1 : (x->token > y->token);
}

/* Tokens in key order (first block, row, position), then cut into groups of tokens that read the same keys. A group
 * that would leave lanes idle is split into single tokens, which attend() serves faster: a group's passes cost the
 * same per key whatever its lanes hold, and with 8-14 of 16 lanes used (GRPO's groups of 4-7 samples, 2 query heads
 * per kv head) that cost more than what reading the shared keys once saved (benchmarks/RESULTS.md, "Attention
 * kernel"). Depends only on the batch, never on the thread count. Returns the number of groups, or -1 when out of
 * memory. */
static int64_t make_groups(const int64_t *positions, const int64_t *token_rows, const int64_t *tables,
                           int64_t num_tokens, int64_t max_blocks, int64_t g_heads, int64_t page, int64_t window,
                           int64_t *order, group_t *groups) {
    token_key_t *keys = malloc(sizeof(token_key_t) * (num_tokens ? num_tokens : 1));
    if (!keys) return -1;
    for (int64_t t = 0; t < num_tokens; t++)
        keys[t] = (token_key_t){tables[token_rows[t] * max_blocks], token_rows[t], positions[t], t};
    qsort(keys, num_tokens, sizeof *keys, compare_tokens);
    for (int64_t i = 0; i < num_tokens; i++) order[i] = keys[i].token;
    free(keys);

    const int64_t max_members = (window > 0 || g_heads > LANES) ? 1 : LANES / g_heads;
    int64_t count = 0;
    for (int64_t i = 0; i < num_tokens;) {
        const int64_t lead = order[i], *lead_table = tables + token_rows[lead] * max_blocks;
        int64_t n = 1, one_row = 1, shared = positions[lead] + 1, longest = positions[lead] + 1;
        for (; i + n < num_tokens && n < max_members; n++) {
            const int64_t t = order[i + n], row = token_rows[t], last = token_rows[order[i + n - 1]];
            const int64_t *table = tables + row * max_blocks;
            if (table[0] != lead_table[0]) break;
            if (row == token_rows[lead] ? !one_row : row == last) break; /* one row, or distinct rows */
            if (row != token_rows[lead]) {
                int64_t blocks = 0, limit = shared < positions[t] + 1 ? shared : positions[t] + 1;
                while (blocks * page < limit && table[blocks] == lead_table[blocks]) blocks++;
                shared = blocks * page < limit ? blocks * page : limit;
                one_row = 0;
            }
            if (positions[t] + 1 > longest) longest = positions[t] + 1;
        }
        if (one_row) shared = longest;
        if (n * g_heads >= LANES && shared > 0) {
            groups[count++] = (group_t){i, n, shared, longest, (int)one_row};
        } else {
            for (int64_t j = 0; j < n; j++)
                groups[count++] = (group_t){i + j, 1, 0, positions[order[i + j]] + 1, 1};
        }
        i += n;
    }
    return count;
}

/* 64-byte aligned memory for `bytes` (NULL for 0 bytes). */
static void *scratch(size_t bytes) {
    return bytes ? aligned_alloc(64, (bytes + 63) / 64 * 64) : NULL;
}

/* Returns 0, or -1 when memory for the work split or a thread's scratch could not be had. */
int rollout_paged_attention(const void *q, int64_t q_token_stride, int64_t q_head_stride, void *out,
                            const void *k_cache, const void *v_cache,
                            const int64_t *positions, const int64_t *token_rows, const int64_t *tables,
                            int64_t num_tokens, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t page_size, float scale, int64_t window, float softcap,
                            int dtype, int num_threads) {
    const int64_t g_heads = num_heads / num_kv_heads;
    int64_t longest = 1;
    for (int64_t t = 0; t < num_tokens; t++) longest = positions[t] + 1 > longest ? positions[t] + 1 : longest;
    int64_t *order = malloc(sizeof(int64_t) * (num_tokens ? num_tokens : 1));
    group_t *groups = malloc(sizeof(group_t) * (num_tokens ? num_tokens : 1));
    const int64_t num_groups = order && groups ? make_groups(positions, token_rows, tables, num_tokens, max_blocks,
                                                             g_heads, page_size, window, order, groups) : -1;
    if (num_groups < 0) {
        free(order);
        free(groups);
        return -1;
    }
    /* One item per group and all its kv heads, so its pages are read front to back, when there are two groups per
     * thread (enough to even out groups of different lengths); otherwise one item per (group, kv head). Items of one
     * kv head each read a few hundred bytes per slot of the same pages, which the hardware prefetchers answer with
     * the other heads' bytes too (benchmarks/RESULTS.md, "Attention kernel"). */
    const int64_t kv_per_item = num_groups >= 2 * num_threads ? num_kv_heads : 1;
    const int64_t items_per_group = num_kv_heads / kv_per_item;
    const int64_t items = num_groups * items_per_group;
    int grouped = 0, failed = 0;
    for (int64_t i = 0; i < num_groups; i++) grouped |= groups[i].count > 1;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = scratch(sizeof(float) * num_heads * longest);
        float *qf = scratch(sizeof(float) * num_heads * head_dim);
        float *acc = scratch(sizeof(float) * num_heads * head_dim);
        float *tmp = scratch(sizeof(float) * head_dim);
        /* group scratch only when a group is served (scratch(0) is NULL, and free(NULL) does nothing) */
        const int64_t kvh = grouped ? num_kv_heads : 0;
        lanes_t *sc = scratch(sizeof(lanes_t) * kvh * longest);
        lanes_t *qT = scratch(sizeof(lanes_t) * kvh * head_dim);
        lanes_t *accT = scratch(sizeof(lanes_t) * kvh * head_dim);
        float *qrows = scratch(sizeof(float) * kvh * LANES * head_dim);
        float *tail = scratch(sizeof(float) * kvh * LANES * head_dim);
        float *buf = scratch(sizeof(float) * (grouped ? CHUNK : 0) * head_dim);
        if (!scores || !qf || !acc || !tmp || (grouped && (!sc || !qT || !accT || !qrows || !tail || !buf)))
            failed = 1;
        /* every thread takes part in the loop (a worksharing construct must be met by all of them) */
#pragma omp for schedule(dynamic, 2)
        for (int64_t item = 0; item < items; item++) {
            if (failed) continue;
            const group_t *group = groups + item / items_per_group;
            const int64_t kv = (item % items_per_group) * kv_per_item;
            /* a constant head_dim lets the compiler unroll the inner loops completely */
#define BY_HEAD_DIM(CALL)                                                                                         \
    do {                                                                                                          \
        if (head_dim == 64)                                                                                       \
            CALL(64);                                                                                             \
        else if (head_dim == 128)                                                                                 \
            CALL(128);                                                                                            \
        else                                                                                                      \
            CALL(head_dim);                                                                                       \
    } while (0)
#define ATTEND(D)                                                                                                 \
    attend(q, t * q_token_stride, q_head_stride, out, k_cache, v_cache, table, t, kv, kv_count, positions[t],     \
           num_heads, num_kv_heads, D, page_size, scale, window, softcap, dtype, scores, qf, acc, tmp)
#define ATTEND_GROUP(D) attend_group(&item_ctx, q, q_token_stride, q_head_stride, out, D)
            if (group->count == 1) {
                const int64_t t = order[group->first], kv_count = kv_per_item;
                const int64_t *table = tables + token_rows[t] * max_blocks;
                BY_HEAD_DIM(ATTEND);
            } else {
                const group_item_t item_ctx = {group, order, tables, token_rows, positions, k_cache, v_cache,
                                               max_blocks, kv, kv_per_item, num_kv_heads, g_heads, page_size, scale,
                                               softcap, dtype, sc, qT, accT, qrows, tail, buf, tmp};
                BY_HEAD_DIM(ATTEND_GROUP);
            }
#undef BY_HEAD_DIM
#undef ATTEND
#undef ATTEND_GROUP
        }
        free(scores);
        free(qf);
        free(acc);
        free(tmp);
        free(sc);
        free(qT);
        free(accT);
        free(qrows);
        free(tail);
        free(buf);
    }
    free(order);
    free(groups);
    return failed ? -1 : 0;
}
