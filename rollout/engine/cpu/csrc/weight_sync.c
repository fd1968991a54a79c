/* The two passes of a weight sync over a real-size model that PyTorch ops make slow: the finiteness check of the new
 * values (rollout/rl/weights.py) and the transposed copy that refreshes oneDNN's packed linear weights in place
 * (rollout/engine/cpu/packed_layout.py).
 *
 * Finiteness: torch.aminmax reads bf16 at a fraction of memory speed, and isfinite().all() writes a mask as large as
 * the tensor. Here a value is non-finite when its exponent bits are all ones, found in one vectorized pass.
 *
 * The transposed copy: oneDNN keeps a packed weight as groups of output rows stored column by column (64 rows
 * interleaved for fp32 on AVX-512; bf16 the same with each pair of columns as one 32-bit word). In PyTorch ops the
 * transpose of each group takes two passes over the weight (channel_shuffle into a fresh tensor, then a strided copy
 * into the buffer) and page faults of the temporary; after a weight update of a real-size model that was most of the
 * sync. Here each group is read once and written once, 8 x 8 words at a time transposed in registers (GCC/Clang
 * generic vectors, no intrinsics: every target gets its own shuffles). A weight update writes the live weight in the
 * same pass (`plain`).
 *
 * Words are moved as uint32_t, so the copy is exact for any 32-bit data (fp32 values, bf16 pairs, NaN payloads).
 * Layout: word (b, r, c) of the source, row b * group + r and column c, lies at src[(b * group + r) * src_stride + c];
 * it goes to dst[b * block_stride + c * column_stride + r].
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* 1 if any of the n values at `data` (fp32 or bf16) is NaN or infinite, else 0. The flags are OR-ed in the values'
 * own width, so the loop vectorizes at full width (a count widened to 64 bits ran at a fraction of memory speed). */
int rollout_any_nonfinite(const void *data, int64_t n, int dtype, int threads) {
    (void)threads;
    if (dtype == DTYPE_F32) {
        const uint32_t *u = (const uint32_t *)data;
        uint32_t any = 0;
#pragma omp parallel for simd num_threads(threads) reduction(| : any) schedule(static) if (threads > 1 && n > 65536)
        for (int64_t i = 0; i < n; i++) any |= (uint32_t)((u[i] & 0x7F800000u) == 0x7F800000u);
        return any != 0;
    }
    const uint16_t *u = (const uint16_t *)data;
    uint16_t any = 0;
#pragma omp parallel for simd num_threads(threads) reduction(| : any) schedule(static) if (threads > 1 && n > 65536)
    for (int64_t i = 0; i < n; i++) any |= (uint16_t)((u[i] & 0x7F80u) == 0x7F80u);
    return any != 0;
}

#define TILE_COLS 16 /* columns per tile: one 64-byte line of each of the group's rows */

typedef uint32_t words8 __attribute__((vector_size(32)));

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (words8){__VA_ARGS__})
#endif

/* An 8 x 8 block of words, rows `src_stride` apart, written column by column `column_stride` apart: three rounds of
 * shuffles in registers (the compiler's generic vectors: AVX2 or AVX-512 shuffles, narrower ones elsewhere), where
 * word-by-word copies read every row once per column. */
static inline void transpose8(const uint32_t *src, int64_t src_stride, uint32_t *dst, int64_t column_stride) {
    words8 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) memcpy(&r[i], src + i * src_stride, sizeof(words8));
    for (int i = 0; i < 8; i += 2) { /* pairs of rows interleaved */
        t[i] = SHUFFLE(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = SHUFFLE(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4) { /* quads: each 128-bit half holds one column of 4 rows */
        u[i] = SHUFFLE(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 1] = SHUFFLE(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[i + 2] = SHUFFLE(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 3] = SHUFFLE(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int c = 0; c < 4; c++) { /* the halves of rows 0-3 and 4-7 joined: columns c and c + 4 */
        const words8 low = SHUFFLE(u[c], u[c + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        const words8 high = SHUFFLE(u[c], u[c + 4], 4, 5, 6, 7, 12, 13, 14, 15);
        memcpy(dst + c * column_stride, &low, sizeof(words8));
        memcpy(dst + (c + 4) * column_stride, &high, sizeof(words8));
    }
}

static void transpose_tile(const uint32_t *src, int64_t src_stride, uint32_t *dst, int64_t group, int64_t cols,
                           int64_t column_stride) {
    const int64_t full_rows = group / 8 * 8, full_cols = cols / 8 * 8;
    for (int64_t c = 0; c < full_cols; c += 8)
        for (int64_t r = 0; r < full_rows; r += 8)
            transpose8(src + r * src_stride + c, src_stride, dst + c * column_stride + r, column_stride);
    for (int64_t c = 0; c < cols; c++) { /* what is left: the last rows of every column, the last columns */
        uint32_t *out = dst + c * column_stride;
        for (int64_t r = c < full_cols ? full_rows : 0; r < group; r++) out[r] = src[r * src_stride + c];
    }
}

static void transpose_group(const uint32_t *src, int64_t src_stride, uint32_t *dst, int64_t group, int64_t cols,
                            int64_t column_stride) {
    for (int64_t c0 = 0; c0 < cols; c0 += TILE_COLS)
        transpose_tile(src + c0, src_stride, dst + c0 * column_stride, group,
                       cols - c0 < TILE_COLS ? cols - c0 : TILE_COLS, column_stride);
}

/* `plain` (NULL: none): also copy the source rows there, row r at plain[r * plain_stride] (a weight update writes the
 * live weight and its packed copy from the new values at once). Then each group is first copied row by row, which
 * streams the rows from memory, and transposed right after from the cache (a group of 64 rows of a few thousand
 * words fits in L2); copying within the transpose's tiles instead read 64 rows and wrote 64 others at once, more
 * streams than the prefetchers follow. */
void rollout_transpose_blocks(const uint32_t *src, int64_t src_stride, uint32_t *dst, int64_t blocks,
                              int64_t group, int64_t cols, int64_t block_stride, int64_t column_stride,
                              uint32_t *plain, int64_t plain_stride, int threads) {
    (void)threads;
    if (plain) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && blocks > 1)
        for (int64_t b = 0; b < blocks; b++) {
            const uint32_t *rows = src + b * group * src_stride;
            for (int64_t r = 0; r < group; r++)
                memcpy(plain + (b * group + r) * plain_stride, rows + r * src_stride, (size_t)cols * sizeof(uint32_t));
            transpose_group(rows, src_stride, dst + b * block_stride, group, cols, column_stride);
        }
        return;
    }
    const int64_t tiles = (cols + TILE_COLS - 1) / TILE_COLS;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && blocks * group * cols > 65536)
    for (int64_t item = 0; item < blocks * tiles; item++) {
        const int64_t b = item / tiles, c0 = (item % tiles) * TILE_COLS;
        const int64_t n = cols - c0 < TILE_COLS ? cols - c0 : TILE_COLS;
        transpose_tile(src + b * group * src_stride + c0, src_stride, dst + b * block_stride + c0 * column_stride,
                       group, n, column_stride);
    }
}
