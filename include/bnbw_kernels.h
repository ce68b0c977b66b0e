/*
 * bnbw_kernels.h - the contiguous inner loops of the bnbw_native engine.
 *
 * Every hot loop of the package is one of the seven functions below; the Cython layer
 * (bnbw_native/_core.pyx) only plans, partitions and dispatches.  All of them work on f32
 * rows: half-precision and strided data are first converted into small per-thread f32 tiles
 * (bnbw_half.h), so there is exactly one arithmetic path per formula.
 *
 * Precision.  x - mean is exact in f32 whenever x lies within a factor 2 of the mean (Sterbenz),
 * the product (x - mean) * dy is formed exactly in f64 (24 + 24 bits) and every sum is
 * accumulated in f64 lanes, combined in a fixed tree.  That keeps Sum (x - mean)*dy accurate to ~1e-12 relative for 2^24
 * elements around a large mean, where naive f32 sums lose three or four digits.
 *
 * Determinism.  A function's result depends only on its arguments, never on which thread runs
 * it, and FP contraction is off (-ffp-contract=off), so the AVX2 clone and the baseline clone
 * compute the same bits.
 *
 * Vectorisation.  The loops are written with explicit independent lanes so that gcc vectorises
 * them at -O3 without -ffast-math; target_clones adds an AVX2+FMA+F16C ("x86-64-v3") clone chosen
 * at load time, while the baseline clone keeps the wheel portable.
 */
#ifndef BNBW_KERNELS_H
#define BNBW_KERNELS_H

#include <stdint.h>

#if defined(BNBW_HAVE_TARGET_CLONES)
#define BNBW_SIMD __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define BNBW_SIMD
#endif

/* Lanes of independent f64 partial sums in the channel-major reduction: 16 lanes = 4 AVX2
 * registers per sum, enough to hide the 4-cycle add latency at two loads per cycle. */
#define BNBW_LANES 16

/* ---- channel-major: one channel, n contiguous elements -------------------------------- */

/* The channel-major reduction has a portable body and an AVX2 body with the same 16 f64 lanes
 * and the same combining tree, so both give the same bits; gcc's vectoriser produces poor code
 * for the f32->f64 widening here, hence the explicit AVX2 version. */
static void bnbw_reduce_row_finish(const float *x, const float *dy, int64_t i, int64_t n,
                                   float mean, double *sg, double *sxg, double out[2])
{
    for (int l = 0; i < n; ++i, ++l) {         /* tail: fewer than BNBW_LANES elements */
        float g = dy[i];
        sg[l] += (double)g;
        sxg[l] += (double)(x[i] - mean) * (double)g;
    }
    for (int width = BNBW_LANES / 2; width > 0; width /= 2) {   /* fixed pairwise tree */
        for (int l = 0; l < width; ++l) {
            sg[l] += sg[l + width];
            sxg[l] += sxg[l + width];
        }
    }
    out[0] = sg[0];
    out[1] = sxg[0];
}

static void bnbw_reduce_row_portable(const float *x, const float *dy, int64_t n, float mean,
                                     double out[2])
{
    double sg[BNBW_LANES] = {0}, sxg[BNBW_LANES] = {0};
    int64_t i = 0;
    for (; i + BNBW_LANES <= n; i += BNBW_LANES) {
        for (int l = 0; l < BNBW_LANES; ++l) {
            float g = dy[i + l];
            sg[l] += (double)g;
            sxg[l] += (double)(x[i + l] - mean) * (double)g;
        }
    }
    bnbw_reduce_row_finish(x, dy, i, n, mean, sg, sxg, out);
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define BNBW_HAVE_AVX2_REDUCE 1

/* 16 consecutive floats of dy (G) and x (X), the means of their two halves in MA, MB: adds
 * dy to g0..g3 and the exact f64 product (x - mean) * dy to p0..p3, lane k of register j
 * holding element 4j + k, exactly as the portable loops do. */
#define BNBW_WIDEN_LO(v) _mm256_cvtps_pd(_mm256_castps256_ps128(v))
#define BNBW_WIDEN_HI(v) _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))
#define BNBW_ACCUMULATE16(G, X, MA, MB) do {                                              \
        __m256 ga_ = _mm256_loadu_ps(G), gb_ = _mm256_loadu_ps((G) + 8);                  \
        __m256 da_ = _mm256_sub_ps(_mm256_loadu_ps(X), MA);                               \
        __m256 db_ = _mm256_sub_ps(_mm256_loadu_ps((X) + 8), MB);                         \
        __m256d w0_ = BNBW_WIDEN_LO(ga_), w1_ = BNBW_WIDEN_HI(ga_);                       \
        __m256d w2_ = BNBW_WIDEN_LO(gb_), w3_ = BNBW_WIDEN_HI(gb_);                       \
        g0 = _mm256_add_pd(g0, w0_); g1 = _mm256_add_pd(g1, w1_);                         \
        g2 = _mm256_add_pd(g2, w2_); g3 = _mm256_add_pd(g3, w3_);                         \
        p0 = _mm256_add_pd(p0, _mm256_mul_pd(BNBW_WIDEN_LO(da_), w0_));                   \
        p1 = _mm256_add_pd(p1, _mm256_mul_pd(BNBW_WIDEN_HI(da_), w1_));                   \
        p2 = _mm256_add_pd(p2, _mm256_mul_pd(BNBW_WIDEN_LO(db_), w2_));                   \
        p3 = _mm256_add_pd(p3, _mm256_mul_pd(BNBW_WIDEN_HI(db_), w3_));                   \
    } while (0)

__attribute__((target("avx2"))) static void
bnbw_reduce_row_avx2(const float *x, const float *dy, int64_t n, float mean, double out[2])
{
    /* register k holds lanes 4k..4k+3 of the portable version */
    __m256d g0 = _mm256_setzero_pd(), g1 = g0, g2 = g0, g3 = g0;
    __m256d p0 = g0, p1 = g0, p2 = g0, p3 = g0;
    const __m256 m = _mm256_set1_ps(mean);
    int64_t i = 0;
    for (; i + BNBW_LANES <= n; i += BNBW_LANES) {
        BNBW_ACCUMULATE16(dy + i, x + i, m, m);
    }
    double sg[BNBW_LANES], sxg[BNBW_LANES];
    _mm256_storeu_pd(sg, g0); _mm256_storeu_pd(sg + 4, g1);
    _mm256_storeu_pd(sg + 8, g2); _mm256_storeu_pd(sg + 12, g3);
    _mm256_storeu_pd(sxg, p0); _mm256_storeu_pd(sxg + 4, p1);
    _mm256_storeu_pd(sxg + 8, p2); _mm256_storeu_pd(sxg + 12, p3);
    /* gcc 12 emits no vzeroupper before calling (or returning to) baseline code from a
     * target("avx2") function; SSE instructions after dirty upper halves run several times
     * slower on Skylake-class cores, so clear them explicitly. */
    _mm256_zeroupper();
    bnbw_reduce_row_finish(x, dy, i, n, mean, sg, sxg, out);
}

static int bnbw_cpu_has_avx2(void)
{
    static int cached = -1;   /* benign race: every thread computes the same value */
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return cached;
}
#else
static int bnbw_cpu_has_avx2(void) { return 0; }
#endif

/* out[0] = Sum dy, out[1] = Sum (x - mean) * dy over the row (assigned, not accumulated). */
static void bnbw_reduce_row(const float *x, const float *dy, int64_t n, float mean, double out[2])
{
#ifdef BNBW_HAVE_AVX2_REDUCE
    if (bnbw_cpu_has_avx2()) {
        bnbw_reduce_row_avx2(x, dy, n, mean, out);
        return;
    }
#endif
    bnbw_reduce_row_portable(x, dy, n, mean, out);
}

/* dx = k1*dy + k2*(x - mean) + k3.  dx may be the very same memory as dy (in place). */
static BNBW_SIMD void bnbw_apply_row(const float *x, const float *dy, float *dx, int64_t n,
                                     float mean, float k1, float k2, float k3)
{
    for (int64_t i = 0; i < n; ++i)
        dx[i] = (k1 * dy[i] + k2 * (x[i] - mean)) + k3;
}

/* Frozen statistics: dx = k1*dy.  dx may alias dy. */
static BNBW_SIMD void bnbw_scale_row(const float *dy, float *dx, int64_t n, float k1)
{
    for (int64_t i = 0; i < n; ++i)
        dx[i] = k1 * dy[i];
}

/* ---- channel-last: one row of n consecutive channels ----------------------------------- */

/* sum_g[c] += dy[c];  sum_xg[c] += (x[c] - mean[c]) * dy[c] */
static BNBW_SIMD void bnbw_reduce_channels(const float *x, const float *dy, int64_t n,
                                           const float *mean, double *sum_g, double *sum_xg)
{
    for (int64_t c = 0; c < n; ++c) {
        float g = dy[c];
        sum_g[c] += (double)g;
        sum_xg[c] += (double)(x[c] - mean[c]) * (double)g;
    }
}

/* The same sums over `rows` rows that lie x_row / dy_row floats apart.  Each channel still
 * adds its rows in row order, so this is bnbw_reduce_channels row after row, bit for bit; the
 * AVX2 body only keeps 16 channels' sums in registers across the rows. */
static void bnbw_reduce_rows_portable(const float *x, int64_t x_row, const float *dy,
                                      int64_t dy_row, int64_t rows, int64_t n,
                                      const float *mean, double *sum_g, double *sum_xg)
{
    for (int64_t r = 0; r < rows; ++r)
        bnbw_reduce_channels(x + r * x_row, dy + r * dy_row, n, mean, sum_g, sum_xg);
}

#ifdef BNBW_HAVE_AVX2_REDUCE
/* Rows go four at a time: for each run of 16 channels the sums are loaded, the four rows
 * added in row order and the sums stored back.  Walking all rows per channel run instead
 * would visit addresses a row stride apart, which for power-of-two strides all fall into one
 * L1 set and thrash it. */
#define BNBW_ROW_GROUP 4

__attribute__((target("avx2"))) static void
bnbw_reduce_rows_avx2(const float *x, int64_t x_row, const float *dy, int64_t dy_row,
                      int64_t rows, int64_t n, const float *mean, double *sum_g,
                      double *sum_xg)
{
    int64_t n16 = n - n % 16;
    for (int64_t r = 0; r < rows; r += BNBW_ROW_GROUP) {
        int64_t nr = rows - r < BNBW_ROW_GROUP ? rows - r : BNBW_ROW_GROUP;
        const float *xr0 = x + r * x_row, *gr0 = dy + r * dy_row;
        for (int64_t c = 0; c < n16; c += 16) {
            __m256d g0 = _mm256_loadu_pd(sum_g + c), g1 = _mm256_loadu_pd(sum_g + c + 4);
            __m256d g2 = _mm256_loadu_pd(sum_g + c + 8), g3 = _mm256_loadu_pd(sum_g + c + 12);
            __m256d p0 = _mm256_loadu_pd(sum_xg + c), p1 = _mm256_loadu_pd(sum_xg + c + 4);
            __m256d p2 = _mm256_loadu_pd(sum_xg + c + 8), p3 = _mm256_loadu_pd(sum_xg + c + 12);
            const __m256 ma = _mm256_loadu_ps(mean + c), mb = _mm256_loadu_ps(mean + c + 8);
            for (int64_t j = 0; j < nr; ++j)
                BNBW_ACCUMULATE16(gr0 + j * dy_row + c, xr0 + j * x_row + c, ma, mb);
            _mm256_storeu_pd(sum_g + c, g0); _mm256_storeu_pd(sum_g + c + 4, g1);
            _mm256_storeu_pd(sum_g + c + 8, g2); _mm256_storeu_pd(sum_g + c + 12, g3);
            _mm256_storeu_pd(sum_xg + c, p0); _mm256_storeu_pd(sum_xg + c + 4, p1);
            _mm256_storeu_pd(sum_xg + c + 8, p2); _mm256_storeu_pd(sum_xg + c + 12, p3);
        }
    }
    _mm256_zeroupper();                       /* see bnbw_reduce_row_avx2 */
    if (n16 < n)
        bnbw_reduce_rows_portable(x + n16, x_row, dy + n16, dy_row, rows, n - n16, mean + n16,
                                  sum_g + n16, sum_xg + n16);
}
#endif

static void bnbw_reduce_rows(const float *x, int64_t x_row, const float *dy, int64_t dy_row,
                             int64_t rows, int64_t n, const float *mean, double *sum_g,
                             double *sum_xg)
{
#ifdef BNBW_HAVE_AVX2_REDUCE
    if (bnbw_cpu_has_avx2()) {
        bnbw_reduce_rows_avx2(x, x_row, dy, dy_row, rows, n, mean, sum_g, sum_xg);
        return;
    }
#endif
    bnbw_reduce_rows_portable(x, x_row, dy, dy_row, rows, n, mean, sum_g, sum_xg);
}

/* dx = k1*dy + k2*(x - mean) + k3 per channel, over `rows` rows of n channels; each operand
 * has its own row stride (in floats).  dx may alias dy (in place, same strides). */
static BNBW_SIMD void bnbw_apply_rows(const float *x, int64_t x_row, const float *dy,
                                      int64_t dy_row, float *dx, int64_t dx_row, int64_t rows,
                                      int64_t n, const float *mean, const float *k1,
                                      const float *k2, const float *k3)
{
    for (int64_t r = 0; r < rows; ++r, x += x_row, dy += dy_row, dx += dx_row)
        for (int64_t c = 0; c < n; ++c)
            dx[c] = (k1[c] * dy[c] + k2[c] * (x[c] - mean[c])) + k3[c];
}

static BNBW_SIMD void bnbw_scale_rows(const float *dy, int64_t dy_row, float *dx,
                                      int64_t dx_row, int64_t rows, int64_t n, const float *k1)
{
    for (int64_t r = 0; r < rows; ++r, dy += dy_row, dx += dx_row)
        for (int64_t c = 0; c < n; ++c)
            dx[c] = k1[c] * dy[c];
}

#endif /* BNBW_KERNELS_H */
