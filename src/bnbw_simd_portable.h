/*
 * bnbw_simd_portable.h - the kernels' vector layer in portable C: the definition every other layer
 * (bnbw_simd_avx2.h, bnbw_simd_avx512.h, ...) must match lane for lane and bit for bit.
 *
 *   vf   16 f32 lanes        vd   16 f64 lanes (lane l of a vd widens lane l of a vf)
 *   vm   16 lane predicates
 *   vw   16 f32 lanes held the way the layer widens them to f64 cheapest (the exact sums)
 *
 * What maps to what.  Two implementations of one definition, chosen by the compiler:
 *
 *   GNU C vectors (GCC, Clang: __builtin_convertvector and __builtin_shufflevector)
 *     vf   4 vectors of 4 f32      lanes 4k..4k+3 in q[k]
 *     vd   8 vectors of 2 f64      lanes 2k, 2k+1 in p[k]
 *     vm   4 vectors of 4 int32    all bits set in a true lane, 0 in a false one
 *     Every vector is 128 bits, a register of the common SIMD instruction sets (SSE2, the
 *     x86-64 baseline; NEON; VSX; the z vector facility), and compilers lower it to scalar
 *     code on targets without one.  Wider generic vectors would go through the stack where the
 *     target has no registers that wide.  Nothing here is an instruction set's intrinsic.
 *   plain C (any other compiler, or BNBW_PORTABLE_SCALAR defined)
 *     vf, vd, vm   arrays of 16 lanes, each operation a loop over the lanes.
 * tests/engine/portable/check_layer.c checks both, and tests/engine/test_digests.py the
 * kernels built on them, against the same recorded results.
 *
 * The arithmetic.  Every lane operation is one IEEE operation of its type, rounded to nearest
 * even; FP contraction is off (-ffp-contract=off), so a * b + c rounds twice unless written as
 * vf_fma.  vf_fma is fmaf: a * b + c rounded once.  Where the target has an FMA instruction
 * (BNBW__FMA_INSTRUCTION) it is that instruction; elsewhere (the x86-64 baseline, where fmaf is
 * a libm call) it is computed exactly in f64: v__fmaf_exact below says how, vf_fma does the
 * same 16 lanes at a time with a fast path, and tests/engine/portable/ checks both against fmaf.
 * The floating-point environment is the default one (round to nearest, no flushing of
 * subnormals), as for every other operation of the kernels.
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

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bnbw_half.h"
#include "bnbw_kernels.h"
#include "bnbw_simd_scalar.h"

#define BNBW_SIMD_BODY BNBW_BODY_PORTABLE
/* Lane order the elementwise kernels use for contiguous bf16 rows (see bnbw_simd_avx2.h). */
#define BNBW_SIMD_BF16_EVEN_ODD 0
/* Packed short rows spread and add through arrays (bnbw_kernels_impl.h). */
#define BNBW_SIMD_PACKED_ROWS 0
/* Runs of 16 channels whose two f64 sums a row loop keeps in registers (the least any target holds). */
#define BNBW_SIMD_SUM_RUNS 1

#ifdef __has_builtin
#define BNBW__HAS_BUILTIN(x) __has_builtin(x)
#else
#define BNBW__HAS_BUILTIN(x) 0
#endif

/* f64 operations round to f64 (FLT_EVAL_METHOD 0 or 1; not 2, x87's extended precision, where
 * the error term of an f64 sum is not exact): the fmaf emulation relies on it. */
#if defined(FLT_EVAL_METHOD) && (FLT_EVAL_METHOD == 0 || FLT_EVAL_METHOD == 1)
#define BNBW__IEEE_DOUBLE 1
#else
#define BNBW__IEEE_DOUBLE 0
#endif

/* GNU C vectors: the compiler has them, f64 arithmetic is IEEE double, and the plain C layer
 * was not asked for. */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(BNBW_PORTABLE_SCALAR)                \
    && BNBW__HAS_BUILTIN(__builtin_convertvector) && BNBW__HAS_BUILTIN(__builtin_shufflevector) \
    && BNBW__IEEE_DOUBLE && defined(__BYTE_ORDER__)
#define BNBW__GNU_VECTORS 1
#define BNBW_INLINE static inline __attribute__((always_inline))
#else
#define BNBW__GNU_VECTORS 0
#define BNBW_INLINE static inline
#endif

/* An FMA instruction for f32: fmaf is that instruction, and a lane loop of them vectorises.
 * BNBW_PORTABLE_EMULATED_FMA takes the emulation anyway (tests/engine/portable/ checks it
 * everywhere). */
#if !defined(BNBW_PORTABLE_EMULATED_FMA)                                                       \
    && (defined(__FMA__) || defined(__ARM_FEATURE_FMA) || defined(__FP_FAST_FMAF) || defined(FP_FAST_FMAF))
#define BNBW__FMA_INSTRUCTION 1
#else
#define BNBW__FMA_INSTRUCTION 0
#endif

/* ---- the scalar definitions ---------------------------------------------------------------- */

/* fmaf(a, b, c) without an FMA instruction: a * b is exact in f64 (24 + 24 bits), and so is the
 * error e of s = a * b + c rounded to f64 (two-sum; no overflow: |a * b| <= 2^256).  Rounding
 * the exact sum s + e to odd - s itself when e == 0 or when s's last bit is 1, else the f64
 * neighbour of s towards e - keeps on which side of every f32 rounding boundary it lies, since
 * f64 has 29 more bits than f32; so rounding that to f32 gives the exact sum rounded once.
 * Infinite and NaN s (e is NaN then) pass unchanged: fmaf gives the same.  The sum is never
 * zero with e != 0 (both terms are multiples of 2^-298), so stepping s down never crosses 0. */
static inline float v__fmaf_exact(float a, float b, float c)
{
    double p = (double)a * (double)b, s = p + (double)c;
    double bb = s - p, e = (p - (s - bb)) + ((double)c - bb);
    if (e != 0.0 && e == e) {
        uint64_t bits;
        memcpy(&bits, &s, 8);
        if ((e < 0.0) != (s < 0.0))
            bits -= 1;             /* towards zero: the neighbour below in magnitude */
        bits |= 1;
        memcpy(&s, &bits, 8);
    }
    return (float)s;
}

/* fmaf as the kernels call it: the instruction, or the emulation where f64 arithmetic is exact
 * IEEE double (elsewhere, libm's fmaf). */
static inline float v__fmaf(float a, float b, float c)
{
#if BNBW__FMA_INSTRUCTION || !BNBW__IEEE_DOUBLE
    return fmaf(a, b, c);
#else
    return v__fmaf_exact(a, b, c);
#endif
}

/* Element e of a vector loaded with lane order eo. */
static inline int v__element(int l, int eo) { return eo ? (l < 8 ? 2 * l : 2 * (l - 8) + 1) : l; }

#if BNBW__GNU_VECTORS
/* ================================================================================================
 * GNU C vectors
 * ============================================================================================== */

typedef float v__f4 __attribute__((vector_size(16)));
typedef double v__d2 __attribute__((vector_size(16)));
typedef double v__d4 __attribute__((vector_size(32)));       /* only inside a conversion */
typedef int32_t v__i4 __attribute__((vector_size(16)));
typedef uint32_t v__u4 __attribute__((vector_size(16)));
typedef int64_t v__l2 __attribute__((vector_size(16)));
typedef uint16_t v__h8 __attribute__((vector_size(16)));
typedef int16_t v__s8 __attribute__((vector_size(16)));
typedef signed char v__b16 __attribute__((vector_size(16)));

typedef struct { v__f4 q[4]; } vf;
typedef struct { v__d2 p[8]; } vd;
typedef struct { v__i4 q[4]; } vm;

#define V__Q(k) for (int k = 0; k < 4; ++k)
#define V__P(k) for (int k = 0; k < 8; ++k)

/* Which 16-bit half of a 32-bit lane comes first in memory: the shuffles that split and join
 * halves name it, everything else is independent of the byte order. */
#define V__LITTLE (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__)

/* One 128-bit vector from or to memory (memcpy: any alignment, no aliasing question; compilers
 * make it one unaligned load or store).  A whole vf or vd goes vector by vector: copied at once,
 * it would be copied through the stack. */
#define V__MEMORY(T, NAME)                                                                      \
    BNBW_INLINE T v__load_##NAME(const void *p) { T v; memcpy(&v, p, 16); return v; }           \
    BNBW_INLINE void v__store_##NAME(void *p, T v) { memcpy(p, &v, 16); }
V__MEMORY(v__f4, f4)
V__MEMORY(v__d2, d2)
V__MEMORY(v__i4, i4)
V__MEMORY(v__u4, u4)
V__MEMORY(v__h8, h8)
V__MEMORY(v__b16, b16)

/* lanes 0, 1 and 2, 3 of a widened to f64 (one conversion, which compilers split best) */
BNBW_INLINE void v__widen(v__f4 a, v__d2 *lo, v__d2 *hi)
{
    v__d4 w = __builtin_convertvector(a, v__d4);
    *lo = __builtin_shufflevector(w, w, 0, 1);
    *hi = __builtin_shufflevector(w, w, 2, 3);
}
/* lanes lo, hi rounded to f32 */
BNBW_INLINE v__f4 v__narrow(v__d2 lo, v__d2 hi)
{
    return __builtin_convertvector(__builtin_shufflevector(lo, hi, 0, 1, 2, 3), v__f4);
}
/* a lane mask of 4 lanes as the masks of its f64 lanes 0, 1 and 2, 3 */
BNBW_INLINE v__l2 v__mask_lo(v__i4 m) { return (v__l2)__builtin_shufflevector(m, m, 0, 0, 1, 1); }
BNBW_INLINE v__l2 v__mask_hi(v__i4 m) { return (v__l2)__builtin_shufflevector(m, m, 2, 2, 3, 3); }

BNBW_INLINE vf vf_zero(void) { vf r; V__Q(k) r.q[k] = (v__f4){0.0f, 0.0f, 0.0f, 0.0f}; return r; }
BNBW_INLINE vf vf_set1(float a) { vf r; V__Q(k) r.q[k] = (v__f4){a, a, a, a}; return r; }
BNBW_INLINE vf vf_loadu(const float *p) { vf r; V__Q(k) r.q[k] = v__load_f4(p + 4 * k); return r; }
BNBW_INLINE void vf_storeu(float *p, vf a) { V__Q(k) v__store_f4(p + 4 * k, a.q[k]); }
BNBW_INLINE vf vf_add(vf a, vf b) { V__Q(k) a.q[k] += b.q[k]; return a; }
BNBW_INLINE vf vf_sub(vf a, vf b) { V__Q(k) a.q[k] -= b.q[k]; return a; }
BNBW_INLINE vf vf_mul(vf a, vf b) { V__Q(k) a.q[k] *= b.q[k]; return a; }

#if BNBW__FMA_INSTRUCTION
/* a * b + c rounded once: the target's instruction, lane by lane (compilers vectorise it) */
BNBW_INLINE v__f4 v__fma4(v__f4 a, v__f4 b, v__f4 c)
{
#if BNBW__HAS_BUILTIN(__builtin_elementwise_fma)
    return __builtin_elementwise_fma(a, b, c);
#else
    v__f4 r;
    for (int l = 0; l < 4; ++l)
        r[l] = __builtin_fmaf(a[l], b[l], c[l]);
    return r;
#endif
}
/* a * b + c, rounded once */
BNBW_INLINE vf vf_fma(vf a, vf b, vf c) { V__Q(k) a.q[k] = v__fma4(a.q[k], b.q[k], c.q[k]); return a; }
#else
/* p + c rounded to odd in f64 (v__fmaf_exact, two lanes): e is the exact error of s.  Where e
 * is nonzero (e * e > 0: false for a NaN e, which an infinite s has, and never 0 for a nonzero
 * e, a multiple of 2^-298), s steps one unit towards zero when e points that way (e * s < 0;
 * comparisons give -1 in true lanes, so adding the mask steps), then its last bit is set. */
BNBW_INLINE v__d2 v__sum_to_odd(v__d2 p, v__d2 c)
{
    const v__d2 s = p + c, bb = s - p, e = (p - (s - bb)) + (c - bb);
    const v__l2 inexact = (v__l2)(e * e > 0.0), down = (v__l2)(e * s < 0.0);
    return (v__d2)(((v__l2)s + down) | (inexact & 1));
}

/* 16 lanes of a * b + c rounded once.  a * b is exact in f64, so rounding p + c to f64 and then
 * to f32 gives the right bits unless the f64 sum s lands on a point where the f32 rounding
 * turns (then which side of it p + c lay was lost): a midpoint between two normal floats, the
 * 29 bits f64 has beyond f32 being 1 and 28 zeros (in the low 32 bits of s); or, below 2^-126,
 * where f32 has fewer bits and other midpoints, any s but 0 (s is 0 only when p + c is).
 * Anywhere else s and p + c lie strictly on the same side of every such point.  A vector with
 * a doubtful lane - about 2^-29 of random sums - takes the sums rounded to odd instead. */
BNBW_INLINE vf vf_fma(vf a, vf b, vf c)
{
    vf r;
    v__i4 doubt = {0, 0, 0, 0};
    V__Q(k) {
        v__d2 al, ah, bl, bh, cl, ch;
        v__widen(a.q[k], &al, &ah);
        v__widen(b.q[k], &bl, &bh);
        v__widen(c.q[k], &cl, &ch);
        const v__d2 lo = al * bl + cl, hi = ah * bh + ch;
        r.q[k] = v__narrow(lo, hi);
        /* the low and the high 32 bits of the 4 sums */
#if V__LITTLE
        const v__i4 low = __builtin_shufflevector((v__i4)lo, (v__i4)hi, 0, 2, 4, 6);
        const v__i4 high = __builtin_shufflevector((v__i4)lo, (v__i4)hi, 1, 3, 5, 7);
#else
        const v__i4 low = __builtin_shufflevector((v__i4)lo, (v__i4)hi, 1, 3, 5, 7);
        const v__i4 high = __builtin_shufflevector((v__i4)lo, (v__i4)hi, 0, 2, 4, 6);
#endif
        doubt |= (v__i4)((low & 0x1fffffff) == 0x10000000);
        /* 0 < |s| < 2^-126: the magnitude's high bits m in [1, 897 << 20), moved by
           0x7fffffff to [INT32_MIN, INT32_MIN + (897 << 20) - 1) (and m = 0 to INT32_MAX) so
           that one signed comparison tells */
        const v__i4 m = (v__i4)(((v__u4)high & 0x7fffffffu) + 0x7fffffffu);
        doubt |= (v__i4)((INT32_MIN + (897 << 20) - 1) > m);
    }
    const v__l2 any = (v__l2)doubt;
    if (__builtin_expect((any[0] | any[1]) != 0, 0)) {
        /* copies of a, b, c through memory: no product of the common path is kept for this */
        vf a2 = a, b2 = b, c2 = c;
        __asm__("" : "+m"(a2), "+m"(b2), "+m"(c2));
        V__Q(k) {
            v__d2 al, ah, bl, bh, cl, ch;
            v__widen(a2.q[k], &al, &ah);
            v__widen(b2.q[k], &bl, &bh);
            v__widen(c2.q[k], &cl, &ch);
            r.q[k] = v__narrow(v__sum_to_odd(al * bl, cl), v__sum_to_odd(ah * bh, ch));
        }
    }
    return r;
}
#endif
/* a + b and a - b, which other bodies may issue on their multiply pipes (same bits) */
BNBW_INLINE vf vf_add_mp(vf a, vf b) { return vf_add(a, b); }
BNBW_INLINE vf vf_sub_mp(vf a, vf b) { return vf_sub(a, b); }
/* a, as a value the compiler must hold whole in a register (other bodies) */
BNBW_INLINE vf vf_opaque(vf a) { return a; }
BNBW_INLINE vf vf_keep(vf a, vm m) { V__Q(k) a.q[k] = (v__f4)((v__i4)a.q[k] & m.q[k]); return a; }
BNBW_INLINE vf vf_select(vm m, vf a, vf b)
{
    V__Q(k) a.q[k] = (v__f4)(((v__i4)a.q[k] & m.q[k]) | ((v__i4)b.q[k] & ~m.q[k]));
    return a;
}

BNBW_INLINE vm vm_below(int64_t t)
{
    const int32_t n = t < 0 ? 0 : t > 16 ? 16 : (int32_t)t;
    vm r;
    V__Q(k) r.q[k] = (v__i4)((v__i4){4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3} < n);
    return r;
}
BNBW_INLINE vm vm_finite2(vf a, vf b)
{
    vm r;
    V__Q(k) r.q[k] = (v__i4)((a.q[k] - a.q[k] == 0.0f) & (b.q[k] - b.q[k] == 0.0f));
    return r;
}
BNBW_INLINE int vm_all(vm m)
{
    v__i4 a = m.q[0] & m.q[1] & m.q[2] & m.q[3];
    return (a[0] & a[1] & a[2] & a[3]) != 0;
}

/* the lanes a ReLU keeps: a > 0, or a NaN (which it passes on) */
BNBW_INLINE vm vm_relu(vf a)
{
    vm r;
    V__Q(k) r.q[k] = (v__i4)((a.q[k] > 0.0f) | (a.q[k] != a.q[k]));
    return r;
}

BNBW_INLINE vd vd_zero(void) { vd r; V__P(k) r.p[k] = (v__d2){0.0, 0.0}; return r; }
BNBW_INLINE vd vd_loadu(const double *p) { vd r; V__P(k) r.p[k] = v__load_d2(p + 2 * k); return r; }
BNBW_INLINE void vd_storeu(double *p, vd a) { V__P(k) v__store_d2(p + 2 * k, a.p[k]); }
BNBW_INLINE vd vd_add_f32(vd acc, vf a)
{
    V__Q(k) {
        v__d2 lo, hi;
        v__widen(a.q[k], &lo, &hi);
        acc.p[2 * k] += lo;
        acc.p[2 * k + 1] += hi;
    }
    return acc;
}
/* acc + a * b with the product exact in f64: one rounding */
BNBW_INLINE vd vd_fma_f32(vd acc, vf a, vf b)
{
    V__Q(k) {
        v__d2 al, ah, bl, bh;
        v__widen(a.q[k], &al, &ah);
        v__widen(b.q[k], &bl, &bh);
        acc.p[2 * k] += al * bl;
        acc.p[2 * k + 1] += ah * bh;
    }
    return acc;
}
BNBW_INLINE vd vd_select(vm m, vd a, vd b)
{
    V__Q(k) {
        v__l2 lo = v__mask_lo(m.q[k]), hi = v__mask_hi(m.q[k]);
        a.p[2 * k] = (v__d2)(((v__l2)a.p[2 * k] & lo) | ((v__l2)b.p[2 * k] & ~lo));
        a.p[2 * k + 1] = (v__d2)(((v__l2)a.p[2 * k + 1] & hi) | ((v__l2)b.p[2 * k + 1] & ~hi));
    }
    return a;
}
BNBW_INLINE vd vd_add(vd a, vd b) { V__P(k) a.p[k] += b.p[k]; return a; }
BNBW_INLINE vd vd_sub(vd a, vd b) { V__P(k) a.p[k] -= b.p[k]; return a; }
BNBW_INLINE vd vd_mul(vd a, vd b) { V__P(k) a.p[k] *= b.p[k]; return a; }
/* lanes folded pairwise: l += l + 8, l += l + 4, l += l + 2, l += l + 1 */
BNBW_INLINE double vd_fold(vd a)
{
    V__Q(k) a.p[k] += a.p[k + 4];
    a.p[0] += a.p[2];
    a.p[1] += a.p[3];
    a.p[0] += a.p[1];
    return a.p[0][0] + a.p[0][1];
}
/* lane l: a[l] + a[l ^ w] (w = 1, 2 or 4), the step of vd_fold within groups of 2w lanes */
BNBW_INLINE vd vd_add_partners(vd a, int w)
{
    vd r;
    V__P(k) {
        v__d2 b = a.p[k ^ (w >> 1)];
        if (w == 1) {
            b[0] = a.p[k][1];
            b[1] = a.p[k][0];
        }
        r.p[k] = a.p[k] + b;
    }
    return r;
}

/* ---- halves ------------------------------------------------------------------------------ */

/* 32-bit lanes from 16-bit halves: lane j of the result has `hi` element j (or j + 4) in its
 * high half and `lo` element j (j + 4) in its low half - one interleave. */
BNBW_INLINE v__u4 v__join_lo(v__h8 hi, v__h8 lo)
{
#if V__LITTLE
    return (v__u4)__builtin_shufflevector(lo, hi, 0, 8, 1, 9, 2, 10, 3, 11);
#else
    return (v__u4)__builtin_shufflevector(hi, lo, 0, 8, 1, 9, 2, 10, 3, 11);
#endif
}
BNBW_INLINE v__u4 v__join_hi(v__h8 hi, v__h8 lo)
{
#if V__LITTLE
    return (v__u4)__builtin_shufflevector(lo, hi, 4, 12, 5, 13, 6, 14, 7, 15);
#else
    return (v__u4)__builtin_shufflevector(hi, lo, 4, 12, 5, 13, 6, 14, 7, 15);
#endif
}
/* The low halves of the 32-bit lanes of a, then of b (lanes <= 0xffff: the values). */
BNBW_INLINE v__h8 v__pack_low(v__u4 a, v__u4 b)
{
#if V__LITTLE
    return __builtin_shufflevector((v__h8)a, (v__h8)b, 0, 2, 4, 6, 8, 10, 12, 14);
#else
    return __builtin_shufflevector((v__h8)a, (v__h8)b, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

/* f16 bits (low half of each lane) as f32 bits, as bnbw_f16_to_f32: normal halves rebias the
 * exponent (+112), infinities and NaNs get the f32 exponent 255 with the payload kept (never
 * quieted), subnormal halves are their 10-bit integer times 2^-24 (exact in f32; no subnormal
 * f32 on the way, so flushing them to zero - DAZ, FTZ - changes nothing). */
BNBW_INLINE v__u4 v__f16_bits_to_f32(v__u4 h)
{
    const v__u4 sign = (h & 0x8000u) << 16, mag = h & 0x7fffu;
    v__u4 bits = (mag << 13) + 0x38000000u;
    bits += (v__u4)((v__i4)mag > 0x7bff) & 0x38000000u;     /* >: one comparison */
    const v__u4 sub = (v__u4)(0x0400 > (v__i4)mag);
    const v__u4 small = (v__u4)(__builtin_convertvector((v__i4)mag, v__f4) * 0x1p-24f);
    return ((bits & ~sub) | (small & sub)) | sign;
}

/* f32 bits as f16 bits (low half of each lane), as bnbw_f32_to_f16.  Normal halves round 13 bits
 * off to nearest even (a carry moves into the exponent, as it should, up to infinity; larger
 * magnitudes give larger values, clamped to infinity); below 2^-14 the magnitude plus 0.5f
 * rounds it to a multiple of 2^-24 (0.5f's unit) in one IEEE addition, whose bits less those of
 * 0.5f are the half's (a subnormal f32 read as 0 gives the same 0).  NaNs - rare, so the
 * caller looks for them once per 16 lanes (any_nan) and then calls v__f16_nans - keep the top
 * of their payload, made nonzero. */
BNBW_INLINE v__u4 v__f32_bits_to_f16(v__u4 x, v__i4 *any_nan)
{
    const v__u4 ua = x & 0x7fffffffu;
    const v__i4 a = (v__i4)ua;
    const v__u4 normal = (ua - 0x38000000u + 0xfffu + ((ua >> 13) & 1u)) >> 13;
    const v__u4 small = (v__u4)((v__f4)ua + 0.5f) - 0x3f000000u;
    const v__u4 is_small = (v__u4)(0x38800000 > a), is_big = (v__u4)(a > 0x477fffff);
    v__u4 r = (small & is_small) | (normal & ~is_small);
    r = (r & ~is_big) | (0x7c00u & is_big);
    *any_nan |= (v__i4)(a > 0x7f800000);
    return r | ((x >> 16) & 0x8000u);
}

/* ... the NaN lanes of x given their bits (r: the other lanes' bits). */
BNBW_INLINE v__u4 v__f16_nans(v__u4 x, v__u4 r)
{
    const v__u4 is_nan = (v__u4)((v__i4)(x & 0x7fffffffu) > 0x7f800000);
    const v__u4 m = (x >> 13) & 0x3ffu;
    const v__u4 nan = 0x7c00u | m | ((v__u4)(m == 0u) & 1u) | ((x >> 16) & 0x8000u);
    return (r & ~is_nan) | (nan & is_nan);
}

/* f32 bits as bf16 bits (low half of each lane), as bnbw_f32_to_bf16: nearest even on the low 16
 * bits, NaNs the quiet NaN 0x7fc0 with their sign. */
BNBW_INLINE v__u4 v__f32_bits_to_bf16(v__u4 x)
{
    const v__u4 rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    const v__u4 is_nan = (v__u4)((v__i4)(x & 0x7fffffffu) > 0x7f800000);
    const v__u4 nan = ((x >> 16) & 0x8000u) | 0x7fc0u;
    return (rounded & ~is_nan) | (nan & is_nan);
}

/* 16 elements of type dt at p (contiguous) as 16 f32 lanes, element order; halves exactly. */
BNBW_INLINE vf v__load16(const void *p, int dt)
{
    vf r;
    if (dt == BNBW_F32)
        return vf_loadu((const float *)p);
    const v__h8 h[2] = {v__load_h8(p), v__load_h8((const char *)p + 16)};
    const v__h8 zero = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < 2; ++k) {
        v__u4 lo, hi;
        if (dt == BNBW_BF16) {     /* a bf16 is the high half of its f32 */
            lo = v__join_lo(h[k], zero);
            hi = v__join_hi(h[k], zero);
        } else {
            lo = v__f16_bits_to_f32(v__join_lo(zero, h[k]));
            hi = v__f16_bits_to_f32(v__join_hi(zero, h[k]));
        }
        r.q[2 * k] = (v__f4)lo;
        r.q[2 * k + 1] = (v__f4)hi;
    }
    return r;
}

/* 16 contiguous bf16 in even/odd lane order: each 32-bit word of the row holds an even element
 * and the next odd one, so a shift and a mask take them apart. */
BNBW_INLINE vf v__load16_bf16_eo(const void *p)
{
    const v__u4 w[2] = {v__load_u4(p), v__load_u4((const char *)p + 16)};
    vf r;
    for (int k = 0; k < 2; ++k) {
#if V__LITTLE
        r.q[k] = (v__f4)(w[k] << 16);
        r.q[k + 2] = (v__f4)(w[k] & 0xffff0000u);
#else
        r.q[k] = (v__f4)(w[k] & 0xffff0000u);
        r.q[k + 2] = (v__f4)(w[k] << 16);
#endif
    }
    return r;
}

/* 16 lanes (element order) as 16 elements of type dt at p, rounded to nearest even. */
BNBW_INLINE void v__store16(void *p, vf a, int dt)
{
    if (dt == BNBW_F32) {
        vf_storeu((float *)p, a);
        return;
    }
    v__u4 r[4];
    if (dt == BNBW_BF16) {
        V__Q(k) r[k] = v__f32_bits_to_bf16((v__u4)a.q[k]);
    } else {
        v__i4 any_nan = {0, 0, 0, 0};
        V__Q(k) r[k] = v__f32_bits_to_f16((v__u4)a.q[k], &any_nan);
        const v__l2 any = (v__l2)any_nan;
        if (__builtin_expect((any[0] | any[1]) != 0, 0))
            V__Q(k) r[k] = v__f16_nans((v__u4)a.q[k], r[k]);
    }
    for (int k = 0; k < 2; ++k)
        v__store_h8((char *)p + 16 * k, v__pack_low(r[2 * k], r[2 * k + 1]));
}

/* Element-order quarters as even/odd quarters (4 shuffles), and back. */
BNBW_INLINE v__i4 v__evens(v__i4 a, v__i4 b) { return __builtin_shufflevector(a, b, 0, 2, 4, 6); }
BNBW_INLINE v__i4 v__odds(v__i4 a, v__i4 b) { return __builtin_shufflevector(a, b, 1, 3, 5, 7); }
BNBW_INLINE void v__to_even_odd(v__i4 q[4])
{
    v__i4 e0 = v__evens(q[0], q[1]), e1 = v__evens(q[2], q[3]);
    v__i4 o0 = v__odds(q[0], q[1]), o1 = v__odds(q[2], q[3]);
    q[0] = e0, q[1] = e1, q[2] = o0, q[3] = o1;
}
BNBW_INLINE void v__to_elements(v__i4 q[4])
{
    v__i4 a = __builtin_shufflevector(q[0], q[2], 0, 4, 1, 5);
    v__i4 b = __builtin_shufflevector(q[0], q[2], 2, 6, 3, 7);
    v__i4 c = __builtin_shufflevector(q[1], q[3], 0, 4, 1, 5);
    v__i4 d = __builtin_shufflevector(q[1], q[3], 2, 6, 3, 7);
    q[0] = a, q[1] = b, q[2] = c, q[3] = d;
}
BNBW_INLINE vf v__vf_even_odd(vf a)
{
    v__i4 q[4];
    V__Q(k) q[k] = (v__i4)a.q[k];
    v__to_even_odd(q);
    V__Q(k) a.q[k] = (v__f4)q[k];
    return a;
}
BNBW_INLINE vf v__vf_elements(vf a)
{
    v__i4 q[4];
    V__Q(k) q[k] = (v__i4)a.q[k];
    v__to_elements(q);
    V__Q(k) a.q[k] = (v__f4)q[k];
    return a;
}

/* ---- rows -------------------------------------------------------------------------------- */

/* Elements i.. at `step` elements apart, gathered into buf (16 elements of dt). */
BNBW_INLINE void v__gather(void *buf, const void *row, int64_t i, int64_t t, int64_t step, int dt)
{
    const int64_t isz = BNBW_ITEMSIZE(dt);
    for (int64_t l = 0; l < t; ++l)
        memcpy((char *)buf + l * isz, (const char *)row + (i + l) * step * isz, (size_t)isz);
}
BNBW_INLINE void v__scatter(void *row, int64_t i, int64_t t, int64_t step, const void *buf, int dt)
{
    const int64_t isz = BNBW_ITEMSIZE(dt);
    for (int64_t l = 0; l < t; ++l)
        memcpy((char *)row + (i + l) * step * isz, (const char *)buf + l * isz, (size_t)isz);
}

/* n < 64 bytes (a multiple of 2) in pieces of fixed size, largest first: each a move or two,
 * where a memcpy of n bytes would be a call. */
BNBW_INLINE void v__copy_short(void *dst, const void *src, int64_t n)
{
    char *d = (char *)dst;
    const char *s = (const char *)src;
    for (int64_t piece = 32; piece >= 2; piece /= 2)
        if (n & piece) {
            memcpy(d, s, (size_t)piece);
            d += piece;
            s += piece;
        }
}

BNBW_INLINE vf v_load(const void *row, int64_t i, int64_t step, int dt, int eo)
{
    float buf[16];
    const void *p = (const char *)row + i * BNBW_ITEMSIZE(dt);
    if (step != 1) {
        v__gather(buf, row, i, 16, step, dt);
        p = buf;
    }
    if (eo && dt == BNBW_BF16)
        return v__load16_bf16_eo(p);
    vf r = v__load16(p, dt);
    return eo ? v__vf_even_odd(r) : r;
}

BNBW_INLINE void v_store(void *row, int64_t i, int64_t step, vf a, int dt, int eo)
{
    if (eo)
        a = v__vf_elements(a);
    if (step == 1) {
        v__store16((char *)row + i * BNBW_ITEMSIZE(dt), a, dt);
        return;
    }
    float buf[16] = {0};
    v__store16(buf, a, dt);
    v__scatter(row, i, 16, step, buf, dt);
}

BNBW_INLINE vf v_load_part(const void *row, int64_t i, int64_t t, int64_t step, int dt)
{
    float buf[16] = {0};           /* +0 in every format */
    if (step == 1)
        v__copy_short(buf, (const char *)row + i * BNBW_ITEMSIZE(dt), t * BNBW_ITEMSIZE(dt));
    else
        v__gather(buf, row, i, t, step, dt);
    return v__load16(buf, dt);
}

BNBW_INLINE void v_store_part(void *row, int64_t i, int64_t t, int64_t step, vf a, int dt)
{
    float buf[16] = {0};
    v__store16(buf, a, dt);
    if (step == 1)
        v__copy_short((char *)row + i * BNBW_ITEMSIZE(dt), buf, t * BNBW_ITEMSIZE(dt));
    else
        v__scatter(row, i, t, step, buf, dt);
}

/* vw: the same values as vf, in the same registers. */
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
    V__Q(k) v__widen(a.q[k], &r.p[2 * k], &r.p[2 * k + 1]);
    return r;
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

/* ---- the ReLU mask ------------------------------------------------------------------------ */

/* 16 bools as lane masks: each byte's test result (0 or -1) repeated over the bytes of its
 * lane by two interleaves with itself, which no byte order can tell apart. */
BNBW_INLINE vm v__bool_lanes(const unsigned char *b16)
{
    const v__b16 on = (v__b16)(v__load_b16(b16) != 0);
    const v__s8 lo = (v__s8)__builtin_shufflevector(on, on, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                                                    6, 22, 7, 23);
    const v__s8 hi = (v__s8)__builtin_shufflevector(on, on, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28,
                                                    13, 29, 14, 30, 15, 31);
    vm r;
    r.q[0] = (v__i4)__builtin_shufflevector(lo, lo, 0, 8, 1, 9, 2, 10, 3, 11);
    r.q[1] = (v__i4)__builtin_shufflevector(lo, lo, 4, 12, 5, 13, 6, 14, 7, 15);
    r.q[2] = (v__i4)__builtin_shufflevector(hi, hi, 0, 8, 1, 9, 2, 10, 3, 11);
    r.q[3] = (v__i4)__builtin_shufflevector(hi, hi, 4, 12, 5, 13, 6, 14, 7, 15);
    return r;
}

BNBW_INLINE vm v__positive(vf a)
{
    vm r;
    V__Q(k) r.q[k] = (v__i4)(a.q[k] > 0.0f);
    return r;
}

BNBW_INLINE vm v_active(const void *mask, int64_t i, int64_t step, int mdt, int eo)
{
    vm r;
    if (mdt != BNBW_BOOL)
        return v__positive(v_load(mask, i, step, mdt, eo));
    const unsigned char *p = (const unsigned char *)mask;
    if (step == 1) {
        r = v__bool_lanes(p + i);
    } else {
        unsigned char buf[16];
        for (int l = 0; l < 16; ++l)
            buf[l] = p[(i + l) * step];
        r = v__bool_lanes(buf);
    }
    if (eo)
        v__to_even_odd(r.q);
    return r;
}

BNBW_INLINE vm v_active_part(const void *mask, int64_t i, int64_t t, int64_t step, int mdt)
{
    if (mdt != BNBW_BOOL)
        return v__positive(v_load_part(mask, i, t, step, mdt));
    unsigned char buf[16] = {0};
    for (int64_t l = 0; l < t; ++l)
        buf[l] = ((const unsigned char *)mask)[(i + l) * step];
    return v__bool_lanes(buf);
}


/* dst element e = src element e where the mask is active, +0 elsewhere, for the t <= 16
 * elements i..: the bits themselves, so a NaN's payload survives. */
BNBW_INLINE void v_copy_active(void *dst, int64_t dst_step, const void *src, int64_t src_step,
                               const void *mask, int64_t mask_step, int64_t i, int64_t t,
                               int dt, int mdt)
{
    const int64_t isz = BNBW_ITEMSIZE(dt);
    if (t == 16 && dst_step == 1 && src_step == 1 && mask_step == 1) {
        const vm on = v_active(mask, i, 1, mdt, 0);
        const char *s = (const char *)src + i * isz;
        char *d = (char *)dst + i * isz;
        if (dt == BNBW_F32) {
            v__i4 v[4];
            V__Q(k) v[k] = v__load_i4(s + 16 * k) & on.q[k];
            V__Q(k) v__store_i4(d + 16 * k, v[k]);
        } else {
            v__h8 v[2];
            for (int k = 0; k < 2; ++k)
                v[k] = v__load_h8(s + 16 * k) & v__pack_low((v__u4)on.q[2 * k], (v__u4)on.q[2 * k + 1]);
            for (int k = 0; k < 2; ++k)
                v__store_h8(d + 16 * k, v[k]);
        }
        return;
    }
    bnbw_copy_active_elements(dst, dst_step, src, src_step, mask, mask_step, i, t, dt, mdt);
}

#undef V__Q
#undef V__P

#else
/* ================================================================================================
 * plain C: every operation a loop over 16 lanes
 * ============================================================================================== */

typedef struct { float v[16]; } vf;
typedef struct { double v[16]; } vd;
typedef struct { unsigned char v[16]; } vm;

#define BNBW__LANES(l) for (int l = 0; l < 16; ++l)

BNBW_INLINE vf vf_zero(void) { vf r; BNBW__LANES(l) r.v[l] = 0.0f; return r; }
BNBW_INLINE vf vf_set1(float a) { vf r; BNBW__LANES(l) r.v[l] = a; return r; }
BNBW_INLINE vf vf_loadu(const float *p) { vf r; memcpy(r.v, p, sizeof r.v); return r; }
BNBW_INLINE void vf_storeu(float *p, vf a) { memcpy(p, a.v, sizeof a.v); }
BNBW_INLINE vf vf_add(vf a, vf b) { BNBW__LANES(l) a.v[l] += b.v[l]; return a; }
BNBW_INLINE vf vf_sub(vf a, vf b) { BNBW__LANES(l) a.v[l] -= b.v[l]; return a; }
BNBW_INLINE vf vf_mul(vf a, vf b) { BNBW__LANES(l) a.v[l] *= b.v[l]; return a; }
/* a * b + c, rounded once */
BNBW_INLINE vf vf_fma(vf a, vf b, vf c) { BNBW__LANES(l) a.v[l] = v__fmaf(a.v[l], b.v[l], c.v[l]); return a; }
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
/* lane l: a[l] + a[l ^ w] (w = 1, 2 or 4), the step of vd_fold within groups of 2w lanes */
BNBW_INLINE vd vd_add_partners(vd a, int w)
{
    vd r;
    BNBW__LANES(l) r.v[l] = a.v[l] + a.v[l ^ w];
    return r;
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


BNBW_INLINE vm v_active(const void *mask, int64_t i, int64_t step, int mdt, int eo)
{
    vm r;
    BNBW__LANES(l)
        r.v[l] = (unsigned char)bnbw_mask_active(mask, (i + v__element(l, eo)) * step, mdt);
    return r;
}

BNBW_INLINE vm v_active_part(const void *mask, int64_t i, int64_t t, int64_t step, int mdt)
{
    vm r;
    BNBW__LANES(l) r.v[l] = (unsigned char)(l < t && bnbw_mask_active(mask, (i + l) * step, mdt));
    return r;
}

/* dst element e = src element e where the mask is active, +0 elsewhere, for the t <= 16
 * elements i..: the bits themselves, so a NaN's payload survives. */
BNBW_INLINE void v_copy_active(void *dst, int64_t dst_step, const void *src, int64_t src_step,
                               const void *mask, int64_t mask_step, int64_t i, int64_t t,
                               int dt, int mdt)
{
    bnbw_copy_active_elements(dst, dst_step, src, src_step, mask, mask_step, i, t, dt, mdt);
}

#endif /* BNBW__GNU_VECTORS */

/* 16 f32 values to a 64-byte aligned line, past the caches where a body can (non-temporal
 * stores); here a plain store, the same bits.  v_stream_fence orders them before later stores. */
BNBW_INLINE void vf_stream(float *p, vf a) { vf_storeu(p, a); }
BNBW_INLINE void v_stream_fence(void) {}

/* Leaving a kernel: nothing to clean up. */
BNBW_INLINE void v_leave(void) {}

#endif /* BNBW_SIMD_PORTABLE_H */
