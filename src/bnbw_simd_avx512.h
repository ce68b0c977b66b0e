/*
 * bnbw_simd_avx512.h - the kernels' vector layer on x86 AVX-512 (F, BW, VL, DQ) with FMA, F16C
 * and BMI2: one zmm register per 16 f32 lanes, two per 16 f64 lanes (lanes 0-7, 8-15), lane
 * predicates in mask registers.  Same operations, lanes and bits as bnbw_simd_portable.h,
 * which documents the interface.  Compiled only in a translation unit whose functions target
 * these instructions (src/body_avx512.c).
 *
 * bf16 rounds with integer operations, not VCVTNEPS2BF16, which flushes subnormal inputs to
 * zero; f16 converts with VCVTPS2PH / VCVTPH2PS, which round as the portable code does.
 */
#ifndef BNBW_SIMD_AVX512_H
#define BNBW_SIMD_AVX512_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bnbw_half.h"
#include "bnbw_kernels.h"

#define BNBW_SIMD_BODY BNBW_BODY_AVX512
/* Any lane order costs one permutation here: the elementwise kernels keep element order. */
#define BNBW_SIMD_BF16_EVEN_ODD 0
/* Packed short rows (bnbw_kernels_impl.h) take their per-row constants and add their
 * row sums by this layer's permutes: vf_spread, vw_spread, vd_add_group_sums. */
#define BNBW_SIMD_PACKED_ROWS 1
/* Runs of 16 channels whose two f64 sums a row loop keeps in registers (32 zmm: four runs' two sums (16), their means (4) and the terms). */
#define BNBW_SIMD_SUM_RUNS 4
#define BNBW_INLINE static inline __attribute__((always_inline))

typedef __m512 vf;
typedef struct { __m512d lo, hi; } vd;               /* lanes 0-7, 8-15 */
typedef __mmask16 vm;

BNBW_INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
BNBW_INLINE vf vf_set1(float a) { return _mm512_set1_ps(a); }
BNBW_INLINE vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
BNBW_INLINE void vf_storeu(float *p, vf a) { _mm512_storeu_ps(p, a); }
BNBW_INLINE vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
BNBW_INLINE vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
BNBW_INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
BNBW_INLINE vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }

BNBW_INLINE vf vf_opaque(vf a) { __asm__("" : "+v"(a)); return a; }
/* a + b and a - b on the multiply pipes, as in bnbw_simd_avx2.h */
BNBW_INLINE vf vf_add_mp(vf a, vf b) { return _mm512_fmadd_ps(a, vf_opaque(vf_set1(1.0f)), b); }
BNBW_INLINE vf vf_sub_mp(vf a, vf b) { return _mm512_fmsub_ps(a, vf_opaque(vf_set1(1.0f)), b); }

BNBW_INLINE vf vf_keep(vf a, vm m) { return _mm512_maskz_mov_ps(m, a); }
BNBW_INLINE vf vf_select(vm m, vf a, vf b) { return _mm512_mask_blend_ps(m, b, a); }

BNBW_INLINE vm vm_below(int64_t t)
{
    return t <= 0 ? (vm)0 : t >= 16 ? (vm)0xffff : (vm)((1u << t) - 1u);
}
/* not NaN (quiet 0x01, signalling 0x80) and not infinite (0x08, 0x10) */
BNBW_INLINE vm vm_finite2(vf a, vf b)
{
    return (vm)~(_mm512_fpclass_ps_mask(a, 0x99) | _mm512_fpclass_ps_mask(b, 0x99));
}
BNBW_INLINE int vm_all(vm m) { return m == 0xffff; }
/* a > 0 or unordered: not (a <= 0), quiet */
BNBW_INLINE vm vm_relu(vf a) { return _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NLE_UQ); }

BNBW_INLINE vd v__vd(__m512d lo, __m512d hi) { vd r = {lo, hi}; return r; }
BNBW_INLINE vd vd_zero(void) { return v__vd(_mm512_setzero_pd(), _mm512_setzero_pd()); }
BNBW_INLINE vd vd_loadu(const double *p) { return v__vd(_mm512_loadu_pd(p), _mm512_loadu_pd(p + 8)); }
BNBW_INLINE void vd_storeu(double *p, vd a) { _mm512_storeu_pd(p, a.lo); _mm512_storeu_pd(p + 8, a.hi); }
#define V__WIDEN_LO(v) _mm512_cvtps_pd(_mm512_castps512_ps256(v))
#define V__WIDEN_HI(v) _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1))
BNBW_INLINE vd vd_add_f32(vd acc, vf a)
{
    return v__vd(_mm512_add_pd(acc.lo, V__WIDEN_LO(a)), _mm512_add_pd(acc.hi, V__WIDEN_HI(a)));
}
/* exact product in f64: the fused multiply-add rounds where the portable add does */
BNBW_INLINE vd vd_fma_f32(vd acc, vf a, vf b)
{
    return v__vd(_mm512_fmadd_pd(V__WIDEN_LO(a), V__WIDEN_LO(b), acc.lo),
                 _mm512_fmadd_pd(V__WIDEN_HI(a), V__WIDEN_HI(b), acc.hi));
}
BNBW_INLINE vd vd_select(vm m, vd a, vd b)
{
    return v__vd(_mm512_mask_blend_pd((__mmask8)m, b.lo, a.lo),
                 _mm512_mask_blend_pd((__mmask8)(m >> 8), b.hi, a.hi));
}
BNBW_INLINE vd vd_add(vd x, vd y) { return v__vd(_mm512_add_pd(x.lo, y.lo), _mm512_add_pd(x.hi, y.hi)); }
BNBW_INLINE vd vd_sub(vd x, vd y) { return v__vd(_mm512_sub_pd(x.lo, y.lo), _mm512_sub_pd(x.hi, y.hi)); }
BNBW_INLINE vd vd_mul(vd x, vd y) { return v__vd(_mm512_mul_pd(x.lo, y.lo), _mm512_mul_pd(x.hi, y.hi)); }
BNBW_INLINE double vd_fold(vd a)
{
    __m512d s = _mm512_add_pd(a.lo, a.hi);
    __m256d q = _mm256_add_pd(_mm512_castpd512_pd256(s), _mm512_extractf64x4_pd(s, 1));
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(q), _mm256_extractf128_pd(q, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}
/* lane l: a[l] + a[l ^ w] (w = 1, 2 or 4), the step of vd_fold within groups of 2w lanes */
BNBW_INLINE vd vd_add_partners(vd a, int w)
{
    if (w == 1)
        return vd_add(a, v__vd(_mm512_permute_pd(a.lo, 0x55), _mm512_permute_pd(a.hi, 0x55)));
    if (w == 2)
        return vd_add(a, v__vd(_mm512_permutex_pd(a.lo, _MM_SHUFFLE(1, 0, 3, 2)),
                               _mm512_permutex_pd(a.hi, _MM_SHUFFLE(1, 0, 3, 2))));
    return vd_add(a, v__vd(_mm512_shuffle_f64x2(a.lo, a.lo, _MM_SHUFFLE(1, 0, 3, 2)),
                           _mm512_shuffle_f64x2(a.hi, a.hi, _MM_SHUFFLE(1, 0, 3, 2))));
}
/* sums[2g] += a[g << s], sums[2g + 1] += b[g << s] for the 16 >> s groups (s = 1 or 2) */
BNBW_INLINE void vd_add_group_sums(vd a, vd b, int s, double *sums)
{
    const __m512i pick = s == 1 ? _mm512_setr_epi64(0, 8, 2, 10, 4, 12, 6, 14)
                                : _mm512_setr_epi64(0, 8, 4, 12, 0, 8, 4, 12);
    __m512d lo = _mm512_permutex2var_pd(a.lo, pick, b.lo);
    __m512d hi = _mm512_permutex2var_pd(a.hi, pick, b.hi);
    if (s == 1) {
        _mm512_storeu_pd(sums, _mm512_add_pd(_mm512_loadu_pd(sums), lo));
        _mm512_storeu_pd(sums + 8, _mm512_add_pd(_mm512_loadu_pd(sums + 8), hi));
        return;
    }
    __m512d both = _mm512_shuffle_f64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
    _mm512_storeu_pd(sums, _mm512_add_pd(_mm512_loadu_pd(sums), both));
}

/* vw: 16 f32 lanes as two 256-bit halves, each widened by one conversion (no extract). */
typedef struct { __m256 lo, hi; } vw;
BNBW_INLINE vw v__vw(__m256 lo, __m256 hi) { vw r = {lo, hi}; return r; }
/* lane l: c[l >> s] (s = 1 to 4), reading c[0 .. 16 >> s) only */
BNBW_INLINE vf vf_spread(const float *c, int s)
{
    if (s >= 3)             /* one constant a half: broadcasts, no shuffle */
        return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(c[0])),
                                  _mm256_set1_ps(c[s == 3]), 1);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << (16 >> s)) - 1), c);
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(lane, _mm512_set1_epi32(s)), v);
}
BNBW_INLINE vw vw_spread(const float *c, int s)
{
    if (s >= 3)
        return v__vw(_mm256_set1_ps(c[0]), _mm256_set1_ps(c[s == 3]));
    vf v = vf_spread(c, s);
    return v__vw(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
BNBW_INLINE vw vw_set1(float a) { return v__vw(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
BNBW_INLINE vw vw_loadu(const float *p) { return v__vw(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
BNBW_INLINE vw vw_sub(vw a, vw b) { return v__vw(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
BNBW_INLINE vw vw_keep(vw a, vm m)
{
    return v__vw(_mm256_maskz_mov_ps((__mmask8)m, a.lo), _mm256_maskz_mov_ps((__mmask8)(m >> 8), a.hi));
}
BNBW_INLINE vw vw_select(vm m, vw a, vw b)
{
    return v__vw(_mm256_mask_blend_ps((__mmask8)m, b.lo, a.lo),
                 _mm256_mask_blend_ps((__mmask8)(m >> 8), b.hi, a.hi));
}
BNBW_INLINE vd vd_add_w(vd acc, vw a)
{
    return v__vd(_mm512_add_pd(acc.lo, _mm512_cvtps_pd(a.lo)), _mm512_add_pd(acc.hi, _mm512_cvtps_pd(a.hi)));
}
BNBW_INLINE vd vd_fma_w(vd acc, vw a, vw b)
{
    return v__vd(_mm512_fmadd_pd(_mm512_cvtps_pd(a.lo), _mm512_cvtps_pd(b.lo), acc.lo),
                 _mm512_fmadd_pd(_mm512_cvtps_pd(a.hi), _mm512_cvtps_pd(b.hi), acc.hi));
}
BNBW_INLINE vd vd_widen(vw a) { return v__vd(_mm512_cvtps_pd(a.lo), _mm512_cvtps_pd(a.hi)); }

/* ---- rows ------------------------------------------------------------------------------ */

/* Lane l of an even/odd vector holds element V__EO(l); element e sits in lane V__LANE(e). */
#define V__EO_LANES _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)
#define V__EO_ELEMENTS _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15)

/* 16 halves (element order) as 16 f32 lanes, exactly. */
BNBW_INLINE vf v__widen16(__m256i h, int dt)
{
    if (dt == BNBW_F16)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 f32 lanes as bf16 in the high half of each lane: nearest even, NaNs quiet with their sign. */
BNBW_INLINE __m512i v__bf16_high(vf a)
{
    __m512i x = _mm512_castps_si512(a);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb);
    __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(
        _mm512_and_si512(x, _mm512_set1_epi32((int)0x80000000u)), _mm512_set1_epi32(0x7fc00000)));
}

/* 16 lanes as 16 halves; `order` picks, per element e, the lane it comes from (32-bit index
 * vector), as words 2 * lane + 1 (bf16: high halves) of the rounded lanes. */
BNBW_INLINE __m256i v__narrow16(vf a, int dt, int eo)
{
    if (dt == BNBW_F16) {
        if (eo)
            a = _mm512_permutexvar_ps(V__EO_ELEMENTS, a);
        return _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT);
    }
    /* word e of the result = word 2 * lane(e) + 1 of the rounded lanes */
    __m512i words = eo ? _mm512_setr_epi32(0x00110001, 0x00130003, 0x00150005, 0x00170007,
                                           0x00190009, 0x001b000b, 0x001d000d, 0x001f000f,
                                           0, 0, 0, 0, 0, 0, 0, 0)
                       : _mm512_setr_epi32(0x00030001, 0x00070005, 0x000b0009, 0x000f000d,
                                           0x00130011, 0x00170015, 0x001b0019, 0x001f001d,
                                           0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi16(words, v__bf16_high(a)));
}

BNBW_INLINE int v__gatherable(int64_t step) { return step > 0 && step < (INT32_MAX >> 4); }
BNBW_INLINE __m512i v__indices(int64_t step)
{
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32((int)step));
}

/* Elements i.. at `step` elements apart (step != 1), in element order.  Every other element
 * (step 2) comes from two contiguous loads (the second stopping at the last element) and one
 * permutation; f32 at other steps from a gather; halves through a small buffer. */
BNBW_INLINE vf v__load_strided(const void *row, int64_t i, int64_t step, int dt)
{
    if (step == 2) {
        if (dt == BNBW_F32) {
            const float *p = (const float *)row + 2 * i;
            return _mm512_permutex2var_ps(
                _mm512_loadu_ps(p),
                _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                _mm512_maskz_loadu_ps(0x7fff, p + 16));
        }
        __m512i w = _mm512_maskz_loadu_epi16(0x7fffffffu, (const uint16_t *)row + 2 * i);
        /* dword lane l = word 2l, zero-extended */
        __m512i even = _mm512_and_si512(w, _mm512_set1_epi32(0xffff));
        return v__widen16(_mm512_cvtepi32_epi16(even), dt);
    }
    if (dt == BNBW_F32 && v__gatherable(step))
        return _mm512_i32gather_ps(v__indices(step), (const float *)row + i * step, 4);
    if (dt == BNBW_F32) {
        float buf[16];
        for (int l = 0; l < 16; ++l)
            memcpy(buf + l, (const float *)row + (i + l) * step, 4);
        return _mm512_loadu_ps(buf);
    }
    uint16_t buf[16];
    for (int l = 0; l < 16; ++l)
        memcpy(buf + l, (const uint16_t *)row + (i + l) * step, 2);
    return v__widen16(_mm256_loadu_si256((const __m256i *)(const void *)buf), dt);
}

BNBW_INLINE vf v_load(const void *row, int64_t i, int64_t step, int dt, int eo)
{
    vf a;
    if (step != 1) {
        a = v__load_strided(row, i, step, dt);
    } else if (dt == BNBW_F32) {
        a = _mm512_loadu_ps((const float *)row + i);
    } else {
        __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)row + i));
        if (eo && dt == BNBW_BF16) {
            /* word 2l + 1 of the result = element V__EO(l), word 2l = 0: the f32 of a bf16 */
            __m512i idx = _mm512_setr_epi32(0x00000000, 0x00020000, 0x00040000, 0x00060000,
                                            0x00080000, 0x000a0000, 0x000c0000, 0x000e0000,
                                            0x00010000, 0x00030000, 0x00050000, 0x00070000,
                                            0x00090000, 0x000b0000, 0x000d0000, 0x000f0000);
            return _mm512_castsi512_ps(
                _mm512_maskz_permutexvar_epi16(0xaaaaaaaau, idx, _mm512_castsi256_si512(h)));
        }
        a = v__widen16(h, dt);
    }
    return eo ? _mm512_permutexvar_ps(V__EO_LANES, a) : a;
}

/* 8 halves (element order) as 8 f32 lanes, exactly. */
BNBW_INLINE __m256 v__widen8(__m128i h, int dt)
{
    if (dt == BNBW_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Elements i.. (element order) as a vw: contiguous rows half by half. */
BNBW_INLINE vw vw_load(const void *row, int64_t i, int64_t step, int dt)
{
    if (step == 1 && dt == BNBW_F32)
        return vw_loadu((const float *)row + i);
    if (step == 1) {
        const __m128i *p = (const __m128i *)(const void *)((const uint16_t *)row + i);
        return v__vw(v__widen8(_mm_loadu_si128(p), dt), v__widen8(_mm_loadu_si128(p + 1), dt));
    }
    vf a = v_load(row, i, step, dt, 0);
    return v__vw(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

BNBW_INLINE void v_store(void *row, int64_t i, int64_t step, vf a, int dt, int eo)
{
    if (step == 1) {
        if (dt == BNBW_F32)
            _mm512_storeu_ps((float *)row + i, eo ? _mm512_permutexvar_ps(V__EO_ELEMENTS, a) : a);
        else
            _mm256_storeu_si256((__m256i *)(void *)((uint16_t *)row + i), v__narrow16(a, dt, eo));
        return;
    }
    if (eo)
        a = _mm512_permutexvar_ps(V__EO_ELEMENTS, a);
    if (dt == BNBW_F32) {
        float *p = (float *)row + i * step;
        if (step == 2) {           /* two masked stores of the lanes spread to even positions */
            const __m512i lo = _mm512_setr_epi32(0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 0);
            const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
            _mm512_mask_storeu_ps(p, 0x5555, _mm512_permutexvar_ps(lo, a));
            _mm512_mask_storeu_ps(p + 16, 0x5555, _mm512_permutexvar_ps(hi, a));
        } else if (v__gatherable(step)) {
            _mm512_i32scatter_ps(p, v__indices(step), a, 4);
        } else {
            float buf[16];
            _mm512_storeu_ps(buf, a);
            for (int l = 0; l < 16; ++l)
                memcpy(p + l * step, buf + l, 4);
        }
        return;
    }
    __m256i h = v__narrow16(a, dt, 0);
    uint16_t *p = (uint16_t *)row + i * step;
    if (step == 2) {               /* words spread to even positions, one masked store */
        __m512i w = _mm512_cvtepu16_epi32(h);
        _mm512_mask_storeu_epi16(p, 0x55555555u, w);
        return;
    }
    uint16_t buf[16];
    _mm256_storeu_si256((__m256i *)(void *)buf, h);
    for (int l = 0; l < 16; ++l)
        memcpy(p + l * step, buf + l, 2);
}

/* Masked loads and stores touch only the t elements; lanes t.. load as +0, are never stored. */
BNBW_INLINE vf v_load_part(const void *row, int64_t i, int64_t t, int64_t step, int dt)
{
    const vm in = vm_below(t);
    if (step == 1) {
        if (dt == BNBW_F32)
            return _mm512_maskz_loadu_ps(in, (const float *)row + i);
        return v__widen16(_mm256_maskz_loadu_epi16(in, (const uint16_t *)row + i), dt);
    }
    if (dt == BNBW_F32 && v__gatherable(step))
        return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), in, v__indices(step),
                                        (const float *)row + i * step, 4);
    if (dt == BNBW_F32) {
        float buf[16] = {0};
        for (int64_t l = 0; l < t; ++l)
            memcpy(buf + l, (const float *)row + (i + l) * step, 4);
        return _mm512_loadu_ps(buf);
    }
    uint16_t buf[16] = {0};
    for (int64_t l = 0; l < t; ++l)
        memcpy(buf + l, (const uint16_t *)row + (i + l) * step, 2);
    return v__widen16(_mm256_loadu_si256((const __m256i *)(const void *)buf), dt);
}

BNBW_INLINE vw vw_load_part(const void *row, int64_t i, int64_t t, int64_t step, int dt)
{
    vf a = v_load_part(row, i, t, step, dt);
    return v__vw(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

BNBW_INLINE void v_store_part(void *row, int64_t i, int64_t t, int64_t step, vf a, int dt)
{
    const vm in = vm_below(t);
    if (step == 1) {
        if (dt == BNBW_F32)
            _mm512_mask_storeu_ps((float *)row + i, in, a);
        else
            _mm256_mask_storeu_epi16((uint16_t *)row + i, in, v__narrow16(a, dt, 0));
        return;
    }
    if (dt == BNBW_F32 && v__gatherable(step)) {
        _mm512_mask_i32scatter_ps((float *)row + i * step, in, v__indices(step), a, 4);
        return;
    }
    if (dt == BNBW_F32) {
        float buf[16];
        _mm512_storeu_ps(buf, a);
        for (int64_t l = 0; l < t; ++l)
            memcpy((float *)row + (i + l) * step, buf + l, 4);
        return;
    }
    uint16_t buf[16];
    _mm256_storeu_si256((__m256i *)(void *)buf, v__narrow16(a, dt, 0));
    for (int64_t l = 0; l < t; ++l)
        memcpy((uint16_t *)row + (i + l) * step, buf + l, 2);
}

/* ---- the ReLU mask ---------------------------------------------------------------------- */

/* Bits l of an element-order mask moved to the even/odd lane order. */
BNBW_INLINE vm v__eo_bits(vm m)
{
    return (vm)(_pext_u32(m, 0x5555u) | (_pext_u32(m, 0xaaaau) << 8));
}

BNBW_INLINE vm v__bools(const unsigned char *p, int64_t i, int64_t t, int64_t step)
{
    if (step == 1) {
        __m128i b = t >= 16 ? _mm_loadu_si128((const __m128i *)(const void *)(p + i))
                            : _mm_maskz_loadu_epi8(vm_below(t), p + i);
        return _mm_test_epi8_mask(b, b);
    }
    if (step == 2) {               /* every other byte: the low bytes of 16-bit words */
        __m256i w = _mm256_maskz_loadu_epi8((__mmask32)((1ull << (2 * t - 1)) - 1), p + 2 * i);
        __m128i b = _mm256_cvtepi16_epi8(w);
        return _mm_test_epi8_mask(b, b);
    }
    vm m = 0;
    for (int64_t l = 0; l < t; ++l)
        m |= (vm)((p[(i + l) * step] != 0) << l);
    return m;
}

BNBW_INLINE vm v_active(const void *mask, int64_t i, int64_t step, int mdt, int eo)
{
    if (mdt != BNBW_BOOL)
        return _mm512_cmp_ps_mask(v_load(mask, i, step, mdt, eo), _mm512_setzero_ps(), _CMP_GT_OQ);
    vm m = v__bools((const unsigned char *)mask, i, 16, step);
    return eo ? v__eo_bits(m) : m;
}

BNBW_INLINE vm v_active_part(const void *mask, int64_t i, int64_t t, int64_t step, int mdt)
{
    if (mdt != BNBW_BOOL)
        return _mm512_cmp_ps_mask(v_load_part(mask, i, t, step, mdt), _mm512_setzero_ps(),
                                  _CMP_GT_OQ);
    return v__bools((const unsigned char *)mask, i, t, step);
}

/* dst = src where active, +0 elsewhere, for the t <= 16 elements i.. (the bits themselves). */
BNBW_INLINE void v_copy_active(void *dst, int64_t dst_step, const void *src, int64_t src_step,
                               const void *mask, int64_t mask_step, int64_t i, int64_t t,
                               int dt, int mdt)
{
    const vm in = vm_below(t);
    vm on = (t >= 16 ? v_active(mask, i, mask_step, mdt, 0)
                     : v_active_part(mask, i, t, mask_step, mdt)) & in;
    if (dst_step == 1 && src_step == 1) {
        if (dt == BNBW_F32)
            _mm512_mask_storeu_ps((float *)dst + i, in,
                                  _mm512_maskz_loadu_ps(on, (const float *)src + i));
        else
            _mm256_mask_storeu_epi16((uint16_t *)dst + i, in,
                                     _mm256_maskz_loadu_epi16(on, (const uint16_t *)src + i));
        return;
    }
    int64_t isz = BNBW_ITEMSIZE(dt);
    for (int64_t l = 0; l < t; ++l) {
        char *d = (char *)dst + (i + l) * dst_step * isz;
        if (on >> l & 1)
            memcpy(d, (const char *)src + (i + l) * src_step * isz, (size_t)isz);
        else
            memset(d, 0, (size_t)isz);
    }
}

/* 16 f32 values to a 64-byte aligned line with a non-temporal store (as in bnbw_simd_avx2.h) */
BNBW_INLINE void vf_stream(float *p, vf a) { _mm512_stream_ps(p, a); }
BNBW_INLINE void v_stream_fence(void) { _mm_sfence(); }

BNBW_INLINE void v_leave(void) { _mm256_zeroupper(); }

#endif /* BNBW_SIMD_AVX512_H */
