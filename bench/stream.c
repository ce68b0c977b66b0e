/* Bandwidth probes for bench/run.py: STREAM-like loops with the traffic patterns of the
 * batch-norm passes, so that a case's roofline is measured on buffers of the case's own size,
 * with the case's thread count, in the same run.
 *
 *   bw_reduce   reads a, b            (the backward's reduce pass: x, dy)  8 B per f32 element
 *   bw_apply    reads a, b, writes c  (its apply pass: x, dy -> dx)      12 B per f32 element
 *   bw_training bw_reduce then bw_apply, two parallel regions            20 B per f32 element
 *   bw_scale    reads a, writes c     (frozen statistics: dy -> dx)       8 B per f32 element
 *   bw_copy     reads a, writes c     (plain copy, for the report)        8 B per f32 element
 *   bw_sum      reads a               (the forward's statistics pass: x)  4 B per f32 element
 *   bw_forward  bw_sum then bw_scale  (statistics, then x -> y)          12 B per f32 element
 *
 * Every loop is split statically and evenly over `nthreads` OpenMP threads.  The arithmetic is
 * one multiply-add per element: enough to keep the compiler from turning a loop into memcpy,
 * far too little to limit the speed.  Built by run.py with cc -O3 -march=native -fopenmp.
 */
#include <stdint.h>
#include <string.h>
#define LANES 32
#ifdef _OPENMP
#include <omp.h>
#endif

/* The reductions keep 32 independent lanes (four AVX registers): the adds never wait on each
 * other, so the loops run at load speed even from L1. */
double bw_reduce(const float *a, const float *b, int64_t n, int nthreads)
{
    double total = 0.0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        int64_t lo = 0, hi = n;
#ifdef _OPENMP
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        lo = n * t / nt;
        hi = n * (t + 1) / nt;
#endif
        float acc[LANES] = {0};
        int64_t i = lo;
        for (; i + LANES <= hi; i += LANES)
            for (int j = 0; j < LANES; j++)
                acc[j] += a[i + j] * b[i + j];
        for (; i < hi; i++)
            acc[0] += a[i] * b[i];
        for (int j = 0; j < LANES; j++)
            total += acc[j];
    }
    return total;
}

void bw_apply(const float *a, const float *b, float *c, int64_t n, float s, int nthreads)
{
#pragma omp parallel for simd num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < n; i++)
        c[i] = s * a[i] + b[i];
}

double bw_training(const float *a, const float *b, float *c, int64_t n, int nthreads)
{
    double total = bw_reduce(a, b, n, nthreads);
    bw_apply(a, b, c, n, (float)(total * 0.0) + 0.5f, nthreads);
    return total;
}

void bw_scale(const float *a, float *c, int64_t n, float s, int nthreads)
{
#pragma omp parallel for simd num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < n; i++)
        c[i] = s * a[i];
}

void bw_copy(const float *a, float *c, int64_t n, int nthreads)
{
#pragma omp parallel num_threads(nthreads)
    {
        int64_t t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
        memcpy(c + lo, a + lo, (size_t)(hi - lo) * sizeof(float));
    }
}

double bw_sum(const float *a, int64_t n, int nthreads)
{
    double total = 0.0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        int64_t lo = 0, hi = n;
#ifdef _OPENMP
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        lo = n * t / nt;
        hi = n * (t + 1) / nt;
#endif
        float acc[LANES] = {0};
        int64_t i = lo;
        for (; i + LANES <= hi; i += LANES)
            for (int j = 0; j < LANES; j++)
                acc[j] += a[i + j];
        for (; i < hi; i++)
            acc[0] += a[i];
        for (int j = 0; j < LANES; j++)
            total += acc[j];
    }
    return total;
}

/* The training forward's two reads and one write: a read-only pass over x (its statistics),
 * then x read again and y written.  The scale depends on the sum, so the passes cannot merge. */
double bw_forward(const float *a, float *c, int64_t n, int nthreads)
{
    double total = bw_sum(a, n, nthreads);
    bw_scale(a, c, n, (float)(total * 0.0) + 0.5f, nthreads);
    return total;
}
