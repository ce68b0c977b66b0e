/*
 * bnbw_simd_neon.h - the kernels' vector layer on AArch64 Advanced SIMD (NEON): four q registers
 * (float32x4_t) per 16 f32 lanes, eight (float64x2_t) per 16 f64 lanes, predicates as four
 * uint32x4_t of all-ones or zero lanes.  Same operations, lanes and bits as
 * bnbw_simd_portable.h, which documents the interface.  Everything here is base ARMv8.0
 * AdvSIMD, which every AArch64 CPU has (src/body_neon.c).
 *
 *   vf lane l       q[l / 4] lane l % 4
 *   vd lane l       d[l / 2] lane l % 2: d[2k] widens the low half of q[k] (FCVTL), d[2k + 1]
 *                   its high half (FCVTL2), so a vw needs no shuffle and is a vf
 *   f16 <-> f32     FCVTL/FCVTL2 and FCVTN/FCVTN2.  Widening is exact (half subnormals are f32
 *                   normals; FPCR.FZ16 does not apply to conversions); narrowing rounds with
 *                   FPCR's mode, nearest-even unless a caller changed it, as every f32
 *                   operation of the kernels does.  Both quiet signalling NaNs, as F16C does in
 *                   the x86 bodies: NaN payloads are not kept through the kernels' arithmetic
 *                   anyway (bnbw_half.h's row converters, which must keep them, patch them).
 *   bf16 <-> f32    integer code: SHLL #16 widens; narrowing rounds nearest-even with CMGE and
 *                   one rounding add-high-narrow (RADDHN), NaNs made quiet with their sign.
 */
#ifndef BNBW_SIMD_NEON_H
#define BNBW_SIMD_NEON_H

#include <arm_neon.h>
#include <stdint.h>
#include <string.h>

#include "bnbw_half.h"
#include "bnbw_kernels.h"
#include "bnbw_simd_scalar.h"

#define BNBW_SIMD_BODY BNBW_BODY_NEON
/* Element order costs nothing here (LD1 + SHLL widens, RADDHN narrows in order), and the
 * even/odd split would cost a shift-and-insert per store: elementwise kernels keep order. */
#define BNBW_SIMD_BF16_EVEN_ODD 0
/* Packed short rows spread and add through arrays (bnbw_kernels_impl.h). */
#define BNBW_SIMD_PACKED_ROWS 0
/* Runs of 16 channels whose two f64 sums a row loop keeps in registers (32 q registers: one run's two sums take 16). */
#define BNBW_SIMD_SUM_RUNS 1
#define BNBW_INLINE static inline __attribute__((always_inline))

typedef struct { float32x4_t q[4]; } vf;
typedef struct { float64x2_t d[8]; } vd;
typedef struct { uint32x4_t q[4]; } vm;

#define V__Q(k) for (int k = 0; k < 4; ++k)
#define V__D(j) for (int j = 0; j < 8; ++j)

BNBW_INLINE vf vf_zero(void) { vf r; V__Q(k) r.q[k] = vdupq_n_f32(0.0f); return r; }
BNBW_INLINE vf vf_set1(float a) { vf r; V__Q(k) r.q[k] = vdupq_n_f32(a); return r; }
BNBW_INLINE vf vf_loadu(const float *p) { vf r; V__Q(k) r.q[k] = vld1q_f32(p + 4 * k); return r; }
/* Four stores, which the compiler pairs (STP): ST1 of four registers would need them
 * consecutive, and the register allocator moves the results into place for it. */
BNBW_INLINE void vf_storeu(float *p, vf a) { V__Q(k) vst1q_f32(p + 4 * k, a.q[k]); }
BNBW_INLINE vf vf_add(vf a, vf b) { V__Q(k) a.q[k] = vaddq_f32(a.q[k], b.q[k]); return a; }
BNBW_INLINE vf vf_sub(vf a, vf b) { V__Q(k) a.q[k] = vsubq_f32(a.q[k], b.q[k]); return a; }
BNBW_INLINE vf vf_mul(vf a, vf b) { V__Q(k) a.q[k] = vmulq_f32(a.q[k], b.q[k]); return a; }
/* a * b + c rounded once: FMLA, as the portable fmaf */
BNBW_INLINE vf vf_fma(vf a, vf b, vf c)
{
    V__Q(k) c.q[k] = vfmaq_f32(c.q[k], a.q[k], b.q[k]);
    return c;
}
/* the plain add and subtraction: AArch64 cores issue them on the pipes that multiply */
BNBW_INLINE vf vf_add_mp(vf a, vf b) { return vf_add(a, b); }
BNBW_INLINE vf vf_sub_mp(vf a, vf b) { return vf_sub(a, b); }

BNBW_INLINE vf vf_opaque(vf a) { V__Q(k) __asm__("" : "+w"(a.q[k])); return a; }
BNBW_INLINE vf vf_keep(vf a, vm m)
{
    V__Q(k) a.q[k] = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(a.q[k]), m.q[k]));
    return a;
}
BNBW_INLINE vf vf_select(vm m, vf a, vf b)
{
    V__Q(k) a.q[k] = vbslq_f32(m.q[k], a.q[k], b.q[k]);
    return a;
}

/* Lanes 4k.. of a vm: l < t. */
BNBW_INLINE vm vm_below(int64_t t)
{
    const int32_t k = t < 0 ? 0 : (t > 16 ? 16 : (int32_t)t);
    static const int32_t iota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vm r;
    V__Q(q) r.q[q] = vcltq_s32(vld1q_s32(iota + 4 * q), vdupq_n_s32(k));
    return r;
}
/* a - a is +0 for finite a and NaN otherwise: (a - a) + (b - b) == 0 when both are finite */
BNBW_INLINE vm vm_finite2(vf a, vf b)
{
    vm r;
    V__Q(k) r.q[k] = vceqzq_f32(vaddq_f32(vsubq_f32(a.q[k], a.q[k]), vsubq_f32(b.q[k], b.q[k])));
    return r;
}
/* the lanes a ReLU keeps: a > 0, or a NaN (which it passes on): not a <= 0 */
BNBW_INLINE vm vm_relu(vf a)
{
    vm r;
    V__Q(k) r.q[k] = vmvnq_u32(vclezq_f32(a.q[k]));
    return r;
}
BNBW_INLINE int vm_all(vm m)
{
    uint32x4_t a = vandq_u32(vandq_u32(m.q[0], m.q[1]), vandq_u32(m.q[2], m.q[3]));
    return vminvq_u32(a) == 0xffffffffu;
}

BNBW_INLINE vd vd_zero(void) { vd r; V__D(j) r.d[j] = vdupq_n_f64(0.0); return r; }
BNBW_INLINE vd vd_loadu(const double *p)
{
    float64x2x4_t a = vld1q_f64_x4(p), b = vld1q_f64_x4(p + 8);
    vd r = {{a.val[0], a.val[1], a.val[2], a.val[3], b.val[0], b.val[1], b.val[2], b.val[3]}};
    return r;
}
BNBW_INLINE void vd_storeu(double *p, vd a)
{
    float64x2x4_t lo = {{a.d[0], a.d[1], a.d[2], a.d[3]}}, hi = {{a.d[4], a.d[5], a.d[6], a.d[7]}};
    vst1q_f64_x4(p, lo);
    vst1q_f64_x4(p + 8, hi);
}
/* f64 lanes 4k, 4k+1 and 4k+2, 4k+3 of f32 register k */
#define V__WLO(v) vcvt_f64_f32(vget_low_f32(v))
#define V__WHI(v) vcvt_high_f64_f32(v)
BNBW_INLINE vd vd_add_f32(vd acc, vf a)
{
    V__Q(k) {
        acc.d[2 * k] = vaddq_f64(acc.d[2 * k], V__WLO(a.q[k]));
        acc.d[2 * k + 1] = vaddq_f64(acc.d[2 * k + 1], V__WHI(a.q[k]));
    }
    return acc;
}
/* The product of two widened f32 values is exact in f64: FMLA rounds once, where the portable
 * multiply-then-add does. */
BNBW_INLINE vd vd_fma_f32(vd acc, vf a, vf b)
{
    V__Q(k) {
        acc.d[2 * k] = vfmaq_f64(acc.d[2 * k], V__WLO(a.q[k]), V__WLO(b.q[k]));
        acc.d[2 * k + 1] = vfmaq_f64(acc.d[2 * k + 1], V__WHI(a.q[k]), V__WHI(b.q[k]));
    }
    return acc;
}
BNBW_INLINE vd vd_select(vm m, vd a, vd b)
{
    V__Q(k) {
        int32x4_t s = vreinterpretq_s32_u32(m.q[k]);
        uint64x2_t lo = vreinterpretq_u64_s64(vmovl_s32(vget_low_s32(s)));
        uint64x2_t hi = vreinterpretq_u64_s64(vmovl_high_s32(s));
        a.d[2 * k] = vbslq_f64(lo, a.d[2 * k], b.d[2 * k]);
        a.d[2 * k + 1] = vbslq_f64(hi, a.d[2 * k + 1], b.d[2 * k + 1]);
    }
    return a;
}
BNBW_INLINE vd vd_add(vd a, vd b) { V__D(j) a.d[j] = vaddq_f64(a.d[j], b.d[j]); return a; }
BNBW_INLINE vd vd_sub(vd a, vd b) { V__D(j) a.d[j] = vsubq_f64(a.d[j], b.d[j]); return a; }
BNBW_INLINE vd vd_mul(vd a, vd b) { V__D(j) a.d[j] = vmulq_f64(a.d[j], b.d[j]); return a; }
/* l += l + 8, l += l + 4, l += l + 2, l += l + 1 */
BNBW_INLINE double vd_fold(vd a)
{
    float64x2_t s0 = vaddq_f64(a.d[0], a.d[4]), s1 = vaddq_f64(a.d[1], a.d[5]);
    float64x2_t s2 = vaddq_f64(a.d[2], a.d[6]), s3 = vaddq_f64(a.d[3], a.d[7]);
    s0 = vaddq_f64(s0, s2);
    s1 = vaddq_f64(s1, s3);
    return vpaddd_f64(vaddq_f64(s0, s1));
}
/* lane l: a[l] + a[l ^ w] (w = 1, 2 or 4), the step of vd_fold within groups of 2w lanes */
BNBW_INLINE vd vd_add_partners(vd a, int w)
{
    vd r;
    V__D(j) r.d[j] = vaddq_f64(a.d[j], w == 1 ? vextq_f64(a.d[j], a.d[j], 1)
                                              : a.d[j ^ (w >> 1)]);
    return r;
}

/* vw: FCVTL and FCVTL2 widen the two halves of a q register in place: a vf as it is. */
typedef vf vw;
BNBW_INLINE vw vw_set1(float a) { return vf_set1(a); }
BNBW_INLINE vw vw_loadu(const float *p) { return vf_loadu(p); }
BNBW_INLINE vw vw_sub(vw a, vw b) { return vf_sub(a, b); }
BNBW_INLINE vw vw_keep(vw a, vm m) { return vf_keep(a, m); }
BNBW_INLINE vw vw_select(vm m, vw a, vw b) { return vf_select(m, a, b); }
BNBW_INLINE vd vd_add_w(vd acc, vw a) { return vd_add_f32(acc, a); }
BNBW_INLINE vd vd_fma_w(vd acc, vw a, vw b) { return vd_fma_f32(acc, a, b); }
/* the lanes of a as f64 (exact) */
BNBW_INLINE vd vd_widen(vw a)
{
    vd r;
    V__Q(k) {
        r.d[2 * k] = V__WLO(a.q[k]);
        r.d[2 * k + 1] = V__WHI(a.q[k]);
    }
    return r;
}

/* ---- rows ------------------------------------------------------------------------------ */

/* Two registers of 8 halves (lanes 0-7, 8-15) as 16 f32 lanes, exactly. */
BNBW_INLINE vf v__widen(uint16x8_t a, uint16x8_t b, int dt)
{
    vf r;
    if (dt == BNBW_F16) {
        float16x8_t ha = vreinterpretq_f16_u16(a), hb = vreinterpretq_f16_u16(b);
        r.q[0] = vcvt_f32_f16(vget_low_f16(ha));
        r.q[1] = vcvt_high_f32_f16(ha);
        r.q[2] = vcvt_f32_f16(vget_low_f16(hb));
        r.q[3] = vcvt_high_f32_f16(hb);
    } else {                       /* a bf16 is the high half of its f32 */
        r.q[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(a), 16));
        r.q[1] = vreinterpretq_f32_u32(vshll_high_n_u16(a, 16));
        r.q[2] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16));
        r.q[3] = vreinterpretq_f32_u32(vshll_high_n_u16(b, 16));
    }
    return r;
}

/* Whether any of the 16 lanes is a NaN: FMAX passes NaNs on (rare: one test for all). */
BNBW_INLINE int v__any_nan(vf a)
{
    float32x4_t m = vmaxq_f32(vmaxq_f32(a.q[0], a.q[1]), vmaxq_f32(a.q[2], a.q[3]));
    float s = vmaxvq_f32(m);
    return s != s;
}

/* 16 lanes as two registers of 8 halves (lanes 0-7, 8-15). */
BNBW_INLINE uint16x8x2_t v__narrow(vf a, int dt)
{
    uint16x8x2_t r;
    if (dt == BNBW_F16) {
        r.val[0] = vreinterpretq_u16_f16(vcvt_high_f16_f32(vcvt_f16_f32(a.q[0]), a.q[1]));
        r.val[1] = vreinterpretq_u16_f16(vcvt_high_f16_f32(vcvt_f16_f32(a.q[2]), a.q[3]));
        return r;
    }
    uint32x4_t x[4];
    V__Q(k) x[k] = vreinterpretq_u32_f32(a.q[k]);
    /* bnbw_half.h: CMGE and a rounding add-high-narrow per 4 lanes */
    r.val[0] = bnbw__bf16_round4_high(bnbw__bf16_round4(x[0]), x[1]);
    r.val[1] = bnbw__bf16_round4_high(bnbw__bf16_round4(x[2]), x[3]);
    if (__builtin_expect(v__any_nan(a), 0)) {     /* rare: one test for the 16 lanes */
        __asm__ volatile("");      /* a branch: computed always and selected, it costs more */
        V__Q(k) x[k] = bnbw__bf16_quiet4(a.q[k]);
        r.val[0] = bnbw__bf16_round4_high(bnbw__bf16_round4(x[0]), x[1]);
        r.val[1] = bnbw__bf16_round4_high(bnbw__bf16_round4(x[2]), x[3]);
    }
    return r;
}

/* Elements i.. `step` apart through a small buffer, lane l taking element v__element(l, eo). */
BNBW_INLINE int v__element_of(int l, int eo) { return eo ? (l < 8 ? 2 * l : 2 * (l - 8) + 1) : l; }

BNBW_INLINE vf v__load_contig(const void *row, int64_t i, int dt, int eo);

BNBW_INLINE vf v__gather16(const void *row, int64_t i, int64_t step, int dt, int eo)
{
    if (dt == BNBW_F32) {
        float buf[16];
        const float *p = (const float *)row + i * step;
        for (int l = 0; l < 16; ++l)
            memcpy(buf + l, p + v__element_of(l, eo) * step, 4);
        return vf_loadu(buf);
    }
    uint16_t buf[16];
    const uint16_t *p = (const uint16_t *)row + i * step;
    for (int l = 0; l < 16; ++l)
        memcpy(buf + l, p + v__element_of(l, eo) * step, 2);
    return v__load_contig(buf, 0, dt, 0);
}

/* 16 contiguous elements from element i: element order with LD1, even/odd with LD2, which
 * puts the even elements in its first register and the odd ones in its second. */
BNBW_INLINE vf v__load_contig(const void *row, int64_t i, int dt, int eo)
{
    if (dt == BNBW_F32) {
        const float *p = (const float *)row + i;
        if (!eo)
            return vf_loadu(p);
        float32x4x2_t a = vld2q_f32(p), b = vld2q_f32(p + 8);
        vf r = {{a.val[0], b.val[0], a.val[1], b.val[1]}};
        return r;
    }
    const uint16_t *p = (const uint16_t *)row + i;
    uint16x8x2_t h = eo ? vld2q_u16(p) : vld1q_u16_x2(p);
    return v__widen(h.val[0], h.val[1], dt);
}

BNBW_INLINE vf v_load(const void *row, int64_t i, int64_t step, int dt, int eo)
{
    if (step != 1)
        return v__gather16(row, i, step, dt, eo);
    return v__load_contig(row, i, dt, eo);
}

BNBW_INLINE void v_store(void *row, int64_t i, int64_t step, vf a, int dt, int eo)
{
    if (step == 1) {
        if (dt == BNBW_F32) {
            float *p = (float *)row + i;
            if (!eo) {
                vf_storeu(p, a);
            } else {               /* ST2 interleaves what LD2 split */
                float32x4x2_t lo = {{a.q[0], a.q[2]}}, hi = {{a.q[1], a.q[3]}};
                vst2q_f32(p, lo);
                vst2q_f32(p + 8, hi);
            }
        } else {
            uint16_t *p = (uint16_t *)row + i;
            uint16x8x2_t h = v__narrow(a, dt);
            if (eo) {
                vst2q_u16(p, h);
            } else {
                vst1q_u16(p, h.val[0]);
                vst1q_u16(p + 8, h.val[1]);
            }
        }
        return;
    }
    if (dt == BNBW_F32) {
        float buf[16];
        vf_storeu(buf, a);
        float *p = (float *)row + i * step;
        for (int l = 0; l < 16; ++l)
            memcpy(p + v__element_of(l, eo) * step, buf + l, 4);
        return;
    }
    uint16_t buf[16];
    vst1q_u16_x2(buf, v__narrow(a, dt));
    uint16_t *p = (uint16_t *)row + i * step;
    for (int l = 0; l < 16; ++l)
        memcpy(p + v__element_of(l, eo) * step, buf + l, 2);
}

/* The t < 16 elements i.. through a buffer: no load or store touches an element past them;
 * lanes t.. load as +0 and are never stored. */
BNBW_INLINE vf v_load_part(const void *row, int64_t i, int64_t t, int64_t step, int dt)
{
    if (dt == BNBW_F32) {
        float buf[16] = {0};
        const float *p = (const float *)row + i * step;
        for (int64_t l = 0; l < t && l < 16; ++l)
            memcpy(buf + l, p + l * step, 4);
        return vf_loadu(buf);
    }
    uint16_t buf[16] = {0};
    const uint16_t *p = (const uint16_t *)row + i * step;
    for (int64_t l = 0; l < t && l < 16; ++l)
        memcpy(buf + l, p + l * step, 2);
    return v__load_contig(buf, 0, dt, 0);
}

BNBW_INLINE void v_store_part(void *row, int64_t i, int64_t t, int64_t step, vf a, int dt)
{
    if (dt == BNBW_F32) {
        float buf[16];
        vf_storeu(buf, a);
        float *p = (float *)row + i * step;
        for (int64_t l = 0; l < t && l < 16; ++l)
            memcpy(p + l * step, buf + l, 4);
        return;
    }
    uint16_t buf[16];
    vst1q_u16_x2(buf, v__narrow(a, dt));
    uint16_t *p = (uint16_t *)row + i * step;
    for (int64_t l = 0; l < t && l < 16; ++l)
        memcpy(p + l * step, buf + l, 2);
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

/* ---- the ReLU mask ---------------------------------------------------------------------- */

/* Byte indices that spread byte e of 16 over the four bytes of lane l (element or even/odd
 * order): TBL builds each 32-bit lane mask from the byte masks in one instruction. */
static const uint8_t v__spread[2][4][16] = {
    {{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
     {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
     {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11},
     {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15}},
    {{0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6},
     {8, 8, 8, 8, 10, 10, 10, 10, 12, 12, 12, 12, 14, 14, 14, 14},
     {1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7},
     {9, 9, 9, 9, 11, 11, 11, 11, 13, 13, 13, 13, 15, 15, 15, 15}}};

/* 16 bool bytes (element order) as lane masks, in element or even/odd order. */
BNBW_INLINE vm v__bool_lanes(uint8x16_t b, int eo)
{
    uint8x16_t on = vtstq_u8(b, b);
    vm r;
    V__Q(k) r.q[k] = vreinterpretq_u32_u8(vqtbl1q_u8(on, vld1q_u8(v__spread[eo][k])));
    return r;
}

BNBW_INLINE vm v__positive(vf a)
{
    vm r;
    V__Q(k) r.q[k] = vcgtzq_f32(a.q[k]);     /* NaN is not > 0 */
    return r;
}

BNBW_INLINE vm v_active(const void *mask, int64_t i, int64_t step, int mdt, int eo)
{
    if (mdt != BNBW_BOOL)
        return v__positive(v_load(mask, i, step, mdt, eo));
    const unsigned char *p = (const unsigned char *)mask;
    if (step == 1)
        return v__bool_lanes(vld1q_u8(p + i), eo);
    unsigned char buf[16];
    for (int l = 0; l < 16; ++l)
        buf[l] = p[(i + l) * step];
    return v__bool_lanes(vld1q_u8(buf), eo);
}

BNBW_INLINE vm v_active_part(const void *mask, int64_t i, int64_t t, int64_t step, int mdt)
{
    if (mdt != BNBW_BOOL)
        return v__positive(v_load_part(mask, i, t, step, mdt));
    unsigned char buf[16] = {0};
    for (int64_t l = 0; l < t && l < 16; ++l)
        buf[l] = ((const unsigned char *)mask)[(i + l) * step];
    return v__bool_lanes(vld1q_u8(buf), 0);
}

/* dst = src where active, +0 elsewhere, for the t <= 16 elements i.. (the bits themselves). */
BNBW_INLINE void v_copy_active(void *dst, int64_t dst_step, const void *src, int64_t src_step,
                               const void *mask, int64_t mask_step, int64_t i, int64_t t,
                               int dt, int mdt)
{
    if (t == 16 && dst_step == 1 && src_step == 1 && mask_step == 1) {
        if (dt == BNBW_F32) {
            vm on = v_active(mask, i, 1, mdt, 0);
            uint32x4x4_t s = vld1q_u32_x4((const uint32_t *)src + i);
            V__Q(k) s.val[k] = vandq_u32(s.val[k], on.q[k]);
            vst1q_u32_x4((uint32_t *)dst + i, s);
            return;
        }
        uint16x8_t lo, hi;         /* 16-bit lane masks */
        if (mdt == BNBW_BOOL) {
            uint8x16_t b = vld1q_u8((const unsigned char *)mask + i), on = vtstq_u8(b, b);
            lo = vreinterpretq_u16_u8(vzip1q_u8(on, on));
            hi = vreinterpretq_u16_u8(vzip2q_u8(on, on));
        } else {
            vm on = v_active(mask, i, 1, mdt, 0);
            lo = vuzp1q_u16(vreinterpretq_u16_u32(on.q[0]), vreinterpretq_u16_u32(on.q[1]));
            hi = vuzp1q_u16(vreinterpretq_u16_u32(on.q[2]), vreinterpretq_u16_u32(on.q[3]));
        }
        uint16x8x2_t s = vld1q_u16_x2((const uint16_t *)src + i);
        s.val[0] = vandq_u16(s.val[0], lo);
        s.val[1] = vandq_u16(s.val[1], hi);
        vst1q_u16_x2((uint16_t *)dst + i, s);
        return;
    }
    bnbw_copy_active_elements(dst, dst_step, src, src_step, mask, mask_step, i, t, dt, mdt);
}

/* A streamed line is stored plainly: STNP's non-temporal hint is left for a change measured on
 * Arm hardware.  The same bits either way. */
BNBW_INLINE void vf_stream(float *p, vf a) { vf_storeu(p, a); }
BNBW_INLINE void v_stream_fence(void) {}

/* Leaving a kernel: nothing to clean up. */
BNBW_INLINE void v_leave(void) {}

#endif /* BNBW_SIMD_NEON_H */
