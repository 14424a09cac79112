/* bf16 <-> fp32 for kvserve's C extensions (the paged-attention kernel and the fused ops):
 * widening is exact (the 16 bits become the top of an fp32), narrowing rounds to nearest even
 * as torch does, NaN stays a (quiet) NaN. Branch-free, so loops over them vectorize. */
#ifndef KVSERVE_BF16_H
#define KVSERVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t x)
{
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; /* to nearest even */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

#endif /* KVSERVE_BF16_H */
