/*
 * bnbw_kernels.h - the inner loops of the bnbw_native engine: what they compute, and how the
 * engine reaches them.
 *
 * Every hot loop of the package is one of fifteen kernels; the Cython layer
 * (bnbw_native/_plan.pyx, _schedules.pyx) only plans, partitions and dispatches.  A kernel
 * walks the rows of one call:
 *
 *   channel-major (one channel, n elements of a row)   channel-last (rows of n channels)
 *   backward
 *   reduce_row   Sum g, Sum (x - mean) * g             reduce_rows
 *   apply_row    dx = k2*(x - mean) + (k1*g + k3)      apply_rows
 *   scale_row    dx = k1*g (frozen statistics)         scale_rows
 *   forward (training)
 *   stats_row    Sum d, Sum d*d, d = x - shift         stats_rows
 *   normalize_row  y = k*(x - mean) + b, ReLU or not   normalize_rows
 *   *_row_run    the row kernels over a run of adjacent channels' short rows, one call;
 *                rows of 2, 4, 8 or 16 elements laid end to end go 16 / n rows to a vector
 *                (packed runs, bnbw_kernels_impl.h), with the row kernels' bits
 *
 * The forward's terms are exact: d is formed in f64 from the two f32 values, its square is
 * rounded once and every sum accumulates in f64 lanes, whatever the storage type.  The
 * normalized output is one fused multiply-add after the f32 subtraction, rounded once more to
 * its storage type; the ReLU keeps y > 0 and NaN and gives +0 elsewhere.  The forward writes
 * its output through the `dx` operand and reads only x - and, with a residual added before the
 * ReLU (BNBW_ADD_RELU), the residual through `dy`: y rounded to its storage type, plus the
 * residual in f32, then the ReLU and the rounding of the sum, the bits of the three steps.
 *
 * g is the gradient the formulas use: dy, or - with a ReLU mask - dy where the forward's output
 * is > 0 (or the bool mask is set) and +0 elsewhere, selected, never multiplied, so an inf or
 * NaN of dy at an inactive position reaches nothing.  The apply and scale kernels can also
 * write g out (the gradient of a residual added before the ReLU), dy's own bits or +0.
 *
 * Storage and steps.  x, dy, dx and the residual gradient hold one storage type `dt` (f32, f16,
 * bf16); the mask holds dt or bool.  Each operand has its own step in elements: between
 * neighbours along a channel-major row (1 when contiguous), between rows in the channel-last
 * kernels, whose channels are always adjacent.  Arithmetic is f32, sums f64.
 *
 * Precision.  x - mean is exact in f32 whenever x lies within a factor 2 of the mean
 * (Sterbenz), the product (x - mean) * g is exact in f64 (24 + 24 bits), and every sum is
 * accumulated in 16 f64 lanes folded in a fixed pairwise tree: Sum (x - mean) * g stays accurate
 * to ~1e-12 relative for 2^24 elements around a large mean.  dx is two fused multiply-adds,
 * so it rounds twice after the subtraction, then once more to its storage type.
 *
 * Lane plan.  A channel-major row is read in runs of 16; element l of a run goes to lane l
 * (the exact sums).  The last n % 16 elements fill lanes 0.. and the other lanes add an exact
 * identity (g = -0, x - mean = +0).  Channel-last lanes are channels, each adding its rows in
 * row order.
 *
 * Blocked sums (`sums`, chosen by the engine for f16 and bf16).  Widening every term to f64
 * costs more than reading a half, so each lane first sums a short block in f32 -
 * BNBW_BLOCK_RUNS runs of a channel-major row, BNBW_BLOCK_ROWS rows of a channel-last call -
 * with (x - mean) * g rounded to f32, then adds the block's f32 sums into its f64 lanes.  A
 * block adds at most 17 f32 roundings (~2^-20 of the block's Sum |terms|), far below a half's own
 * 2^-11 or 2^-8.  A lane whose block sum is not finite (f32 overflow, inf or NaN inputs) redoes
 * the block in f64, so every finite f64 result stays finite.  With BNBW_BLOCKS_EVEN_ODD lanes
 * 0-7 of a channel-major run take its even elements 0, 2, .., 14 and lanes 8-15 the odd ones
 * (the order bf16 loads cheapest on AVX2); outside blocks lanes keep element order.
 *
 * One source, several instruction sets.  The arithmetic is written once
 * (bnbw_kernels_impl.h) over a small vector layer of 16-lane f32 and f64 vectors and lane
 * predicates (bnbw_simd_portable.h, bnbw_simd_avx2.h, bnbw_simd_avx512.h, bnbw_simd_neon.h)
 * and compiled once per instruction set, each in its own translation unit (src/body_*.c),
 * into a table of the fifteen kernels.  The portable body defines the results: every other body
 * does the same operations on the same lanes in the same order, so all give the same bits; FP
 * contraction is off (-ffp-contract=off) and the bodies fuse a multiply-add only where the
 * portable body calls fmaf or where the product is exact.  Adding an instruction set is one
 * more layer header and one more translation unit.  bnbw_kernels() picks the table at run
 * time: the best body the CPU and the OS support (CPUID, and XGETBV for the AVX and AVX-512
 * register state; on AArch64 the auxiliary vector's HWCAP_ASIMD), capped by bnbw_set_body_cap
 * (the BNBW_KERNELS environment variable, tests, benchmarks).
 *
 * Determinism.  A kernel's result depends only on its arguments, never on which thread runs it.
 */
#ifndef BNBW_KERNELS_H
#define BNBW_KERNELS_H

#include <stdint.h>

/* Storage types (the engine's DType codes); BNBW_BOOL only for the mask. */
enum { BNBW_F32 = 0, BNBW_F16 = 1, BNBW_BF16 = 2, BNBW_BOOL = 3 };
/* Bytes per element of x, dy, dx and dres (f32, f16, bf16): the one place it is written. */
#define BNBW_ITEMSIZE(dt) ((dt) == BNBW_F32 ? 4 : 2)
#define BNBW_NO_MASK (-1)
/* The normalize kernels' `relu`: none, max(y, +0), or a residual added to y first. */
enum { BNBW_NO_RELU = 0, BNBW_RELU = 1, BNBW_ADD_RELU = 2 };

/* The kernels' `sums` argument (see "Blocked sums"). */
enum { BNBW_EXACT_SUMS = 0, BNBW_BLOCKS = 1, BNBW_BLOCKS_EVEN_ODD = 2 };
#define BNBW_BLOCK_RUNS 16   /* channel-major block: 16 runs of 16 from the row piece's start;
                                the last block takes the whole runs left */
#define BNBW_BLOCK_ROWS 16   /* channel-last block: 16 rows from the call's first row */

/* Bodies, from the most portable up.  Levels are per architecture: 1 is the first vector body
 * (AVX2 on x86, NEON on AArch64), 2 AVX-512; a cap at a level this CPU has no body for runs
 * the best body below it. */
enum { BNBW_BODY_PORTABLE = 0, BNBW_BODY_AVX2 = 1, BNBW_BODY_NEON = 1, BNBW_BODY_AVX512 = 2,
       BNBW_N_BODIES = 3 };

/* The operands of one kernel call.  Steps are in elements (see "Storage and steps"); x is not
 * read by the scale kernels, dx not written by the reductions.  mask NULL: no ReLU mask; dres
 * NULL: g is not written out.  dx may be dy itself (in place), and so may dres. */
typedef struct bnbw_io {
    const void *x, *dy, *mask;
    void *dx, *dres;
    int64_t x_step, dy_step, mask_step, dx_step, dres_step;
    int dt;                  /* storage type of x, dy, dx, dres */
    int mask_dt;             /* dt, BNBW_BOOL, or BNBW_NO_MASK */
    int stream_dx;           /* a hint: write f32 dx past the caches in whole 64-byte lines */
    int from_line;           /* a hint: the data stay in the caches, so dense rows of whole
                                lines may be walked from x's first line (bnbw_kernels_impl.h) */
} bnbw_io;

/* A run of `count` channel-major rows of adjacent channels: row r of each operand starts
 * r * (its byte step) after row 0 of the call's bnbw_io. */
typedef struct bnbw_run {
    int64_t count;
    int64_t x, dy, mask, dx, dres;     /* bytes between the rows of the run */
} bnbw_run;

typedef struct bnbw_kernel_table {
    /* out[0] = Sum g, out[1] = Sum (x - mean) * g over the row (assigned) */
    void (*reduce_row)(const bnbw_io *io, int64_t n, float mean, double out[2], int sums);
    void (*apply_row)(const bnbw_io *io, int64_t n, float mean, float k1, float k2, float k3);
    void (*scale_row)(const bnbw_io *io, int64_t n, float k1);
    /* sum_g[c] += Sum_r g[r][c], sum_xg[c] += Sum_r (x[r][c] - mean[c]) * g[r][c];
     * streaming: a hint that the rows come from memory, not cache (visiting order only) */
    void (*reduce_rows)(const bnbw_io *io, int64_t rows, int64_t n, const float *mean,
                        double *sum_g, double *sum_xg, int streaming, int sums);
    void (*apply_rows)(const bnbw_io *io, int64_t rows, int64_t n, const float *mean,
                       const float *k1, const float *k2, const float *k3);
    void (*scale_rows)(const bnbw_io *io, int64_t rows, int64_t n, const float *k1);
    /* row r of the run adds its two sums, exactly as reduce_row gives them, to
     * sums[r * sums_step], sums[r * sums_step + 1]; mean[r], k1[r], .. are row r's */
    void (*reduce_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n, const float *mean,
                           double *sums, int64_t sums_step, int sum_mode);
    void (*apply_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n, const float *mean,
                          const float *k1, const float *k2, const float *k3);
    void (*scale_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n, const float *k1);
    /* the forward: out[0] = Sum (x - shift), out[1] = Sum (x - shift)^2 over the row (assigned) */
    void (*stats_row)(const bnbw_io *io, int64_t n, float shift, double out[2]);
    /* dx = k*(x - mean) + b, then max(., +0) keeping NaN when relu is BNBW_RELU; with
     * BNBW_ADD_RELU, max(round(.) + r, +0), r read through dy (a residual added before the
     * ReLU, in the steps of dy) */
    void (*normalize_row)(const bnbw_io *io, int64_t n, float mean, float k, float b, int relu);
    /* sum[c] += Sum_r (x[r][c] - shift[c]), sum_sq[c] += Sum_r (x[r][c] - shift[c])^2 */
    void (*stats_rows)(const bnbw_io *io, int64_t rows, int64_t n, const float *shift,
                       double *sum, double *sum_sq, int streaming);
    void (*normalize_rows)(const bnbw_io *io, int64_t rows, int64_t n, const float *mean,
                           const float *k, const float *b, int relu);
    /* as reduce_row_run and apply_row_run */
    void (*stats_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n, const float *shift,
                          double *sums, int64_t sums_step);
    void (*normalize_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n,
                              const float *mean, const float *k, const float *b, int relu);
} bnbw_kernel_table;

/* The tables, one per translation unit; NULL entries where this build has no such body. */
extern const bnbw_kernel_table bnbw_kernels_portable;
extern const bnbw_kernel_table *const bnbw_kernels_avx2;
extern const bnbw_kernel_table *const bnbw_kernels_avx512;
extern const bnbw_kernel_table *const bnbw_kernels_neon;

/* The best body this CPU and OS run and this build has; the body in use (that, at most the
 * cap); the cap; a body's name ("portable", "AVX2", "AVX-512", "NEON"). */
int bnbw_cpu_body(void);
int bnbw_body(void);
void bnbw_set_body_cap(int cap);
const char *bnbw_body_name(int body);
/* The table of the body in use. */
const bnbw_kernel_table *bnbw_kernels(void);
/* The table of body `body` (<= bnbw_cpu_body()). */
const bnbw_kernel_table *bnbw_kernels_of(int body);

#endif /* BNBW_KERNELS_H */
