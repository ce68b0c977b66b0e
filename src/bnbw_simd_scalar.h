/*
 * bnbw_simd_scalar.h - the element-at-a-time pieces every vector layer shares: whether a mask
 * element is active (a bool byte that is nonzero, or a value above +0, NaN not) and the copy
 * of the active elements of a run that does not fill a vector, strided or short.
 */
#ifndef BNBW_SIMD_SCALAR_H
#define BNBW_SIMD_SCALAR_H

#include <stdint.h>
#include <string.h>

#include "bnbw_half.h"
#include "bnbw_kernels.h"

/* Element e of a mask of type mdt (BNBW_BOOL, or the storage type of y). */
static inline int bnbw_mask_active(const void *mask, int64_t e, int mdt)
{
    if (mdt == BNBW_BOOL)
        return ((const unsigned char *)mask)[e] != 0;
    if (mdt == BNBW_F32) {
        float f;
        memcpy(&f, (const char *)mask + 4 * e, 4);
        return f > 0.0f;
    }
    uint16_t h;
    memcpy(&h, (const char *)mask + 2 * e, 2);
    return (mdt == BNBW_F16 ? bnbw_f16_to_f32((bnbw_f16){h}) : bnbw_bf16_to_f32((bnbw_bf16){h}))
           > 0.0f;
}

/* dst element e = src element e where the mask is active, +0 elsewhere, for the t elements
 * i..: the bits themselves, so a NaN's payload survives. */
static inline void bnbw_copy_active_elements(void *dst, int64_t dst_step, const void *src,
                                             int64_t src_step, const void *mask,
                                             int64_t mask_step, int64_t i, int64_t t, int dt,
                                             int mdt)
{
    const int64_t isz = BNBW_ITEMSIZE(dt);
    for (int64_t l = 0; l < t; ++l) {
        char *d = (char *)dst + (i + l) * dst_step * isz;
        if (bnbw_mask_active(mask, (i + l) * mask_step, mdt))
            memcpy(d, (const char *)src + (i + l) * src_step * isz, (size_t)isz);
        else
            memset(d, 0, (size_t)isz);
    }
}

#endif /* BNBW_SIMD_SCALAR_H */
