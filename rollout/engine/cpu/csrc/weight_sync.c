/* The two passes of a weight sync over a real-size model that PyTorch ops make slow: the finiteness check of the new
 * values (rollout/rl/weights.py) and the transposed copy that refreshes oneDNN's packed linear weights in place
 * (rollout/engine/cpu/packed_layout.py).
 *
 * Finiteness: torch.aminmax reads bf16 at a fraction of memory speed, and isfinite().all() writes a mask as large as
 * the tensor. Here a value is non-finite when its exponent bits are all ones, found in one vectorized pass.
 *
 * The transposed copy: oneDNN keeps a packed weight as groups of output rows stored column by column (64 rows
 * interleaved for fp32 on AVX-512; bf16 the same with each pair of columns as one 32-bit word where the CPU has bf16
 * dot products, else the whole weight as one transpose of 16-bit values). A bf16 weight computed on an fp32 copy is
 * widened on the way into that copy's fp32 layout. In PyTorch ops the transpose of each group
 * takes two passes over the weight (channel_shuffle into a fresh tensor, then a strided copy into the buffer) and page
 * faults of the temporary, and a 16-bit transpose is an element-by-element strided copy; after a weight update of a
 * real-size model that was most of the sync. Here each group is read once and written once, 8 x 8 elements at a time
 * transposed in registers (GCC/Clang generic vectors, no intrinsics: every target gets its own shuffles). A weight
 * update writes the live weight in the same pass (`plain`).
 *
 * Elements are moved as unsigned integers of their width, so the copy is exact for any data (fp32 values, bf16
 * pairs or single bf16 values, NaN payloads); a bf16 value is widened by shifting its bits up 16, as torch widens it.
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

typedef uint32_t words8 __attribute__((vector_size(32)));
typedef uint16_t halves8 __attribute__((vector_size(16)));

#if defined(__clang__)
#define SHUFFLE(mask_t, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(mask_t, a, b, ...) __builtin_shuffle(a, b, (mask_t){__VA_ARGS__})
#endif

/* The transposed copy for one pair of element widths: `src_t` the source's element and `src_vec_t` a vector of 8 of
 * them, `elem_t` the packed copy's element and `vec_t` a vector of 8 of them, `SHIFT` how far a source element moves
 * up in its wider word (16: a bf16 value widened to the fp32 of the same value, exact, as torch widens it; 0: the same
 * width), `TILE` the columns per tile (one 64-byte line of each of the group's source rows). Generated for 32-bit
 * words, for 16-bit elements (bf16 packed as one plain transpose, where oneDNN has no bf16 dot products to block for)
 * and for bf16 into fp32 (the fp32 copy of a bf16 weight, where the CPU computes bf16 linears on fp32 copies).
 *
 * transpose8: an 8 x 8 block, rows `src_stride` apart, written column by column `column_stride` apart: three rounds
 * of shuffles in registers (the compiler's generic vectors: AVX2 or AVX-512 shuffles, narrower ones elsewhere), where
 * element-by-element copies read every row once per column.
 *
 * transpose_blocks: with `plain` (NULL: none), also copy the source rows there, row r at plain[r * plain_stride] (a
 * weight update writes the live weight and its packed copy from the new values at once). Then each group is first
 * copied row by row, which streams the rows from memory, and transposed right after from the cache (a group of 64
 * rows of a few thousand elements fits in L2); copying within the transpose's tiles instead read 64 rows and wrote 64
 * others at once, more streams than the prefetchers follow. */
#define DEFINE_TRANSPOSE(SFX, src_t, src_vec_t, elem_t, vec_t, SHIFT, TILE)                                          \
    static inline void transpose8_##SFX(const src_t *src, int64_t src_stride, elem_t *dst, int64_t column_stride) {  \
        vec_t r[8], t[8], u[8];                                                                                      \
        for (int i = 0; i < 8; i++) {                                                                                \
            src_vec_t row;                                                                                           \
            memcpy(&row, src + i * src_stride, sizeof row);                                                          \
            r[i] = __builtin_convertvector(row, vec_t) << SHIFT;                                                     \
        }                                                                                                            \
        for (int i = 0; i < 8; i += 2) { /* pairs of rows interleaved */                                             \
            t[i] = SHUFFLE(vec_t, r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);                                          \
            t[i + 1] = SHUFFLE(vec_t, r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);                                    \
        }                                                                                                            \
        for (int i = 0; i < 8; i += 4) { /* quads: each half holds one column of 4 rows */                           \
            u[i] = SHUFFLE(vec_t, t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);                                          \
            u[i + 1] = SHUFFLE(vec_t, t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);                                    \
            u[i + 2] = SHUFFLE(vec_t, t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);                                  \
            u[i + 3] = SHUFFLE(vec_t, t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);                                \
        }                                                                                                            \
        for (int c = 0; c < 4; c++) { /* the halves of rows 0-3 and 4-7 joined: columns c and c + 4 */               \
            const vec_t low = SHUFFLE(vec_t, u[c], u[c + 4], 0, 1, 2, 3, 8, 9, 10, 11);                               \
            const vec_t high = SHUFFLE(vec_t, u[c], u[c + 4], 4, 5, 6, 7, 12, 13, 14, 15);                            \
            memcpy(dst + c * column_stride, &low, sizeof(vec_t));                                                    \
            memcpy(dst + (c + 4) * column_stride, &high, sizeof(vec_t));                                             \
        }                                                                                                            \
    }                                                                                                                \
                                                                                                                     \
    static void transpose_tile_##SFX(const src_t *src, int64_t src_stride, elem_t *dst, int64_t group, int64_t cols,  \
                                     int64_t column_stride) {                                                        \
        const int64_t full_rows = group / 8 * 8, full_cols = cols / 8 * 8;                                           \
        for (int64_t c = 0; c < full_cols; c += 8)                                                                   \
            for (int64_t r = 0; r < full_rows; r += 8)                                                               \
                transpose8_##SFX(src + r * src_stride + c, src_stride, dst + c * column_stride + r, column_stride);   \
        for (int64_t c = 0; c < cols; c++) { /* what is left: the last rows of every column, the last columns */     \
            elem_t *out = dst + c * column_stride;                                                                   \
            for (int64_t r = c < full_cols ? full_rows : 0; r < group; r++)                                          \
                out[r] = (elem_t)((elem_t)src[r * src_stride + c] << SHIFT);                                         \
        }                                                                                                            \
    }                                                                                                                \
                                                                                                                     \
    static void transpose_group_##SFX(const src_t *src, int64_t src_stride, elem_t *dst, int64_t group, int64_t cols, \
                                      int64_t column_stride) {                                                       \
        for (int64_t c0 = 0; c0 < cols; c0 += TILE)                                                                  \
            transpose_tile_##SFX(src + c0, src_stride, dst + c0 * column_stride, group,                              \
                                 cols - c0 < TILE ? cols - c0 : TILE, column_stride);                                \
    }                                                                                                                \
                                                                                                                     \
    static void transpose_blocks_##SFX(const src_t *src, int64_t src_stride, elem_t *dst, int64_t blocks,            \
                                       int64_t group, int64_t cols, int64_t block_stride, int64_t column_stride,     \
                                       src_t *plain, int64_t plain_stride, int threads) {                            \
        (void)threads;                                                                                               \
        if (plain) {                                                                                                 \
            _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1 && blocks > 1)")        \
            for (int64_t b = 0; b < blocks; b++) {                                                                   \
                const src_t *rows = src + b * group * src_stride;                                                    \
                for (int64_t r = 0; r < group; r++)                                                                  \
                    memcpy(plain + (b * group + r) * plain_stride, rows + r * src_stride,                            \
                           (size_t)cols * sizeof(src_t));                                                            \
                transpose_group_##SFX(rows, src_stride, dst + b * block_stride, group, cols, column_stride);         \
            }                                                                                                        \
            return;                                                                                                  \
        }                                                                                                            \
        const int64_t tiles = (cols + TILE - 1) / TILE;                                                              \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1 && blocks * group * cols > 65536)") \
        for (int64_t item = 0; item < blocks * tiles; item++) {                                                      \
            const int64_t b = item / tiles, c0 = (item % tiles) * TILE;                                              \
            const int64_t n = cols - c0 < TILE ? cols - c0 : TILE;                                                   \
            transpose_tile_##SFX(src + b * group * src_stride + c0, src_stride,                                      \
                                 dst + b * block_stride + c0 * column_stride, group, n, column_stride);               \
        }                                                                                                            \
    }

DEFINE_TRANSPOSE(32, uint32_t, words8, uint32_t, words8, 0, 16)
DEFINE_TRANSPOSE(16, uint16_t, halves8, uint16_t, halves8, 0, 32)
DEFINE_TRANSPOSE(widen, uint16_t, halves8, uint32_t, words8, 16, 32)

/* Element (b, r, c) of the source, row b * group + r and column c, lies at src[(b * group + r) * src_stride + c]; it
 * goes to dst[b * block_stride + c * column_stride + r]. `src_bytes` / `dst_bytes`: 4 / 4 (fp32 values, bf16 pairs),
 * 2 / 2 (bf16), or 2 / 4 (bf16 values into the fp32 copy, widened). `plain` has the source's element width. */
void rollout_transpose_blocks(const void *src, int64_t src_stride, void *dst, int64_t blocks, int64_t group,
                              int64_t cols, int64_t block_stride, int64_t column_stride, void *plain,
                              int64_t plain_stride, int src_bytes, int dst_bytes, int threads) {
    if (src_bytes == 2 && dst_bytes == 4)
        transpose_blocks_widen((const uint16_t *)src, src_stride, (uint32_t *)dst, blocks, group, cols, block_stride,
                               column_stride, (uint16_t *)plain, plain_stride, threads);
    else if (src_bytes == 2)
        transpose_blocks_16((const uint16_t *)src, src_stride, (uint16_t *)dst, blocks, group, cols, block_stride,
                            column_stride, (uint16_t *)plain, plain_stride, threads);
    else
        transpose_blocks_32((const uint32_t *)src, src_stride, (uint32_t *)dst, blocks, group, cols, block_stride,
                            column_stride, (uint32_t *)plain, plain_stride, threads);
}
