/* What the C kernels share: the dtype codes kernel.py passes (DTYPES) and bf16 <-> fp32 conversions that give
 * torch's bits. Included by the .c files of this folder; kernel.py hashes it with them. */
#ifndef ROLLOUT_BF16_H
#define ROLLOUT_BF16_H

#include <stdint.h>
#include <string.h>

#define DTYPE_F32 0
#define DTYPE_BF16 1

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch does; a NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

#endif
