/*
 * bnbw_simd_portable.h - the kernels' vector layer in plain C: the definition every other layer
 * (bnbw_simd_avx2.h, bnbw_simd_avx512.h) must match lane for lane and bit for bit.
 *
 *   vf   16 f32 lanes        vd   16 f64 lanes (lane l of a vd widens lane l of a vf)
 *   vm   16 lane predicates
 *   vw   16 f32 lanes held the way the layer widens them to f64 cheapest (the exact sums)
 *
 * Rows.  v_load(row, i, step, dt, eo) reads elements i..i+15 of a row of storage type dt whose
 * element e lies at row + e * step elements; eo = 0 puts element i + l in lane l, eo = 1 the
 * even elements i, i+2, .., i+14 in lanes 0-7 and the odd ones in lanes 8-15.  v_store writes
 * them back the same way, rounding to nearest even.  The *_part forms take only t < 16
 * elements: lanes t.. load as +0 and are never stored.  Halves convert exactly as bnbw_half.h's
 * scalar functions, so results never depend on the conversion instructions of a body.
 *
 * The ReLU mask: v_active gives the lanes whose mask element is active - a nonzero bool, or a
 * value > 0 (NaN is not) - in the same lane order as v_load.
 */
#ifndef BNBW_SIMD_PORTABLE_H
#define BNBW_SIMD_PORTABLE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bnbw_half.h"
#include "bnbw_kernels.h"

#define BNBW_SIMD_BODY BNBW_BODY_PORTABLE
/* Lane order the elementwise kernels use for contiguous bf16 rows (see bnbw_simd_avx2.h). */
#define BNBW_SIMD_BF16_EVEN_ODD 0
#define BNBW_INLINE static inline

typedef struct { float v[16]; } vf;
typedef struct { double v[16]; } vd;
typedef struct { unsigned char v[16]; } vm;

#define BNBW__LANES(l) for (int l = 0; l < 16; ++l)

/* Element e of a vector loaded with lane order eo. */
BNBW_INLINE int v__element(int l, int eo) { return eo ? (l < 8 ? 2 * l : 2 * (l - 8) + 1) : l; }

BNBW_INLINE vf vf_zero(void) { vf r; BNBW__LANES(l) r.v[l] = 0.0f; return r; }
BNBW_INLINE vf vf_set1(float a) { vf r; BNBW__LANES(l) r.v[l] = a; return r; }
BNBW_INLINE vf vf_loadu(const float *p) { vf r; memcpy(r.v, p, sizeof r.v); return r; }
BNBW_INLINE void vf_storeu(float *p, vf a) { memcpy(p, a.v, sizeof a.v); }
BNBW_INLINE vf vf_add(vf a, vf b) { BNBW__LANES(l) a.v[l] += b.v[l]; return a; }
BNBW_INLINE vf vf_sub(vf a, vf b) { BNBW__LANES(l) a.v[l] -= b.v[l]; return a; }
BNBW_INLINE vf vf_mul(vf a, vf b) { BNBW__LANES(l) a.v[l] *= b.v[l]; return a; }
/* a * b + c, rounded once */
BNBW_INLINE vf vf_fma(vf a, vf b, vf c) { BNBW__LANES(l) a.v[l] = fmaf(a.v[l], b.v[l], c.v[l]); return a; }
/* a + b and a - b, which other bodies may issue on their multiply pipes (same bits) */
BNBW_INLINE vf vf_add_mp(vf a, vf b) { return vf_add(a, b); }
BNBW_INLINE vf vf_sub_mp(vf a, vf b) { return vf_sub(a, b); }
/* a, as a value the compiler must hold whole in a register (other bodies) */
BNBW_INLINE vf vf_opaque(vf a) { return a; }
BNBW_INLINE vf vf_keep(vf a, vm m) { BNBW__LANES(l) if (!m.v[l]) a.v[l] = 0.0f; return a; }
BNBW_INLINE vf vf_select(vm m, vf a, vf b) { BNBW__LANES(l) if (!m.v[l]) a.v[l] = b.v[l]; return a; }

BNBW_INLINE vm vm_below(int64_t t) { vm r; BNBW__LANES(l) r.v[l] = l < t; return r; }
BNBW_INLINE vm vm_finite2(vf a, vf b)
{
    vm r;
    BNBW__LANES(l) r.v[l] = a.v[l] - a.v[l] == 0.0f && b.v[l] - b.v[l] == 0.0f;
    return r;
}
BNBW_INLINE int vm_all(vm m) { int all = 1; BNBW__LANES(l) all &= m.v[l]; return all; }
/* the lanes a ReLU keeps: a > 0, or a NaN (which it passes on) */
BNBW_INLINE vm vm_relu(vf a)
{
    vm r;
    BNBW__LANES(l) r.v[l] = a.v[l] > 0.0f || a.v[l] != a.v[l];
    return r;
}

BNBW_INLINE vd vd_zero(void) { vd r; BNBW__LANES(l) r.v[l] = 0.0; return r; }
BNBW_INLINE vd vd_loadu(const double *p) { vd r; memcpy(r.v, p, sizeof r.v); return r; }
BNBW_INLINE void vd_storeu(double *p, vd a) { memcpy(p, a.v, sizeof a.v); }
BNBW_INLINE vd vd_add_f32(vd acc, vf a) { BNBW__LANES(l) acc.v[l] += (double)a.v[l]; return acc; }
/* acc + a * b with the product exact in f64: one rounding */
BNBW_INLINE vd vd_fma_f32(vd acc, vf a, vf b)
{
    BNBW__LANES(l) acc.v[l] += (double)a.v[l] * (double)b.v[l];
    return acc;
}
BNBW_INLINE vd vd_select(vm m, vd a, vd b) { BNBW__LANES(l) if (!m.v[l]) a.v[l] = b.v[l]; return a; }
BNBW_INLINE vd vd_add(vd a, vd b) { BNBW__LANES(l) a.v[l] += b.v[l]; return a; }
BNBW_INLINE vd vd_sub(vd a, vd b) { BNBW__LANES(l) a.v[l] -= b.v[l]; return a; }
BNBW_INLINE vd vd_mul(vd a, vd b) { BNBW__LANES(l) a.v[l] *= b.v[l]; return a; }
/* lanes folded pairwise: l += l + 8, l += l + 4, l += l + 2, l += l + 1 */
BNBW_INLINE double vd_fold(vd a)
{
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; ++l)
            a.v[l] += a.v[l + w];
    return a.v[0];
}

/* vw: the same values as vf, in registers each body widens without shuffles. */
typedef vf vw;
BNBW_INLINE vw vw_set1(float a) { return vf_set1(a); }
BNBW_INLINE vw vw_loadu(const float *p) { return vf_loadu(p); }
BNBW_INLINE vw vw_sub(vw a, vw b) { return vf_sub(a, b); }
BNBW_INLINE vw vw_keep(vw a, vm m) { return vf_keep(a, m); }
BNBW_INLINE vw vw_select(vm m, vw a, vw b) { return vf_select(m, a, b); }
BNBW_INLINE vd vd_add_w(vd acc, vw a) { return vd_add_f32(acc, a); }
BNBW_INLINE vd vd_fma_w(vd acc, vw a, vw b) { return vd_fma_f32(acc, a, b); }
/* the lanes of a as f64 (exact) */
BNBW_INLINE vd vd_widen(vw a) { vd r; BNBW__LANES(l) r.v[l] = (double)a.v[l]; return r; }

/* ---- rows ------------------------------------------------------------------------------ */

BNBW_INLINE float v__get(const void *row, int64_t e, int dt)
{
    const char *p = (const char *)row;
    if (dt == BNBW_F32) {
        float f;
        memcpy(&f, p + 4 * e, 4);
        return f;
    }
    uint16_t bits;
    memcpy(&bits, p + 2 * e, 2);
    if (dt == BNBW_F16) {
        bnbw_f16 h = {bits};
        return bnbw_f16_to_f32(h);
    }
    bnbw_bf16 b = {bits};
    return bnbw_bf16_to_f32(b);
}

BNBW_INLINE void v__put(void *row, int64_t e, int dt, float v)
{
    char *p = (char *)row;
    if (dt == BNBW_F32) {
        memcpy(p + 4 * e, &v, 4);
        return;
    }
    uint16_t bits = dt == BNBW_F16 ? bnbw_f32_to_f16(v).bits : bnbw_f32_to_bf16(v).bits;
    memcpy(p + 2 * e, &bits, 2);
}

BNBW_INLINE vf v_load(const void *row, int64_t i, int64_t step, int dt, int eo)
{
    vf r;
    BNBW__LANES(l) r.v[l] = v__get(row, (i + v__element(l, eo)) * step, dt);
    return r;
}

BNBW_INLINE void v_store(void *row, int64_t i, int64_t step, vf a, int dt, int eo)
{
    BNBW__LANES(l) v__put(row, (i + v__element(l, eo)) * step, dt, a.v[l]);
}

BNBW_INLINE vf v_load_part(const void *row, int64_t i, int64_t t, int64_t step, int dt)
{
    vf r = vf_zero();
    for (int64_t l = 0; l < t; ++l)
        r.v[l] = v__get(row, (i + l) * step, dt);
    return r;
}

BNBW_INLINE void v_store_part(void *row, int64_t i, int64_t t, int64_t step, vf a, int dt)
{
    for (int64_t l = 0; l < t; ++l)
        v__put(row, (i + l) * step, dt, a.v[l]);
}

/* Elements i.. (element order) as a vw. */
BNBW_INLINE vw vw_load(const void *row, int64_t i, int64_t step, int dt)
{
    return v_load(row, i, step, dt, 0);
}
BNBW_INLINE vw vw_load_part(const void *row, int64_t i, int64_t t, int64_t step, int dt)
{
    return v_load_part(row, i, t, step, dt);
}

BNBW_INLINE int v__active(const void *mask, int64_t e, int mdt)
{
    if (mdt == BNBW_BOOL)
        return ((const unsigned char *)mask)[e] != 0;
    return v__get(mask, e, mdt) > 0.0f;
}

BNBW_INLINE vm v_active(const void *mask, int64_t i, int64_t step, int mdt, int eo)
{
    vm r;
    BNBW__LANES(l) r.v[l] = (unsigned char)v__active(mask, (i + v__element(l, eo)) * step, mdt);
    return r;
}

BNBW_INLINE vm v_active_part(const void *mask, int64_t i, int64_t t, int64_t step, int mdt)
{
    vm r;
    BNBW__LANES(l) r.v[l] = (unsigned char)(l < t && v__active(mask, (i + l) * step, mdt));
    return r;
}

/* dst element e = src element e where the mask is active, +0 elsewhere, for the t <= 16
 * elements i..: the bits themselves, so a NaN's payload survives. */
BNBW_INLINE void v_copy_active(void *dst, int64_t dst_step, const void *src, int64_t src_step,
                               const void *mask, int64_t mask_step, int64_t i, int64_t t,
                               int dt, int mdt)
{
    int64_t isz = dt == BNBW_F32 ? 4 : 2;
    for (int64_t l = 0; l < t; ++l) {
        char *d = (char *)dst + (i + l) * dst_step * isz;
        if (v__active(mask, (i + l) * mask_step, mdt))
            memcpy(d, (const char *)src + (i + l) * src_step * isz, (size_t)isz);
        else
            memset(d, 0, (size_t)isz);
    }
}

/* Leaving a kernel: nothing to clean up. */
BNBW_INLINE void v_leave(void) {}

#endif /* BNBW_SIMD_PORTABLE_H */
