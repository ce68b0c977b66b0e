/*
 * bnbw_kernels_impl.h - the arithmetic of the fifteen kernels, written once over the vector layer
 * (see bnbw_kernels.h for what they compute, the precision and the lane plan).
 *
 * Included by one translation unit per instruction set, after that instruction set's layer
 * (bnbw_simd_*.h), with K__NAME(name) naming its kernels; the unit then defines its table from
 * K__TABLE_ENTRIES.  Every body specialises on the storage type, the mask's type and
 * (channel-major rows) whether every operand is contiguous, so the loops carry no per-element
 * branch.
 */
#ifndef K__NAME
#error "define K__NAME and include a bnbw_simd_*.h layer before bnbw_kernels_impl.h"
#endif

/* Elements in the next channel-major block when `left` remain: BNBW_BLOCK_RUNS whole runs, or
 * the whole runs that are left (short rows, row ends), 0 when less than a run is left. */
BNBW_INLINE int64_t k__block_length(int64_t left)
{
    int64_t most = BNBW_BLOCK_RUNS * 16;
    return left >= most ? most : left - left % 16;
}

/* g for elements i..i+15 of a row: dy, masked when the call has a mask. */
BNBW_INLINE vf k__g(const bnbw_io *io, int64_t i, int64_t gs, int64_t ms, int dt, int mdt, int eo)
{
    vf g = v_load(io->dy, i, gs, dt, eo);
    if (mdt != BNBW_NO_MASK)
        g = vf_keep(g, v_active(io->mask, i, ms, mdt, eo));
    return g;
}

BNBW_INLINE vf k__g_part(const bnbw_io *io, int64_t i, int64_t t, int64_t gs, int64_t ms, int dt,
                         int mdt)
{
    vf g = v_load_part(io->dy, i, t, gs, dt);
    if (mdt != BNBW_NO_MASK)
        g = vf_keep(g, v_active_part(io->mask, i, t, ms, mdt));
    return g;
}

/* ... held for widening (the exact sums). */
BNBW_INLINE vw k__gw(const bnbw_io *io, int64_t i, int64_t gs, int64_t ms, int dt, int mdt)
{
    vw g = vw_load(io->dy, i, gs, dt);
    if (mdt != BNBW_NO_MASK)
        g = vw_keep(g, v_active(io->mask, i, ms, mdt, 0));
    return g;
}

BNBW_INLINE vw k__gw_part(const bnbw_io *io, int64_t i, int64_t t, int64_t gs, int64_t ms, int dt,
                          int mdt)
{
    vw g = vw_load_part(io->dy, i, t, gs, dt);
    if (mdt != BNBW_NO_MASK)
        g = vw_keep(g, v_active_part(io->mask, i, t, ms, mdt));
    return g;
}

/* The exact sums of 16 terms: dy (g) and (x - mean) * g in f64, lane for lane. */
#define K__ACCUMULATE(G, P, GV, DV) do {                                                    \
        vf k_acc_g = (GV);                                                                  \
        G = vd_add_f32(G, k_acc_g);                                                         \
        P = vd_fma_f32(P, (DV), k_acc_g);                                                   \
    } while (0)
/* ... from vw values: the same operations, the form the main loops load */
#define K__ACCUMULATE_W(G, P, GW, DW) do {                                                  \
        vw k_acc_g = (GW);                                                                  \
        G = vd_add_w(G, k_acc_g);                                                           \
        P = vd_fma_w(P, (DW), k_acc_g);                                                     \
    } while (0)

/* The f32 block sums of 16 terms. */
#define K__BLOCK_ADD(FG, FP, GV, DV) do {                                                   \
        vf k_blk_g = (GV);                                                                  \
        FG = vf_add(FG, k_blk_g);                                                           \
        FP = vf_add_mp(FP, vf_mul((DV), k_blk_g));                                          \
    } while (0)

/* Adds a block's f32 sums FG, FP into the f64 lanes G, P.  Lanes whose block sums are not
 * finite take instead what REDO - the block's terms through K__ACCUMULATE into G, P - gives
 * them: a rare path (overflow, inf, NaN), so it runs for every lane and the lanes are picked. */
#define K__BLOCK_FLUSH(G, P, FG, FP, REDO) do {                                             \
        vm ok_ = vm_finite2(FG, FP);                                                        \
        vd bg_ = vd_add_f32(G, FG), bp_ = vd_add_f32(P, FP);                                \
        if (vm_all(ok_)) {                                                                  \
            G = bg_;                                                                        \
            P = bp_;                                                                        \
        } else {                                                                            \
            REDO;                                                                           \
            G = vd_select(ok_, bg_, G);                                                     \
            P = vd_select(ok_, bp_, P);                                                     \
        }                                                                                   \
    } while (0)

/* ---- channel-major rows ---------------------------------------------------------------- */

BNBW_INLINE void k_reduce_row(const bnbw_io *io, int64_t n, float mean, double out[2], int sums,
                              int dt, int mdt, int contig)
{
    const int64_t xs = contig ? 1 : io->x_step, gs = contig ? 1 : io->dy_step;
    const int64_t ms = contig ? 1 : io->mask_step;
    const vf m = vf_set1(mean);
    vd G = vd_zero(), P = vd_zero();
    int64_t i = 0, block;
    if (sums != BNBW_EXACT_SUMS) {
        const int eo = sums == BNBW_BLOCKS_EVEN_ODD;
        /* one run per iteration, kept rolled: unrolled, compilers hoist a block's loads and
           spill them */
#define K__RUN_TERMS(ADD, A, B)                                                             \
        _Pragma("GCC unroll 1")                                                             \
        for (int64_t k = i; k < i + block; k += 16)                                         \
            ADD(A, B, k__g(io, k, gs, ms, dt, mdt, eo),                                     \
                vf_sub_mp(v_load(io->x, k, xs, dt, eo), m))
        for (; (block = k__block_length(n - i)) > 0; i += block) {
            vf FG = vf_zero(), FP = vf_zero();
            K__RUN_TERMS(K__BLOCK_ADD, FG, FP);
            K__BLOCK_FLUSH(G, P, FG, FP, K__RUN_TERMS(K__ACCUMULATE, G, P));
        }
#undef K__RUN_TERMS
    }
    const vw mw = vw_set1(mean);
    for (const int64_t n16 = n - n % 16; i < n16; i += 16)
        K__ACCUMULATE_W(G, P, k__gw(io, i, gs, ms, dt, mdt), vw_sub(vw_load(io->x, i, xs, dt), mw));
    if (i < n) {
        /* the last t < 16 elements in lanes 0.., the others an exact identity: g = -0 and
           x - mean = +0 add -0 to both sums, and s + -0 == s for every s, signed zeros too */
        const int64_t t = n - i;
        const vm in = vm_below(t);
        K__ACCUMULATE_W(G, P, vw_select(in, k__gw_part(io, i, t, gs, ms, dt, mdt), vw_set1(-0.0f)),
                        vw_keep(vw_sub(vw_load_part(io->x, i, t, xs, dt), mw), in));
    }
    out[0] = vd_fold(G);
    out[1] = vd_fold(P);
}

/* dx = k2*(x - mean) + (k1*g + k3): two fused multiply-adds, rounded twice after the exact
 * subtraction. */
BNBW_INLINE vf k__apply(vf x, vf g, vf m, vf k1, vf k2, vf k3)
{
    return vf_fma(k2, vf_sub_mp(x, m), vf_fma(k1, g, k3));
}

/* Elementwise kernels read contiguous bf16 rows in the layer's cheapest lane order. */
#define K__EO(dt, contig) (BNBW_SIMD_BF16_EVEN_ODD && (dt) == BNBW_BF16 && (contig))

/* Streaming dx (io->stream_dx: the call's data outgrow the caches; channel-major rows only).  An
 * f32 dx row is written with non-temporal stores, which skip the read for ownership, in whole
 * 64-byte lines only: it first takes the `lead` elements up to its first line the usual way (an
 * elementwise kernel's chunks never change a bit).  The last store of a row is followed by a
 * fence. */
BNBW_INLINE int64_t k__lead(const bnbw_io *io, int64_t n, int dt, int contig)
{
    if (!io->stream_dx || dt != BNBW_F32 || !contig)
        return -1;
    const int64_t lead = (int64_t)((64 - ((uintptr_t)io->dx & 63)) & 63) / 4;
    return lead < n ? lead : n;
}
BNBW_INLINE void k__store16(void *row, int64_t i, int64_t step, vf y, int dt, int eo, int st)
{
    if (st)
        vf_stream((float *)row + i, y);
    else
        v_store(row, i, step, y, dt, eo);
}

/* A row in chunks of 16 from `lead` (k__lead; < 0: no streaming): CHUNK(i, t, streamed). */
#define K__ROW_CHUNKS(N, LEAD, CHUNK) do {                                                  \
        const int64_t k_lead_ = (LEAD);                                                     \
        int64_t k_i_ = 0;                                                                   \
        if (k_lead_ > 0) {                                                                  \
            CHUNK(0, k_lead_, 0);                                                           \
            k_i_ = k_lead_;                                                                 \
        }                                                                                   \
        for (; k_i_ + 16 <= (N); k_i_ += 16)                                                \
            CHUNK(k_i_, 16, k_lead_ >= 0);                                                  \
        if (k_i_ < (N))                                                                     \
            CHUNK(k_i_, (N) - k_i_, 0);                                                     \
        if (k_lead_ >= 0)                                                                   \
            v_stream_fence();                                                               \
    } while (0)

/* g written out for elements i..i+t (t <= 16), before dx, which may overwrite dy. */
BNBW_INLINE void k__residual(const bnbw_io *io, int64_t i, int64_t t, int64_t gs, int64_t ms,
                             int64_t rs, int dt, int mdt)
{
    if (mdt != BNBW_NO_MASK && io->dres != NULL)
        v_copy_active(io->dres, rs, io->dy, gs, io->mask, ms, i, t, dt, mdt);
}

BNBW_INLINE void k_apply_row(const bnbw_io *io, int64_t n, float mean, float k1, float k2,
                             float k3, int dt, int mdt, int contig)
{
    const int64_t xs = contig ? 1 : io->x_step, gs = contig ? 1 : io->dy_step;
    const int64_t ms = contig ? 1 : io->mask_step, ds = contig ? 1 : io->dx_step;
    const int64_t rs = contig ? 1 : io->dres_step;
    const int eo = K__EO(dt, contig);
    const vf m = vf_set1(mean), a = vf_set1(k1), b = vf_set1(k2), c = vf_set1(k3);
#define K__CHUNK(I, T, ST) do {                                                             \
        if ((T) == 16) {                                                                    \
            vf x = v_load(io->x, I, xs, dt, eo), g = k__g(io, I, gs, ms, dt, mdt, eo);       \
            k__residual(io, I, 16, gs, ms, rs, dt, mdt);                                    \
            k__store16(io->dx, I, ds, k__apply(x, g, m, a, b, c), dt, eo, ST);              \
        } else {                                                                            \
            vf x = v_load_part(io->x, I, T, xs, dt), g = k__g_part(io, I, T, gs, ms, dt, mdt); \
            k__residual(io, I, T, gs, ms, rs, dt, mdt);                                     \
            v_store_part(io->dx, I, T, ds, k__apply(x, g, m, a, b, c), dt);                 \
        }                                                                                   \
    } while (0)
    K__ROW_CHUNKS(n, k__lead(io, n, dt, contig), K__CHUNK);
#undef K__CHUNK
}

BNBW_INLINE void k_scale_row(const bnbw_io *io, int64_t n, float k1, int dt, int mdt, int contig)
{
    const int64_t gs = contig ? 1 : io->dy_step, ms = contig ? 1 : io->mask_step;
    const int64_t ds = contig ? 1 : io->dx_step, rs = contig ? 1 : io->dres_step;
    const int eo = K__EO(dt, contig);
    const vf a = vf_set1(k1);
#define K__CHUNK(I, T, ST) do {                                                             \
        if ((T) == 16) {                                                                    \
            vf g = k__g(io, I, gs, ms, dt, mdt, eo);                                        \
            k__residual(io, I, 16, gs, ms, rs, dt, mdt);                                    \
            k__store16(io->dx, I, ds, vf_mul(a, g), dt, eo, ST);                            \
        } else {                                                                            \
            vf g = k__g_part(io, I, T, gs, ms, dt, mdt);                                    \
            k__residual(io, I, T, gs, ms, rs, dt, mdt);                                     \
            v_store_part(io->dx, I, T, ds, vf_mul(a, g), dt);                               \
        }                                                                                   \
    } while (0)
    K__ROW_CHUNKS(n, k__lead(io, n, dt, contig), K__CHUNK);
#undef K__CHUNK
}

/* ---- channel-last rows ------------------------------------------------------------------ */

/* Row j, channels c..c+15 of a channel-last call (contiguous channels, element order). */
#define K__X(j, c) v_load(io->x, (j) * io->x_step + (c), 1, dt, 0)
#define K__G(j, c) k__g_rows(io, j, c, dt, mdt)
BNBW_INLINE vf k__g_rows(const bnbw_io *io, int64_t j, int64_t c, int dt, int mdt)
{
    vf g = v_load(io->dy, j * io->dy_step + c, 1, dt, 0);
    if (mdt != BNBW_NO_MASK)
        g = vf_keep(g, v_active(io->mask, j * io->mask_step + c, 1, mdt, 0));
    return g;
}

/* ... held for widening (the exact sums). */
BNBW_INLINE vw k__gw_rows(const bnbw_io *io, int64_t j, int64_t c, int dt, int mdt)
{
    vw g = vw_load(io->dy, j * io->dy_step + c, 1, dt);
    if (mdt != BNBW_NO_MASK)
        g = vw_keep(g, v_active(io->mask, j * io->mask_step + c, 1, mdt, 0));
    return g;
}

/* The last t < 16 channels of row j. */
BNBW_INLINE vf k__g_rows_part(const bnbw_io *io, int64_t j, int64_t c, int64_t t, int dt, int mdt)
{
    vf g = v_load_part(io->dy, j * io->dy_step + c, t, 1, dt);
    if (mdt != BNBW_NO_MASK)
        g = vf_keep(g, v_active_part(io->mask, j * io->mask_step + c, t, 1, mdt));
    return g;
}

/* The loops that walk a channel-last row one run of 16 channels after another take two runs
 * per step.  One run per step left rows streaming from memory up to 1.9x slower on the AVX-512
 * body of a Zen 4 (docs/benchmark-history.md, 6d); each channel's terms are added in the same
 * order either way. */
#define K__TWO_RUNS_A_VISIT _Pragma("GCC unroll 2")

/* Rows r..r+nr of channels c..c+15 (mean mv) as 16 terms per row. */
#define K__ROW_TERMS(ADD, A, B)                                                             \
    for (int64_t j = r; j < r + nr; ++j)                                                    \
        ADD(A, B, K__G(j, c), vf_sub_mp(K__X(j, c), mv))

/* Adds the f32 block sums FG, FP of rows r..r+nr, channels c..c+15, into sum_g, sum_xg. */
BNBW_INLINE void k__rows_flush(const bnbw_io *io, int64_t r, int64_t nr, int64_t c, vf mv, vf FG,
                               vf FP, double *sum_g, double *sum_xg, int dt, int mdt)
{
    vd G = vd_loadu(sum_g + c), P = vd_loadu(sum_xg + c);
    K__BLOCK_FLUSH(G, P, FG, FP, K__ROW_TERMS(K__ACCUMULATE, G, P));
    vd_storeu(sum_g + c, G);
    vd_storeu(sum_xg + c, P);
}

/* Channels per slice of the channel-last kernels that keep per-channel f32 values on the stack
 * (block sums, constants in lane order; up to 32 KiB): the engine's widest call, so that each
 * walks a row once. */
#define BNBW_SLICE 2048

/* Blocked sums of channels 0..n16 (a multiple of 16) of rows wider than K__WIDE_ROW bytes:
 * rows one after another, each block's f32 sums in a buffer.  Visiting a block's 16 rows a few
 * channels at a time instead reads 32 interleaved streams, which the prefetchers do not follow.
 * The buffer is read back whole (vf_opaque): split into narrower loads of wide stores it would
 * miss store forwarding. */
BNBW_INLINE void k__reduce_wide_rows_blocked(const bnbw_io *io, int64_t rows, int64_t n16,
                                             const float *mean, double *sum_g, double *sum_xg,
                                             int dt, int mdt)
{
    float bg[BNBW_SLICE], bp[BNBW_SLICE];
    for (int64_t c0 = 0; c0 < n16; c0 += BNBW_SLICE) {
        int64_t w = n16 - c0 < BNBW_SLICE ? n16 - c0 : BNBW_SLICE;
        for (int64_t r = 0; r < rows; r += BNBW_BLOCK_ROWS) {
            int64_t nr = rows - r < BNBW_BLOCK_ROWS ? rows - r : BNBW_BLOCK_ROWS;
            for (int64_t j = r; j < r + nr; ++j)
                for (int64_t l = 0; l < w; l += 16) {
                    const int64_t c = c0 + l;
                    vf FG = vf_zero(), FP = vf_zero();
                    if (j > r) {
                        FG = vf_loadu(bg + l);
                        FP = vf_loadu(bp + l);
                    }
                    K__BLOCK_ADD(FG, FP, K__G(j, c), vf_sub_mp(K__X(j, c), vf_loadu(mean + c)));
                    vf_storeu(bg + l, FG);
                    vf_storeu(bp + l, FP);
                }
            for (int64_t l = 0; l < w; l += 16) {
                const int64_t c = c0 + l;
                k__rows_flush(io, r, nr, c, vf_loadu(mean + c), vf_opaque(vf_loadu(bg + l)),
                              vf_opaque(vf_loadu(bp + l)), sum_g, sum_xg, dt, mdt);
            }
        }
    }
}

/* Blocked sums of channels 0..n16, a block of BNBW_BLOCK_ROWS rows at a time: rows of up to
 * K__WIDE_ROW bytes keep the block sums in registers, 32 channels per visit of the block's rows
 * (a whole 64-byte line of halves at once); wider ones go through the buffered walk. */
#define K__WIDE_ROW 128
BNBW_INLINE void k__reduce_rows_blocked(const bnbw_io *io, int64_t rows, int64_t n16,
                                        const float *mean, double *sum_g, double *sum_xg, int dt,
                                        int mdt)
{
    const int64_t isz = BNBW_ITEMSIZE(dt);
    if (io->x_step * isz > K__WIDE_ROW || io->dy_step * isz > K__WIDE_ROW) {
        k__reduce_wide_rows_blocked(io, rows, n16, mean, sum_g, sum_xg, dt, mdt);
        return;
    }
    for (int64_t r = 0; r < rows; r += BNBW_BLOCK_ROWS) {
        int64_t nr = rows - r < BNBW_BLOCK_ROWS ? rows - r : BNBW_BLOCK_ROWS;
        int64_t c = 0;
        for (; c + 32 <= n16; c += 32) {
            const vf ma = vf_loadu(mean + c), mb = vf_loadu(mean + c + 16);
            vf FG = vf_zero(), FP = FG, HG = FG, HP = FG;
            for (int64_t j = r; j < r + nr; ++j) {
                K__BLOCK_ADD(FG, FP, K__G(j, c), vf_sub_mp(K__X(j, c), ma));
                K__BLOCK_ADD(HG, HP, K__G(j, c + 16), vf_sub_mp(K__X(j, c + 16), mb));
            }
            k__rows_flush(io, r, nr, c, ma, FG, FP, sum_g, sum_xg, dt, mdt);
            k__rows_flush(io, r, nr, c + 16, mb, HG, HP, sum_g, sum_xg, dt, mdt);
        }
        if (c < n16) {             /* one run of 16 channels left */
            const vf mv = vf_loadu(mean + c);
            vf FG = vf_zero(), FP = FG;
            K__ROW_TERMS(K__BLOCK_ADD, FG, FP);
            k__rows_flush(io, r, nr, c, mv, FG, FP, sum_g, sum_xg, dt, mdt);
        }
    }
}

/* Short rows go four at a time: for each run of 16 channels the sums are loaded, the four rows
 * added in row order and the sums stored back.  Walking all rows per channel run instead would
 * visit addresses a row stride apart, which for power-of-two strides all fall into one L1 set.
 * When the rows stream from memory (`streaming`), a row goes on its own when the kernel reads
 * more than 256 B of it (x and dy in the backward: rows of more than 32 f32 channels; x alone
 * for the forward's statistics: more than 64) and x's row is at most 2 KiB: four rows
 * interleaved line by line defeat the hardware prefetchers, which follow one stream in address
 * order, and the sums of a row (16 B a channel, at most 8 KiB) stay in L1 from row to row.
 * Below 256 B per row, loading and storing the sums for every row costs more than the order
 * saves; past 2 KiB, four at a time measured as fast from memory, and up to 2x faster from
 * 3 KiB, where a row's sums crowd the L1 (docs/benchmark-history.md, 6g).  Either way each
 * channel adds its rows in row order: the same bits.  Rows whose sums fit the registers do
 * not come here (K__REDUCE_IN_REGISTERS). */
#define K__ROW_GROUP 4
#define K__ONE_ROW_READS 257
#define K__ONE_ROW_TO 2048

/* Rows per visit of a channel run: `arrays` rows of x's width are read per row (x, or x and
 * dy). */
BNBW_INLINE int64_t k__row_group(const bnbw_io *io, int arrays, int streaming, int dt)
{
    const int64_t row_bytes = io->x_step * BNBW_ITEMSIZE(dt);
    return streaming && arrays * row_bytes >= K__ONE_ROW_READS && row_bytes <= K__ONE_ROW_TO
           ? 1 : K__ROW_GROUP;
}

/* Where the sums of all n16 channels fit the body's registers (n16 <= 16 *
 * BNBW_SIMD_SUM_RUNS), rows go one at a time in memory order, whether they come from memory or
 * not, and the sums stay in registers from the first row to the last: neither the prefetchers
 * nor loads and stores of the sums between rows cost anything (a channel-last call of 64
 * channels ran 1.1-1.2x faster than four rows a visit or one row with the sums in memory,
 * docs/benchmark-history.md, 8c).  RUNS is a constant at each use, so the arrays below live in
 * registers.  Each channel adds its rows in row order, as in the other loops: the same bits. */
#define K__REDUCE_IN_REGISTERS(RUNS)                                                        \
    do {                                                                                    \
        vd G[RUNS], P[RUNS];                                                                \
        vw M[RUNS];                                                                         \
        for (int k = 0; k < RUNS; ++k) {                                                    \
            G[k] = vd_loadu(sum_g + 16 * k);                                                \
            P[k] = vd_loadu(sum_xg + 16 * k);                                               \
            M[k] = vw_loadu(mean + 16 * k);                                                 \
        }                                                                                   \
        for (int64_t j = 0; j < rows; ++j)                                                  \
            for (int k = 0; k < RUNS; ++k)                                                  \
                K__ACCUMULATE_W(G[k], P[k], k__gw_rows(io, j, 16 * k, dt, mdt),             \
                                vw_sub(vw_load(io->x, j * io->x_step + 16 * k, 1, dt),     \
                                       M[k]));                                              \
        for (int k = 0; k < RUNS; ++k) {                                                    \
            vd_storeu(sum_g + 16 * k, G[k]);                                                \
            vd_storeu(sum_xg + 16 * k, P[k]);                                               \
        }                                                                                   \
    } while (0)

/* Calls MACRO(runs) with runs = n16 / 16 as a constant, for n16 of at most four runs. */
#define K__BY_RUNS(MACRO, n16)                                                              \
    switch ((n16) / 16) {                                                                   \
    case 1: MACRO(1); break;                                                                \
    case 2: MACRO(2); break;                                                                \
    case 3: MACRO(3); break;                                                                \
    case 4: MACRO(4); break;                                                                \
    default: break;                                                                         \
    }

BNBW_INLINE void k_reduce_rows(const bnbw_io *io, int64_t rows, int64_t n, const float *mean,
                               double *sum_g, double *sum_xg, int streaming, int sums, int dt,
                               int mdt)
{
    const int64_t n16 = n - n % 16;
    int64_t group = k__row_group(io, 2, streaming, dt);
    if (sums != BNBW_EXACT_SUMS) {     /* a group is a block */
        k__reduce_rows_blocked(io, rows, n16, mean, sum_g, sum_xg, dt, mdt);
        group = BNBW_BLOCK_ROWS;
    } else {
        if (n16 <= 16 * BNBW_SIMD_SUM_RUNS) {
            K__BY_RUNS(K__REDUCE_IN_REGISTERS, n16);
        } else if (group == 1) {
            for (int64_t j = 0; j < rows; ++j)
                K__TWO_RUNS_A_VISIT
                for (int64_t c = 0; c < n16; c += 16) {
                    vd G = vd_loadu(sum_g + c), P = vd_loadu(sum_xg + c);
                    K__ACCUMULATE_W(G, P, k__gw_rows(io, j, c, dt, mdt),
                                    vw_sub(vw_load(io->x, j * io->x_step + c, 1, dt),
                                           vw_loadu(mean + c)));
                    vd_storeu(sum_g + c, G);
                    vd_storeu(sum_xg + c, P);
                }
        } else {
            for (int64_t r = 0; r < rows; r += group) {
                int64_t nr = rows - r < group ? rows - r : group;
                for (int64_t c = 0; c < n16; c += 16) {
                    vd G = vd_loadu(sum_g + c), P = vd_loadu(sum_xg + c);
                    const vw mw = vw_loadu(mean + c);
                    for (int64_t j = r; j < r + nr; ++j)
                        K__ACCUMULATE_W(G, P, k__gw_rows(io, j, c, dt, mdt),
                                        vw_sub(vw_load(io->x, j * io->x_step + c, 1, dt), mw));
                    vd_storeu(sum_g + c, G);
                    vd_storeu(sum_xg + c, P);
                }
            }
        }
    }
    if (n16 < n) {                 /* the last t < 16 channels: sums in registers, all rows */
        const int64_t t = n - n16;
        double sg[16] = {0}, sxg[16] = {0};
        const vf mv = v_load_part(mean, n16, t, 1, BNBW_F32);
        memcpy(sg, sum_g + n16, (size_t)t * sizeof(double));
        memcpy(sxg, sum_xg + n16, (size_t)t * sizeof(double));
        vd G = vd_loadu(sg), P = vd_loadu(sxg);
        for (int64_t r = 0; r < rows; r += group) {
            int64_t nr = rows - r < group ? rows - r : group;
#define K__PART_TERMS(ADD, A, B)                                                            \
            for (int64_t j = r; j < r + nr; ++j) {                                          \
                ADD(A, B, k__g_rows_part(io, j, n16, t, dt, mdt),                           \
                    vf_sub(v_load_part(io->x, j * io->x_step + n16, t, 1, dt), mv));        \
            }
            if (sums != BNBW_EXACT_SUMS) {
                vf FG = vf_zero(), FP = FG;
                K__PART_TERMS(K__BLOCK_ADD, FG, FP);
                K__BLOCK_FLUSH(G, P, FG, FP, K__PART_TERMS(K__ACCUMULATE, G, P));
            } else {
                K__PART_TERMS(K__ACCUMULATE, G, P);
            }
#undef K__PART_TERMS
        }
        vd_storeu(sg, G);
        vd_storeu(sxg, P);
        memcpy(sum_g + n16, sg, (size_t)t * sizeof(double));
        memcpy(sum_xg + n16, sxg, (size_t)t * sizeof(double));
    }
}

/* The per-channel constants of channels c0..c0+w (w a multiple of 16, at most BNBW_SLICE) in
 * the lane order the elementwise kernels load dt's rows in: src itself, or a copy. */
BNBW_INLINE const float *k__lane_order(const float *src, int64_t c0, int64_t w, float *copy,
                                       int dt)
{
    if (!K__EO(dt, 1))
        return src + c0;
    for (int64_t c = 0; c < w; c += 16)
        for (int k = 0; k < 8; ++k) {
            copy[c + k] = src[c0 + c + 2 * k];
            copy[c + 8 + k] = src[c0 + c + 2 * k + 1];
        }
    return copy;
}

/* Rows r of channels c..c+15, in lane order (contiguous rows of channels) */
#define K__LX(j, c) v_load(io->x, (j) * io->x_step + (c), 1, dt, eo)
#define K__LG(j, c) k__g_rows_lanes(io, j, c, dt, mdt, eo)
BNBW_INLINE vf k__g_rows_lanes(const bnbw_io *io, int64_t j, int64_t c, int dt, int mdt, int eo)
{
    vf g = v_load(io->dy, j * io->dy_step + c, 1, dt, eo);
    if (mdt != BNBW_NO_MASK)
        g = vf_keep(g, v_active(io->mask, j * io->mask_step + c, 1, mdt, eo));
    return g;
}

BNBW_INLINE void k__residual_rows(const bnbw_io *io, int64_t j, int64_t c, int64_t t, int dt,
                                  int mdt)
{
    if (mdt != BNBW_NO_MASK && io->dres != NULL)
        v_copy_active((char *)io->dres + j * io->dres_step * BNBW_ITEMSIZE(dt), 1,
                      (const char *)io->dy + j * io->dy_step * BNBW_ITEMSIZE(dt), 1,
                      (const char *)io->mask + j * io->mask_step
                          * (mdt == BNBW_BOOL ? 1 : BNBW_ITEMSIZE(dt)),
                      1, c, t, dt, mdt);
}

BNBW_INLINE void k_apply_rows(const bnbw_io *io, int64_t rows, int64_t n, const float *mean,
                              const float *k1, const float *k2, const float *k3, int dt,
                              int mdt)
{
    float cm[BNBW_SLICE], c1[BNBW_SLICE], c2[BNBW_SLICE], c3[BNBW_SLICE];
    const int eo = K__EO(dt, 1);
    const int64_t n16 = n - n % 16, slice = eo ? BNBW_SLICE : n16;
    for (int64_t c0 = 0; c0 < n16; c0 += slice) {     /* one slice unless in lane order */
        int64_t w = n16 - c0 < slice ? n16 - c0 : slice;
        const float *lm = k__lane_order(mean, c0, w, cm, dt);
        const float *l1 = k__lane_order(k1, c0, w, c1, dt);
        const float *l2 = k__lane_order(k2, c0, w, c2, dt);
        const float *l3 = k__lane_order(k3, c0, w, c3, dt);
        for (int64_t j = 0; j < rows; ++j) {
            K__TWO_RUNS_A_VISIT
            for (int64_t c = 0; c < w; c += 16) {
                vf x = K__LX(j, c0 + c), g = K__LG(j, c0 + c);
                k__residual_rows(io, j, c0 + c, 16, dt, mdt);
                v_store(io->dx, j * io->dx_step + c0 + c, 1,
                        k__apply(x, g, vf_loadu(lm + c), vf_loadu(l1 + c), vf_loadu(l2 + c),
                                 vf_loadu(l3 + c)),
                        dt, eo);
            }
        }
    }
    if (n16 < n) {                 /* the last t < 16 channels */
        const int64_t t = n - n16;
        const vf mv = v_load_part(mean, n16, t, 1, BNBW_F32);
        const vf a = v_load_part(k1, n16, t, 1, BNBW_F32), b = v_load_part(k2, n16, t, 1, BNBW_F32);
        const vf c = v_load_part(k3, n16, t, 1, BNBW_F32);
        for (int64_t j = 0; j < rows; ++j) {
            vf x = v_load_part(io->x, j * io->x_step + n16, t, 1, dt);
            vf g = k__g_rows_part(io, j, n16, t, dt, mdt);
            k__residual_rows(io, j, n16, t, dt, mdt);
            v_store_part(io->dx, j * io->dx_step + n16, t, 1, k__apply(x, g, mv, a, b, c), dt);
        }
    }
}

BNBW_INLINE void k_scale_rows(const bnbw_io *io, int64_t rows, int64_t n, const float *k1, int dt,
                              int mdt)
{
    float c1[BNBW_SLICE];
    const int eo = K__EO(dt, 1);
    const int64_t n16 = n - n % 16, slice = eo ? BNBW_SLICE : n16;
    for (int64_t c0 = 0; c0 < n16; c0 += slice) {
        int64_t w = n16 - c0 < slice ? n16 - c0 : slice;
        const float *l1 = k__lane_order(k1, c0, w, c1, dt);
        for (int64_t j = 0; j < rows; ++j) {
            for (int64_t c = 0; c < w; c += 16) {
                vf g = K__LG(j, c0 + c);
                k__residual_rows(io, j, c0 + c, 16, dt, mdt);
                v_store(io->dx, j * io->dx_step + c0 + c, 1, vf_mul(vf_loadu(l1 + c), g), dt, eo);
            }
        }
    }
    if (n16 < n) {
        const int64_t t = n - n16;
        const vf a = v_load_part(k1, n16, t, 1, BNBW_F32);
        for (int64_t j = 0; j < rows; ++j) {
            vf g = k__g_rows_part(io, j, n16, t, dt, mdt);
            k__residual_rows(io, j, n16, t, dt, mdt);
            v_store_part(io->dx, j * io->dx_step + n16, t, 1, vf_mul(a, g), dt);
        }
    }
}

/* ---- runs of short channel-major rows --------------------------------------------------- */

/* Row r of a run: the call's operands moved r rows on. */
BNBW_INLINE bnbw_io k__run_row(const bnbw_io *io, const bnbw_run *run, int64_t r)
{
    bnbw_io o = *io;
    o.x = (const char *)io->x + r * run->x;
    o.dy = (const char *)io->dy + r * run->dy;
    if (io->mask != NULL)
        o.mask = (const char *)io->mask + r * run->mask;
    if (io->dx != NULL)
        o.dx = (char *)io->dx + r * run->dx;
    if (io->dres != NULL)
        o.dres = (char *)io->dres + r * run->dres;
    return o;
}

/* Runs of rows of n = 2, 4, 8 or 16 elements (a 2 x 2 or 4 x 4 image, say) whose operands
 * each lay the run's rows end to end go 16 / n rows to a vector: lane l holds element l % n of
 * row l / n and the per-row constants are spread to match.  Every lane computes what the row
 * kernels compute for it.  A row's sums are its lanes folded by the same pairwise tree as
 * vd_fold: the steps vd_fold takes past the row's n lanes add +0 to a lane that is never -0
 * (0 + a term), which changes nothing, so the packed rows give the row kernels' bits with
 * 16 / n times fewer vector steps and folds, and no per-row set-up.  Rows of 16 pack only
 * for exact sums: blocked sums (f16, bf16) sum whole runs of 16 in f32 blocks first.  Returns
 * log2(n) when the run packs, else 0.  reads: which operands the kernel reads or writes
 * (K__PACK_*). */
enum { K__PACK_X = 1, K__PACK_DY = 2, K__PACK_DX = 4 };
BNBW_INLINE int k__packs(const bnbw_io *io, const bnbw_run *run, int64_t n, int dt, int mdt,
                         int reads)
{
    const int64_t row = n * BNBW_ITEMSIZE(dt);
    const int s = n == 2 ? 1 : n == 4 ? 2 : n == 8 ? 3 : n == 16 ? 4 : 0;
    if (s == 0 || run->count < (16 >> s))
        return 0;
    if (((reads & K__PACK_X) && run->x != row) || ((reads & K__PACK_DY) && run->dy != row)
        || ((reads & K__PACK_DX) && run->dx != row)
        || (io->dres != NULL && (reads & K__PACK_DX) && run->dres != row)
        || (mdt != BNBW_NO_MASK && (reads & K__PACK_DY)
            && run->mask != n * (mdt == BNBW_BOOL ? 1 : BNBW_ITEMSIZE(dt))))
        return 0;
    return s;
}

/* FN(s, args) with s a constant (1 to 4), so that its spreads and folds unroll; 0 for s 0. */
#define K__PACKED(FN, S, ...)                                                              \
    ((S) == 1 ? FN(1, __VA_ARGS__) : (S) == 2 ? FN(2, __VA_ARGS__)                          \
     : (S) == 3 ? FN(3, __VA_ARGS__) : (S) == 4 ? FN(4, __VA_ARGS__) : 0)

/* Lane l: c[l >> s] (the constant of the row lane l belongs to), by the layer's permutes
 * where it has them: lanes stored one group at a time and read back as one vector stall the
 * load (no store forwarding across stores). */
#if BNBW_SIMD_PACKED_ROWS
#define k__spread vf_spread
#define k__spread_w vw_spread
#else
BNBW_INLINE void k__spread_to(const float *c, int s, float out[16])
{
    for (int l = 0; l < 16; ++l)
        out[l] = c[l >> s];
}
BNBW_INLINE vf k__spread(const float *c, int s)
{
    float a[16];
    k__spread_to(c, s, a);
    return vf_loadu(a);
}
BNBW_INLINE vw k__spread_w(const float *c, int s)
{
    float a[16];
    k__spread_to(c, s, a);
    return vw_loadu(a);
}
#endif

/* Each group of 2^s lanes folded into its first, vd_fold's pairwise steps within the group
 * (lane l + lane l ^ w adds the same two terms as lane l + lane l + w where it matters). */
BNBW_INLINE vd k__fold_groups(vd a, int s)
{
    for (int w = (1 << s) >> 1; w > 0; w >>= 1)
        a = vd_add_partners(a, w);
    return a;
}

/* Adds the packed rows' sums A, B, each row's lanes folded, to their rows' sums (a row of
 * 16 lanes: vd_fold itself). */
BNBW_INLINE void k__add_groups(vd A, vd B, int s, double *sums, int64_t sums_step)
{
    double a[16], b[16];
    if (s == 4) {
        sums[0] += vd_fold(A);
        sums[1] += vd_fold(B);
        return;
    }
    A = k__fold_groups(A, s);
    B = k__fold_groups(B, s);
#if BNBW_SIMD_PACKED_ROWS
    if (s <= 2 && sums_step == 2) {
        vd_add_group_sums(A, B, s, sums);
        return;
    }
#endif
    vd_storeu(a, A);
    vd_storeu(b, B);
    for (int g = 0; g < 16 >> s; ++g) {
        sums[g * sums_step] += a[g << s];
        sums[g * sums_step + 1] += b[g << s];
    }
}

/* Rows r.. of a packed run: the rows' 16 elements from element r << s of each operand. */
BNBW_INLINE int64_t k__reduce_packed(int s, const bnbw_io *io, const bnbw_run *run,
                                     const float *mean, double *sums, int64_t sums_step, int dt,
                                     int mdt)
{
    const int per = 16 >> s;
    int64_t r = 0;
    for (; r + per <= run->count; r += per) {
        vd G = vd_zero(), P = vd_zero();
        K__ACCUMULATE_W(G, P, k__gw(io, r << s, 1, 1, dt, mdt),
                        vw_sub(vw_load(io->x, r << s, 1, dt), k__spread_w(mean + r, s)));
        k__add_groups(G, P, s, sums + r * sums_step, sums_step);
    }
    return r;
}

BNBW_INLINE int64_t k__apply_packed(int s, const bnbw_io *io, const bnbw_run *run,
                                    const float *mean, const float *k1, const float *k2,
                                    const float *k3, int dt, int mdt)
{
    const int per = 16 >> s;
    int64_t r = 0;
    for (; r + per <= run->count; r += per) {
        const int64_t i = r << s;
        vf x = v_load(io->x, i, 1, dt, 0), g = k__g(io, i, 1, 1, dt, mdt, 0);
        k__residual(io, i, 16, 1, 1, 1, dt, mdt);
        v_store(io->dx, i, 1, k__apply(x, g, k__spread(mean + r, s), k__spread(k1 + r, s),
                                       k__spread(k2 + r, s), k__spread(k3 + r, s)), dt, 0);
    }
    return r;
}

BNBW_INLINE int64_t k__scale_packed(int s, const bnbw_io *io, const bnbw_run *run,
                                    const float *k1, int dt, int mdt)
{
    const int per = 16 >> s;
    int64_t r = 0;
    for (; r + per <= run->count; r += per) {
        const int64_t i = r << s;
        vf g = k__g(io, i, 1, 1, dt, mdt, 0);
        k__residual(io, i, 16, 1, 1, 1, dt, mdt);
        v_store(io->dx, i, 1, vf_mul(k__spread(k1 + r, s), g), dt, 0);
    }
    return r;
}

BNBW_INLINE void k_reduce_row_run(const bnbw_io *io, const bnbw_run *run, int64_t n,
                                  const float *mean, double *sums, int64_t sums_step, int mode,
                                  int dt, int mdt)
{
    const int s = n == 16 && mode != BNBW_EXACT_SUMS
                  ? 0 : k__packs(io, run, n, dt, mdt, K__PACK_X | K__PACK_DY);
    const int64_t packed = K__PACKED(k__reduce_packed, s, io, run, mean, sums, sums_step, dt, mdt);
    sums += packed * sums_step;
    for (int64_t r = packed; r < run->count; ++r, sums += sums_step) {
        bnbw_io o = k__run_row(io, run, r);
        double part[2];
        k_reduce_row(&o, n, mean[r], part, mode, dt, mdt, 1);
        sums[0] += part[0];
        sums[1] += part[1];
    }
}

BNBW_INLINE void k_apply_row_run(const bnbw_io *io, const bnbw_run *run, int64_t n,
                                 const float *mean, const float *k1, const float *k2,
                                 const float *k3, int dt, int mdt)
{
    const int s = k__packs(io, run, n, dt, mdt, K__PACK_X | K__PACK_DY | K__PACK_DX);
    const int64_t packed = K__PACKED(k__apply_packed, s, io, run, mean, k1, k2, k3, dt, mdt);
    for (int64_t r = packed; r < run->count; ++r) {
        bnbw_io o = k__run_row(io, run, r);
        k_apply_row(&o, n, mean[r], k1[r], k2[r], k3[r], dt, mdt, 1);
    }
}

BNBW_INLINE void k_scale_row_run(const bnbw_io *io, const bnbw_run *run, int64_t n,
                                 const float *k1, int dt, int mdt)
{
    const int s = k__packs(io, run, n, dt, mdt, K__PACK_DY | K__PACK_DX);
    const int64_t packed = K__PACKED(k__scale_packed, s, io, run, k1, dt, mdt);
    for (int64_t r = packed; r < run->count; ++r) {
        bnbw_io o = k__run_row(io, run, r);
        k_scale_row(&o, n, k1[r], dt, mdt, 1);
    }
}

/* ---- the forward: batch statistics and the normalized output ------------------------------ */

/* The exact terms of 16 elements around the channel's shift: d = x - shift in f64 (exact for
 * any two f32 values less than 2^29 apart in exponent), Sum d and Sum d*d in f64, the product
 * rounded once, then added. */
#define K__STATS(S, Q, XW, SD) do {                                                          \
        vd k_d_ = vd_sub(vd_widen(XW), (SD));                                               \
        S = vd_add(S, k_d_);                                                                \
        Q = vd_add(Q, vd_mul(k_d_, k_d_));                                                  \
    } while (0)
/* ... of the first t < 16 lanes: the others add d = +0 (an exact identity, as above) */
#define K__STATS_PART(S, Q, XW, SD, T) do {                                                 \
        vd k_d_ = vd_select(vm_below(T), vd_sub(vd_widen(XW), (SD)), vd_zero());            \
        S = vd_add(S, k_d_);                                                                \
        Q = vd_add(Q, vd_mul(k_d_, k_d_));                                                  \
    } while (0)

BNBW_INLINE void k_stats_row(const bnbw_io *io, int64_t n, float shift, double out[2], int dt,
                             int contig)
{
    const int64_t xs = contig ? 1 : io->x_step;
    const vd sd = vd_widen(vw_set1(shift));
    vd S = vd_zero(), Q = vd_zero();
    int64_t i = 0;
    for (const int64_t n16 = n - n % 16; i < n16; i += 16)
        K__STATS(S, Q, vw_load(io->x, i, xs, dt), sd);
    if (i < n)
        K__STATS_PART(S, Q, vw_load_part(io->x, i, n - i, xs, dt), sd, n - i);
    out[0] = vd_fold(S);
    out[1] = vd_fold(Q);
}

/* y = k*(x - mean) + b, one fused multiply-add after the subtraction; with the ReLU, lanes
 * y > 0 and NaN kept, +0 elsewhere. */
BNBW_INLINE vf k__normalize(vf x, vf m, vf k, vf b, int relu)
{
    vf y = vf_fma(k, vf_sub_mp(x, m), b);
    return relu ? vf_keep(y, vm_relu(y)) : y;
}

/* a rounded to the storage type and back (16 lanes, or the first t), in the lane order eo */
BNBW_INLINE vf k__rounded(vf a, int dt, int eo)
{
    uint16_t half[16];
    if (dt == BNBW_F32)
        return a;
    v_store(half, 0, 1, a, dt, eo);
    return v_load(half, 0, 1, dt, eo);
}
BNBW_INLINE vf k__rounded_part(vf a, int64_t t, int dt)
{
    uint16_t half[16];
    if (dt == BNBW_F32)
        return a;
    v_store_part(half, 0, t, 1, a, dt);
    return v_load_part(half, 0, t, 1, dt);
}

/* BNBW_ADD_RELU: y = max(round(k*(x - mean) + b) + r, 0), r the residual (read through dy):
 * the batch norm's y rounded to its storage type, the residual added in f32 and the ReLU as
 * above - what `relu(bn(x) + r)` computes in that type, in one pass. */
BNBW_INLINE vf k__add_relu(vf y, vf r)
{
    vf s = vf_add(y, r);
    return vf_keep(s, vm_relu(s));
}

BNBW_INLINE void k_normalize_row(const bnbw_io *io, int64_t n, float mean, float k, float b,
                                 int dt, int relu, int contig)
{
    const int64_t xs = contig ? 1 : io->x_step, ds = contig ? 1 : io->dx_step;
    const int64_t rs = contig ? 1 : io->dy_step;
    const int eo = K__EO(dt, contig), add = relu == BNBW_ADD_RELU;
    const vf m = vf_set1(mean), kv = vf_set1(k), bv = vf_set1(b);
#define K__CHUNK(I, T, ST) do {                                                             \
        if ((T) == 16) {                                                                    \
            vf y = k__normalize(v_load(io->x, I, xs, dt, eo), m, kv, bv, relu && !add);     \
            if (add)                                                                        \
                y = k__add_relu(k__rounded(y, dt, eo), v_load(io->dy, I, rs, dt, eo));      \
            k__store16(io->dx, I, ds, y, dt, eo, ST);                                       \
        } else {                                                                            \
            vf y = k__normalize(v_load_part(io->x, I, T, xs, dt), m, kv, bv, relu && !add); \
            if (add)                                                                        \
                y = k__add_relu(k__rounded_part(y, T, dt), v_load_part(io->dy, I, T, rs, dt)); \
            v_store_part(io->dx, I, T, ds, y, dt);                                          \
        }                                                                                   \
    } while (0)
    K__ROW_CHUNKS(n, k__lead(io, n, dt, contig), K__CHUNK);
#undef K__CHUNK
}

/* Channel-last: channel c of every row adds its rows in row order (in groups of rows, as
 * k_reduce_rows visits them, for the same reasons). */
/* The forward's statistics the same way (K__REDUCE_IN_REGISTERS). */
#define K__STATS_IN_REGISTERS(RUNS)                                                         \
    do {                                                                                    \
        vd S[RUNS], Q[RUNS], D[RUNS];                                                       \
        for (int k = 0; k < RUNS; ++k) {                                                    \
            S[k] = vd_loadu(sum + 16 * k);                                                  \
            Q[k] = vd_loadu(sum_sq + 16 * k);                                               \
            D[k] = vd_widen(vw_loadu(shift + 16 * k));                                      \
        }                                                                                   \
        for (int64_t j = 0; j < rows; ++j)                                                  \
            for (int k = 0; k < RUNS; ++k)                                                  \
                K__STATS(S[k], Q[k], vw_load(io->x, j * io->x_step + 16 * k, 1, dt), D[k]); \
        for (int k = 0; k < RUNS; ++k) {                                                    \
            vd_storeu(sum + 16 * k, S[k]);                                                  \
            vd_storeu(sum_sq + 16 * k, Q[k]);                                               \
        }                                                                                   \
    } while (0)

BNBW_INLINE void k_stats_rows(const bnbw_io *io, int64_t rows, int64_t n, const float *shift,
                              double *sum, double *sum_sq, int streaming, int dt)
{
    const int64_t n16 = n - n % 16, group = k__row_group(io, 1, streaming, dt);
    if (n16 <= 16 * BNBW_SIMD_SUM_RUNS) {
        K__BY_RUNS(K__STATS_IN_REGISTERS, n16);
    } else if (group == 1) {
        for (int64_t j = 0; j < rows; ++j)
            K__TWO_RUNS_A_VISIT
            for (int64_t c = 0; c < n16; c += 16) {
                vd S = vd_loadu(sum + c), Q = vd_loadu(sum_sq + c);
                K__STATS(S, Q, vw_load(io->x, j * io->x_step + c, 1, dt),
                         vd_widen(vw_loadu(shift + c)));
                vd_storeu(sum + c, S);
                vd_storeu(sum_sq + c, Q);
            }
    } else {
        for (int64_t r = 0; r < rows; r += group) {
            const int64_t nr = rows - r < group ? rows - r : group;
            for (int64_t c = 0; c < n16; c += 16) {
                vd S = vd_loadu(sum + c), Q = vd_loadu(sum_sq + c);
                const vd sd = vd_widen(vw_loadu(shift + c));
                for (int64_t j = r; j < r + nr; ++j)
                    K__STATS(S, Q, vw_load(io->x, j * io->x_step + c, 1, dt), sd);
                vd_storeu(sum + c, S);
                vd_storeu(sum_sq + c, Q);
            }
        }
    }
    if (n16 < n) {                 /* the last t < 16 channels: sums in registers, all rows */
        const int64_t t = n - n16;
        double s[16] = {0}, q[16] = {0};
        memcpy(s, sum + n16, (size_t)t * sizeof(double));
        memcpy(q, sum_sq + n16, (size_t)t * sizeof(double));
        vd S = vd_loadu(s), Q = vd_loadu(q);
        const vd sd = vd_widen(vw_load_part(shift, n16, t, 1, BNBW_F32));
        for (int64_t j = 0; j < rows; ++j)
            K__STATS_PART(S, Q, vw_load_part(io->x, j * io->x_step + n16, t, 1, dt), sd, t);
        vd_storeu(s, S);
        vd_storeu(q, Q);
        memcpy(sum + n16, s, (size_t)t * sizeof(double));
        memcpy(sum_sq + n16, q, (size_t)t * sizeof(double));
    }
}

BNBW_INLINE void k_normalize_rows(const bnbw_io *io, int64_t rows, int64_t n, const float *mean,
                                  const float *k, const float *b, int dt, int relu)
{
    float cm[BNBW_SLICE], ck[BNBW_SLICE], cb[BNBW_SLICE];
    const int eo = K__EO(dt, 1), add = relu == BNBW_ADD_RELU;
    const int64_t n16 = n - n % 16, slice = eo ? BNBW_SLICE : n16;
    for (int64_t c0 = 0; c0 < n16; c0 += slice) {     /* one slice unless in lane order */
        const int64_t w = n16 - c0 < slice ? n16 - c0 : slice;
        const float *lm = k__lane_order(mean, c0, w, cm, dt);
        const float *lk = k__lane_order(k, c0, w, ck, dt);
        const float *lb = k__lane_order(b, c0, w, cb, dt);
        for (int64_t j = 0; j < rows; ++j) {
            K__TWO_RUNS_A_VISIT
            for (int64_t c = 0; c < w; c += 16) {
                vf y = k__normalize(K__LX(j, c0 + c), vf_loadu(lm + c), vf_loadu(lk + c),
                                    vf_loadu(lb + c), relu && !add);
                if (add)
                    y = k__add_relu(k__rounded(y, dt, eo),
                                    v_load(io->dy, j * io->dy_step + c0 + c, 1, dt, eo));
                v_store(io->dx, j * io->dx_step + c0 + c, 1, y, dt, eo);
            }
        }
    }
    if (n16 < n) {                 /* the last t < 16 channels */
        const int64_t t = n - n16;
        const vf mv = v_load_part(mean, n16, t, 1, BNBW_F32), kv = v_load_part(k, n16, t, 1, BNBW_F32);
        const vf bv = v_load_part(b, n16, t, 1, BNBW_F32);
        for (int64_t j = 0; j < rows; ++j) {
            vf y = k__normalize(v_load_part(io->x, j * io->x_step + n16, t, 1, dt), mv, kv, bv,
                                relu && !add);
            if (add)
                y = k__add_relu(k__rounded_part(y, t, dt),
                                v_load_part(io->dy, j * io->dy_step + n16, t, 1, dt));
            v_store_part(io->dx, j * io->dx_step + n16, t, 1, y, dt);
        }
    }
}

/* The forward's kernels over packed runs (k__packs): the same lanes, the same bits. */
BNBW_INLINE int64_t k__stats_packed(int s, const bnbw_io *io, const bnbw_run *run,
                                    const float *shift, double *sums, int64_t sums_step, int dt)
{
    const int per = 16 >> s;
    int64_t r = 0;
    for (; r + per <= run->count; r += per) {
        vd S = vd_zero(), Q = vd_zero();
        K__STATS(S, Q, vw_load(io->x, r << s, 1, dt), vd_widen(k__spread_w(shift + r, s)));
        k__add_groups(S, Q, s, sums + r * sums_step, sums_step);
    }
    return r;
}

BNBW_INLINE int64_t k__normalize_packed(int s, const bnbw_io *io, const bnbw_run *run,
                                        const float *mean, const float *k, const float *b,
                                        int dt, int relu)
{
    const int per = 16 >> s, add = relu == BNBW_ADD_RELU;
    int64_t r = 0;
    for (; r + per <= run->count; r += per) {
        const int64_t i = r << s;
        vf y = k__normalize(v_load(io->x, i, 1, dt, 0), k__spread(mean + r, s),
                            k__spread(k + r, s), k__spread(b + r, s), relu && !add);
        if (add)
            y = k__add_relu(k__rounded(y, dt, 0), v_load(io->dy, i, 1, dt, 0));
        v_store(io->dx, i, 1, y, dt, 0);
    }
    return r;
}

BNBW_INLINE void k_stats_row_run(const bnbw_io *io, const bnbw_run *run, int64_t n,
                                 const float *shift, double *sums, int64_t sums_step, int dt)
{
    const int s = k__packs(io, run, n, dt, BNBW_NO_MASK, K__PACK_X);
    const int64_t packed = K__PACKED(k__stats_packed, s, io, run, shift, sums, sums_step, dt);
    sums += packed * sums_step;
    for (int64_t r = packed; r < run->count; ++r, sums += sums_step) {
        bnbw_io o = k__run_row(io, run, r);
        double part[2];
        k_stats_row(&o, n, shift[r], part, dt, 1);
        sums[0] += part[0];
        sums[1] += part[1];
    }
}

BNBW_INLINE void k_normalize_row_run(const bnbw_io *io, const bnbw_run *run, int64_t n,
                                     const float *mean, const float *k, const float *b, int dt,
                                     int relu)
{
    const int s = k__packs(io, run, n, dt, BNBW_NO_MASK, K__PACK_X | K__PACK_DX
                           | (relu == BNBW_ADD_RELU ? K__PACK_DY : 0));
    const int64_t packed = K__PACKED(k__normalize_packed, s, io, run, mean, k, b, dt, relu);
    for (int64_t r = packed; r < run->count; ++r) {
        bnbw_io o = k__run_row(io, run, r);
        k_normalize_row(&o, n, mean[r], k[r], b[r], dt, relu, 1);
    }
}

/* ---- the table ------------------------------------------------------------------------- */

/* Every kernel is compiled once per storage type and a second constant - the mask's type for
 * the backward, ReLU or not for the forward - and, for channel-major rows, per "every operand
 * contiguous": each variant a function of its own, so that its loops are optimised alone with
 * their constants folded and carry no per-element branch.  The table's entry picks the
 * variant. */

/* The variant KERNEL_TN_VN_CONTIG, which runs KERNEL ARGS with the constants DT = T, VAR = V
 * (MDT or RELU) and CONTIG_ = CONTIG; K__ENTRY names it. */
#define K__DEFINE(KERNEL, TN, T, VN, VAR, V, CONTIG, PARAMS, ARGS)                           \
    static __attribute__((noinline)) void KERNEL##_##TN##_##VN##_##CONTIG PARAMS              \
    {                                                                                        \
        /* a local copy: stores through the rows' pointers could alias the caller's struct,  \
           which would make the compiler reload its fields in every loop */                  \
        const bnbw_io io_copy = *io_arg, *const io = &io_copy;                               \
        const int DT = T, VAR = V, CONTIG_ = CONTIG;                                         \
        (void)VAR;                                                                           \
        (void)CONTIG_;                                                                       \
        KERNEL ARGS;                                                                         \
        v_leave();                                                                           \
    }
#define K__ENTRY(KERNEL, TN, T, VN, VAR, V, CONTIG, PARAMS, ARGS)                            \
    KERNEL##_##TN##_##VN##_##CONTIG,

/* The backward's variants: X per storage type and mask type, mask-minor (k__variant). */
#define K__MASKS(X, KERNEL, TN, T, CONTIG, PARAMS, ARGS)                                     \
    X(KERNEL, TN, T, none, MDT, BNBW_NO_MASK, CONTIG, PARAMS, ARGS)                          \
    X(KERNEL, TN, T, bool, MDT, BNBW_BOOL, CONTIG, PARAMS, ARGS)                             \
    X(KERNEL, TN, T, vals, MDT, T, CONTIG, PARAMS, ARGS)
#define K__TYPES(X, KERNEL, CONTIG, PARAMS, ARGS)                                            \
    K__MASKS(X, KERNEL, f32, BNBW_F32, CONTIG, PARAMS, ARGS)                                 \
    K__MASKS(X, KERNEL, f16, BNBW_F16, CONTIG, PARAMS, ARGS)                                 \
    K__MASKS(X, KERNEL, bf16, BNBW_BF16, CONTIG, PARAMS, ARGS)

#define K__ROW_KERNEL(KERNEL, PARAMS, ARGS)                                                  \
    K__TYPES(K__DEFINE, KERNEL, 0, PARAMS, ARGS)                                             \
    K__TYPES(K__DEFINE, KERNEL, 1, PARAMS, ARGS)                                             \
    static void (*const KERNEL##_variants[2][9]) PARAMS = {                                  \
        {K__TYPES(K__ENTRY, KERNEL, 0, PARAMS, ARGS)},                                       \
        {K__TYPES(K__ENTRY, KERNEL, 1, PARAMS, ARGS)}};
#define K__ROWS_KERNEL(KERNEL, PARAMS, ARGS)                                                 \
    K__TYPES(K__DEFINE, KERNEL, 1, PARAMS, ARGS)                                             \
    static void (*const KERNEL##_variants[9]) PARAMS = {                                     \
        K__TYPES(K__ENTRY, KERNEL, 1, PARAMS, ARGS)};

/* The variant index of a call's storage type and mask. */
BNBW_INLINE int k__variant(const bnbw_io *io)
{
    int mask = io->mask == NULL ? 0 : io->mask_dt == BNBW_BOOL ? 1 : 2;
    return 3 * (io->dt == BNBW_F16 ? 1 : io->dt == BNBW_BF16 ? 2 : 0) + mask;
}

BNBW_INLINE int k__contiguous(const bnbw_io *io)
{
    return (io->x == NULL || io->x_step == 1) && io->dy_step == 1
           && (io->dx == NULL || io->dx_step == 1) && (io->mask == NULL || io->mask_step == 1)
           && (io->dres == NULL || io->dres_step == 1);
}

K__ROW_KERNEL(k_reduce_row,
              (const bnbw_io *io_arg, int64_t n, float mean, double *out, int sums),
              (io, n, mean, out, sums, DT, MDT, CONTIG_))
K__ROW_KERNEL(k_apply_row,
              (const bnbw_io *io_arg, int64_t n, float mean, float k1, float k2, float k3),
              (io, n, mean, k1, k2, k3, DT, MDT, CONTIG_))
K__ROW_KERNEL(k_scale_row, (const bnbw_io *io_arg, int64_t n, float k1),
              (io, n, k1, DT, MDT, CONTIG_))
K__ROWS_KERNEL(k_reduce_rows,
               (const bnbw_io *io_arg, int64_t rows, int64_t n, const float *mean, double *sum_g,
                double *sum_xg, int streaming, int sums),
               (io, rows, n, mean, sum_g, sum_xg, streaming, sums, DT, MDT))
K__ROWS_KERNEL(k_apply_rows,
               (const bnbw_io *io_arg, int64_t rows, int64_t n, const float *mean,
                const float *k1, const float *k2, const float *k3),
               (io, rows, n, mean, k1, k2, k3, DT, MDT))
K__ROWS_KERNEL(k_scale_rows, (const bnbw_io *io_arg, int64_t rows, int64_t n, const float *k1),
               (io, rows, n, k1, DT, MDT))
K__ROWS_KERNEL(k_reduce_row_run,
               (const bnbw_io *io_arg, const bnbw_run *run, int64_t n, const float *mean,
                double *sums, int64_t sums_step, int mode),
               (io, run, n, mean, sums, sums_step, mode, DT, MDT))
K__ROWS_KERNEL(k_apply_row_run,
               (const bnbw_io *io_arg, const bnbw_run *run, int64_t n, const float *mean,
                const float *k1, const float *k2, const float *k3),
               (io, run, n, mean, k1, k2, k3, DT, MDT))
K__ROWS_KERNEL(k_scale_row_run,
               (const bnbw_io *io_arg, const bnbw_run *run, int64_t n, const float *k1),
               (io, run, n, k1, DT, MDT))

static void K__NAME(reduce_row)(const bnbw_io *io, int64_t n, float mean, double out[2],
                                int sums)
{
    k_reduce_row_variants[k__contiguous(io)][k__variant(io)](io, n, mean, out, sums);
}

static void K__NAME(apply_row)(const bnbw_io *io, int64_t n, float mean, float k1, float k2,
                               float k3)
{
    k_apply_row_variants[k__contiguous(io)][k__variant(io)](io, n, mean, k1, k2, k3);
}

static void K__NAME(scale_row)(const bnbw_io *io, int64_t n, float k1)
{
    k_scale_row_variants[k__contiguous(io)][k__variant(io)](io, n, k1);
}

/* Channel-last rows wider than K__CUT_ROWS_ABOVE bytes whose x starts inside a 64-byte line
 * (numpy's arrays start 16 bytes into one) are cut at x's next line: the first `lead` channels
 * go alone, in a pass of their own over the rows, and every load of the rest starts on a line
 * instead of straddling two.  Each channel is one lane whose sums take its rows in row order,
 * so the lane a channel falls in never changes a bit.  Only where every row starts at the same
 * place in its line.  On narrower rows the extra pass costs more than it saves: those are
 * walked from the line instead (k__rows_rotation). */
#define K__CUT_ROWS_ABOVE 2048
BNBW_INLINE int64_t k__rows_lead(const bnbw_io *io, int64_t n)
{
    const int64_t isz = BNBW_ITEMSIZE(io->dt);
    const uintptr_t at = (uintptr_t)io->x;
    if (io->x == NULL || io->x_step * isz <= K__CUT_ROWS_ABOVE || (io->x_step * isz) % 64 != 0
        || at % (uintptr_t)isz != 0)
        return 0;
    const int64_t lead = (int64_t)((64 - at % 64) % 64) / isz;
    return n - lead >= 16 ? lead : 0;
}
/* Dense channel-last rows of whole 64-byte lines, at most K__CUT_ROWS_ABOVE bytes wide, whose
 * x starts inside a line (numpy's arrays start 16 bytes into one) are walked from x's first
 * line instead, where the engine says the data stay in the caches (io->from_line: from memory
 * the straddling loads cost nothing and the rotated walk measured slower).  They are walked as
 * rows of the same width with the channels rotated: row 0's first `a` channels go alone, then
 * rows - 1 rotated rows (channels a..n-1 of row j, then 0..a-1 of row j + 1), then the last
 * row's channels a..n-1.  Every load of the middle call starts on a line,
 * no channel is read twice, and each channel still takes its rows in row order into the sums it
 * carries, whichever lane carries it: the same bits.  Only where every operand's rows follow
 * each other (steps of n elements), with at least one block of rows (the rotated copies of the
 * per-channel arrays cost about a row), and - for the backward's sums - only exact ones:
 * blocked sums group 16 rows from the call's first, which a rotation would shift. */
#define K__ROTATE_MAX (K__CUT_ROWS_ABOVE / 2)
BNBW_INLINE int64_t k__rows_rotation(const bnbw_io *io, int64_t rows, int64_t n)
{
    const int64_t isz = BNBW_ITEMSIZE(io->dt);
    const uintptr_t at = (uintptr_t)io->x;
    if (!io->from_line || io->x == NULL || rows < BNBW_BLOCK_ROWS || io->x_step != n
        || n * isz > K__CUT_ROWS_ABOVE || (n * isz) % 64 != 0 || at % 64 == 0
        || at % (uintptr_t)isz != 0 || (io->dy != NULL && io->dy_step != n)
        || (io->mask != NULL && io->mask_step != n) || (io->dx != NULL && io->dx_step != n)
        || (io->dres != NULL && io->dres_step != n))
        return 0;
    return (int64_t)(64 - at % 64) / isz;
}
/* dst[k] = src[(a + k) % n], and back */
BNBW_INLINE const float *k__rotated(const float *src, int64_t n, int64_t a, float *dst)
{
    memcpy(dst, src + a, (size_t)(n - a) * sizeof(float));
    memcpy(dst + n - a, src, (size_t)a * sizeof(float));
    return dst;
}
BNBW_INLINE double *k__rotated_sums(const double *src, int64_t n, int64_t a, double *dst)
{
    memcpy(dst, src + a, (size_t)(n - a) * sizeof(double));
    memcpy(dst + n - a, src, (size_t)a * sizeof(double));
    return dst;
}
BNBW_INLINE void k__unrotate_sums(const double *src, int64_t n, int64_t a, double *dst)
{
    memcpy(dst + a, src, (size_t)(n - a) * sizeof(double));
    memcpy(dst, src + n - a, (size_t)a * sizeof(double));
}
/* The same call from channel `c` on */
BNBW_INLINE bnbw_io k__rows_from(const bnbw_io *io, int64_t c)
{
    const int64_t isz = BNBW_ITEMSIZE(io->dt), msz = io->mask_dt == BNBW_BOOL ? 1 : isz;
    bnbw_io r = *io;
    r.x = io->x ? (const char *)io->x + c * isz : NULL;
    r.dy = io->dy ? (const char *)io->dy + c * isz : NULL;
    r.dx = io->dx ? (char *)io->dx + c * isz : NULL;
    r.mask = io->mask ? (const char *)io->mask + c * msz : NULL;
    r.dres = io->dres ? (char *)io->dres + c * isz : NULL;
    return r;
}
#define K__PEEL(CALL_ALL, CALL_LEAD, CALL_REST) do {                                        \
        const int64_t lead = k__rows_lead(io, n);                                           \
        if (lead == 0) {                                                                    \
            CALL_ALL;                                                                       \
        } else {                                                                            \
            const bnbw_io rest = k__rows_from(io, lead);                                    \
            CALL_LEAD;                                                                      \
            CALL_REST;                                                                      \
        }                                                                                   \
    } while (0)

/* A rotated walk of a summing kernel F(io, rows, n, mean, sums, sums_2, ...), from channel
 * `a` (k__rows_rotation): the middle call takes the per-channel arrays rotated. */
#define K__ROTATED_SUMS(F, MEAN, S1, S2, ...) do {                                          \
        float m_[K__ROTATE_MAX];                                                            \
        double s1_[K__ROTATE_MAX], s2_[K__ROTATE_MAX];                                      \
        const bnbw_io middle_ = k__rows_from(io, a);                                        \
        const bnbw_io last_ = k__rows_from(io, (rows - 1) * n + a);                         \
        F(io, 1, a, MEAN, S1, S2, __VA_ARGS__);                                             \
        F(&middle_, rows - 1, n, k__rotated(MEAN, n, a, m_), k__rotated_sums(S1, n, a, s1_), \
          k__rotated_sums(S2, n, a, s2_), __VA_ARGS__);                                     \
        k__unrotate_sums(s1_, n, a, S1);                                                    \
        k__unrotate_sums(s2_, n, a, S2);                                                    \
        F(&last_, 1, n - a, MEAN + a, S1 + a, S2 + a, __VA_ARGS__);                         \
    } while (0)

static void K__NAME(reduce_rows)(const bnbw_io *io, int64_t rows, int64_t n, const float *mean,
                                 double *sum_g, double *sum_xg, int streaming, int sums)
{
    void (*const f)(const bnbw_io *, int64_t, int64_t, const float *, double *, double *, int,
                    int) = k_reduce_rows_variants[k__variant(io)];
    const int64_t a = sums == BNBW_EXACT_SUMS ? k__rows_rotation(io, rows, n) : 0;
    if (a != 0) {
        K__ROTATED_SUMS(f, mean, sum_g, sum_xg, streaming, sums);
        return;
    }
    K__PEEL(f(io, rows, n, mean, sum_g, sum_xg, streaming, sums),
            f(io, rows, lead, mean, sum_g, sum_xg, streaming, sums),
            f(&rest, rows, n - lead, mean + lead, sum_g + lead, sum_xg + lead, streaming, sums));
}

static void K__NAME(apply_rows)(const bnbw_io *io, int64_t rows, int64_t n, const float *mean,
                                const float *k1, const float *k2, const float *k3)
{
    void (*const f)(const bnbw_io *, int64_t, int64_t, const float *, const float *,
                    const float *, const float *) = k_apply_rows_variants[k__variant(io)];
    const int64_t a = k__rows_rotation(io, rows, n);
    if (a != 0) {
        float m[K__ROTATE_MAX], r1[K__ROTATE_MAX], r2[K__ROTATE_MAX], r3[K__ROTATE_MAX];
        const bnbw_io middle = k__rows_from(io, a), last = k__rows_from(io, (rows - 1) * n + a);
        f(io, 1, a, mean, k1, k2, k3);
        f(&middle, rows - 1, n, k__rotated(mean, n, a, m), k__rotated(k1, n, a, r1),
          k__rotated(k2, n, a, r2), k__rotated(k3, n, a, r3));
        f(&last, 1, n - a, mean + a, k1 + a, k2 + a, k3 + a);
        return;
    }
    K__PEEL(f(io, rows, n, mean, k1, k2, k3), f(io, rows, lead, mean, k1, k2, k3),
            f(&rest, rows, n - lead, mean + lead, k1 + lead, k2 + lead, k3 + lead));
}

static void K__NAME(scale_rows)(const bnbw_io *io, int64_t rows, int64_t n, const float *k1)
{
    void (*const f)(const bnbw_io *, int64_t, int64_t, const float *) =
        k_scale_rows_variants[k__variant(io)];
    const int64_t a = k__rows_rotation(io, rows, n);
    if (a != 0) {
        float r1[K__ROTATE_MAX];
        const bnbw_io middle = k__rows_from(io, a), last = k__rows_from(io, (rows - 1) * n + a);
        f(io, 1, a, k1);
        f(&middle, rows - 1, n, k__rotated(k1, n, a, r1));
        f(&last, 1, n - a, k1 + a);
        return;
    }
    K__PEEL(f(io, rows, n, k1), f(io, rows, lead, k1), f(&rest, rows, n - lead, k1 + lead));
}

static void K__NAME(reduce_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n,
                                    const float *mean, double *sums, int64_t sums_step, int mode)
{
    k_reduce_row_run_variants[k__variant(io)](io, run, n, mean, sums, sums_step, mode);
}

static void K__NAME(apply_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n,
                                   const float *mean, const float *k1, const float *k2,
                                   const float *k3)
{
    k_apply_row_run_variants[k__variant(io)](io, run, n, mean, k1, k2, k3);
}

static void K__NAME(scale_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n,
                                   const float *k1)
{
    k_scale_row_run_variants[k__variant(io)](io, run, n, k1);
}


/* The forward's variants: X per storage type (k__type) for RELU = R. */
#define K__FWD_TYPES(X, KERNEL, R, CONTIG, PARAMS, ARGS)                                     \
    X(KERNEL, f32, BNBW_F32, R, RELU, R, CONTIG, PARAMS, ARGS)                               \
    X(KERNEL, f16, BNBW_F16, R, RELU, R, CONTIG, PARAMS, ARGS)                               \
    X(KERNEL, bf16, BNBW_BF16, R, RELU, R, CONTIG, PARAMS, ARGS)

K__FWD_TYPES(K__DEFINE, k_stats_row, 0, 0,
             (const bnbw_io *io_arg, int64_t n, float shift, double *out),
             (io, n, shift, out, DT, CONTIG_))
K__FWD_TYPES(K__DEFINE, k_stats_row, 0, 1,
             (const bnbw_io *io_arg, int64_t n, float shift, double *out),
             (io, n, shift, out, DT, CONTIG_))
static void (*const k_stats_row_variants[2][3])(const bnbw_io *, int64_t, float, double *) = {
    {K__FWD_TYPES(K__ENTRY, k_stats_row, 0, 0, , )},
    {K__FWD_TYPES(K__ENTRY, k_stats_row, 0, 1, , )}};

#define K__NORMALIZE_ROW_PARAMS                                                              \
    (const bnbw_io *io_arg, int64_t n, float mean, float k, float b)
#define K__NORMALIZE_ROW_ARGS (io, n, mean, k, b, DT, RELU, CONTIG_)
K__FWD_TYPES(K__DEFINE, k_normalize_row, 0, 0, K__NORMALIZE_ROW_PARAMS, K__NORMALIZE_ROW_ARGS)
K__FWD_TYPES(K__DEFINE, k_normalize_row, 1, 0, K__NORMALIZE_ROW_PARAMS, K__NORMALIZE_ROW_ARGS)
K__FWD_TYPES(K__DEFINE, k_normalize_row, 2, 0, K__NORMALIZE_ROW_PARAMS, K__NORMALIZE_ROW_ARGS)
K__FWD_TYPES(K__DEFINE, k_normalize_row, 0, 1, K__NORMALIZE_ROW_PARAMS, K__NORMALIZE_ROW_ARGS)
K__FWD_TYPES(K__DEFINE, k_normalize_row, 1, 1, K__NORMALIZE_ROW_PARAMS, K__NORMALIZE_ROW_ARGS)
K__FWD_TYPES(K__DEFINE, k_normalize_row, 2, 1, K__NORMALIZE_ROW_PARAMS, K__NORMALIZE_ROW_ARGS)
static void (*const k_normalize_row_variants[2][3][3])(const bnbw_io *, int64_t, float, float,
                                                        float) = {
    {{K__FWD_TYPES(K__ENTRY, k_normalize_row, 0, 0, , )},
     {K__FWD_TYPES(K__ENTRY, k_normalize_row, 1, 0, , )},
     {K__FWD_TYPES(K__ENTRY, k_normalize_row, 2, 0, , )}},
    {{K__FWD_TYPES(K__ENTRY, k_normalize_row, 0, 1, , )},
     {K__FWD_TYPES(K__ENTRY, k_normalize_row, 1, 1, , )},
     {K__FWD_TYPES(K__ENTRY, k_normalize_row, 2, 1, , )}}};

K__FWD_TYPES(K__DEFINE, k_stats_rows, 0, 1,
             (const bnbw_io *io_arg, int64_t rows, int64_t n, const float *shift, double *sum,
              double *sum_sq, int streaming),
             (io, rows, n, shift, sum, sum_sq, streaming, DT))
static void (*const k_stats_rows_variants[3])(const bnbw_io *, int64_t, int64_t, const float *,
                                              double *, double *, int) = {
    K__FWD_TYPES(K__ENTRY, k_stats_rows, 0, 1, , )};

#define K__NORMALIZE_ROWS_PARAMS                                                             \
    (const bnbw_io *io_arg, int64_t rows, int64_t n, const float *mean, const float *k,      \
     const float *b)
#define K__NORMALIZE_ROWS_ARGS (io, rows, n, mean, k, b, DT, RELU)
K__FWD_TYPES(K__DEFINE, k_normalize_rows, 0, 1, K__NORMALIZE_ROWS_PARAMS, K__NORMALIZE_ROWS_ARGS)
K__FWD_TYPES(K__DEFINE, k_normalize_rows, 1, 1, K__NORMALIZE_ROWS_PARAMS, K__NORMALIZE_ROWS_ARGS)
K__FWD_TYPES(K__DEFINE, k_normalize_rows, 2, 1, K__NORMALIZE_ROWS_PARAMS, K__NORMALIZE_ROWS_ARGS)
static void (*const k_normalize_rows_variants[3][3])(const bnbw_io *, int64_t, int64_t,
                                                     const float *, const float *,
                                                     const float *) = {
    {K__FWD_TYPES(K__ENTRY, k_normalize_rows, 0, 1, , )},
    {K__FWD_TYPES(K__ENTRY, k_normalize_rows, 1, 1, , )},
    {K__FWD_TYPES(K__ENTRY, k_normalize_rows, 2, 1, , )}};

K__FWD_TYPES(K__DEFINE, k_stats_row_run, 0, 1,
             (const bnbw_io *io_arg, const bnbw_run *run, int64_t n, const float *shift,
              double *sums, int64_t sums_step),
             (io, run, n, shift, sums, sums_step, DT))
static void (*const k_stats_row_run_variants[3])(const bnbw_io *, const bnbw_run *, int64_t,
                                                 const float *, double *, int64_t) = {
    K__FWD_TYPES(K__ENTRY, k_stats_row_run, 0, 1, , )};

#define K__NORMALIZE_RUN_PARAMS                                                              \
    (const bnbw_io *io_arg, const bnbw_run *run, int64_t n, const float *mean, const float *k, \
     const float *b)
#define K__NORMALIZE_RUN_ARGS (io, run, n, mean, k, b, DT, RELU)
K__FWD_TYPES(K__DEFINE, k_normalize_row_run, 0, 1, K__NORMALIZE_RUN_PARAMS, K__NORMALIZE_RUN_ARGS)
K__FWD_TYPES(K__DEFINE, k_normalize_row_run, 1, 1, K__NORMALIZE_RUN_PARAMS, K__NORMALIZE_RUN_ARGS)
K__FWD_TYPES(K__DEFINE, k_normalize_row_run, 2, 1, K__NORMALIZE_RUN_PARAMS, K__NORMALIZE_RUN_ARGS)
static void (*const k_normalize_row_run_variants[3][3])(const bnbw_io *, const bnbw_run *,
                                                        int64_t, const float *, const float *,
                                                        const float *) = {
    {K__FWD_TYPES(K__ENTRY, k_normalize_row_run, 0, 1, , )},
    {K__FWD_TYPES(K__ENTRY, k_normalize_row_run, 1, 1, , )},
    {K__FWD_TYPES(K__ENTRY, k_normalize_row_run, 2, 1, , )}};

/* The normalize kernels' variant: BNBW_NO_RELU, BNBW_RELU or BNBW_ADD_RELU (anything else
 * nonzero: the ReLU). */
BNBW_INLINE int k__mode(int relu) { return relu == BNBW_ADD_RELU ? 2 : relu != 0; }

/* The storage-type index of a forward call. */
BNBW_INLINE int k__type(const bnbw_io *io) { return io->dt == BNBW_F16 ? 1 : io->dt == BNBW_BF16 ? 2 : 0; }

static void K__NAME(stats_row)(const bnbw_io *io, int64_t n, float shift, double out[2])
{
    k_stats_row_variants[k__contiguous(io)][k__type(io)](io, n, shift, out);
}

static void K__NAME(normalize_row)(const bnbw_io *io, int64_t n, float mean, float k, float b,
                                   int relu)
{
    k_normalize_row_variants[k__contiguous(io)][k__mode(relu)][k__type(io)](io, n, mean, k, b);
}

static void K__NAME(stats_rows)(const bnbw_io *io, int64_t rows, int64_t n, const float *shift,
                                double *sum, double *sum_sq, int streaming)
{
    void (*const f)(const bnbw_io *, int64_t, int64_t, const float *, double *, double *, int) =
        k_stats_rows_variants[k__type(io)];
    const int64_t a = k__rows_rotation(io, rows, n);
    if (a != 0) {
        K__ROTATED_SUMS(f, shift, sum, sum_sq, streaming);
        return;
    }
    K__PEEL(f(io, rows, n, shift, sum, sum_sq, streaming),
            f(io, rows, lead, shift, sum, sum_sq, streaming),
            f(&rest, rows, n - lead, shift + lead, sum + lead, sum_sq + lead, streaming));
}

static void K__NAME(normalize_rows)(const bnbw_io *io, int64_t rows, int64_t n,
                                    const float *mean, const float *k, const float *b, int relu)
{
    void (*const f)(const bnbw_io *, int64_t, int64_t, const float *, const float *,
                    const float *) = k_normalize_rows_variants[k__mode(relu)][k__type(io)];
    const int64_t a = k__rows_rotation(io, rows, n);
    if (a != 0) {
        float m[K__ROTATE_MAX], rk[K__ROTATE_MAX], rb[K__ROTATE_MAX];
        const bnbw_io middle = k__rows_from(io, a), last = k__rows_from(io, (rows - 1) * n + a);
        f(io, 1, a, mean, k, b);
        f(&middle, rows - 1, n, k__rotated(mean, n, a, m), k__rotated(k, n, a, rk),
          k__rotated(b, n, a, rb));
        f(&last, 1, n - a, mean + a, k + a, b + a);
        return;
    }
    K__PEEL(f(io, rows, n, mean, k, b), f(io, rows, lead, mean, k, b),
            f(&rest, rows, n - lead, mean + lead, k + lead, b + lead));
}

static void K__NAME(stats_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n,
                                   const float *shift, double *sums, int64_t sums_step)
{
    k_stats_row_run_variants[k__type(io)](io, run, n, shift, sums, sums_step);
}

static void K__NAME(normalize_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n,
                                       const float *mean, const float *k, const float *b,
                                       int relu)
{
    k_normalize_row_run_variants[k__mode(relu)][k__type(io)](io, run, n, mean, k, b);
}

#define K__TABLE_ENTRIES {                                                                  \
        K__NAME(reduce_row), K__NAME(apply_row), K__NAME(scale_row),                        \
        K__NAME(reduce_rows), K__NAME(apply_rows), K__NAME(scale_rows),                     \
        K__NAME(reduce_row_run), K__NAME(apply_row_run), K__NAME(scale_row_run),            \
        K__NAME(stats_row), K__NAME(normalize_row), K__NAME(stats_rows),                    \
        K__NAME(normalize_rows), K__NAME(stats_row_run), K__NAME(normalize_row_run),        \
    }
