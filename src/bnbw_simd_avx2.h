/*
 * bnbw_simd_avx2.h - the kernels' vector layer on x86 AVX2 + FMA + F16C: two ymm registers per
 * 16 f32 lanes (lanes 0-7, 8-15), four per 16 f64 lanes.  Same operations, lanes and bits as
 * bnbw_simd_portable.h, which documents the interface.  Compiled only in a translation unit
 * whose functions target these instructions (src/body_avx2.c).
 */
#ifndef BNBW_SIMD_AVX2_H
#define BNBW_SIMD_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bnbw_half.h"
#include "bnbw_kernels.h"
#include "bnbw_simd_scalar.h"

#define BNBW_SIMD_BODY BNBW_BODY_AVX2
/* Contiguous bf16 rows load cheapest as even and odd elements (a shift and a mask of one load,
 * no widening shuffle), so the elementwise kernels take them in that order. */
#define BNBW_SIMD_BF16_EVEN_ODD 1
/* Packed short rows (bnbw_kernels_impl.h) take their per-row constants and add their
 * row sums by this layer's permutes: vf_spread, vw_spread, vd_add_group_sums. */
#define BNBW_SIMD_PACKED_ROWS 1
/* Runs of 16 channels whose two f64 sums a row loop keeps in registers (16 ymm: one run's two sums take 8). */
#define BNBW_SIMD_SUM_RUNS 1
#define BNBW_INLINE static inline __attribute__((always_inline))

typedef struct { __m256 lo, hi; } vf;               /* lanes 0-7, 8-15 */
typedef struct { __m256d a, b, c, d; } vd;           /* lanes 0-3, 4-7, 8-11, 12-15 */
typedef struct { __m256 lo, hi; } vm;               /* all bits set in active lanes */

BNBW_INLINE vf v__vf(__m256 lo, __m256 hi) { vf r = {lo, hi}; return r; }
BNBW_INLINE vf vf_zero(void) { return v__vf(_mm256_setzero_ps(), _mm256_setzero_ps()); }
BNBW_INLINE vf vf_set1(float a) { return v__vf(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
BNBW_INLINE vf vf_loadu(const float *p) { return v__vf(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
BNBW_INLINE void vf_storeu(float *p, vf a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
BNBW_INLINE vf vf_add(vf a, vf b) { return v__vf(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
BNBW_INLINE vf vf_sub(vf a, vf b) { return v__vf(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
BNBW_INLINE vf vf_mul(vf a, vf b) { return v__vf(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
BNBW_INLINE vf vf_fma(vf a, vf b, vf c)
{
    return v__vf(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}

/* v, as a value the compiler cannot see through or split. */
BNBW_INLINE __m256 v__opaque(__m256 v) { __asm__("" : "+x"(v)); return v; }
BNBW_INLINE vf vf_opaque(vf a) { return v__vf(v__opaque(a.lo), v__opaque(a.hi)); }

/* a + b and a - b as fma(a, 1, b) and fmsub(a, 1, b) with a 1.0 the compiler cannot fold:
 * a * 1 is exact, so they round exactly as the add and the subtraction (NaNs included), but run
 * on the multiply pipes.  Zen 4 issues adds, shifts and the f16 conversions on the same two
 * pipes, which bound the half kernels. */
BNBW_INLINE vf vf_add_mp(vf a, vf b)
{
    __m256 one = v__opaque(_mm256_set1_ps(1.0f));
    return v__vf(_mm256_fmadd_ps(a.lo, one, b.lo), _mm256_fmadd_ps(a.hi, one, b.hi));
}
BNBW_INLINE vf vf_sub_mp(vf a, vf b)
{
    __m256 one = v__opaque(_mm256_set1_ps(1.0f));
    return v__vf(_mm256_fmsub_ps(a.lo, one, b.lo), _mm256_fmsub_ps(a.hi, one, b.hi));
}

BNBW_INLINE vf vf_keep(vf a, vm m) { return v__vf(_mm256_and_ps(a.lo, m.lo), _mm256_and_ps(a.hi, m.hi)); }
BNBW_INLINE vf vf_select(vm m, vf a, vf b)
{
    return v__vf(_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi));
}

/* Mask of the 32-bit lanes l < t of 8 (any t). */
BNBW_INLINE __m256i v__lanes_below(int64_t t)
{
    int k = t < 0 ? 0 : (t > 8 ? 8 : (int)t);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
BNBW_INLINE vm vm_below(int64_t t)
{
    vm r = {_mm256_castsi256_ps(v__lanes_below(t)), _mm256_castsi256_ps(v__lanes_below(t - 8))};
    return r;
}
BNBW_INLINE __m256 v__finite2(__m256 a, __m256 b)
{
    __m256 z = _mm256_add_ps(_mm256_sub_ps(a, a), _mm256_sub_ps(b, b));
    return _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_EQ_OQ);
}
BNBW_INLINE vm vm_finite2(vf a, vf b)
{
    vm r = {v__finite2(a.lo, b.lo), v__finite2(a.hi, b.hi)};
    return r;
}
BNBW_INLINE int vm_all(vm m) { return _mm256_movemask_ps(_mm256_and_ps(m.lo, m.hi)) == 0xff; }
/* a > 0 or unordered: not (a <= 0), quiet */
BNBW_INLINE vm vm_relu(vf a)
{
    vm r = {_mm256_cmp_ps(a.lo, _mm256_setzero_ps(), _CMP_NLE_UQ),
            _mm256_cmp_ps(a.hi, _mm256_setzero_ps(), _CMP_NLE_UQ)};
    return r;
}

BNBW_INLINE vd v__vd(__m256d a, __m256d b, __m256d c, __m256d d) { vd r = {a, b, c, d}; return r; }
BNBW_INLINE vd vd_zero(void)
{
    __m256d z = _mm256_setzero_pd();
    return v__vd(z, z, z, z);
}
BNBW_INLINE vd vd_loadu(const double *p)
{
    return v__vd(_mm256_loadu_pd(p), _mm256_loadu_pd(p + 4), _mm256_loadu_pd(p + 8),
                 _mm256_loadu_pd(p + 12));
}
BNBW_INLINE void vd_storeu(double *p, vd a)
{
    _mm256_storeu_pd(p, a.a); _mm256_storeu_pd(p + 4, a.b);
    _mm256_storeu_pd(p + 8, a.c); _mm256_storeu_pd(p + 12, a.d);
}
#define V__WIDEN_LO(v) _mm256_cvtps_pd(_mm256_castps256_ps128(v))
#define V__WIDEN_HI(v) _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))
BNBW_INLINE vd vd_add_f32(vd acc, vf a)
{
    return v__vd(_mm256_add_pd(acc.a, V__WIDEN_LO(a.lo)), _mm256_add_pd(acc.b, V__WIDEN_HI(a.lo)),
                 _mm256_add_pd(acc.c, V__WIDEN_LO(a.hi)), _mm256_add_pd(acc.d, V__WIDEN_HI(a.hi)));
}
/* The product of two widened f32 values is exact in f64, so one fused multiply-add rounds
 * exactly where the portable multiply-then-add does. */
BNBW_INLINE vd vd_fma_f32(vd acc, vf a, vf b)
{
    return v__vd(_mm256_fmadd_pd(V__WIDEN_LO(a.lo), V__WIDEN_LO(b.lo), acc.a),
                 _mm256_fmadd_pd(V__WIDEN_HI(a.lo), V__WIDEN_HI(b.lo), acc.b),
                 _mm256_fmadd_pd(V__WIDEN_LO(a.hi), V__WIDEN_LO(b.hi), acc.c),
                 _mm256_fmadd_pd(V__WIDEN_HI(a.hi), V__WIDEN_HI(b.hi), acc.d));
}
#define V__MASK_LO(k) _mm256_castsi256_pd(_mm256_cvtepi32_epi64(                          \
                          _mm256_castsi256_si128(_mm256_castps_si256(k))))
#define V__MASK_HI(k) _mm256_castsi256_pd(_mm256_cvtepi32_epi64(                          \
                          _mm256_extracti128_si256(_mm256_castps_si256(k), 1)))
BNBW_INLINE vd vd_select(vm m, vd a, vd b)
{
    return v__vd(_mm256_blendv_pd(b.a, a.a, V__MASK_LO(m.lo)),
                 _mm256_blendv_pd(b.b, a.b, V__MASK_HI(m.lo)),
                 _mm256_blendv_pd(b.c, a.c, V__MASK_LO(m.hi)),
                 _mm256_blendv_pd(b.d, a.d, V__MASK_HI(m.hi)));
}
BNBW_INLINE vd vd_add(vd x, vd y)
{
    return v__vd(_mm256_add_pd(x.a, y.a), _mm256_add_pd(x.b, y.b), _mm256_add_pd(x.c, y.c),
                 _mm256_add_pd(x.d, y.d));
}
BNBW_INLINE vd vd_sub(vd x, vd y)
{
    return v__vd(_mm256_sub_pd(x.a, y.a), _mm256_sub_pd(x.b, y.b), _mm256_sub_pd(x.c, y.c),
                 _mm256_sub_pd(x.d, y.d));
}
BNBW_INLINE vd vd_mul(vd x, vd y)
{
    return v__vd(_mm256_mul_pd(x.a, y.a), _mm256_mul_pd(x.b, y.b), _mm256_mul_pd(x.c, y.c),
                 _mm256_mul_pd(x.d, y.d));
}
BNBW_INLINE double vd_fold(vd a)
{
    __m256d s = _mm256_add_pd(_mm256_add_pd(a.a, a.c), _mm256_add_pd(a.b, a.d));
    __m128d q = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    return _mm_cvtsd_f64(_mm_add_sd(q, _mm_unpackhi_pd(q, q)));
}
/* lane l: a[l] + a[l ^ w] (w = 1, 2 or 4), the step of vd_fold within groups of 2w lanes */
BNBW_INLINE vd vd_add_partners(vd a, int w)
{
    if (w == 1)
        return vd_add(a, v__vd(_mm256_permute_pd(a.a, 0x5), _mm256_permute_pd(a.b, 0x5),
                               _mm256_permute_pd(a.c, 0x5), _mm256_permute_pd(a.d, 0x5)));
    if (w == 2)
        return vd_add(a, v__vd(_mm256_permute2f128_pd(a.a, a.a, 0x01),
                               _mm256_permute2f128_pd(a.b, a.b, 0x01),
                               _mm256_permute2f128_pd(a.c, a.c, 0x01),
                               _mm256_permute2f128_pd(a.d, a.d, 0x01)));
    return vd_add(a, v__vd(a.b, a.a, a.d, a.c));
}
/* sums[2g] += a[g << s], sums[2g + 1] += b[g << s] for the 16 >> s groups (s = 1 or 2) */
BNBW_INLINE void vd_add_group_sums(vd a, vd b, int s, double *sums)
{
    __m256d p[4] = {_mm256_unpacklo_pd(a.a, b.a), _mm256_unpacklo_pd(a.b, b.b),
                    _mm256_unpacklo_pd(a.c, b.c), _mm256_unpacklo_pd(a.d, b.d)};
    if (s == 1) {           /* quarter k: groups 2k, 2k + 1 */
        for (int k = 0; k < 4; ++k)
            _mm256_storeu_pd(sums + 4 * k, _mm256_add_pd(_mm256_loadu_pd(sums + 4 * k), p[k]));
        return;
    }
    for (int k = 0; k < 2; ++k) {   /* group k of each quarter's low half */
        __m256d two = _mm256_permute2f128_pd(p[2 * k], p[2 * k + 1], 0x20);
        _mm256_storeu_pd(sums + 4 * k, _mm256_add_pd(_mm256_loadu_pd(sums + 4 * k), two));
    }
}

/* vw: 16 f32 lanes as four 128-bit quarters, each widened by one conversion (no extract:
 * the exact sums were bound by the shuffle port that the extracts share with them). */
typedef struct { __m128 q[4]; } vw;
#define V__QUARTERS(k) for (int k = 0; k < 4; ++k)
BNBW_INLINE vw vw_set1(float a) { vw r; V__QUARTERS(k) r.q[k] = _mm_set1_ps(a); return r; }
BNBW_INLINE vw vw_loadu(const float *p) { vw r; V__QUARTERS(k) r.q[k] = _mm_loadu_ps(p + 4 * k); return r; }
/* lane l: c[l >> s] (s = 1 to 4), reading c[0 .. 16 >> s) only */
BNBW_INLINE vf vf_spread(const float *c, int s)
{
    if (s >= 3)             /* one constant a half: broadcasts, no shuffle */
        return v__vf(_mm256_set1_ps(c[0]), _mm256_set1_ps(c[s == 3]));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i shift = _mm256_set1_epi32(s);
    __m256 v = _mm256_maskload_ps(c, _mm256_cmpgt_epi32(_mm256_set1_epi32(16 >> s), lane));
    return v__vf(_mm256_permutevar8x32_ps(v, _mm256_srlv_epi32(lane, shift)),
                 _mm256_permutevar8x32_ps(v, _mm256_srlv_epi32(
                     _mm256_add_epi32(lane, _mm256_set1_epi32(8)), shift)));
}
BNBW_INLINE vw vw_spread(const float *c, int s)
{
    vw r;
    if (s >= 2) {           /* one constant a quarter */
        V__QUARTERS(k) r.q[k] = _mm_set1_ps(c[k >> (s - 2)]);
        return r;
    }
    vf v = vf_spread(c, s);
    r.q[0] = _mm256_castps256_ps128(v.lo);
    r.q[1] = _mm256_extractf128_ps(v.lo, 1);
    r.q[2] = _mm256_castps256_ps128(v.hi);
    r.q[3] = _mm256_extractf128_ps(v.hi, 1);
    return r;
}
BNBW_INLINE vw vw_sub(vw a, vw b) { V__QUARTERS(k) a.q[k] = _mm_sub_ps(a.q[k], b.q[k]); return a; }
/* the lanes of a vm as 4 quarter masks */
BNBW_INLINE void v__quarter_masks(vm m, __m128 q[4])
{
    q[0] = _mm256_castps256_ps128(m.lo);
    q[1] = _mm256_extractf128_ps(m.lo, 1);
    q[2] = _mm256_castps256_ps128(m.hi);
    q[3] = _mm256_extractf128_ps(m.hi, 1);
}
BNBW_INLINE vw vw_keep(vw a, vm m)
{
    __m128 q[4];
    v__quarter_masks(m, q);
    V__QUARTERS(k) a.q[k] = _mm_and_ps(a.q[k], q[k]);
    return a;
}
BNBW_INLINE vw vw_select(vm m, vw a, vw b)
{
    __m128 q[4];
    v__quarter_masks(m, q);
    V__QUARTERS(k) a.q[k] = _mm_blendv_ps(b.q[k], a.q[k], q[k]);
    return a;
}
BNBW_INLINE vd vd_add_w(vd acc, vw a)
{
    return v__vd(_mm256_add_pd(acc.a, _mm256_cvtps_pd(a.q[0])),
                 _mm256_add_pd(acc.b, _mm256_cvtps_pd(a.q[1])),
                 _mm256_add_pd(acc.c, _mm256_cvtps_pd(a.q[2])),
                 _mm256_add_pd(acc.d, _mm256_cvtps_pd(a.q[3])));
}
BNBW_INLINE vd vd_fma_w(vd acc, vw a, vw b)
{
    return v__vd(_mm256_fmadd_pd(_mm256_cvtps_pd(a.q[0]), _mm256_cvtps_pd(b.q[0]), acc.a),
                 _mm256_fmadd_pd(_mm256_cvtps_pd(a.q[1]), _mm256_cvtps_pd(b.q[1]), acc.b),
                 _mm256_fmadd_pd(_mm256_cvtps_pd(a.q[2]), _mm256_cvtps_pd(b.q[2]), acc.c),
                 _mm256_fmadd_pd(_mm256_cvtps_pd(a.q[3]), _mm256_cvtps_pd(b.q[3]), acc.d));
}
BNBW_INLINE vd vd_widen(vw a)
{
    return v__vd(_mm256_cvtps_pd(a.q[0]), _mm256_cvtps_pd(a.q[1]), _mm256_cvtps_pd(a.q[2]),
                 _mm256_cvtps_pd(a.q[3]));
}

/* ---- rows ------------------------------------------------------------------------------ */

/* 8 halves of type dt as 8 f32 lanes (exact). */
BNBW_INLINE __m256 v__widen8(__m128i h, int dt)
{
    if (dt == BNBW_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 16 contiguous elements from element i, in element order. */
BNBW_INLINE vf v__load16(const void *row, int64_t i, int dt)
{
    if (dt == BNBW_F32)
        return vf_loadu((const float *)row + i);
    /* two 16-byte loads, which the conversions take as memory operands */
    const __m128i *p = (const __m128i *)(const void *)((const uint16_t *)row + i);
    return v__vf(v__widen8(_mm_loadu_si128(p), dt), v__widen8(_mm_loadu_si128(p + 1), dt));
}

/* Lanes 0-7 of `a` and lanes 0-7 of `b` (elements in order) as the even and odd elements. */
BNBW_INLINE vf v__deinterleave(vf a)
{
    /* per 128-bit half: elements 0 2 8 10 | 4 6 12 14, then the middle 64-bit pairs swapped */
    __m256 e = _mm256_shuffle_ps(a.lo, a.hi, _MM_SHUFFLE(2, 0, 2, 0));
    __m256 o = _mm256_shuffle_ps(a.lo, a.hi, _MM_SHUFFLE(3, 1, 3, 1));
    return v__vf(_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0))),
                 _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0))));
}

/* The inverse of v__deinterleave. */
BNBW_INLINE vf v__interleave(vf a)
{
    __m256 e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(a.lo), _MM_SHUFFLE(3, 1, 2, 0)));
    __m256 o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(a.hi), _MM_SHUFFLE(3, 1, 2, 0)));
    return v__vf(_mm256_unpacklo_ps(e, o), _mm256_unpackhi_ps(e, o));
}

/* Elements i.. at `step` elements apart, in element order, through a small buffer. */
BNBW_INLINE vf v__gather16(const void *row, int64_t i, int64_t step, int dt)
{
    if (dt == BNBW_F32) {
        const float *p = (const float *)row + i * step;
        if (step > 0 && step < (INT32_MAX >> 4)) {
            const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                   _mm256_set1_epi32((int)step));
            return v__vf(_mm256_i32gather_ps(p, idx, 4), _mm256_i32gather_ps(p + 8 * step, idx, 4));
        }
        float buf[16];
        for (int l = 0; l < 16; ++l)
            memcpy(buf + l, p + l * step, 4);
        return vf_loadu(buf);
    }
    uint16_t buf[16];
    const uint16_t *p = (const uint16_t *)row + i * step;
    for (int l = 0; l < 16; ++l)
        memcpy(buf + l, p + l * step, 2);
    return v__load16(buf, 0, dt);
}

BNBW_INLINE vf v_load(const void *row, int64_t i, int64_t step, int dt, int eo)
{
    if (step != 1)
        return eo ? v__deinterleave(v__gather16(row, i, step, dt)) : v__gather16(row, i, step, dt);
    if (!eo)
        return v__load16(row, i, dt);
    if (dt == BNBW_BF16) {         /* lane 2j's low half is element 2j, its high half 2j + 1 */
        __m256i w = _mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)row + i));
        return v__vf(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
                     _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u))));
    }
    return v__deinterleave(v__load16(row, i, dt));
}

/* 16 lanes in element order as 16 halves. */
BNBW_INLINE __m256i v__narrow16(vf a, int dt)
{
    if (dt == BNBW_F16)
        return _mm256_set_m128i(_mm256_cvtps_ph(a.hi, _MM_FROUND_TO_NEAREST_INT),
                                _mm256_cvtps_ph(a.lo, _MM_FROUND_TO_NEAREST_INT));
    return bnbw__bf16_pack16(a.lo, a.hi);     /* bnbw_half.h, as the row converters round */
}

BNBW_INLINE void v__scatter16(void *row, int64_t i, int64_t step, vf a, int dt)
{
    if (dt == BNBW_F32) {
        float buf[16];
        vf_storeu(buf, a);
        float *p = (float *)row + i * step;
        for (int l = 0; l < 16; ++l)
            memcpy(p + l * step, buf + l, 4);
        return;
    }
    uint16_t buf[16];
    _mm256_storeu_si256((__m256i *)(void *)buf, v__narrow16(a, dt));
    uint16_t *p = (uint16_t *)row + i * step;
    for (int l = 0; l < 16; ++l)
        memcpy(p + l * step, buf + l, 2);
}

BNBW_INLINE void v_store(void *row, int64_t i, int64_t step, vf a, int dt, int eo)
{
    if (eo && dt == BNBW_BF16 && step == 1) {
        /* even and odd elements' bf16 are the high halves of their lanes: one word blend */
        _mm256_storeu_si256((__m256i *)(void *)((uint16_t *)row + i),
                            bnbw__bf16_join16(a.lo, a.hi));
        return;
    }
    if (eo)
        a = v__interleave(a);
    if (step != 1) {
        v__scatter16(row, i, step, a, dt);
        return;
    }
    if (dt == BNBW_F32)
        vf_storeu((float *)row + i, a);
    else
        _mm256_storeu_si256((__m256i *)(void *)((uint16_t *)row + i), v__narrow16(a, dt));
}

/* Elements i.. (element order) as a vw: contiguous rows quarter by quarter. */
BNBW_INLINE vw vw_load(const void *row, int64_t i, int64_t step, int dt)
{
    vw r;
    if (step == 1 && dt == BNBW_F32) {
        V__QUARTERS(k) r.q[k] = _mm_loadu_ps((const float *)row + i + 4 * k);
        return r;
    }
    if (step == 1) {               /* 4 halves (8 bytes) per quarter, widened exactly */
        const uint16_t *p = (const uint16_t *)row + i;
        V__QUARTERS(k) {
            __m128i h = _mm_loadl_epi64((const __m128i *)(const void *)(p + 4 * k));
            r.q[k] = dt == BNBW_F16 ? _mm_cvtph_ps(h)
                                    : _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
        }
        return r;
    }
    vf a = v_load(row, i, step, dt, 0);
    r.q[0] = _mm256_castps256_ps128(a.lo);
    r.q[1] = _mm256_extractf128_ps(a.lo, 1);
    r.q[2] = _mm256_castps256_ps128(a.hi);
    r.q[3] = _mm256_extractf128_ps(a.hi, 1);
    return r;
}

/* Masked loads and stores touch only the t elements (halves: t/2 whole 32-bit pairs, and the
 * odd one alone); lanes t.. load as +0 and are never stored. */
BNBW_INLINE vf v_load_part(const void *row, int64_t i, int64_t t, int64_t step, int dt)
{
    if (step != 1) {
        float buf[16] = {0};
        for (int64_t l = 0; l < t; ++l) {
            if (dt == BNBW_F32) {
                memcpy(buf + l, (const float *)row + (i + l) * step, 4);
            } else {
                uint16_t h;
                memcpy(&h, (const uint16_t *)row + (i + l) * step, 2);
                buf[l] = dt == BNBW_F16 ? bnbw_f16_to_f32((bnbw_f16){h})
                                        : bnbw_bf16_to_f32((bnbw_bf16){h});
            }
        }
        return vf_loadu(buf);
    }
    if (dt == BNBW_F32) {
        const float *p = (const float *)row + i;
        return v__vf(_mm256_maskload_ps(p, v__lanes_below(t)),
                     _mm256_maskload_ps(p + 8, v__lanes_below(t - 8)));
    }
    const uint16_t *p = (const uint16_t *)row + i;
    __m256i w = _mm256_maskload_epi32((const int *)(const void *)p, v__lanes_below(t / 2));
    if (t & 1)      /* the odd last element: the low half of pair t / 2 */
        w = _mm256_blendv_epi8(w, _mm256_set1_epi32(p[t - 1]),
                               _mm256_cmpeq_epi32(_mm256_set1_epi32((int)(t / 2)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    return v__vf(v__widen8(_mm256_castsi256_si128(w), dt),
                 v__widen8(_mm256_extracti128_si256(w, 1), dt));
}

BNBW_INLINE vw vw_load_part(const void *row, int64_t i, int64_t t, int64_t step, int dt)
{
    vf a = v_load_part(row, i, t, step, dt);
    vw r;
    r.q[0] = _mm256_castps256_ps128(a.lo);
    r.q[1] = _mm256_extractf128_ps(a.lo, 1);
    r.q[2] = _mm256_castps256_ps128(a.hi);
    r.q[3] = _mm256_extractf128_ps(a.hi, 1);
    return r;
}

BNBW_INLINE void v_store_part(void *row, int64_t i, int64_t t, int64_t step, vf a, int dt)
{
    if (step != 1) {
        float buf[16];
        vf_storeu(buf, a);
        for (int64_t l = 0; l < t; ++l) {
            if (dt == BNBW_F32) {
                memcpy((float *)row + (i + l) * step, buf + l, 4);
            } else {
                uint16_t h = dt == BNBW_F16 ? bnbw_f32_to_f16(buf[l]).bits
                                            : bnbw_f32_to_bf16(buf[l]).bits;
                memcpy((uint16_t *)row + (i + l) * step, &h, 2);
            }
        }
        return;
    }
    if (dt == BNBW_F32) {
        float *p = (float *)row + i;
        _mm256_maskstore_ps(p, v__lanes_below(t), a.lo);
        _mm256_maskstore_ps(p + 8, v__lanes_below(t - 8), a.hi);
        return;
    }
    uint16_t *p = (uint16_t *)row + i;
    __m256i h = v__narrow16(a, dt);
    _mm256_maskstore_epi32((int *)(void *)p, v__lanes_below(t / 2), h);
    if (t & 1)      /* the low half of pair t / 2, moved to lane 0 */
        p[t - 1] = (uint16_t)_mm256_cvtsi256_si32(
            _mm256_permutevar8x32_epi32(h, _mm256_set1_epi32((int)(t / 2))));
}

/* ---- the ReLU mask ---------------------------------------------------------------------- */

/* 16 bool bytes as lane masks, in element or even/odd order. */
BNBW_INLINE vm v__bool_lanes(__m128i b, int eo)
{
    if (eo)
        b = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    __m128i on = _mm_xor_si128(_mm_cmpeq_epi8(b, _mm_setzero_si128()), _mm_set1_epi8(-1));
    vm r = {_mm256_castsi256_ps(_mm256_cvtepi8_epi32(on)),
            _mm256_castsi256_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(on, 8)))};
    return r;
}

BNBW_INLINE vm v__positive(vf a)
{
    vm r = {_mm256_cmp_ps(a.lo, _mm256_setzero_ps(), _CMP_GT_OQ),
            _mm256_cmp_ps(a.hi, _mm256_setzero_ps(), _CMP_GT_OQ)};
    return r;
}

BNBW_INLINE vm v_active(const void *mask, int64_t i, int64_t step, int mdt, int eo)
{
    if (mdt != BNBW_BOOL)
        return v__positive(v_load(mask, i, step, mdt, eo));
    const unsigned char *p = (const unsigned char *)mask;
    if (step == 1)
        return v__bool_lanes(_mm_loadu_si128((const __m128i *)(const void *)(p + i)), eo);
    unsigned char buf[16];
    for (int l = 0; l < 16; ++l)
        buf[l] = p[(i + l) * step];
    return v__bool_lanes(_mm_loadu_si128((const __m128i *)(const void *)buf), eo);
}

BNBW_INLINE vm v_active_part(const void *mask, int64_t i, int64_t t, int64_t step, int mdt)
{
    if (mdt != BNBW_BOOL)
        return v__positive(v_load_part(mask, i, t, step, mdt));
    unsigned char buf[16] = {0};
    for (int64_t l = 0; l < t; ++l)
        buf[l] = ((const unsigned char *)mask)[(i + l) * step];
    return v__bool_lanes(_mm_loadu_si128((const __m128i *)(const void *)buf), 0);
}

/* dst = src where active, +0 elsewhere, for the t <= 16 elements i.. (the bits themselves). */
BNBW_INLINE void v_copy_active(void *dst, int64_t dst_step, const void *src, int64_t src_step,
                               const void *mask, int64_t mask_step, int64_t i, int64_t t,
                               int dt, int mdt)
{
    if (t == 16 && dst_step == 1 && src_step == 1 && mask_step == 1) {
        vm on = v_active(mask, i, 1, mdt, 0);
        if (dt == BNBW_F32) {
            const float *s = (const float *)src + i;
            float *d = (float *)dst + i;
            _mm256_storeu_ps(d, _mm256_and_ps(_mm256_loadu_ps(s), on.lo));
            _mm256_storeu_ps(d + 8, _mm256_and_ps(_mm256_loadu_ps(s + 8), on.hi));
        } else {
            __m256i w = _mm256_permute4x64_epi64(
                _mm256_packs_epi32(_mm256_castps_si256(on.lo), _mm256_castps_si256(on.hi)), 0xd8);
            const uint16_t *s = (const uint16_t *)src + i;
            _mm256_storeu_si256((__m256i *)(void *)((uint16_t *)dst + i),
                                _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(const void *)s), w));
        }
        return;
    }
    bnbw_copy_active_elements(dst, dst_step, src, src_step, mask, mask_step, i, t, dt, mdt);
}

/* Leaving a kernel: clear the upper register halves, which gcc does not do on leaving a
 * function compiled for AVX2 by a target pragma; SSE code after dirty upper halves runs
 * several times slower on some cores. */
/* 16 f32 values to a 64-byte aligned line with non-temporal stores (no read for ownership);
 * the fence makes them visible before the stores that follow. */
BNBW_INLINE void vf_stream(float *p, vf a) { _mm256_stream_ps(p, a.lo); _mm256_stream_ps(p + 8, a.hi); }
BNBW_INLINE void v_stream_fence(void) { _mm_sfence(); }

BNBW_INLINE void v_leave(void) { _mm256_zeroupper(); }

#endif /* BNBW_SIMD_AVX2_H */
