/* The two passes of a weight sync over a real-size model that PyTorch ops make slow: the finiteness check of the new
 * values (rollout/rl/weights.py) and the transposed copy that refreshes oneDNN's packed linear weights in place
 * (rollout/engine/cpu/packed_layout.py).
 *
 * Finiteness: torch.aminmax reads bf16 at a fraction of memory speed, and isfinite().all() writes a mask as large as
 * the tensor. Here a value is non-finite when its exponent bits are all ones, found in one vectorized pass.
 *
 * The transposed copy: oneDNN keeps a packed weight as groups of output rows stored column by column (64 rows interleaved for fp32
 * on AVX-512; bf16 the same with each pair of columns as one 32-bit word). In PyTorch ops the transpose of each group
 * takes two passes over the weight (channel_shuffle into a fresh tensor, then a strided copy into the buffer) and page
 * faults of the temporary; after a weight update of a real-size model that was most of the sync. Here each group is
 * read once and written once, through a tile that stays in L1.
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

static void transpose_tile(const uint32_t *src, int64_t src_stride, uint32_t *dst, int64_t group, int64_t cols,
                           int64_t column_stride) {
    for (int64_t c = 0; c < cols; c++) {
        uint32_t *out = dst + c * column_stride;
        for (int64_t r = 0; r < group; r++) out[r] = src[r * src_stride + c];
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
