/* bnbw_half.h: float16 / bfloat16 <-> float32 conversions for bnbw_native.
 *
 * Why it looks like this:
 * - The scalar functions are integer bit manipulation only, so they mean the same thing on every
 *   compiler, under every MXCSR/FENV state (rounding mode, FTZ, DAZ) and with or without SIMD.
 *   They reproduce NumPy's float16 casts and ml_dtypes' bfloat16 casts bit for bit, NaNs
 *   included: NumPy truncates a NaN payload into the half (keeping it a NaN, never quieting it)
 *   and widens it back unchanged; ml_dtypes turns every NaN into the quiet NaN 0x7fc0 with the
 *   sign kept.  Every other value is rounded to nearest, ties to even, with subnormals and
 *   overflow to infinity.
 * - The SIMD kernels must agree with the scalar functions on every input.  F16C quiets signalling
 *   NaNs in both directions, so the f16 kernels patch NaN lanes with integer ops afterwards.
 *   F16C rounding comes from the immediate (nearest-even), never from MXCSR.
 * - AArch64 (NEON): FCVTL/FCVTN convert halves as IEEE conversions under FPCR, so the row
 *   converters use them only while FPCR holds round-to-nearest and IEEE halves (as Linux sets
 *   it), and send groups holding a NaN to the scalar code; bf16 is integer code throughout.
 * - The row converters take `simd` from their caller: nonzero when the kernel body in use
 *   (bnbw_kernels.h, which checks the CPU and the OS) is a vector one (AVX2 or better, NEON),
 *   so one decision and one cap (BNBW_KERNELS) govern the kernels and the converters alike.
 *   Other CPUs or non-GNU compilers get portable code whatever `simd` says.
 * - Everything is static: the header is compiled into more than one extension module.
 * - Row converters: the 16-bit (or strided f32) side is accessed through memcpy, so it needs no
 *   alignment and any byte stride (negative, zero, odd) works; strided rows are gathered into a
 *   small stack buffer so they use the same SIMD kernels as contiguous ones.  The float side is
 *   a contiguous, aligned float array.  n <= 0 does nothing.  Source and destination must not
 *   overlap.
 */
#ifndef BNBW_HALF_H
#define BNBW_HALF_H

#include <stdint.h>
#include <string.h>

typedef struct { uint16_t bits; } bnbw_f16;   /* IEEE binary16 storage */
typedef struct { uint16_t bits; } bnbw_bf16;  /* bfloat16 storage */
/* distinct struct types on purpose: a Cython fused type over two uint16_t typedefs collapses to one */

#if defined(__GNUC__) || defined(__clang__)
#define BNBW__UNUSED __attribute__((unused))
#else
#define BNBW__UNUSED
#endif

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define BNBW__X86_DISPATCH 1
#include <immintrin.h>
#define BNBW__AVX2 __attribute__((target("avx2,fma,f16c")))
#elif defined(__aarch64__) && defined(__ARM_NEON) && (defined(__GNUC__) || defined(__clang__))
#define BNBW__NEON_DISPATCH 1
#include <arm_neon.h>
#endif

/* ---------------------------------------------------------------- scalar, bit-level semantics */

static inline uint32_t bnbw__f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bnbw__bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Rounds the finite magnitude sig * 2^(e - src_frac) (sig < 2^53, e its unbiased exponent, or the
 * minimum one for a subnormal) to a format with dst_frac fraction bits and exponent bias dst_bias,
 * with a single round-to-nearest-even.  Returns exponent and fraction bits; a carry out of the
 * fraction lands in the exponent, so rounding past the largest finite value gives infinity. */
static inline uint32_t bnbw__narrow(uint64_t sig, int e, int src_frac, int dst_frac, int dst_bias)
{
    const int emin = 1 - dst_bias;
    if (e > dst_bias)
        return (uint32_t)(2 * dst_bias + 1) << dst_frac;
    int et = e < emin ? emin : e;
    int shift = src_frac - dst_frac + (et - e);
    if (shift > 63)
        shift = 63;  /* sig < 2^53 then lies below half a unit: rounds to zero all the same */
    uint64_t q = sig >> shift;
    uint64_t rem = sig & ((UINT64_C(1) << shift) - 1);
    uint64_t half = UINT64_C(1) << (shift - 1);
    q += (rem > half) || (rem == half && (q & 1));
    return ((uint32_t)(et - emin) << dst_frac) + (uint32_t)q;
}

static inline float bnbw_f16_to_f32(bnbw_f16 h)
{
    uint32_t sign = (uint32_t)(h.bits & 0x8000u) << 16;
    uint32_t exp = (h.bits >> 10) & 0x1fu;
    uint32_t frac = h.bits & 0x3ffu;
    if (exp == 0x1f)  /* inf or NaN: payload kept, never quieted */
        return bnbw__bits_f32(sign | 0x7f800000u | (frac << 13));
    if (exp == 0) {
        if (frac == 0)
            return bnbw__bits_f32(sign);
        exp = 1;
        while (!(frac & 0x400u)) {
            frac <<= 1;
            exp--;
        }
        frac &= 0x3ffu;
    }
    return bnbw__bits_f32(sign | ((exp + 112u) << 23) | (frac << 13));
}

static inline bnbw_f16 bnbw_f32_to_f16(float f)
{
    uint32_t x = bnbw__f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t a = x & 0x7fffffffu;
    bnbw_f16 r;
    if (a > 0x7f800000u) {  /* NaN keeps the top of its payload, and stays a NaN */
        uint32_t m = (a >> 13) & 0x3ffu;
        r.bits = (uint16_t)(sign | 0x7c00u | (m ? m : 1u));
    } else if (a >= 0x477ff000u) {  /* 65520 and above round to infinity */
        r.bits = (uint16_t)(sign | 0x7c00u);
    } else if (a >= 0x38800000u) {  /* normal half: rebias, round off 13 bits; a carry is right */
        a -= 0x38000000u;
        r.bits = (uint16_t)(sign | ((a + 0xfffu + ((a >> 13) & 1u)) >> 13));
    } else {
        uint32_t exp = a >> 23;
        uint64_t sig = exp ? ((a & 0x7fffffu) | 0x800000u) : a;
        r.bits = (uint16_t)(sign | bnbw__narrow(sig, exp ? (int)exp - 127 : -126, 23, 10, 15));
    }
    return r;
}

/* A double rounded once to the 16-bit format bnbw__narrow describes by dst_frac and dst_bias.
 * A NaN keeps the top of its payload (made non-zero) when keep_payload, as NumPy's float16
 * does; otherwise it becomes the quiet NaN, as ml_dtypes' bfloat16 does. */
static inline uint16_t bnbw__f64_to_16(double d, int dst_frac, int dst_bias, int keep_payload)
{
    uint64_t x;
    memcpy(&x, &d, 8);
    uint16_t sign = (uint16_t)((x >> 48) & 0x8000u);
    uint32_t exp = (uint32_t)(x >> 52) & 0x7ffu;
    uint64_t frac = x & ((UINT64_C(1) << 52) - 1);
    if (exp == 0x7ff) {
        uint32_t inf = (uint32_t)(2 * dst_bias + 1) << dst_frac;
        uint32_t m = keep_payload ? (uint32_t)(frac >> (52 - dst_frac)) : 1u << (dst_frac - 1);
        return (uint16_t)(sign | inf | (frac ? (m ? m : 1u) : 0u));
    }
    uint64_t sig = exp ? (frac | (UINT64_C(1) << 52)) : frac;
    int e = exp ? (int)exp - 1023 : -1022;
    return (uint16_t)(sign | bnbw__narrow(sig, e, 52, dst_frac, dst_bias));
}

static inline bnbw_f16 bnbw_f64_to_f16(double d)
{
    bnbw_f16 r = {bnbw__f64_to_16(d, 10, 15, 1)};
    return r;
}

static inline float bnbw_bf16_to_f32(bnbw_bf16 h)
{
    return bnbw__bits_f32((uint32_t)h.bits << 16);
}

static inline bnbw_bf16 bnbw_f32_to_bf16(float f)
{
    uint32_t x = bnbw__f32_bits(f);
    bnbw_bf16 r;
    if ((x & 0x7fffffffu) > 0x7f800000u)
        r.bits = (uint16_t)(((x >> 16) & 0x8000u) | 0x7fc0u);
    else  /* same exponent range as float32: nearest-even on the low 16 bits is the whole story */
        r.bits = (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
    return r;
}

static inline bnbw_bf16 bnbw_f64_to_bf16(double d)
{
    bnbw_bf16 r = {bnbw__f64_to_16(d, 7, 127, 0)};
    return r;
}

/* ---------------------------------------------------------------- contiguous portable rows */

static inline uint16_t bnbw__get16(const char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline void bnbw__put16(char *p, uint16_t v) { memcpy(p, &v, 2); }

/* bnbw__load_NAME_portable and bnbw__store_NAME_portable: rows of the 16-bit format NAME (T its
 * storage type) element by element, through the scalar functions above. */
#define BNBW__PORTABLE_ROWS(NAME, T)                                                             \
    static BNBW__UNUSED void bnbw__load_##NAME##_portable(const char *src, int64_t n,          \
                                                          float *dst)                          \
    {                                                                                          \
        for (int64_t i = 0; i < n; i++) {                                                      \
            T h = {bnbw__get16(src + 2 * i)};                                                  \
            dst[i] = bnbw_##NAME##_to_f32(h);                                                  \
        }                                                                                      \
    }                                                                                          \
    static BNBW__UNUSED void bnbw__store_##NAME##_portable(const float *src, int64_t n,        \
                                                           char *dst)                          \
    {                                                                                          \
        for (int64_t i = 0; i < n; i++)                                                        \
            bnbw__put16(dst + 2 * i, bnbw_f32_to_##NAME(src[i]).bits);                         \
    }
BNBW__PORTABLE_ROWS(f16, bnbw_f16)
BNBW__PORTABLE_ROWS(bf16, bnbw_bf16)

/* ---------------------------------------------------------------- contiguous AVX2/F16C rows */

#ifdef BNBW__X86_DISPATCH

static BNBW__UNUSED BNBW__AVX2 void bnbw__load_f16_f16c(const char *src, int64_t n, float *dst)
{
    const __m256i quiet = _mm256_set1_epi32(0x00400000);
    const __m256i mag = _mm256_set1_epi32(0x7fff);
    const __m256i inf = _mm256_set1_epi32(0x7c00);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(src + 2 * i));
        __m256i f = _mm256_castps_si256(_mm256_cvtph_ps(h));
        /* F16C sets the quiet bit of a NaN; put the source's own bit back */
        __m256i h32 = _mm256_cvtepu16_epi32(h);
        __m256i fix = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_and_si256(h32, mag), inf), quiet);
        f = _mm256_or_si256(_mm256_andnot_si256(fix, f),
                            _mm256_and_si256(_mm256_slli_epi32(h32, 13), fix));
        _mm256_storeu_si256((__m256i *)(void *)(dst + i), f);
    }
    _mm256_zeroupper();   /* gcc 12 omits it here: SSE code after dirty AVX state stalls */
    bnbw__load_f16_portable(src + 2 * i, n - i, dst + i);
}

/* For arithmetic only (the engine's kernels): plain F16C widening, which quiets signalling
 * NaNs.  Every value converts exactly as above; a NaN stays a NaN, only its payload may differ,
 * and IEEE arithmetic does not carry payloads anyway.  A third of the instructions. */
static BNBW__UNUSED BNBW__AVX2 void bnbw__load_f16_f16c_arith(const char *src, int64_t n,
                                                            float *dst)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(
            _mm_loadu_si128((const __m128i *)(const void *)(src + 2 * i))));
    _mm256_zeroupper();   /* gcc 12 omits it here: SSE code after dirty AVX state stalls */
    bnbw__load_f16_portable(src + 2 * i, n - i, dst + i);
}

static BNBW__UNUSED BNBW__AVX2 void bnbw__store_f16_f16c(const float *src, int64_t n, char *dst)
{
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
    const __m256i inf = _mm256_set1_epi32(0x7f800000);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 f = _mm256_loadu_ps(src + i);
        __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT);
        __m256i x = _mm256_castps_si256(f);
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, absmask), inf);
        if (!_mm256_testz_si256(nan, nan)) {
            /* F16C quiets NaNs; NumPy keeps the payload's top bits (made non-zero) instead */
            __m256i m = _mm256_srli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffff)), 13);
            m = _mm256_or_si256(m, _mm256_and_si256(_mm256_cmpeq_epi32(m, _mm256_setzero_si256()),
                                                    _mm256_set1_epi32(1)));
            __m256i sign = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x8000));
            __m256i v = _mm256_or_si256(_mm256_or_si256(sign, m), _mm256_set1_epi32(0x7c00));
            __m128i v16 = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            __m128i n16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
            h = _mm_blendv_epi8(h, v16, n16);
        }
        _mm_storeu_si128((__m128i *)(void *)(dst + 2 * i), h);
    }
    _mm256_zeroupper();   /* gcc 12 omits it here: SSE code after dirty AVX state stalls */
    bnbw__store_f16_portable(src + i, n - i, dst + 2 * i);
}

static BNBW__UNUSED BNBW__AVX2 void bnbw__load_bf16_avx2(const char *src, int64_t n, float *dst)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(src + 2 * i));
        __m256i f = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
        _mm256_storeu_si256((__m256i *)(void *)(dst + i), f);
    }
    _mm256_zeroupper();   /* gcc 12 omits it here: SSE code after dirty AVX state stalls */
    bnbw__load_bf16_portable(src + 2 * i, n - i, dst + i);
}

/* The AVX2 bf16 rounding, shared with the kernels' AVX2 layer (bnbw_simd_avx2.h), which
   inlines it into its loops. */
#define BNBW__AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* 8 f32 lanes rounded to nearest even bf16, each in the high half of its 32-bit lane (the
   low half is left over); right for every lane that is not a NaN. */
BNBW__AVX2_INLINE __m256i bnbw__bf16_round8_high(__m256i x)
{
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb);
}

/* The bf16 of a NaN x: the quiet NaN 0x7fc0 with x's sign, in the high half of the lane. */
BNBW__AVX2_INLINE __m256i bnbw__bf16_quiet8_high(__m256i x)
{
    return _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32((int)0x80000000u)),
                           _mm256_set1_epi32(0x7fc00000));
}

/* 8 f32 lanes as bf16 in the high half of each lane, NaN lanes too when `any_nan`. */
BNBW__AVX2_INLINE __m256i bnbw__bf16_high8(__m256 a, int any_nan)
{
    __m256i x = _mm256_castps_si256(a), r = bnbw__bf16_round8_high(x);
    if (any_nan)
        r = _mm256_blendv_epi8(r, bnbw__bf16_quiet8_high(x),
                               _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
    return r;
}

/* Whether a or b holds a NaN.  NaNs are rare: one test for 16 lanes, and the fix-up only when
   it finds one. */
BNBW__AVX2_INLINE int bnbw__any_nan16(__m256 a, __m256 b)
{
    __m256 nan = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
    return !_mm256_testz_ps(nan, nan);
}

/* 16 f32 lanes (a: elements 0-7, b: 8-15) as 16 bf16 in element order. */
BNBW__AVX2_INLINE __m256i bnbw__bf16_pack16(__m256 a, __m256 b)
{
    int any = bnbw__any_nan16(a, b);
    __m256i lo = _mm256_srli_epi32(bnbw__bf16_high8(a, any), 16);
    __m256i hi = _mm256_srli_epi32(bnbw__bf16_high8(b, any), 16);
    /* lanes hold values <= 0xffff, so the unsigned saturating pack is exact; it packs per
       128-bit half, hence the qword permutation back into order */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
}

/* 16 bf16 in element order from the f32 values of the even elements (0, 2, .., 14: `even`)
   and of the odd ones (`odd`), rounded as bnbw__bf16_pack16 rounds.  An element's bf16 is the
   high half of its f32 lane, so this needs no packing shuffle: one blend of 16-bit words. */
BNBW__AVX2_INLINE __m256i bnbw__bf16_join16(__m256 even, __m256 odd)
{
    int any = bnbw__any_nan16(even, odd);
    __m256i e = bnbw__bf16_high8(even, any), o = bnbw__bf16_high8(odd, any);
    return _mm256_blend_epi16(_mm256_srli_epi32(e, 16), o, 0xaa);
}

static BNBW__UNUSED BNBW__AVX2 void bnbw__store_bf16_avx2(const float *src, int64_t n, char *dst)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(void *)(dst + 2 * i),
                            bnbw__bf16_pack16(_mm256_loadu_ps(src + i), _mm256_loadu_ps(src + i + 8)));
    _mm256_zeroupper();   /* gcc 12 omits it here: SSE code after dirty AVX state stalls */
    bnbw__store_bf16_portable(src + i, n - i, dst + 2 * i);
}

#define BNBW__PICK(simd, fast, portable) ((simd) ? (fast) : (portable))
#define BNBW__SIMD_PATH "f16: F16C, bf16: AVX2"
#define BNBW__LOAD_F16 bnbw__load_f16_f16c
#define BNBW__LOAD_F16_ARITH bnbw__load_f16_f16c_arith
#define BNBW__STORE_F16 bnbw__store_f16_f16c
#define BNBW__LOAD_BF16 bnbw__load_bf16_avx2
#define BNBW__STORE_BF16 bnbw__store_bf16_avx2

#elif defined(BNBW__NEON_DISPATCH)

/* ---------------------------------------------------------------- contiguous AArch64 NEON rows */

/* FPCR as the conversions below assume it: rounding to nearest (RMode 0) and IEEE half
 * precision (AHP 0), as Linux starts every thread.  FCVTN rounds with FPCR's mode and FCVTL
 * reads AHP, so a caller that changed either gets the portable code, which FPCR never touches.
 * Flush-to-zero does not matter: conversions ignore FZ16, and FZ only flushes f32 subnormals,
 * which round to a half's signed zero anyway. */
static inline int bnbw__fpcr_plain(void)
{
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    return (fpcr & ((UINT64_C(3) << 22) | (UINT64_C(1) << 26))) == 0;
}

/* Whether any of 8 halves is a NaN (exponent all ones, fraction not 0). */
static inline int bnbw__any_nan_f16x8(uint16x8_t h)
{
    return vmaxvq_u16(vandq_u16(h, vdupq_n_u16(0x7fff))) > 0x7c00;
}

/* Whether any of 8 f32 lanes is a NaN: FMAX passes NaNs on. */
static inline int bnbw__any_nan_f32x8(float32x4_t a, float32x4_t b)
{
    float m = vmaxvq_f32(vmaxq_f32(a, b));
    return m != m;
}

/* 8 halves widened to dst[0..7] by FCVTL (FPCR as bnbw__fpcr_plain checks it). */
static inline void bnbw__widen_f16x8(uint16x8_t h, float *dst)
{
    float16x8_t f = vreinterpretq_f16_u16(h);
    vst1q_f32(dst, vcvt_f32_f16(vget_low_f16(f)));
    vst1q_f32(dst + 4, vcvt_high_f32_f16(f));
}

/* FCVTL widens every half exactly, but quiets signalling NaNs (and FPCR.DN would replace
 * them): groups of 8 holding a NaN take the portable code, which keeps payloads. */
static BNBW__UNUSED void bnbw__load_f16_neon(const char *src, int64_t n, float *dst)
{
    int64_t i = 0;
    if (bnbw__fpcr_plain())
        for (; i + 8 <= n; i += 8) {
            uint16x8_t h = vld1q_u16((const uint16_t *)(const void *)(src + 2 * i));
            if (bnbw__any_nan_f16x8(h))
                bnbw__load_f16_portable(src + 2 * i, 8, dst + i);
            else
                bnbw__widen_f16x8(h, dst + i);
        }
    bnbw__load_f16_portable(src + 2 * i, n - i, dst + i);
}

/* For arithmetic only: plain FCVTL, NaN payloads not kept (see bnbw__load_f16_f16c_arith). */
static BNBW__UNUSED void bnbw__load_f16_neon_arith(const char *src, int64_t n, float *dst)
{
    int64_t i = 0;
    if (bnbw__fpcr_plain())
        for (; i + 8 <= n; i += 8)
            bnbw__widen_f16x8(vld1q_u16((const uint16_t *)(const void *)(src + 2 * i)), dst + i);
    bnbw__load_f16_portable(src + 2 * i, n - i, dst + i);
}

/* FCVTN rounds to nearest even (FPCR checked), subnormals and overflow included; NaNs, which it
 * would quiet, go through the portable code. */
static BNBW__UNUSED void bnbw__store_f16_neon(const float *src, int64_t n, char *dst)
{
    int64_t i = 0;
    if (bnbw__fpcr_plain())
        for (; i + 8 <= n; i += 8) {
            float32x4_t a = vld1q_f32(src + i), b = vld1q_f32(src + i + 4);
            if (bnbw__any_nan_f32x8(a, b)) {
                bnbw__store_f16_portable(src + i, 8, dst + 2 * i);
                continue;
            }
            vst1q_u16((uint16_t *)(void *)(dst + 2 * i),
                      vreinterpretq_u16_f16(vcvt_high_f16_f32(vcvt_f16_f32(a), b)));
        }
    bnbw__store_f16_portable(src + i, n - i, dst + 2 * i);
}

static BNBW__UNUSED void bnbw__load_bf16_neon(const char *src, int64_t n, float *dst)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint16x8_t h = vld1q_u16((const uint16_t *)(const void *)(src + 2 * i));
        vst1q_u32((uint32_t *)(void *)(dst + i), vshll_n_u16(vget_low_u16(h), 16));
        vst1q_u32((uint32_t *)(void *)(dst + i + 4), vshll_high_n_u16(h, 16));
    }
    bnbw__load_bf16_portable(src + 2 * i, n - i, dst + i);
}

/* All ones in the lanes whose bit 16 is 0, zero elsewhere: lsb - 1 for rounding bf16 (CMGE #0
 * of x << 15, whose sign bit is bit 16). */
static inline uint32x4_t bnbw__bf16_lsb_minus_1(uint32x4_t x)
{
    return vcgezq_s32(vshlq_n_s32(vreinterpretq_s32_u32(x), 15));
}

/* 4 f32 lanes (numbers) rounded to nearest-even bf16: the high half of x + 0x7fff + lsb, which
 * RADDHN (adding 0x8000 as it narrows) computes as x + (lsb - 1) + 0x8000.  Integer code:
 * BFCVTN (Armv8.6) flushes subnormal inputs, as the portable code does not. */
static inline uint16x4_t bnbw__bf16_round4(uint32x4_t x)
{
    return vraddhn_u32(x, bnbw__bf16_lsb_minus_1(x));
}

/* ... into the high half of `lo`. */
static inline uint16x8_t bnbw__bf16_round4_high(uint16x4_t lo, uint32x4_t x)
{
    return vraddhn_high_u32(lo, x, bnbw__bf16_lsb_minus_1(x));
}

/* NaN lanes replaced by the quiet NaN 0x7fc00000 with their sign, which rounds to the bf16 of
 * every NaN (bnbw_f32_to_bf16); other lanes as they are. */
static inline uint32x4_t bnbw__bf16_quiet4(float32x4_t a)
{
    uint32x4_t x = vreinterpretq_u32_f32(a);
    uint32x4_t q = vorrq_u32(vandq_u32(x, vdupq_n_u32(0x80000000u)), vdupq_n_u32(0x7fc00000u));
    /* BIF in place (x where a == a, q elsewhere): left to choose, the compiler takes BSL, whose
     * result lands in the mask's register, and pays copies on the path without NaNs */
    __asm__("bif %0.16b, %1.16b, %2.16b" : "+w"(x) : "w"(q), "w"(vceqq_f32(a, a)));
    return x;
}

static BNBW__UNUSED void bnbw__store_bf16_neon(const float *src, int64_t n, char *dst)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        float32x4_t a = vld1q_f32(src + i), b = vld1q_f32(src + i + 4);
        uint32x4_t xa = vreinterpretq_u32_f32(a), xb = vreinterpretq_u32_f32(b);
        if (__builtin_expect(bnbw__any_nan_f32x8(a, b), 0)) {    /* rare: one test for both */
            __asm__ volatile("");  /* a branch: computed always and selected, it costs more */
            xa = bnbw__bf16_quiet4(a);
            xb = bnbw__bf16_quiet4(b);
        }
        vst1q_u16((uint16_t *)(void *)(dst + 2 * i),
                  bnbw__bf16_round4_high(bnbw__bf16_round4(xa), xb));
    }
    bnbw__store_bf16_portable(src + i, n - i, dst + 2 * i);
}

#define BNBW__PICK(simd, fast, portable) ((simd) ? (fast) : (portable))
#define BNBW__SIMD_PATH "f16: NEON, bf16: NEON"
#define BNBW__LOAD_F16 bnbw__load_f16_neon
#define BNBW__LOAD_F16_ARITH bnbw__load_f16_neon_arith
#define BNBW__STORE_F16 bnbw__store_f16_neon
#define BNBW__LOAD_BF16 bnbw__load_bf16_neon
#define BNBW__STORE_BF16 bnbw__store_bf16_neon

#else

#define BNBW__PICK(simd, fast, portable) ((void)(simd), (portable))
#define BNBW__SIMD_PATH "portable"
#define BNBW__LOAD_F16 bnbw__load_f16_portable
#define BNBW__LOAD_F16_ARITH bnbw__load_f16_portable
#define BNBW__STORE_F16 bnbw__store_f16_portable
#define BNBW__LOAD_BF16 bnbw__load_bf16_portable
#define BNBW__STORE_BF16 bnbw__store_bf16_portable

#endif

/* What the row converters run when their caller allows SIMD (see bnbw_load_f16). */
static BNBW__UNUSED const char *bnbw_half_simd_path(int simd)
{
    return BNBW__PICK(simd, BNBW__SIMD_PATH, "portable");
}

/* ---------------------------------------------------------------- public row converters */

typedef void (*bnbw__load_kernel)(const char *, int64_t, float *);
typedef void (*bnbw__store_kernel)(const float *, int64_t, char *);

#define BNBW__STAGE 256  /* elements gathered per strided step: 512 bytes of stack */

/* n items of `size` bytes from src to dst, each side with its own byte step: one memcpy when
 * both are contiguous. */
static inline void bnbw__copy_items(char *dst, int64_t dst_step, const char *src,
                                    int64_t src_step, int64_t n, int64_t size)
{
    if (n <= 0)
        return;
    if (dst_step == size && src_step == size) {
        memcpy(dst, src, (size_t)(n * size));
        return;
    }
    for (int64_t i = 0; i < n; i++)
        memcpy(dst + i * dst_step, src + i * src_step, (size_t)size);
}

/* Elements in the stage from element i of n. */
static inline int64_t bnbw__stage_length(int64_t i, int64_t n)
{
    return n - i < BNBW__STAGE ? n - i : BNBW__STAGE;
}

static inline void bnbw__load16(bnbw__load_kernel k, const char *src, int64_t src_stride,
                                int64_t n, float *dst)
{
    if (src_stride == 2) {
        k(src, n, dst);
        return;
    }
    char buf[2 * BNBW__STAGE];
    for (int64_t i = 0; i < n; i += BNBW__STAGE) {
        int64_t m = bnbw__stage_length(i, n);
        bnbw__copy_items(buf, 2, src + i * src_stride, src_stride, m, 2);
        k(buf, m, dst + i);
    }
}

static inline void bnbw__store16(bnbw__store_kernel k, const float *src, int64_t n, char *dst,
                                 int64_t dst_stride)
{
    if (dst_stride == 2) {
        k(src, n, dst);
        return;
    }
    char buf[2 * BNBW__STAGE];
    for (int64_t i = 0; i < n; i += BNBW__STAGE) {
        int64_t m = bnbw__stage_length(i, n);
        k(src + i, m, buf);
        bnbw__copy_items(dst + i * dst_stride, dst_stride, buf, 2, m, 2);
    }
}

static BNBW__UNUSED void bnbw_load_f16(const char *src, int64_t src_stride, int64_t n, float *dst,
                                       int simd)
{
    bnbw__load16(BNBW__PICK(simd, BNBW__LOAD_F16, bnbw__load_f16_portable), src, src_stride, n, dst);
}

/* bnbw_load_f16 for arithmetic: the same values, NaN payloads not preserved (see above). */
static BNBW__UNUSED void bnbw_load_f16_arith(const char *src, int64_t src_stride, int64_t n,
                                             float *dst, int simd)
{
    bnbw__load16(BNBW__PICK(simd, BNBW__LOAD_F16_ARITH, bnbw__load_f16_portable), src,
                 src_stride, n, dst);
}

static BNBW__UNUSED void bnbw_store_f16(const float *src, int64_t n, char *dst, int64_t dst_stride,
                                        int simd)
{
    bnbw__store16(BNBW__PICK(simd, BNBW__STORE_F16, bnbw__store_f16_portable), src, n, dst, dst_stride);
}

static BNBW__UNUSED void bnbw_load_bf16(const char *src, int64_t src_stride, int64_t n, float *dst,
                                        int simd)
{
    bnbw__load16(BNBW__PICK(simd, BNBW__LOAD_BF16, bnbw__load_bf16_portable), src, src_stride, n, dst);
}

static BNBW__UNUSED void bnbw_store_bf16(const float *src, int64_t n, char *dst, int64_t dst_stride,
                                         int simd)
{
    bnbw__store16(BNBW__PICK(simd, BNBW__STORE_BF16, bnbw__store_bf16_portable), src, n, dst, dst_stride);
}

static BNBW__UNUSED void bnbw_load_f32(const char *src, int64_t src_stride, int64_t n, float *dst)
{
    bnbw__copy_items((char *)dst, 4, src, src_stride, n, 4);
}

static BNBW__UNUSED void bnbw_store_f32(const float *src, int64_t n, char *dst, int64_t dst_stride)
{
    bnbw__copy_items(dst, dst_stride, (const char *)src, 4, n, 4);
}

#endif /* BNBW_HALF_H */
