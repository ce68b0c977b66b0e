/*
 * bnbw_kernels.h - the contiguous inner loops of the bnbw_native engine.
 *
 * Every hot loop of the package is one of the kernels below; the Cython layer
 * (bnbw_native/_core.pyx) only plans, partitions and dispatches.  A kernel reads and writes
 * rows of one storage type `dt` (f32, f16 or bf16, unit stride) and computes in f32/f64:
 *
 *   channel-major (one channel, n contiguous elements)     channel-last (rows of n channels)
 *   bnbw_reduce_row   Sum dy, Sum (x - mean) * dy          bnbw_reduce_rows
 *   bnbw_apply_row    dx = k2*(x - mean) + (k1*dy + k3)    bnbw_apply_rows
 *   bnbw_scale_row    dx = k1*dy (frozen statistics)       bnbw_scale_rows
 *
 * bnbw_{reduce,apply,scale}_row_run take a run of short channel-major rows of adjacent channels
 * in one call (the same row bodies in a loop): on 7x7 rows the fixed work of one call per row
 * cost as much as the row.
 *
 * Two bodies per kernel.  The AVX2 body (x86 with AVX2+FMA+F16C, picked at run time) converts
 * halves in registers - F16C for f16, a shift for bf16 - so 16-bit data costs half the memory
 * traffic of f32 and no extra pass.  The portable body works on f32 only; on CPUs without the
 * AVX2 body the engine first converts halves and strided rows into small f32 tiles.  Both bodies
 * do the same arithmetic in the same order, so they give the same bits (the tests force the
 * portable body and compare).
 *
 * Precision.  x - mean is exact in f32 whenever x lies within a factor 2 of the mean (Sterbenz),
 * the product (x - mean) * dy is formed exactly in f64 (24 + 24 bits) and every sum is
 * accumulated in 16 f64 lanes, combined in a fixed tree.  That keeps Sum (x - mean)*dy accurate
 * to ~1e-12 relative for 2^24 elements around a large mean, where naive f32 sums lose three or
 * four digits.  dx is rounded once to its storage type.
 *
 * Blocked sums (`blocked`, chosen by the engine for f16 and bf16 storage).  Widening every
 * term to f64 costs more than reading a half: Zen 4 widens f32 -> f64 and f16 -> f32 on one pipe
 * at one per cycle, and the f64 reduction of 16 halves needs 12 such operations.  So with
 * `blocked` each lane first sums a short block in f32 - BNBW_BLOCK_RUNS runs of 16 of a
 * channel-major row, BNBW_BLOCK_ROWS rows of a channel-last call - (x - mean) * dy rounded to
 * f32, and adds the block's f32 sums into its f64 lanes: 4.5 widening operations per 16 halves.
 * A block adds at most 17 f32 roundings (2^-24 each, so ~2^-20) relative to the block's sum of
 * |terms|, far below a half's own 2^-11 or 2^-8, and the f64 lanes keep 2^24 elements as
 * accurate as that.  A lane whose block sum is not finite (an f32 overflow, or an inf or NaN
 * input) redoes that block in f64, so every finite f64 result stays finite.  Which elements of
 * a channel-major run share a lane is the order the storage type loads cheapest
 * (BNBW_BLOCKS_EVEN_ODD for bf16).  Both bodies block alike.
 *
 * Determinism.  A kernel's result depends only on its arguments, never on which thread runs
 * it, and FP contraction is off (-ffp-contract=off): the AVX2 bodies spell out every rounding,
 * and fuse a multiply-add only where the product is exact or where the portable bodies call
 * fmaf (the apply).
 */
#ifndef BNBW_KERNELS_H
#define BNBW_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bnbw_half.h"

/* Storage types of x, dy and dx: the codes of _core.pxd's DType. */
enum { BNBW_F32 = 0, BNBW_F16 = 1, BNBW_BF16 = 2 };

/* Lanes of independent f64 partial sums in the channel-major reduction: 16 lanes = 4 AVX2
 * registers per sum, enough to hide the 4-cycle add latency at two loads per cycle. */
#define BNBW_LANES 16

/* Blocked sums (see the header): a channel-major block is BNBW_BLOCK_RUNS runs of 16 elements
 * from the start of the row piece a kernel is given (the last block the whole runs left, so
 * that short rows block too), a channel-last block BNBW_BLOCK_ROWS rows from the first row of
 * the call (the engine cuts calls at multiples of it).  Sixteen terms per lane rather than 8
 * (runs) or 4 (rows) cut the cost of adding the blocks into f64 - in a channel-last block that
 * includes loading and storing its channels' f64 sums - for a bound of 2^-20 instead of
 * 2^-21: blocked reductions in L1 1.2x (f16 channel-major) to 1.7x (f16 channel-last) as
 * fast. */
#define BNBW_BLOCK_RUNS 16
#define BNBW_BLOCK_ROWS 16

/* The kernels' `blocked` argument.  Channel-last kernels take any nonzero value as
 * BNBW_BLOCKS (their lanes are channels).  In a channel-major block, lane l (0..15) of
 * BNBW_BLOCKS sums element l of every run; with BNBW_BLOCKS_EVEN_ODD, lanes 0-7 sum the
 * run's elements 0, 2, .., 14 and lanes 8-15 its elements 1, 3, .., 15: for bf16 that is a
 * shift and a mask of one load, against two widening shuffles and two shifts (blocked bf16
 * reduction 1.2x as fast in L1).  Runs outside blocks and the f64 lanes keep element order. */
enum { BNBW_EXACT_SUMS = 0, BNBW_BLOCKS = 1, BNBW_BLOCKS_EVEN_ODD = 2 };

/* 1 when v is neither infinite nor NaN. */
static inline int bnbw__finite(float v) { return v - v == 0.0f; }

/* Element i of a row of storage type dt, as f32 (exact for every type). */
static inline float bnbw_get(const void *row, int64_t i, int dt)
{
    const char *p = (const char *)row;
    if (dt == BNBW_F32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    uint16_t bits;
    memcpy(&bits, p + 2 * i, 2);
    if (dt == BNBW_F16) {
        bnbw_f16 h = {bits};
        return bnbw_f16_to_f32(h);
    }
    bnbw_bf16 b = {bits};
    return bnbw_bf16_to_f32(b);
}

/* Element i of a row of storage type dt = v, rounded to nearest even. */
static inline void bnbw_put(void *row, int64_t i, int dt, float v)
{
    char *p = (char *)row;
    if (dt == BNBW_F32) {
        memcpy(p + 4 * i, &v, 4);
        return;
    }
    uint16_t bits = dt == BNBW_F16 ? bnbw_f32_to_f16(v).bits : bnbw_f32_to_bf16(v).bits;
    memcpy(p + 2 * i, &bits, 2);
}

/* dx = k2*(x - mean) + (k1*dy + k3): two fused multiply-adds, so dx rounds twice (after the
 * exact-near-the-mean x - mean) instead of four times, and the AVX2 apply issues 3 operations
 * per 8 lanes instead of 5 (bf16 channel-major apply 1.2x as fast in L1).  fmaf rounds once
 * wherever it runs, so both bodies give the same bits. */
static inline float bnbw__apply1(float x, float dy, float mean, float k1, float k2, float k3)
{
    return fmaf(k2, x - mean, fmaf(k1, dy, k3));
}

/* ---- portable bodies (f32 rows) --------------------------------------------------------- */

/* Adds the last n (< BNBW_LANES) elements to lanes 0..n-1, then folds the lanes in a fixed
 * pairwise tree: out[0] = Sum dy, out[1] = Sum (x - mean) * dy. */
static void bnbw_reduce_row_finish(const float *x, const float *dy, int64_t n, float mean,
                                   double *sg, double *sxg, double out[2])
{
    for (int64_t l = 0; l < n; ++l) {
        float g = dy[l];
        sg[l] += (double)g;
        sxg[l] += (double)(x[l] - mean) * (double)g;
    }
    for (int width = BNBW_LANES / 2; width > 0; width /= 2) {
        for (int l = 0; l < width; ++l) {
            sg[l] += sg[l + width];
            sxg[l] += sxg[l + width];
        }
    }
    out[0] = sg[0];
    out[1] = sxg[0];
}

/* Elements in the next channel-major block when `left` remain: BNBW_BLOCK_RUNS whole runs,
 * or the whole runs that are left (short rows, row ends), 0 when less than a run is left. */
static inline int64_t bnbw__block_length(int64_t left)
{
    int64_t most = BNBW_BLOCK_RUNS * BNBW_LANES;
    return left >= most ? most : left - left % BNBW_LANES;
}

/* Element e of a channel-major run in lane l (BNBW_BLOCKS_EVEN_ODD): l < 8 holds e = 2l. */
static inline int64_t bnbw__even_odd_element(int64_t l)
{
    return l < 8 ? 2 * l : 2 * (l - 8) + 1;
}

/* One block of `len` terms per lane, lanes 0..lanes-1: lane l's k-th term is element
 * k * step + e of x and dy (mean[l * mean_step]), e = l or, with even_odd, the element
 * bnbw__even_odd_element(l).  Summed in f32 and added to sg[l], sxg[l]; a lane whose f32 sums
 * are not finite adds its terms in f64 instead. */
static void bnbw__reduce_block_portable(const float *x, int64_t x_step, const float *dy,
                                        int64_t dy_step, int64_t len, int64_t lanes,
                                        const float *mean, int64_t mean_step, int even_odd,
                                        double *sg, double *sxg)
{
    for (int64_t l = 0; l < lanes; ++l) {
        int64_t e = even_odd ? bnbw__even_odd_element(l) : l;
        float m = mean[l * mean_step], fg = 0.0f, fp = 0.0f;
        for (int64_t k = 0; k < len; ++k) {
            float g = dy[k * dy_step + e];
            fg += g;
            fp += (x[k * x_step + e] - m) * g;
        }
        if (bnbw__finite(fg) && bnbw__finite(fp)) {
            sg[l] += (double)fg;
            sxg[l] += (double)fp;
            continue;
        }
        for (int64_t k = 0; k < len; ++k) {
            float g = dy[k * dy_step + e];
            sg[l] += (double)g;
            sxg[l] += (double)(x[k * x_step + e] - m) * (double)g;
        }
    }
}

static void bnbw_reduce_row_portable(const float *x, const float *dy, int64_t n, float mean,
                                     double out[2], int blocked)
{
    double sg[BNBW_LANES] = {0}, sxg[BNBW_LANES] = {0};
    int64_t i = 0, block;
    for (; blocked && (block = bnbw__block_length(n - i)) > 0; i += block)
        bnbw__reduce_block_portable(x + i, BNBW_LANES, dy + i, BNBW_LANES, block / BNBW_LANES,
                                    BNBW_LANES, &mean, 0, blocked == BNBW_BLOCKS_EVEN_ODD,
                                    sg, sxg);
    for (; i + BNBW_LANES <= n; i += BNBW_LANES) {
        for (int l = 0; l < BNBW_LANES; ++l) {
            float g = dy[i + l];
            sg[l] += (double)g;
            sxg[l] += (double)(x[i + l] - mean) * (double)g;
        }
    }
    bnbw_reduce_row_finish(x + i, dy + i, n - i, mean, sg, sxg, out);
}

/* dx may be the very same memory as dy (in place) in every apply/scale kernel. */
static void bnbw_apply_row_portable(const float *x, const float *dy, float *dx, int64_t n,
                                    float mean, float k1, float k2, float k3)
{
    for (int64_t i = 0; i < n; ++i)
        dx[i] = bnbw__apply1(x[i], dy[i], mean, k1, k2, k3);
}

static void bnbw_scale_row_portable(const float *dy, float *dx, int64_t n, float k1)
{
    for (int64_t i = 0; i < n; ++i)
        dx[i] = k1 * dy[i];
}

/* Channel-last sums of channel c over `rows` rows, added in row order (every body does the
 * same per channel, whatever it keeps in registers). */
static void bnbw_reduce_rows_portable(const float *x, int64_t x_row, const float *dy,
                                      int64_t dy_row, int64_t rows, int64_t n,
                                      const float *mean, double *sum_g, double *sum_xg,
                                      int blocked)
{
    if (blocked) {
        for (int64_t r = 0; r < rows; r += BNBW_BLOCK_ROWS) {
            int64_t nr = rows - r < BNBW_BLOCK_ROWS ? rows - r : BNBW_BLOCK_ROWS;
            bnbw__reduce_block_portable(x + r * x_row, x_row, dy + r * dy_row, dy_row, nr, n,
                                        mean, 1, 0, sum_g, sum_xg);
        }
        return;
    }
    for (int64_t r = 0; r < rows; ++r, x += x_row, dy += dy_row) {
        for (int64_t c = 0; c < n; ++c) {
            float g = dy[c];
            sum_g[c] += (double)g;
            sum_xg[c] += (double)(x[c] - mean[c]) * (double)g;
        }
    }
}

static void bnbw_apply_rows_portable(const float *x, int64_t x_row, const float *dy,
                                     int64_t dy_row, float *dx, int64_t dx_row, int64_t rows,
                                     int64_t n, const float *mean, const float *k1,
                                     const float *k2, const float *k3)
{
    for (int64_t r = 0; r < rows; ++r, x += x_row, dy += dy_row, dx += dx_row)
        for (int64_t c = 0; c < n; ++c)
            dx[c] = bnbw__apply1(x[c], dy[c], mean[c], k1[c], k2[c], k3[c]);
}

static void bnbw_scale_rows_portable(const float *dy, int64_t dy_row, float *dx,
                                     int64_t dx_row, int64_t rows, int64_t n, const float *k1)
{
    for (int64_t r = 0; r < rows; ++r, dy += dy_row, dx += dx_row)
        for (int64_t c = 0; c < n; ++c)
            dx[c] = k1[c] * dy[c];
}

/* ---- AVX2 bodies (any storage type) ------------------------------------------------------ */

#ifdef BNBW__X86_DISPATCH
#define BNBW_HAVE_AVX2_KERNELS 1
#define BNBW_AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* 8 halves of type dt (f16 or bf16) as 8 f32 lanes. */
BNBW_AVX2_INLINE __m256 bnbw__widen8(__m128i h, int dt)
{
    if (dt == BNBW_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Elements i..i+7 of a row of type dt as 8 f32 lanes. */
BNBW_AVX2_INLINE __m256 bnbw_load8(const void *row, int64_t i, int dt)
{
    if (dt == BNBW_F32)
        return _mm256_loadu_ps((const float *)row + i);
    return bnbw__widen8(_mm_loadu_si128((const __m128i *)(const void *)((const uint16_t *)row + i)),
                        dt);
}

/* Elements i..i+15 of a row of type dt as two vectors of 8 f32 lanes in the order cheapest
 * for dt: elements i..i+7 and i+8..i+15, but for bf16 the even elements (i, i+2, ..) and the
 * odd ones, a shift and a mask of one load (and no shuffle on the way back out: channel-major
 * bf16 apply 1.35x as fast in L1).  Only elementwise kernels whose constants are the same for
 * all 16 may use it, storing with bnbw_store16_lanes in the same order. */
BNBW_AVX2_INLINE void bnbw_load16_lanes(const void *row, int64_t i, int dt, __m256 *a, __m256 *b)
{
    if (dt != BNBW_BF16) {
        *a = bnbw_load8(row, i, dt);
        *b = bnbw_load8(row, i + 8, dt);
        return;
    }
    __m256i w = _mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)row + i));
    *a = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    *b = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
}

/* Elements i..i+15 of a row of type dt: a = i..i+7, b = i+8..i+15. */
BNBW_AVX2_INLINE void bnbw__load16_in_order(const void *row, int64_t i, int dt, __m256 *a,
                                            __m256 *b)
{
    *a = bnbw_load8(row, i, dt);
    *b = bnbw_load8(row, i + 8, dt);
}

/* ... even = elements i, i+2, .., i+14, odd = i+1, .., i+15 (BNBW_BLOCKS_EVEN_ODD): for bf16
 * bnbw_load16_lanes' order; other types (staged bf16 rows are f32) deinterleaved. */
BNBW_AVX2_INLINE void bnbw__load16_even_odd(const void *row, int64_t i, int dt, __m256 *even,
                                            __m256 *odd)
{
    if (dt == BNBW_BF16) {
        bnbw_load16_lanes(row, i, dt, even, odd);
        return;
    }
    __m256 lo = bnbw_load8(row, i, dt), hi = bnbw_load8(row, i + 8, dt);
    /* per 128-bit half: elements 0 2 8 10 | 4 6 12 14, then the middle 64-bit pairs swapped */
    __m256 e = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
    __m256 o = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
}

/* lo, hi as 16 halves of type dt (f16 or bf16), rounded as bnbw_store16 says. */
BNBW_AVX2_INLINE __m256i bnbw__narrow16(__m256 lo, __m256 hi, int dt)
{
    if (dt == BNBW_F16)
        return _mm256_set_m128i(_mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT),
                                _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
    return bnbw__bf16_pack16(lo, hi);
}

/* Elements i..i+15 of a row of type dt = lo (i..i+7), hi (i+8..i+15), rounded to nearest even
 * as bnbw_put does.  F16C quiets NaNs; NaNs made by arithmetic are quiet already, and for
 * those F16C and the scalar rounding agree. */
BNBW_AVX2_INLINE void bnbw_store16(void *row, int64_t i, __m256 lo, __m256 hi, int dt)
{
    if (dt == BNBW_F32) {
        _mm256_storeu_ps((float *)row + i, lo);
        _mm256_storeu_ps((float *)row + i + 8, hi);
        return;
    }
    _mm256_storeu_si256((__m256i *)(void *)((uint16_t *)row + i), bnbw__narrow16(lo, hi, dt));
}

/* bnbw_store16 for a and b in the order bnbw_load16_lanes gives. */
BNBW_AVX2_INLINE void bnbw_store16_lanes(void *row, int64_t i, __m256 a, __m256 b, int dt)
{
    if (dt != BNBW_BF16) {
        bnbw_store16(row, i, a, b, dt);
        return;
    }
    _mm256_storeu_si256((__m256i *)(void *)((uint16_t *)row + i), bnbw__bf16_join16(a, b));
}

/* Runs of t < 16 elements - the end of a channel-major row, the last channels of channel-last
 * rows - go through 16-lane registers too, so that every size runs at vector speed: masked
 * loads and stores touch only the t elements (halves: t/2 whole 32-bit pairs, and the odd one
 * alone), lanes t.. load as zeros and are never stored.  Per element the arithmetic is the
 * same as in full runs. */

/* Mask of the 32-bit lanes l < t (any t). */
BNBW_AVX2_INLINE __m256i bnbw__lanes_below(int64_t t)
{
    int k = t < 0 ? 0 : (t > 8 ? 8 : (int)t);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

BNBW_AVX2_INLINE void bnbw_load_part16(const void *row, int64_t i, int64_t t, int dt,
                                       __m256 *lo, __m256 *hi)
{
    if (dt == BNBW_F32) {
        const float *p = (const float *)row + i;
        *lo = _mm256_maskload_ps(p, bnbw__lanes_below(t));
        *hi = _mm256_maskload_ps(p + 8, bnbw__lanes_below(t - 8));
        return;
    }
    const uint16_t *p = (const uint16_t *)row + i;
    __m256i w = _mm256_maskload_epi32((const int *)(const void *)p, bnbw__lanes_below(t / 2));
    if (t & 1)      /* the odd last element: the low half of pair t / 2 */
        w = _mm256_blendv_epi8(w, _mm256_set1_epi32(p[t - 1]),
                               _mm256_cmpeq_epi32(_mm256_set1_epi32((int)(t / 2)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    *lo = bnbw__widen8(_mm256_castsi256_si128(w), dt);
    *hi = bnbw__widen8(_mm256_extracti128_si256(w, 1), dt);
}

BNBW_AVX2_INLINE void bnbw_store_part16(void *row, int64_t i, int64_t t, __m256 lo, __m256 hi,
                                        int dt)
{
    if (dt == BNBW_F32) {
        float *p = (float *)row + i;
        _mm256_maskstore_ps(p, bnbw__lanes_below(t), lo);
        _mm256_maskstore_ps(p + 8, bnbw__lanes_below(t - 8), hi);
        return;
    }
    uint16_t *p = (uint16_t *)row + i;
    __m256i h = bnbw__narrow16(lo, hi, dt);
    _mm256_maskstore_epi32((int *)(void *)p, bnbw__lanes_below(t / 2), h);
    if (t & 1)      /* the low half of pair t / 2, moved to lane 0 (no stack buffer: that
                       would give every caller an aligned stack frame) */
        p[t - 1] = (uint16_t)_mm256_cvtsi256_si32(
            _mm256_permutevar8x32_epi32(h, _mm256_set1_epi32((int)(t / 2))));
}

/* v, as a value the compiler cannot see through or split: it must hold it whole in a
 * register (bnbw__one; the block sums of bnbw__reduce_wide_rows_blocked). */
BNBW_AVX2_INLINE __m256 bnbw__opaque(__m256 v)
{
    __asm__("" : "+x"(v));
    return v;
}

/* 1.0f that the compiler cannot see through.  a*1 is exact, so fma(a, 1, b) rounds a + b
 * and fmsub(a, 1, b) rounds a - b exactly as the add and the subtraction do (NaNs included:
 * the first NaN operand wins either way), but they run on the multiply pipes.  Zen 4 runs
 * adds, shifts and the f16 conversions on the same two pipes, which bound the half kernels:
 * moving some adds across made channel-major f16 apply 1.2x and the blocked f16 reduction
 * 1.15x as fast in L1.  A visible 1.0 would be folded back into the add. */
BNBW_AVX2_INLINE __m256 bnbw__one(void) { return bnbw__opaque(_mm256_set1_ps(1.0f)); }

/* a + b and a - b, on the multiply pipes (bnbw__one). */
#define BNBW_ADD_ON_FMA(a, b) _mm256_fmadd_ps((a), bnbw__one(), (b))
#define BNBW_SUB_ON_FMA(a, b) _mm256_fmsub_ps((a), bnbw__one(), (b))

/* bnbw__apply1 on 8 lanes: the same two fused multiply-adds. */
BNBW_AVX2_INLINE __m256 bnbw__apply8(__m256 x, __m256 g, __m256 m, __m256 k1, __m256 k2,
                                     __m256 k3)
{
    return _mm256_fmadd_ps(k2, BNBW_SUB_ON_FMA(x, m), _mm256_fmadd_ps(k1, g, k3));
}

/* dy (GA, GB) and x - mean (DA, DB) for 16 consecutive elements: adds dy to g0..g3 and the
 * f64 product (x - mean) * dy to p0..p3, lane k of register j holding element 4j + k, as the
 * portable loops do.  A product of two widened f32 values is exact in f64, so one fused
 * multiply-add rounds exactly where the portable multiply-then-add does: same bits, a third
 * fewer instructions (the reduction's throughput limit). */
#define BNBW_WIDEN_LO(v) _mm256_cvtps_pd(_mm256_castps256_ps128(v))
#define BNBW_WIDEN_HI(v) _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))
#define BNBW_ACCUMULATE16(GA, GB, DA, DB) do {                                            \
        __m256d w0_ = BNBW_WIDEN_LO(GA), w1_ = BNBW_WIDEN_HI(GA);                         \
        __m256d w2_ = BNBW_WIDEN_LO(GB), w3_ = BNBW_WIDEN_HI(GB);                         \
        g0 = _mm256_add_pd(g0, w0_); g1 = _mm256_add_pd(g1, w1_);                         \
        g2 = _mm256_add_pd(g2, w2_); g3 = _mm256_add_pd(g3, w3_);                         \
        p0 = _mm256_fmadd_pd(BNBW_WIDEN_LO(DA), w0_, p0);                    \
        p1 = _mm256_fmadd_pd(BNBW_WIDEN_HI(DA), w1_, p1);                    \
        p2 = _mm256_fmadd_pd(BNBW_WIDEN_LO(DB), w2_, p2);                    \
        p3 = _mm256_fmadd_pd(BNBW_WIDEN_HI(DB), w3_, p3);                    \
    } while (0)

/* Blocked sums (see the header): dy (GA, GB) added to the f32 block sums G0, G1 and
 * (x - mean) * dy (DA, DB times GA, GB), rounded to f32, to P0, P1 - lane for lane as
 * bnbw__reduce_block_portable does.  BNBW_BLOCK_ADD16 adds to fg0, fg1, fp0, fp1. */
#define BNBW_BLOCK_ADD16_TO(G0, G1, P0, P1, GA, GB, DA, DB) do {                           \
        __m256 ga_ = (GA), gb_ = (GB);                                                     \
        G0 = _mm256_add_ps(G0, ga_); G1 = _mm256_add_ps(G1, gb_);                          \
        P0 = BNBW_ADD_ON_FMA(P0, _mm256_mul_ps((DA), ga_));                                \
        P1 = BNBW_ADD_ON_FMA(P1, _mm256_mul_ps((DB), gb_));                                \
    } while (0)
#define BNBW_BLOCK_ADD16(GA, GB, DA, DB) BNBW_BLOCK_ADD16_TO(fg0, fg1, fp0, fp1, GA, GB, DA, DB)

/* All bits set in the lanes where both a and b are finite. */
BNBW_AVX2_INLINE __m256 bnbw__finite_lanes(__m256 a, __m256 b)
{
    __m256 z = _mm256_add_ps(_mm256_sub_ps(a, a), _mm256_sub_ps(b, b));
    return _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_EQ_OQ);
}

/* A mask of 8 f32 lanes as the masks of its lanes 0..3 (lo) or 4..7 (hi) as f64 lanes. */
#define BNBW_MASK_LO(k) _mm256_castsi256_pd(_mm256_cvtepi32_epi64(                       \
                            _mm256_castsi256_si128(_mm256_castps_si256(k))))
#define BNBW_MASK_HI(k) _mm256_castsi256_pd(_mm256_cvtepi32_epi64(                       \
                            _mm256_extracti128_si256(_mm256_castps_si256(k), 1)))

/* Adds the block sums fg0, fg1, fp0, fp1 to the f64 lanes g0..g3, p0..p3 (lane k of fg0 to
 * lane k of g0, lane 4 + k to g1, fg1 to g2, g3).  Lanes whose block sums are not finite take
 * instead what REDO - the block's terms through BNBW_ACCUMULATE16, from the same f64 lanes -
 * gives them: a rare path (overflow, inf, NaN), so it simply runs for all lanes and blends. */
#define BNBW_BLOCK_FLUSH(REDO) do {                                                        \
        __m256 ok0_ = bnbw__finite_lanes(fg0, fp0), ok1_ = bnbw__finite_lanes(fg1, fp1);   \
        __m256d b0_ = _mm256_add_pd(g0, BNBW_WIDEN_LO(fg0));                               \
        __m256d b1_ = _mm256_add_pd(g1, BNBW_WIDEN_HI(fg0));                               \
        __m256d b2_ = _mm256_add_pd(g2, BNBW_WIDEN_LO(fg1));                               \
        __m256d b3_ = _mm256_add_pd(g3, BNBW_WIDEN_HI(fg1));                               \
        __m256d q0_ = _mm256_add_pd(p0, BNBW_WIDEN_LO(fp0));                               \
        __m256d q1_ = _mm256_add_pd(p1, BNBW_WIDEN_HI(fp0));                               \
        __m256d q2_ = _mm256_add_pd(p2, BNBW_WIDEN_LO(fp1));                               \
        __m256d q3_ = _mm256_add_pd(p3, BNBW_WIDEN_HI(fp1));                               \
        if (_mm256_movemask_ps(_mm256_and_ps(ok0_, ok1_)) == 0xff) {                       \
            g0 = b0_; g1 = b1_; g2 = b2_; g3 = b3_;                                        \
            p0 = q0_; p1 = q1_; p2 = q2_; p3 = q3_;                                        \
        } else {                                                                           \
            REDO;                                                                          \
            __m256d m0_ = BNBW_MASK_LO(ok0_), m1_ = BNBW_MASK_HI(ok0_);                    \
            __m256d m2_ = BNBW_MASK_LO(ok1_), m3_ = BNBW_MASK_HI(ok1_);                    \
            g0 = _mm256_blendv_pd(g0, b0_, m0_); g1 = _mm256_blendv_pd(g1, b1_, m1_);      \
            g2 = _mm256_blendv_pd(g2, b2_, m2_); g3 = _mm256_blendv_pd(g3, b3_, m3_);      \
            p0 = _mm256_blendv_pd(p0, q0_, m0_); p1 = _mm256_blendv_pd(p1, q1_, m1_);      \
            p2 = _mm256_blendv_pd(p2, q2_, m2_); p3 = _mm256_blendv_pd(p3, q3_, m3_);      \
        }                                                                                  \
    } while (0)

/* One block: TERMS(ADD16) applies ADD16 to each of the block's runs of 16 terms, in order. */
#define BNBW_BLOCK_SUM(TERMS) do {                                                         \
        __m256 fg0 = _mm256_setzero_ps(), fg1 = fg0, fp0 = fg0, fp1 = fg0;                 \
        TERMS(BNBW_BLOCK_ADD16);                                                           \
        BNBW_BLOCK_FLUSH(TERMS(BNBW_ACCUMULATE16));                                        \
    } while (0)

BNBW_AVX2_INLINE void bnbw_reduce_row_body(const void *x, const void *dy, int64_t n,
                                           float mean, double out[2], int blocked, int dt)
{
    __m256d g0 = _mm256_setzero_pd(), g1 = g0, g2 = g0, g3 = g0;
    __m256d p0 = g0, p1 = g0, p2 = g0, p3 = g0;
    const __m256 m = _mm256_set1_ps(mean);
    int64_t i = 0, block;
/* one run per iteration (unrolled, gcc hoists all the loads of a block and spills them),
   loaded in the lane order `blocked` asks for */
#define BNBW_BLOCK_RUN_TERMS(ADD16, LOAD16) _Pragma("GCC unroll 1")                         \
    for (int64_t k = i; k < i + block; k += BNBW_LANES) {                                 \
        __m256 xa_, xb_, ya_, yb_;                                                         \
        LOAD16(x, k, dt, &xa_, &xb_);                                                      \
        LOAD16(dy, k, dt, &ya_, &yb_);                                                     \
        ADD16(ya_, yb_, BNBW_SUB_ON_FMA(xa_, m), BNBW_SUB_ON_FMA(xb_, m));                 \
    }
#define BNBW_RUN_TERMS(ADD16) BNBW_BLOCK_RUN_TERMS(ADD16, bnbw__load16_in_order)
#define BNBW_EVEN_ODD_TERMS(ADD16) BNBW_BLOCK_RUN_TERMS(ADD16, bnbw__load16_even_odd)
    if (blocked == BNBW_BLOCKS_EVEN_ODD)
        for (; (block = bnbw__block_length(n - i)) > 0; i += block)
            BNBW_BLOCK_SUM(BNBW_EVEN_ODD_TERMS);
    else if (blocked)
        for (; (block = bnbw__block_length(n - i)) > 0; i += block)
            BNBW_BLOCK_SUM(BNBW_RUN_TERMS);
#undef BNBW_EVEN_ODD_TERMS
#undef BNBW_RUN_TERMS
#undef BNBW_BLOCK_RUN_TERMS
    for (; i + BNBW_LANES <= n; i += BNBW_LANES)
        BNBW_ACCUMULATE16(bnbw_load8(dy, i, dt), bnbw_load8(dy, i + 8, dt),
                          _mm256_sub_ps(bnbw_load8(x, i, dt), m),
                          _mm256_sub_ps(bnbw_load8(x, i + 8, dt), m));
    if (i < n) {
        /* the last t = n - i < 16 elements in lanes 0.., the other lanes padded with an exact
           identity: dy = -0.0 and x - mean = +0.0 add -0.0 to both sums, and s + -0.0 == s
           for every s, signed zeros included */
        int64_t t = n - i;
        __m256 xa, xb, ya, yb;
        bnbw_load_part16(x, i, t, dt, &xa, &xb);
        bnbw_load_part16(dy, i, t, dt, &ya, &yb);
        const __m256 ka = _mm256_castsi256_ps(bnbw__lanes_below(t));
        const __m256 kb = _mm256_castsi256_ps(bnbw__lanes_below(t - 8));
        const __m256 neg0 = _mm256_set1_ps(-0.0f);
        BNBW_ACCUMULATE16(_mm256_blendv_ps(neg0, ya, ka), _mm256_blendv_ps(neg0, yb, kb),
                          _mm256_and_ps(_mm256_sub_ps(xa, m), ka),
                          _mm256_and_ps(_mm256_sub_ps(xb, m), kb));
    }
    /* bnbw_reduce_row_finish's pairwise tree, in registers: lanes l += l + 8 (registers 0, 1
       += 2, 3), l += l + 4, l += l + 2 (the two halves of register 0), l += l + 1 */
    g0 = _mm256_add_pd(g0, g2); g1 = _mm256_add_pd(g1, g3); g0 = _mm256_add_pd(g0, g1);
    p0 = _mm256_add_pd(p0, p2); p1 = _mm256_add_pd(p1, p3); p0 = _mm256_add_pd(p0, p1);
    __m128d g = _mm_add_pd(_mm256_castpd256_pd128(g0), _mm256_extractf128_pd(g0, 1));
    __m128d p = _mm_add_pd(_mm256_castpd256_pd128(p0), _mm256_extractf128_pd(p0, 1));
    out[0] = _mm_cvtsd_f64(_mm_add_sd(g, _mm_unpackhi_pd(g, g)));
    out[1] = _mm_cvtsd_f64(_mm_add_sd(p, _mm_unpackhi_pd(p, p)));
}

BNBW_AVX2_INLINE void bnbw_apply_row_body(const void *x, const void *dy, void *dx, int64_t n,
                                          float mean, float k1, float k2, float k3, int dt)
{
    const __m256 m = _mm256_set1_ps(mean), a = _mm256_set1_ps(k1);
    const __m256 b = _mm256_set1_ps(k2), k = _mm256_set1_ps(k3);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 xa, xb, ya, yb;
        bnbw_load16_lanes(x, i, dt, &xa, &xb);
        bnbw_load16_lanes(dy, i, dt, &ya, &yb);
        bnbw_store16_lanes(dx, i, bnbw__apply8(xa, ya, m, a, b, k),
                           bnbw__apply8(xb, yb, m, a, b, k), dt);
    }
    if (n - i <= 2) {              /* one or two left: cheaper one by one */
        for (; i < n; ++i)
            bnbw_put(dx, i, dt, bnbw__apply1(bnbw_get(x, i, dt), bnbw_get(dy, i, dt), mean, k1,
                                             k2, k3));
    } else {                       /* the last n - i < 16 elements, padded to 16 lanes */
        __m256 xa, xb, ya, yb;
        bnbw_load_part16(x, i, n - i, dt, &xa, &xb);
        bnbw_load_part16(dy, i, n - i, dt, &ya, &yb);
        bnbw_store_part16(dx, i, n - i, bnbw__apply8(xa, ya, m, a, b, k),
                          bnbw__apply8(xb, yb, m, a, b, k), dt);
    }
}

BNBW_AVX2_INLINE void bnbw_scale_row_body(const void *dy, void *dx, int64_t n, float k1, int dt)
{
    const __m256 a = _mm256_set1_ps(k1);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 ya, yb;
        bnbw_load16_lanes(dy, i, dt, &ya, &yb);
        bnbw_store16_lanes(dx, i, _mm256_mul_ps(a, ya), _mm256_mul_ps(a, yb), dt);
    }
    if (n - i <= 2) {              /* as in bnbw_apply_row_body */
        for (; i < n; ++i)
            bnbw_put(dx, i, dt, k1 * bnbw_get(dy, i, dt));
    } else {
        __m256 ya, yb;
        bnbw_load_part16(dy, i, n - i, dt, &ya, &yb);
        bnbw_store_part16(dx, i, n - i, _mm256_mul_ps(a, ya), _mm256_mul_ps(a, yb), dt);
    }
}

/* Row strides are in elements.  Short rows go four at a time: for each run of 16 channels the
 * sums are loaded, the four rows added in row order and the sums stored back.  Walking all rows
 * per channel run instead would visit addresses a row stride apart, which for power-of-two
 * strides all fall into one L1 set and thrash it.  When the caller says the rows stream from
 * memory (`streaming`), rows of 256 B to 2 KiB go one at a time instead: four of them
 * interleaved line by line within a page or two defeat the hardware prefetcher (Zen 4, 128
 * channels of f32 from DRAM: 0.57-0.78 ns per element four at a time, 0.37-0.45 one at a time;
 * (32, 14, 14, 256) from DRAM 0.67x time), while shorter rows read as one stream anyway, longer
 * ones as separate pages ((256, 2048) 1.3x slower one at a time), and from cache four at a time
 * stay 10-30% faster.  Either way each channel adds its rows in row order: the same bits.
 * Blocked sums go a block (BNBW_BLOCK_ROWS rows) at a time. */
#define BNBW_ROW_GROUP 4
#define BNBW_ONE_ROW_FROM 257          /* bytes per row: the range that goes one at a time */
#define BNBW_ONE_ROW_TO 2048

/* Rows r..r+nr of channels c..c+15 (means ma, mb) as 16 terms per row (ADD16's arguments). */
#define BNBW_ROW_TERMS(ADD16) for (int64_t j = r; j < r + nr; ++j)                          \
        ADD16(bnbw_load8(dy, j * dy_row + c, dt), bnbw_load8(dy, j * dy_row + c + 8, dt),   \
              BNBW_SUB_ON_FMA(bnbw_load8(x, j * x_row + c, dt), ma),                        \
              BNBW_SUB_ON_FMA(bnbw_load8(x, j * x_row + c + 8, dt), mb))

/* Adds the f32 block sums fg0..fp1 of rows r..r+nr, channels c..c+15, into sum_g, sum_xg
 * (BNBW_BLOCK_FLUSH: lanes whose block sums are not finite add the rows' terms in f64). */
BNBW_AVX2_INLINE void bnbw__rows_flush(const void *x, int64_t x_row, const void *dy,
                                       int64_t dy_row, int64_t r, int64_t nr, int64_t c,
                                       __m256 ma, __m256 mb, __m256 fg0, __m256 fg1,
                                       __m256 fp0, __m256 fp1, double *sum_g, double *sum_xg,
                                       int dt)
{
    __m256d g0 = _mm256_loadu_pd(sum_g + c), g1 = _mm256_loadu_pd(sum_g + c + 4);
    __m256d g2 = _mm256_loadu_pd(sum_g + c + 8), g3 = _mm256_loadu_pd(sum_g + c + 12);
    __m256d p0 = _mm256_loadu_pd(sum_xg + c), p1 = _mm256_loadu_pd(sum_xg + c + 4);
    __m256d p2 = _mm256_loadu_pd(sum_xg + c + 8), p3 = _mm256_loadu_pd(sum_xg + c + 12);
    BNBW_BLOCK_FLUSH(BNBW_ROW_TERMS(BNBW_ACCUMULATE16));
    _mm256_storeu_pd(sum_g + c, g0); _mm256_storeu_pd(sum_g + c + 4, g1);
    _mm256_storeu_pd(sum_g + c + 8, g2); _mm256_storeu_pd(sum_g + c + 12, g3);
    _mm256_storeu_pd(sum_xg + c, p0); _mm256_storeu_pd(sum_xg + c + 4, p1);
    _mm256_storeu_pd(sum_xg + c + 8, p2); _mm256_storeu_pd(sum_xg + c + 12, p3);
}

/* Channels per slice of the channel-last kernels that keep per-channel f32 values on the stack
 * (block sums here, bf16 constants in lane order below; up to 32 KiB): the engine's widest
 * call (TILE), so that each walks a row once. */
#define BNBW_SLICE 2048

/* Blocked sums of channels 0..n16 (a multiple of 16) of rows wider than BNBW_WIDE_ROW: rows
 * one after another, each block's f32 sums in a buffer.  Visiting a block's 16 rows for a few
 * channels at a time instead reads 32 interleaved streams, which the prefetchers do not follow
 * (rows of 256 B to 2 KiB: 2.5-3.5x slower from memory).  The buffer is read back whole
 * (bnbw__opaque): as two 16-byte memory operands of the widening, which gcc would fold the
 * loads into, its 32-byte stores miss store forwarding (2-3x slower). */
BNBW_AVX2_INLINE void bnbw__reduce_wide_rows_blocked(const void *x, int64_t x_row,
                                                     const void *dy, int64_t dy_row,
                                                     int64_t rows, int64_t n16,
                                                     const float *mean, double *sum_g,
                                                     double *sum_xg, int dt)
{
    float bg[BNBW_SLICE], bp[BNBW_SLICE];
    for (int64_t c0 = 0; c0 < n16; c0 += BNBW_SLICE) {
        int64_t w = n16 - c0 < BNBW_SLICE ? n16 - c0 : BNBW_SLICE;
        for (int64_t r = 0; r < rows; r += BNBW_BLOCK_ROWS) {
            int64_t nr = rows - r < BNBW_BLOCK_ROWS ? rows - r : BNBW_BLOCK_ROWS;
            for (int64_t j = r; j < r + nr; ++j)
                for (int64_t i = 0; i < w; i += 16) {
                    const int64_t c = c0 + i, xj = j * x_row + c, gj = j * dy_row + c;
                    const __m256 ma = _mm256_loadu_ps(mean + c), mb = _mm256_loadu_ps(mean + c + 8);
                    __m256 fg0 = _mm256_setzero_ps(), fg1 = fg0, fp0 = fg0, fp1 = fg0;
                    if (j > r) {
                        fg0 = _mm256_loadu_ps(bg + i); fg1 = _mm256_loadu_ps(bg + i + 8);
                        fp0 = _mm256_loadu_ps(bp + i); fp1 = _mm256_loadu_ps(bp + i + 8);
                    }
                    BNBW_BLOCK_ADD16(bnbw_load8(dy, gj, dt), bnbw_load8(dy, gj + 8, dt),
                                     BNBW_SUB_ON_FMA(bnbw_load8(x, xj, dt), ma),
                                     BNBW_SUB_ON_FMA(bnbw_load8(x, xj + 8, dt), mb));
                    _mm256_storeu_ps(bg + i, fg0); _mm256_storeu_ps(bg + i + 8, fg1);
                    _mm256_storeu_ps(bp + i, fp0); _mm256_storeu_ps(bp + i + 8, fp1);
                }
            for (int64_t i = 0; i < w; i += 16) {
                const int64_t c = c0 + i;
                bnbw__rows_flush(x, x_row, dy, dy_row, r, nr, c, _mm256_loadu_ps(mean + c),
                                 _mm256_loadu_ps(mean + c + 8),
                                 bnbw__opaque(_mm256_loadu_ps(bg + i)),
                                 bnbw__opaque(_mm256_loadu_ps(bg + i + 8)),
                                 bnbw__opaque(_mm256_loadu_ps(bp + i)),
                                 bnbw__opaque(_mm256_loadu_ps(bp + i + 8)), sum_g, sum_xg, dt);
            }
        }
    }
}

/* Blocked sums of channels 0..n16 (a multiple of 16), a block of BNBW_BLOCK_ROWS rows at a
 * time: rows of up to BNBW_WIDE_ROW bytes keep the block sums in registers, 32
 * channels per visit of the block's rows (a whole 64-byte line of halves at once), wider ones
 * go through bnbw__reduce_wide_rows_blocked. */
#define BNBW_WIDE_ROW 128
BNBW_AVX2_INLINE void bnbw__reduce_rows_blocked(const void *x, int64_t x_row, const void *dy,
                                                int64_t dy_row, int64_t rows, int64_t n16,
                                                const float *mean, double *sum_g,
                                                double *sum_xg, int dt)
{
    int64_t isz = dt == BNBW_F32 ? 4 : 2;
    if (x_row * isz > BNBW_WIDE_ROW || dy_row * isz > BNBW_WIDE_ROW) {
        bnbw__reduce_wide_rows_blocked(x, x_row, dy, dy_row, rows, n16, mean, sum_g, sum_xg,
                                       dt);
        return;
    }
    for (int64_t r = 0; r < rows; r += BNBW_BLOCK_ROWS) {
        int64_t nr = rows - r < BNBW_BLOCK_ROWS ? rows - r : BNBW_BLOCK_ROWS;
        int64_t c = 0;
        for (; c + 32 <= n16; c += 32) {
            const __m256 ma = _mm256_loadu_ps(mean + c), mb = _mm256_loadu_ps(mean + c + 8);
            const __m256 mc = _mm256_loadu_ps(mean + c + 16), md = _mm256_loadu_ps(mean + c + 24);
            __m256 fg0 = _mm256_setzero_ps(), fg1 = fg0, fp0 = fg0, fp1 = fg0;
            __m256 hg0 = fg0, hg1 = fg0, hp0 = fg0, hp1 = fg0;
            for (int64_t j = r; j < r + nr; ++j) {
                const int64_t xj = j * x_row + c, gj = j * dy_row + c;
                BNBW_BLOCK_ADD16(bnbw_load8(dy, gj, dt), bnbw_load8(dy, gj + 8, dt),
                                 BNBW_SUB_ON_FMA(bnbw_load8(x, xj, dt), ma),
                                 BNBW_SUB_ON_FMA(bnbw_load8(x, xj + 8, dt), mb));
                BNBW_BLOCK_ADD16_TO(hg0, hg1, hp0, hp1,
                                    bnbw_load8(dy, gj + 16, dt), bnbw_load8(dy, gj + 24, dt),
                                    BNBW_SUB_ON_FMA(bnbw_load8(x, xj + 16, dt), mc),
                                    BNBW_SUB_ON_FMA(bnbw_load8(x, xj + 24, dt), md));
            }
            bnbw__rows_flush(x, x_row, dy, dy_row, r, nr, c, ma, mb, fg0, fg1, fp0, fp1, sum_g,
                             sum_xg, dt);
            bnbw__rows_flush(x, x_row, dy, dy_row, r, nr, c + 16, mc, md, hg0, hg1, hp0, hp1,
                             sum_g, sum_xg, dt);
        }
        if (c < n16) {             /* one run of 16 channels left */
            const __m256 ma = _mm256_loadu_ps(mean + c), mb = _mm256_loadu_ps(mean + c + 8);
            __m256 fg0 = _mm256_setzero_ps(), fg1 = fg0, fp0 = fg0, fp1 = fg0;
            BNBW_ROW_TERMS(BNBW_BLOCK_ADD16);
            bnbw__rows_flush(x, x_row, dy, dy_row, r, nr, c, ma, mb, fg0, fg1, fp0, fp1, sum_g,
                             sum_xg, dt);
        }
    }
}

BNBW_AVX2_INLINE void bnbw_reduce_rows_body(const void *x, int64_t x_row, const void *dy,
                                            int64_t dy_row, int64_t rows, int64_t n,
                                            const float *mean, double *sum_g, double *sum_xg,
                                            int streaming, int blocked, int dt)
{
    int64_t n16 = n - n % 16;
    int64_t row_bytes = x_row * (dt == BNBW_F32 ? 4 : 2);
    int64_t group = streaming && row_bytes >= BNBW_ONE_ROW_FROM && row_bytes <= BNBW_ONE_ROW_TO
                    ? 1 : BNBW_ROW_GROUP;
    if (blocked) {                 /* a group is a block */
        bnbw__reduce_rows_blocked(x, x_row, dy, dy_row, rows, n16, mean, sum_g, sum_xg, dt);
        group = BNBW_BLOCK_ROWS;
    } else {
        for (int64_t r = 0; r < rows; r += group) {
            int64_t nr = rows - r < group ? rows - r : group;
            for (int64_t c = 0; c < n16; c += 16) {
                __m256d g0 = _mm256_loadu_pd(sum_g + c), g1 = _mm256_loadu_pd(sum_g + c + 4);
                __m256d g2 = _mm256_loadu_pd(sum_g + c + 8);
                __m256d g3 = _mm256_loadu_pd(sum_g + c + 12);
                __m256d p0 = _mm256_loadu_pd(sum_xg + c), p1 = _mm256_loadu_pd(sum_xg + c + 4);
                __m256d p2 = _mm256_loadu_pd(sum_xg + c + 8);
                __m256d p3 = _mm256_loadu_pd(sum_xg + c + 12);
                const __m256 ma = _mm256_loadu_ps(mean + c), mb = _mm256_loadu_ps(mean + c + 8);
                BNBW_ROW_TERMS(BNBW_ACCUMULATE16);
                _mm256_storeu_pd(sum_g + c, g0); _mm256_storeu_pd(sum_g + c + 4, g1);
                _mm256_storeu_pd(sum_g + c + 8, g2); _mm256_storeu_pd(sum_g + c + 12, g3);
                _mm256_storeu_pd(sum_xg + c, p0); _mm256_storeu_pd(sum_xg + c + 4, p1);
                _mm256_storeu_pd(sum_xg + c + 8, p2); _mm256_storeu_pd(sum_xg + c + 12, p3);
            }
        }
    }
    if (n16 < n) {                 /* the last t < 16 channels: sums in registers, all rows */
        int64_t t = n - n16;
        double sg[16] = {0}, sxg[16] = {0};
        __m256 ma, mb;
        bnbw_load_part16(mean, n16, t, BNBW_F32, &ma, &mb);
        memcpy(sg, sum_g + n16, (size_t)t * sizeof(double));
        memcpy(sxg, sum_xg + n16, (size_t)t * sizeof(double));
        __m256d g0 = _mm256_loadu_pd(sg), g1 = _mm256_loadu_pd(sg + 4);
        __m256d g2 = _mm256_loadu_pd(sg + 8), g3 = _mm256_loadu_pd(sg + 12);
        __m256d p0 = _mm256_loadu_pd(sxg), p1 = _mm256_loadu_pd(sxg + 4);
        __m256d p2 = _mm256_loadu_pd(sxg + 8), p3 = _mm256_loadu_pd(sxg + 12);
        for (int64_t r = 0; r < rows; r += group) {
            int64_t nr = rows - r < group ? rows - r : group;
#define BNBW_PART_TERMS(ADD16) for (int64_t j = r; j < r + nr; ++j) {                      \
                __m256 xa, xb, ya, yb;                                                      \
                bnbw_load_part16(x, j * x_row + n16, t, dt, &xa, &xb);                      \
                bnbw_load_part16(dy, j * dy_row + n16, t, dt, &ya, &yb);                    \
                ADD16(ya, yb, _mm256_sub_ps(xa, ma), _mm256_sub_ps(xb, mb));                \
            }
            if (blocked)
                BNBW_BLOCK_SUM(BNBW_PART_TERMS);
            else
                BNBW_PART_TERMS(BNBW_ACCUMULATE16);
#undef BNBW_PART_TERMS
        }
        _mm256_storeu_pd(sg, g0); _mm256_storeu_pd(sg + 4, g1);
        _mm256_storeu_pd(sg + 8, g2); _mm256_storeu_pd(sg + 12, g3);
        _mm256_storeu_pd(sxg, p0); _mm256_storeu_pd(sxg + 4, p1);
        _mm256_storeu_pd(sxg + 8, p2); _mm256_storeu_pd(sxg + 12, p3);
        memcpy(sum_g + n16, sg, (size_t)t * sizeof(double));
        memcpy(sum_xg + n16, sxg, (size_t)t * sizeof(double));
    }
}
#undef BNBW_ROW_TERMS

/* The channel-last elementwise kernels take runs of 16 channels in bnbw_load16_lanes order,
 * so bf16 rows go as even and odd elements (a shift and a mask, no widening or packing
 * shuffles: (32, 56, 56, 64) bf16 apply 1.14-1.22x as fast, training 0.90x the time, 1 thread).
 * Their per-channel constants must then be in that order too: bnbw__lane_order gives src's
 * channels c0..c0+w (w a multiple of 16; at most BNBW_SLICE for bf16) in dt's lane order:
 * src itself for f32 and f16, a copy into `copy` for bf16. */
BNBW_AVX2_INLINE const float *bnbw__lane_order(const float *src, int64_t c0, int64_t w,
                                               float *copy, int dt)
{
    if (dt != BNBW_BF16)
        return src + c0;
    for (int64_t c = 0; c < w; c += 16)
        for (int k = 0; k < 8; ++k) {
            copy[c + k] = src[c0 + c + 2 * k];
            copy[c + 8 + k] = src[c0 + c + 2 * k + 1];
        }
    return copy;
}


BNBW_AVX2_INLINE void bnbw_apply_rows_body(const void *x, int64_t x_row, const void *dy,
                                           int64_t dy_row, void *dx, int64_t dx_row,
                                           int64_t rows, int64_t n, const float *mean,
                                           const float *k1, const float *k2, const float *k3,
                                           int dt)
{
    float cm[BNBW_SLICE], c1[BNBW_SLICE], c2[BNBW_SLICE], c3[BNBW_SLICE];
    int64_t n16 = n - n % 16, slice = dt == BNBW_BF16 ? BNBW_SLICE : n16;
    for (int64_t c0 = 0; c0 < n16; c0 += slice) {      /* one slice unless bf16 */
        int64_t w = n16 - c0 < slice ? n16 - c0 : slice;
        const float *lm = bnbw__lane_order(mean, c0, w, cm, dt);
        const float *l1 = bnbw__lane_order(k1, c0, w, c1, dt);
        const float *l2 = bnbw__lane_order(k2, c0, w, c2, dt);
        const float *l3 = bnbw__lane_order(k3, c0, w, c3, dt);
        for (int64_t r = 0; r < rows; ++r) {
            int64_t xi = r * x_row + c0, gi = r * dy_row + c0, di = r * dx_row + c0;
            for (int64_t c = 0; c < w; c += 16) {
                __m256 xa, xb, ya, yb;
                bnbw_load16_lanes(x, xi + c, dt, &xa, &xb);
                bnbw_load16_lanes(dy, gi + c, dt, &ya, &yb);
                bnbw_store16_lanes(
                    dx, di + c,
                    bnbw__apply8(xa, ya, _mm256_loadu_ps(lm + c), _mm256_loadu_ps(l1 + c),
                                 _mm256_loadu_ps(l2 + c), _mm256_loadu_ps(l3 + c)),
                    bnbw__apply8(xb, yb, _mm256_loadu_ps(lm + c + 8), _mm256_loadu_ps(l1 + c + 8),
                                 _mm256_loadu_ps(l2 + c + 8), _mm256_loadu_ps(l3 + c + 8)),
                    dt);
            }
        }
    }
    if (n % 16) {                  /* the last t < 16 channels, padded to 16 lanes */
        int64_t c = n - n % 16, t = n - c;
        __m256 ma, mb, aa, ab, ba, bb, ka, kb;
        bnbw_load_part16(mean, c, t, BNBW_F32, &ma, &mb);
        bnbw_load_part16(k1, c, t, BNBW_F32, &aa, &ab);
        bnbw_load_part16(k2, c, t, BNBW_F32, &ba, &bb);
        bnbw_load_part16(k3, c, t, BNBW_F32, &ka, &kb);
        for (int64_t r = 0; r < rows; ++r) {
            __m256 xa, xb, ya, yb;
            bnbw_load_part16(x, r * x_row + c, t, dt, &xa, &xb);
            bnbw_load_part16(dy, r * dy_row + c, t, dt, &ya, &yb);
            bnbw_store_part16(dx, r * dx_row + c, t, bnbw__apply8(xa, ya, ma, aa, ba, ka),
                              bnbw__apply8(xb, yb, mb, ab, bb, kb), dt);
        }
    }
}

BNBW_AVX2_INLINE void bnbw_scale_rows_body(const void *dy, int64_t dy_row, void *dx,
                                           int64_t dx_row, int64_t rows, int64_t n,
                                           const float *k1, int dt)
{
    float c1[BNBW_SLICE];
    int64_t n16 = n - n % 16, slice = dt == BNBW_BF16 ? BNBW_SLICE : n16;
    for (int64_t c0 = 0; c0 < n16; c0 += slice) {      /* as in bnbw_apply_rows_body */
        int64_t w = n16 - c0 < slice ? n16 - c0 : slice;
        const float *l1 = bnbw__lane_order(k1, c0, w, c1, dt);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < w; c += 16) {
                __m256 ya, yb;
                bnbw_load16_lanes(dy, r * dy_row + c0 + c, dt, &ya, &yb);
                bnbw_store16_lanes(dx, r * dx_row + c0 + c,
                                   _mm256_mul_ps(_mm256_loadu_ps(l1 + c), ya),
                                   _mm256_mul_ps(_mm256_loadu_ps(l1 + c + 8), yb), dt);
            }
    }
    if (n % 16) {                  /* the last t < 16 channels, as in bnbw_apply_rows_body */
        int64_t c = n - n % 16, t = n - c;
        __m256 aa, ab;
        bnbw_load_part16(k1, c, t, BNBW_F32, &aa, &ab);
        for (int64_t r = 0; r < rows; ++r) {
            __m256 ya, yb;
            bnbw_load_part16(dy, r * dy_row + c, t, dt, &ya, &yb);
            bnbw_store_part16(dx, r * dx_row + c, t, _mm256_mul_ps(aa, ya), _mm256_mul_ps(ab, yb),
                              dt);
        }
    }
}

/* Runs `call`, an expression in the constant T, once specialised per storage type: the
 * always-inline bodies above become one loop per type, with no per-element branch.  gcc 12
 * emits no vzeroupper on leaving a target("avx2") function for baseline code, and SSE code
 * after dirty upper halves runs several times slower on Skylake-class cores: clear them. */
#define BNBW_PER_TYPE(dt, call) do {                                           \
        if ((dt) == BNBW_F16) { const int T = BNBW_F16; call; }                \
        else if ((dt) == BNBW_BF16) { const int T = BNBW_BF16; call; }         \
        else { const int T = BNBW_F32; call; }                                 \
        _mm256_zeroupper();                                                    \
    } while (0)
#define BNBW_AVX2_KERNEL static __attribute__((noinline, target("avx2,fma,f16c"))) void

BNBW_AVX2_KERNEL bnbw_reduce_row_avx2(const void *x, const void *dy, int64_t n, float mean,
                                      double out[2], int blocked, int dt)
{ BNBW_PER_TYPE(dt, bnbw_reduce_row_body(x, dy, n, mean, out, blocked, T)); }

BNBW_AVX2_KERNEL bnbw_apply_row_avx2(const void *x, const void *dy, void *dx, int64_t n,
                                     float mean, float k1, float k2, float k3, int dt)
{ BNBW_PER_TYPE(dt, bnbw_apply_row_body(x, dy, dx, n, mean, k1, k2, k3, T)); }

BNBW_AVX2_KERNEL bnbw_scale_row_avx2(const void *dy, void *dx, int64_t n, float k1, int dt)
{ BNBW_PER_TYPE(dt, bnbw_scale_row_body(dy, dx, n, k1, T)); }

BNBW_AVX2_KERNEL bnbw_reduce_rows_avx2(const void *x, int64_t x_row, const void *dy,
                                       int64_t dy_row, int64_t rows, int64_t n,
                                       const float *mean, double *sum_g, double *sum_xg,
                                       int streaming, int blocked, int dt)
{
    BNBW_PER_TYPE(dt, bnbw_reduce_rows_body(x, x_row, dy, dy_row, rows, n, mean, sum_g, sum_xg,
                                            streaming, blocked, T));
}

BNBW_AVX2_KERNEL bnbw_apply_rows_avx2(const void *x, int64_t x_row, const void *dy,
                                      int64_t dy_row, void *dx, int64_t dx_row, int64_t rows,
                                      int64_t n, const float *mean, const float *k1,
                                      const float *k2, const float *k3, int dt)
{
    BNBW_PER_TYPE(dt, bnbw_apply_rows_body(x, x_row, dy, dy_row, dx, dx_row, rows, n, mean,
                                           k1, k2, k3, T));
}

BNBW_AVX2_KERNEL bnbw_scale_rows_avx2(const void *dy, int64_t dy_row, void *dx, int64_t dx_row,
                                      int64_t rows, int64_t n, const float *k1, int dt)
{ BNBW_PER_TYPE(dt, bnbw_scale_rows_body(dy, dy_row, dx, dx_row, rows, n, k1, T)); }

/* Runs of short rows (see bnbw_reduce_row_run): the row bodies in a loop, one call. */
BNBW_AVX2_INLINE void bnbw__reduce_run_body(const char *x, int64_t x_step, const char *dy,
                                            int64_t dy_step, int64_t n, int64_t count,
                                            const float *mean, double *sums, int64_t sums_step,
                                            int blocked, int dt)
{
    for (int64_t r = 0; r < count; ++r, x += x_step, dy += dy_step, sums += sums_step) {
        double part[2];
        bnbw_reduce_row_body(x, dy, n, mean[r], part, blocked, dt);
        sums[0] += part[0];
        sums[1] += part[1];
    }
}

BNBW_AVX2_INLINE void bnbw__apply_run_body(const char *x, int64_t x_step, const char *dy,
                                           int64_t dy_step, char *dx, int64_t dx_step,
                                           int64_t n, int64_t count, const float *mean,
                                           const float *k1, const float *k2, const float *k3,
                                           int dt)
{
    for (int64_t r = 0; r < count; ++r, x += x_step, dy += dy_step, dx += dx_step)
        bnbw_apply_row_body(x, dy, dx, n, mean[r], k1[r], k2[r], k3[r], dt);
}

BNBW_AVX2_INLINE void bnbw__scale_run_body(const char *dy, int64_t dy_step, char *dx,
                                           int64_t dx_step, int64_t n, int64_t count,
                                           const float *k1, int dt)
{
    for (int64_t r = 0; r < count; ++r, dy += dy_step, dx += dx_step)
        bnbw_scale_row_body(dy, dx, n, k1[r], dt);
}

BNBW_AVX2_KERNEL bnbw_reduce_row_run_avx2(const void *x, int64_t x_step, const void *dy,
                                          int64_t dy_step, int64_t n, int64_t count,
                                          const float *mean, double *sums, int64_t sums_step,
                                          int blocked, int dt)
{
    BNBW_PER_TYPE(dt, bnbw__reduce_run_body((const char *)x, x_step, (const char *)dy, dy_step,
                                            n, count, mean, sums, sums_step, blocked, T));
}

BNBW_AVX2_KERNEL bnbw_apply_row_run_avx2(const void *x, int64_t x_step, const void *dy,
                                         int64_t dy_step, void *dx, int64_t dx_step, int64_t n,
                                         int64_t count, const float *mean, const float *k1,
                                         const float *k2, const float *k3, int dt)
{
    BNBW_PER_TYPE(dt, bnbw__apply_run_body((const char *)x, x_step, (const char *)dy, dy_step,
                                           (char *)dx, dx_step, n, count, mean, k1, k2, k3, T));
}

BNBW_AVX2_KERNEL bnbw_scale_row_run_avx2(const void *dy, int64_t dy_step, void *dx,
                                         int64_t dx_step, int64_t n, int64_t count,
                                         const float *k1, int dt)
{
    BNBW_PER_TYPE(dt, bnbw__scale_run_body((const char *)dy, dy_step, (char *)dx, dx_step, n,
                                           count, k1, T));
}

/* 1 when the AVX2 bodies run: the body in use (bnbw_half.h's bnbw_body, shared with the
 * converters) is AVX2 or better. */
static inline int bnbw_avx2_kernels(void) { return bnbw__half_level(); }
#else
static inline int bnbw_avx2_kernels(void) { return 0; }
#endif

/* ---- dispatch ---------------------------------------------------------------------------- */

/* 1 when the kernels take rows of storage type dt directly; otherwise the caller converts
 * them into f32 tiles and passes BNBW_F32. */
static inline int bnbw_kernels_take(int dt) { return dt == BNBW_F32 || bnbw_avx2_kernels(); }

#ifdef BNBW_HAVE_AVX2_KERNELS
#define BNBW_DISPATCH(avx2_call, portable_call) do {   \
        if (bnbw_avx2_kernels()) avx2_call; else portable_call; \
    } while (0)
#else
#define BNBW_DISPATCH(avx2_call, portable_call) portable_call
#endif

/* out[0] = Sum dy, out[1] = Sum (x - mean) * dy over the row (assigned, not accumulated);
 * blocked: BNBW_EXACT_SUMS, or f32 blocks with lanes in the order it names (see the header). */
static void bnbw_reduce_row(const void *x, const void *dy, int64_t n, float mean, double out[2],
                            int blocked, int dt)
{
    BNBW_DISPATCH(bnbw_reduce_row_avx2(x, dy, n, mean, out, blocked, dt),
                  bnbw_reduce_row_portable(x, dy, n, mean, out, blocked));
}

static void bnbw_apply_row(const void *x, const void *dy, void *dx, int64_t n, float mean,
                           float k1, float k2, float k3, int dt)
{
    BNBW_DISPATCH(bnbw_apply_row_avx2(x, dy, dx, n, mean, k1, k2, k3, dt),
                  bnbw_apply_row_portable(x, dy, dx, n, mean, k1, k2, k3));
}

static void bnbw_scale_row(const void *dy, void *dx, int64_t n, float k1, int dt)
{
    BNBW_DISPATCH(bnbw_scale_row_avx2(dy, dx, n, k1, dt), bnbw_scale_row_portable(dy, dx, n, k1));
}

/* sum_g[c] += Sum_r dy[r][c];  sum_xg[c] += Sum_r (x[r][c] - mean[c]) * dy[r][c].
 * streaming: a hint that the rows come from memory rather than cache (visiting order only);
 * blocked: in f32 blocks of BNBW_BLOCK_ROWS rows from the first (see the header). */
static void bnbw_reduce_rows(const void *x, int64_t x_row, const void *dy, int64_t dy_row,
                             int64_t rows, int64_t n, const float *mean, double *sum_g,
                             double *sum_xg, int streaming, int blocked, int dt)
{
    BNBW_DISPATCH(bnbw_reduce_rows_avx2(x, x_row, dy, dy_row, rows, n, mean, sum_g, sum_xg,
                                        streaming, blocked, dt),
                  bnbw_reduce_rows_portable(x, x_row, dy, dy_row, rows, n, mean, sum_g, sum_xg,
                                            blocked));
}

static void bnbw_apply_rows(const void *x, int64_t x_row, const void *dy, int64_t dy_row,
                            void *dx, int64_t dx_row, int64_t rows, int64_t n, const float *mean,
                            const float *k1, const float *k2, const float *k3, int dt)
{
    BNBW_DISPATCH(bnbw_apply_rows_avx2(x, x_row, dy, dy_row, dx, dx_row, rows, n, mean, k1, k2,
                                       k3, dt),
                  bnbw_apply_rows_portable(x, x_row, dy, dy_row, dx, dx_row, rows, n, mean, k1,
                                           k2, k3));
}

static void bnbw_scale_rows(const void *dy, int64_t dy_row, void *dx, int64_t dx_row,
                            int64_t rows, int64_t n, const float *k1, int dt)
{
    BNBW_DISPATCH(bnbw_scale_rows_avx2(dy, dy_row, dx, dx_row, rows, n, k1, dt),
                  bnbw_scale_rows_portable(dy, dy_row, dx, dx_row, rows, n, k1));
}

/* Runs of `count` short channel-major rows of n elements, one call instead of one per row (the
 * fixed work of a call matters on 7x7 rows): row r of x starts r * x_step bytes after x (dy,
 * dx likewise) and has the statistics mean[r] (k1[r], k2[r], k3[r]).  The reduction adds row
 * r's two sums, exactly as bnbw_reduce_row returns them, to sums[r * sums_step + 0, 1]. */
static void bnbw_reduce_row_run(const void *x, int64_t x_step, const void *dy, int64_t dy_step,
                                int64_t n, int64_t count, const float *mean, double *sums,
                                int64_t sums_step, int blocked, int dt)
{
#ifdef BNBW_HAVE_AVX2_KERNELS
    if (bnbw_avx2_kernels()) {
        bnbw_reduce_row_run_avx2(x, x_step, dy, dy_step, n, count, mean, sums, sums_step,
                                 blocked, dt);
        return;
    }
#endif
    (void)dt;
    for (int64_t r = 0; r < count; ++r) {     /* portable: direct rows are f32 */
        double part[2];
        bnbw_reduce_row_portable((const float *)(const void *)((const char *)x + r * x_step),
                                 (const float *)(const void *)((const char *)dy + r * dy_step),
                                 n, mean[r], part, blocked);
        sums[r * sums_step] += part[0];
        sums[r * sums_step + 1] += part[1];
    }
}

static void bnbw_apply_row_run(const void *x, int64_t x_step, const void *dy, int64_t dy_step,
                               void *dx, int64_t dx_step, int64_t n, int64_t count,
                               const float *mean, const float *k1, const float *k2,
                               const float *k3, int dt)
{
#ifdef BNBW_HAVE_AVX2_KERNELS
    if (bnbw_avx2_kernels()) {
        bnbw_apply_row_run_avx2(x, x_step, dy, dy_step, dx, dx_step, n, count, mean, k1, k2, k3,
                                dt);
        return;
    }
#endif
    (void)dt;
    for (int64_t r = 0; r < count; ++r)
        bnbw_apply_row_portable((const float *)(const void *)((const char *)x + r * x_step),
                                (const float *)(const void *)((const char *)dy + r * dy_step),
                                (float *)(void *)((char *)dx + r * dx_step), n, mean[r], k1[r],
                                k2[r], k3[r]);
}

static void bnbw_scale_row_run(const void *dy, int64_t dy_step, void *dx, int64_t dx_step,
                               int64_t n, int64_t count, const float *k1, int dt)
{
#ifdef BNBW_HAVE_AVX2_KERNELS
    if (bnbw_avx2_kernels()) {
        bnbw_scale_row_run_avx2(dy, dy_step, dx, dx_step, n, count, k1, dt);
        return;
    }
#endif
    (void)dt;
    for (int64_t r = 0; r < count; ++r)
        bnbw_scale_row_portable((const float *)(const void *)((const char *)dy + r * dy_step),
                                (float *)(void *)((char *)dx + r * dx_step), n, k1[r]);
}

#endif /* BNBW_KERNELS_H */
