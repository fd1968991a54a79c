/* Top-p (nucleus) truncation of a step's [rows, vocab] distributions without sorting the vocabulary
 * (rollout/engine/sample/truncation.py).
 *
 * Sorting every row costs O(vocab log vocab) per row: at a 151,936-token vocabulary torch.sort of 64 rows takes longer
 * than the model's whole decode step. Top-p only needs one boundary per row, which a radix select finds in a few
 * linear passes: histograms of 11, 11 and 10 bits of the probabilities' bits (which order non-negative floats) narrow
 * it down to one value.
 *
 * A row's tokens in the order (probability descending, index ascending) keep a prefix: a token is kept while the
 * probability mass strictly before it is below the row's budget, and the first token always is. The mass is an exact
 * integer sum: each probability becomes floor(p * 2^40) (p <= 0 or NaN: 0), so no order of summation can move the
 * boundary, and the PyTorch path of truncation.py (a stable sort and an int64 cumulative sum) keeps exactly the same
 * tokens. The budget is floor(top_p * 2^40). Built without -ffast-math: NaN must compare as NaN.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LEVELS 3
static const int SHIFT[LEVELS] = {21, 10, 0};
static const int WIDTH[LEVELS] = {11, 11, 10};
#define MAX_BUCKETS 2048

/* The key of a probability: its bits (non-negative floats order as their bits); p <= 0 and NaN are 0. */
static inline uint32_t prob_key(float p) {
    uint32_t u;
    memcpy(&u, &p, sizeof u);
    return p > 0.0f ? u : 0u;
}

static inline int64_t prob_units(float p) { return p > 0.0f ? (int64_t)((double)p * 0x1p40) : 0; }

static int walk(const int64_t *units, const int64_t *count, int buckets, int64_t budget, int64_t *above) {
    for (int b = buckets - 1; b >= 0; b--) {
        if (!count[b]) continue;
        if (*above + units[b] >= budget) return b;
        *above += units[b];
    }
    return -1;
}

/* The boundary key of a row: walking its keys from the largest down, the first whose units bring the mass to the
 * budget; *above ends as the mass of every key above it. Level 0 reads the whole row; the keys in its boundary bucket
 * (and their units) are then gathered into `cand`/`cand_units`, and the next levels only read those. Returns 0 with
 * *none = 1 where the whole row's mass stays below the budget (only possible at level 0). */
static uint32_t boundary_key(const float *row, int64_t vocab, int64_t budget, uint32_t *cand, int64_t *cand_units,
                             int64_t *above, int *none) {
    int64_t units[MAX_BUCKETS], count[MAX_BUCKETS];
    const int buckets0 = 1 << WIDTH[0];
    memset(units, 0, sizeof(int64_t) * buckets0);
    memset(count, 0, sizeof(int64_t) * buckets0);
    for (int64_t i = 0; i < vocab; i++) {
        const int b = (int)(prob_key(row[i]) >> SHIFT[0]);
        units[b] += prob_units(row[i]);
        count[b]++;
    }
    *above = 0;
    const int b0 = walk(units, count, buckets0, budget, above);
    *none = b0 < 0;
    if (*none) return 0;
    int64_t n = 0;
    for (int64_t i = 0; i < vocab; i++) {
        const uint32_t key = prob_key(row[i]);
        if ((int)(key >> SHIFT[0]) == b0) {
            cand[n] = key;
            cand_units[n++] = prob_units(row[i]);
        }
    }
    uint32_t prefix = (uint32_t)b0 << SHIFT[0], mask = (uint32_t)(buckets0 - 1) << SHIFT[0];
    for (int level = 1; level < LEVELS; level++) {
        const int shift = SHIFT[level], buckets = 1 << WIDTH[level];
        memset(units, 0, sizeof(int64_t) * buckets);
        memset(count, 0, sizeof(int64_t) * buckets);
        for (int64_t j = 0; j < n; j++) {
            if ((cand[j] & mask) != prefix) continue;
            const int b = (cand[j] >> shift) & (buckets - 1);
            units[b] += cand_units[j];
            count[b]++;
        }
        prefix |= (uint32_t)walk(units, count, buckets, budget, above) << shift; /* found: the parent bucket was */
        mask |= (uint32_t)(buckets - 1) << shift;
    }
    return prefix;
}

/* Keep the tokens of one row: keys above the boundary, and of its ties (equal units each) the first `ties` by index,
 * those whose mass before stays below the budget; at least one where nothing is above (the first token always
 * stays). */
static void keep_row(const float *row, int64_t vocab, int64_t budget, uint8_t *keep, uint32_t *cand,
                     int64_t *cand_units) {
    int64_t above;
    int none;
    const uint32_t boundary = boundary_key(row, vocab, budget, cand, cand_units, &above, &none);
    if (none) {
        memset(keep, 1, (size_t)vocab);
        return;
    }
    int64_t each = -1;
    for (int64_t i = 0; i < vocab && each < 0; i++)
        if (prob_key(row[i]) == boundary) each = prob_units(row[i]);
    int64_t ties = each > 0 ? (budget - above + each - 1) / each : 0;
    if (ties < 1 && above == 0) ties = 1;
    for (int64_t i = 0; i < vocab; i++) {
        const uint32_t key = prob_key(row[i]);
        keep[i] = key > boundary || (key == boundary && ties > 0 && ties--);
    }
}

/* Per row of `rows` rows of `vocab` probabilities (contiguous), the tokens top-p keeps (keep: 1) under the row's
 * budget in units of 2^-40 (`budgets`). Returns 1 if a thread could not allocate its scratch memory, else 0. */
int rollout_top_p_keep(const float *probs, int64_t rows, int64_t vocab, const int64_t *budgets, uint8_t *keep,
                       int threads) {
    int failed = 0;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows > 1)
    {
        uint32_t *cand = malloc(sizeof(uint32_t) * (size_t)vocab);
        int64_t *cand_units = malloc(sizeof(int64_t) * (size_t)vocab);
        if (!cand || !cand_units) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++)
            if (cand && cand_units) keep_row(probs + r * vocab, vocab, budgets[r], keep + r * vocab, cand, cand_units);
        free(cand);
        free(cand_units);
    }
    return failed;
}
