/* The sampler's draw (rollout/engine/sample/sampler.py, inverse_cdf): per row of log-probabilities, the first token
 * whose cumulative probability passes the row's uniform, in one pass over the row instead of PyTorch's several (exp of
 * the whole [rows, vocab] block, block sums, then a search).
 *
 * A probability counts in whole units of 2^-40: floor(exp(lp) * 2^40), summed in int64, so the sums are exact in any
 * order. exp is computed by a fixed sequence of float64 operations (units.py spells it out, and its PyTorch path runs
 * the same operations), so both paths give every token the same units and draw the same tokens. Tokens with lp below
 * -28 weigh nothing (exp(-28) < 2^-40) and are never exponentiated, which also spares the subnormal results that make
 * a vectorized exp slow. A row's threshold is floor(u * total) with u in [0, 1); the drawn token is the first whose
 * cumulative units exceed it. A row of no units at all draws its first largest log-probability (NaN the largest, as
 * torch.argmax). Built without -ffast-math and without contraction: every operation must round as units.py's do.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 1024 /* tokens per block: the first pass keeps each block's units, the search reads one block again */
#define LOWEST_LP (-28.0)

/* units.py's exp, as a float64 holding a whole number of units: x = k ln2 + r with k = round(x / ln2) (ties to
 * even: adding and subtracting 1.5 * 2^52 rounds so in the default rounding mode), exp(r) by its Taylor polynomial to
 * r^11 (Horner, one multiply then one add per step), times 2^k (built from k's bits), times 2^40, rounded down.
 * Branch-free and in float64 throughout, so the compiler vectorizes it. */
static inline double lp_units(float lp) {
    const double ROUNDER = 0x1.8p52;
    const int live = lp >= LOWEST_LP; /* NaN and -inf are not */
    const double x = live && lp < 0.0f ? (double)lp : 0.0; /* a log-probability rounded above 0 counts as 0 */
    const double shifted = x * 0x1.71547652b82fep0 + ROUNDER;
    const double k = shifted - ROUNDER;
    const double r = (x - k * 0x1.62e42fee00000p-1) - k * 0x1.a39ef35793c76p-33;
    double q = 1.0 / 39916800.0;
    q = q * r + 1.0 / 3628800.0;
    q = q * r + 1.0 / 362880.0;
    q = q * r + 1.0 / 40320.0;
    q = q * r + 1.0 / 5040.0;
    q = q * r + 1.0 / 720.0;
    q = q * r + 1.0 / 120.0;
    q = q * r + 1.0 / 24.0;
    q = q * r + 1.0 / 6.0;
    q = q * r + 1.0 / 2.0;
    q = q * r + 1.0;
    q = q * r + 1.0;
    int64_t k_bits, rounder_bits;
    memcpy(&k_bits, &shifted, sizeof k_bits);
    memcpy(&rounder_bits, &ROUNDER, sizeof rounder_bits);
    const int64_t scale_bits = (k_bits - rounder_bits + 1023 + 40) << 52; /* 2^(k + 40) */
    double scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    return live ? floor(q * scale) : 0.0;
}

#define LANES 8 /* independent partial sums: the compiler vectorizes them without reassociating a float sum */

/* The units of row[begin, end): a float64 sum of whole numbers under 2^53 (a block holds at most BLOCK * 2^40), so
 * exact in any order. */
static int64_t units_of(const float *row, int64_t begin, int64_t end) {
    double acc[LANES] = {0};
    int64_t i = begin;
    for (; i + LANES <= end; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += lp_units(row[i + j]);
    double sum = 0.0;
    for (int j = 0; j < LANES; j++) sum += acc[j];
    for (; i < end; i++) sum += lp_units(row[i]);
    return (int64_t)sum;
}

/* torch.argmax's token: the first largest value, a NaN counting as the largest. */
static int64_t first_largest(const float *row, int64_t vocab) {
    int64_t best = 0;
    for (int64_t i = 0; i < vocab; i++) {
        if (row[i] != row[i]) return i;
        if (row[i] > row[best]) best = i;
    }
    return best;
}

static int64_t draw_row(const float *row, int64_t vocab, double u, int64_t *block_units) {
    const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
    int64_t total = 0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * BLOCK < vocab ? (b + 1) * BLOCK : vocab;
        block_units[b] = units_of(row, b * BLOCK, end);
        total += block_units[b];
    }
    if (total == 0) return first_largest(row, vocab);
    int64_t threshold = (int64_t)floor(u * (double)total);
    if (threshold >= total) threshold = total - 1;
    if (threshold < 0) threshold = 0;
    int64_t cum = 0, b = 0;
    while (cum + block_units[b] <= threshold) cum += block_units[b++];
    for (int64_t i = b * BLOCK;; i++) {
        cum += (int64_t)lp_units(row[i]);
        if (cum > threshold) return i;
    }
}

/* One token per row of `rows` rows of `vocab` log-probabilities (contiguous) for the row's uniform in [0, 1).
 * Returns 1 if a thread could not allocate its scratch memory, else 0. */
int rollout_draw_tokens(const float *logprobs, int64_t rows, int64_t vocab, const double *uniforms, int64_t *out,
                        int threads) {
    int failed = 0;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows > 1)
    {
        int64_t *block_units = malloc(sizeof(int64_t) * (size_t)((vocab + BLOCK - 1) / BLOCK));
        if (!block_units) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            if (block_units) out[r] = draw_row(logprobs + r * vocab, vocab, uniforms[r], block_units);
        free(block_units);
    }
    return failed;
}
