# cython: language_level=3
"""The schedules: who visits which part of a plan, in which order, on which thread.

A call runs one named schedule, chosen by schedule_choose from the plan, what the call does
and the thread count, and carried out by execute().  Every schedule adds the same block sums
in the same order (the plan's fixed partition, each block summed by one sequential function,
block sums added in block order), so which schedule runs, and on how many threads, never
changes a bit.

    LAST_SPLIT           channel-last (NXC).  Items are (row block, channel group): a reduce
                         pass writes each block's sums to its own partial arrays, the block sums
                         are combined serially in block order, then an apply pass.  Frozen
                         statistics write dx in the reduce pass.
    MAJOR_SWEEP          channel-major, rows no longer than a block.  Items are (block, group
                         of adjacent channels), visited in memory order: NCX rows of one n and
                         consecutive channels are adjacent, where a channel at a time would
                         read N short pieces far apart.  Reduce pass, combine, apply pass.
    MAJOR_BLOCKS         channel-major, rows longer than a block: items (channel, block), each
                         already a long stream.  Reduce pass, combine, apply pass.
    MAJOR_SWEEP_FUSED    training with at least two channels per thread, rows no longer than
                         a block: one item reduces a group of adjacent channels in memory
                         order, finishes their sums and coefficients, and applies them while
                         their rows are still cached (the group's x and dy fit a thread's share
                         of FUSE_BYTES).
    MAJOR_CHANNEL_FUSED  the same with rows longer than a block, one channel per item.

Rows go to the kernels of bnbw_kernels.h where they lie when the kernels take their storage
type at unit stride ("direct"); otherwise they are staged through per-thread f32 tiles of TILE
elements, cut at the same TILE boundaries on every path so that staging never changes the
arithmetic.
"""
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy, memset
from cython.parallel cimport prange

from bnbw_native._engine cimport (
    Plan, MAX_DIMS, N_BIG, N_SLOTS, S_X, S_DY, S_DX, S_MASK, S_DRES, S_MEAN, S_VAR, S_SCALE,
    S_DSCALE, S_DBIAS, DT_F32, DT_F16, DT_BF16, DT_BOOL, OP_REDUCE, OP_GIVEN_SUMS,
    OP_TRAINING, OP_DX, OP_PARAMS, OP_RETURN_SUMS, OP_EXACT_SUMS, itemsize, imin, chan_origin,
    row_origin, load_stat, store_stat, coefficients, bnbw_omp_thread_num,
    bnbw_load_f32, bnbw_store_f32, bnbw_load_f16_arith, bnbw_store_f16, bnbw_load_bf16,
    bnbw_store_bf16, bnbw_bf16, bnbw_f16, bnbw_f16_to_f32, bnbw_bf16_to_f32,
    bnbw_reduce_row, bnbw_apply_row, bnbw_scale_row, bnbw_reduce_rows, bnbw_apply_rows,
    bnbw_scale_rows, bnbw_reduce_row_run, bnbw_apply_row_run, bnbw_scale_row_run,
    bnbw_kernels_take, BNBW_BLOCK_ROWS, BNBW_EXACT_SUMS, BNBW_BLOCKS, BNBW_BLOCKS_EVEN_ODD)

cdef enum:
    TILE = 2048           # elements per staged row segment (3 tiles per thread: 24 KiB)
    SERIAL_BELOW = 32768  # elements below which threads cost more than they bring
    FUSE_BYTES = 1 << 24  # fused: x and dy of the groups in flight (one per thread) share this
    FUSE_MIN = 1 << 19    # ... but a group never gets less

SCHEDULE_NAMES = {0: "nothing", 1: "last-split", 2: "major-sweep", 3: "major-blocks",
                  4: "major-sweep-fused", 5: "major-channel-fused"}
TILE_ELEMENTS = TILE


# ---------------------------------------------------------------------------------------
# Choosing
# ---------------------------------------------------------------------------------------

cdef bint _direct(const Plan *p) noexcept nogil:
    """Whether the kernels can take the big tensors where they lie: rows of unit stride in a
    storage type they read, (channel-last) row strides whole in elements, and no ReLU mask
    (selected while rows are staged)."""
    cdef int64_t isz = itemsize(p.big_dtype)
    cdef int t
    if p.present[S_MASK] or not bnbw_kernels_take(p.big_dtype):
        return False
    for t in range(3):
        if p.inner_stride[t] != isz and p.inner_size > 1:
            return False
        if p.channel_last and p.n_outer == 1 and p.outer_stride[t][0] % isz != 0:
            return False
    return True


cdef int _sum_mode(const Plan *p, int op) noexcept nogil:
    """f16 and bf16 sums go through f32 blocks (a half's own precision is far coarser, and
    widening every term costs more than reading it), bf16 in the lane order it loads
    cheapest - on every path, staged rows included.  A block must span the same terms on
    every path: channel-major rows are cut alike everywhere (row_span), and channel-last slabs
    hold whole blocks - except rows that do not share one stride, which go to the kernels one
    at a time and so keep f64 terms."""
    if op & OP_EXACT_SUMS or p.big_dtype == DT_F32 or (p.channel_last and p.n_outer > 1):
        return BNBW_EXACT_SUMS
    return BNBW_BLOCKS_EVEN_ODD if p.big_dtype == DT_BF16 else BNBW_BLOCKS


cdef void schedule_choose(const Plan *p, int op, int nthreads, Schedule *s) noexcept nogil:
    cdef int64_t C = p.channels
    cdef int64_t budget, most, g
    cdef bint sums = (op & OP_REDUCE) != 0
    cdef bint dx = (op & OP_DX) != 0
    s.nthreads = nthreads if nthreads > 0 else 1
    s.direct = False
    s.sums = BNBW_EXACT_SUMS
    s.streaming = False
    s.group = 1
    s.ngroups = 0
    s.items = 0
    s.partial_doubles = 0
    s.partial_stride = (2 * C + 7) // 8 * 8
    s.tile_floats = 0
    if p.empty or not (sums or dx):
        s.kind = SCHED_NOTHING
        s.nthreads = 1
        return
    s.direct = _direct(p)
    s.sums = _sum_mode(p, op)
    s.streaming = 2 * itemsize(p.big_dtype) * C * p.count > 2 * FUSE_MIN
    s.tile_floats = 3 * TILE
    if C * p.count < SERIAL_BELOW:
        s.nthreads = 1
    if p.channel_last:
        s.kind = SCHED_LAST_SPLIT
        # channels per item: whole rows up to TILE (narrower slices of wide rows read memory
        # in short strided pieces), except that staged halves need slabs of whole blocks of
        # blocked sums: BNBW_BLOCK_ROWS rows per tile
        s.group = TILE // BNBW_BLOCK_ROWS if p.big_dtype != DT_F32 and not s.direct else TILE
        s.ngroups = (C + s.group - 1) // s.group
        s.items = p.nblocks * s.ngroups
        s.partial_doubles = s.partial_stride * p.nblocks if sums else 0
    else:
        s.items = C * p.nblocks
    if s.nthreads > s.items:
        s.nthreads = <int> s.items if s.items > 0 else 1
    if p.channel_last:
        return
    if sums and dx and op & OP_TRAINING and C >= 2 * s.nthreads:
        if p.whole_rows:
            s.kind = SCHED_MAJOR_SWEEP_FUSED
            # channels per item: as many as keep the group's x and dy within this thread's
            # share of FUSE_BYTES (FUSE_MIN at least), and at least two items per thread
            budget = FUSE_BYTES // s.nthreads
            if budget < FUSE_MIN:
                budget = FUSE_MIN
            g = budget // (2 * itemsize(p.big_dtype) * p.count)
            most = (C + 2 * s.nthreads - 1) // (2 * s.nthreads)
            g = most if g > most else g
            s.group = g if g > 0 else 1
            s.ngroups = (C + s.group - 1) // s.group
            s.items = s.ngroups
            s.partial_doubles = s.partial_stride * p.nblocks
        else:
            s.kind = SCHED_MAJOR_CHANNEL_FUSED
            s.items = C
        return
    if p.whole_rows:
        s.kind = SCHED_MAJOR_SWEEP
        s.group = (C + 4 * s.nthreads - 1) // (4 * s.nthreads)      # about 4 items a thread
        s.ngroups = (C + s.group - 1) // s.group
        s.items = p.nblocks * s.ngroups
    else:
        s.kind = SCHED_MAJOR_BLOCKS
    s.partial_doubles = s.partial_stride * p.nblocks if sums else 0


# ---------------------------------------------------------------------------------------
# What every item of a call shares
# ---------------------------------------------------------------------------------------

ctypedef struct Work:
    const Plan *p
    const Schedule *s
    char *x
    char *dy
    char *dx
    char *mask            # NULL: no ReLU mask
    char *dres            # NULL: no residual gradient to write
    char **ptr            # every slot (statistics read by the fused coefficients)
    float *mean           # [C] gathered statistics and coefficients, f32
    float *k1
    float *k2
    float *k3
    int op
    int what              # this pass: OP_REDUCE and/or OP_DX
    int kdt               # what the kernels are told the rows hold: the storage type, or f32
    double eps
    double count
    double *sums          # [C][2] channel sums
    double *dscale
    double *dbias
    double *partial       # block sums (NULL when the pass keeps none)
    float *tiles          # 3 * TILE floats per thread

ctypedef void (*ItemFn)(const Work *w, int64_t i, float *tiles) noexcept nogil


cdef void run_items(const Work *w, ItemFn item, int64_t n) noexcept nogil:
    """item(w, i, the running thread's tiles) for every i < n.  One thread runs them in this
    thread: even a one-thread OpenMP region costs microseconds, more than a tiny call's work.
    Items write disjoint outputs and never depend on the thread that runs them."""
    cdef int64_t i
    cdef int nt = w.s.nthreads
    if nt <= 1:
        for i in range(n):
            item(w, i, w.tiles)
    else:
        for i in prange(n, num_threads=nt, schedule='dynamic'):
            item(w, i, w.tiles + bnbw_omp_thread_num() * 3 * TILE)


# ---------------------------------------------------------------------------------------
# Staging: rows the kernels take as they are are used in place; everything else is converted
# through a per-thread f32 tile, and the ReLU mask is applied to dy there
# ---------------------------------------------------------------------------------------

cdef inline bint _in_place(const Work *w, int64_t stride) noexcept nogil:
    return w.s.direct or (w.p.big_dtype == DT_F32 and stride == 4 and w.mask == NULL)


cdef inline void copy_row(int dtype, const char *src, int64_t stride, int64_t n,
                          float *tile) noexcept nogil:
    if dtype == DT_F32:
        bnbw_load_f32(src, stride, n, tile)
    elif dtype == DT_F16:
        bnbw_load_f16_arith(src, stride, n, tile)
    else:
        bnbw_load_bf16(src, stride, n, tile)


cdef inline bint _active(const char *m, int dtype) noexcept nogil:
    """Whether one element of the ReLU mask lets the gradient through: a nonzero bool, or a
    forward output > 0 (NaN is not)."""
    cdef float f
    cdef bnbw_f16 h
    cdef bnbw_bf16 b
    if dtype == DT_BOOL:
        return m[0] != 0
    if dtype == DT_F32:
        memcpy(&f, m, 4)
    elif dtype == DT_F16:
        memcpy(&h, m, 2)
        f = bnbw_f16_to_f32(h)
    else:
        memcpy(&b, m, 2)
        f = bnbw_bf16_to_f32(b)
    return f > 0


cdef inline void mask_row(const Work *w, const char *m, int64_t stride, int64_t n,
                          float *tile) noexcept nogil:
    """g = dy where the mask is active, +0 elsewhere: selected, never multiplied."""
    cdef int64_t i
    for i in range(n):
        if not _active(m + i * stride, w.p.mask_dtype):
            tile[i] = 0.0


cdef inline void residual_row(const Work *w, const char *g, int64_t g_stride, const char *m,
                              int64_t m_stride, char *r, int64_t r_stride,
                              int64_t n) noexcept nogil:
    """The residual gradient: dy's own bits where the mask is active, +0 elsewhere."""
    cdef int64_t i, isz = itemsize(w.p.big_dtype)
    for i in range(n):
        if _active(m + i * m_stride, w.p.mask_dtype):
            memcpy(r + i * r_stride, g + i * g_stride, isz)
        else:
            memset(r + i * r_stride, 0, isz)


cdef inline const char *load_x(const Work *w, const char *src, int64_t stride, int64_t n,
                               float *tile) noexcept nogil:
    if w.s.direct or (w.p.big_dtype == DT_F32 and stride == 4):
        return src
    copy_row(w.p.big_dtype, src, stride, n, tile)
    return <const char *> tile


cdef inline const char *load_dy(const Work *w, const char *src, int64_t stride,
                                const char *m, int64_t m_stride, int64_t n,
                                float *tile) noexcept nogil:
    if _in_place(w, stride):
        return src
    copy_row(w.p.big_dtype, src, stride, n, tile)
    if w.mask != NULL:
        mask_row(w, m, m_stride, n, tile)
    return <const char *> tile


cdef inline char *row_target(const Work *w, char *dst, int64_t stride,
                             float *tile) noexcept nogil:
    if w.s.direct or (w.p.big_dtype == DT_F32 and stride == 4):
        return dst
    return <char *> tile


cdef inline void store_row(const Work *w, const float *src, int64_t n, char *dst,
                           int64_t stride) noexcept nogil:
    """Writes back a row that row_target put in a tile."""
    if <const char *> src == dst:
        return
    if w.p.big_dtype == DT_F32:
        bnbw_store_f32(src, n, dst, stride)
    elif w.p.big_dtype == DT_F16:
        bnbw_store_f16(src, n, dst, stride)
    else:
        bnbw_store_bf16(src, n, dst, stride)


# ---------------------------------------------------------------------------------------
# Channel-major items
# ---------------------------------------------------------------------------------------

cdef void row_span(const Work *w, int64_t c, const int64_t *off, int64_t col, int64_t end,
                   int what, float *tiles, double *sums) noexcept nogil:
    """Columns [col, end) of one channel-major row (channel c, row origin `off`), cut at TILE
    boundaries counted from the row start, the same cuts for every layout and schedule."""
    cdef const Plan *p = w.p
    cdef int64_t n, seg_end
    cdef int64_t sx = p.inner_stride[S_X], sg = p.inner_stride[S_DY]
    cdef int64_t sd = p.inner_stride[S_DX], sm = p.inner_stride[S_MASK]
    cdef int64_t sr = p.inner_stride[S_DRES]
    cdef const char *cx = w.x + chan_origin(p, S_X, c) + off[S_X]
    cdef const char *cg = w.dy + chan_origin(p, S_DY, c) + off[S_DY]
    cdef const char *cm = NULL
    cdef char *cr = NULL
    cdef char *cd = NULL
    cdef const char *xs = NULL
    cdef const char *gs
    cdef char *ds
    cdef double part[2]
    cdef float mean = w.mean[c]
    if w.mask != NULL:
        cm = w.mask + chan_origin(p, S_MASK, c) + off[S_MASK]
    if what & OP_DX:
        cd = w.dx + chan_origin(p, S_DX, c) + off[S_DX]
        if w.dres != NULL:
            cr = w.dres + chan_origin(p, S_DRES, c) + off[S_DRES]
    while col < end:
        seg_end = imin((col // TILE + 1) * TILE, end)
        n = seg_end - col
        gs = load_dy(w, cg + col * sg, sg, cm + col * sm if cm != NULL else NULL, sm, n,
                     tiles + TILE)
        if what & OP_REDUCE or (what & OP_DX and w.op & OP_TRAINING):
            xs = load_x(w, cx + col * sx, sx, n, tiles)
        if what & OP_REDUCE:
            bnbw_reduce_row(xs, gs, n, mean, part, w.s.sums, w.kdt)
            sums[0] += part[0]
            sums[1] += part[1]
        if what & OP_DX:
            if cr != NULL:         # before dx, which may overwrite dy in place
                residual_row(w, cg + col * sg, sg, cm + col * sm, sm, cr + col * sr, sr, n)
            ds = row_target(w, cd + col * sd, sd, tiles + 2 * TILE)
            if w.op & OP_TRAINING:
                bnbw_apply_row(xs, gs, ds, n, mean, w.k1[c], w.k2[c], w.k3[c], w.kdt)
            else:
                bnbw_scale_row(gs, ds, n, w.k1[c], w.kdt)
            store_row(w, <const float *> ds, n, cd + col * sd, sd)
        col = seg_end


cdef void major_block(const Work *w, int64_t c, int64_t b, int what, float *tiles,
                      double *sums) noexcept nogil:
    """Channel c, block b: the reduced elements [b*block, +block)."""
    cdef const Plan *p = w.p
    cdef int64_t lo = b * p.block
    cdef int64_t hi = imin(lo + p.block, p.count)
    cdef int64_t L = p.inner_size
    cdef int64_t row = lo // L
    cdef int64_t col = lo - row * L
    cdef int64_t pos = lo, end
    cdef int64_t off[N_BIG]
    if what & OP_REDUCE:
        sums[0] = 0.0
        sums[1] = 0.0
    while pos < hi:
        row_origin(p, row, off)
        end = imin(L, col + hi - pos)
        row_span(w, c, off, col, end, what, tiles, sums)
        pos += end - col
        row += 1
        col = 0


cdef void sweep_block(const Work *w, int64_t b, int64_t c_lo, int64_t c_hi, int what,
                      float *tiles) noexcept nogil:
    """The whole rows of block b, each for channels c_lo..c_hi in turn (memory order for NCX).
    Channel c's block sum, block b's pair for c (block_sums), adds the same rows in the order
    as major_block(c, b).  Rows the kernels take in place, of channels a fixed stride apart,
    go to them as one run per outer row (row_run): the same row sums, one call instead of
    c_hi - c_lo.  Rows longer than TILE go through row_span, which cuts them where every
    schedule does."""
    cdef const Plan *p = w.p
    cdef int64_t k = p.block // p.inner_size
    cdef int64_t row, c, r_end = imin((b + 1) * k, p.count // p.inner_size)
    cdef int64_t off[N_BIG]
    cdef double *sums
    cdef bint runs = (w.s.direct and p.inner_size <= TILE and p.chan_offset[S_X] == NULL
                      and p.chan_offset[S_DY] == NULL and p.chan_offset[S_DX] == NULL)
    cdef double *block = block_sums(w, b) if what & OP_REDUCE else NULL
    if what & OP_REDUCE:
        for c in range(c_lo, c_hi):
            block[2 * c] = 0.0
            block[2 * c + 1] = 0.0
    for row in range(b * k, r_end):
        row_origin(p, row, off)
        if runs:
            row_run(w, off, c_lo, c_hi, what, block + 2 * c_lo if what & OP_REDUCE else NULL)
            continue
        for c in range(c_lo, c_hi):
            sums = block + 2 * c if what & OP_REDUCE else NULL
            row_span(w, c, off, 0, p.inner_size, what, tiles, sums)


cdef inline void row_run(const Work *w, const int64_t *off, int64_t c_lo, int64_t c_hi,
                         int what, double *sums) noexcept nogil:
    """The whole rows (shorter than TILE) of channels c_lo..c_hi at row origin `off`, in place,
    one kernel call per step; `sums` is channel c_lo's block sum, the next channel's 2 on.
    Row by row it does what row_span does: reduce, then apply or scale."""
    cdef const Plan *p = w.p
    cdef int64_t L = p.inner_size, n = c_hi - c_lo
    cdef int64_t sx = p.chan_stride[S_X], sg = p.chan_stride[S_DY], sd = p.chan_stride[S_DX]
    cdef const char *x = w.x + off[S_X] + sx * c_lo
    cdef const char *g = w.dy + off[S_DY] + sg * c_lo
    cdef char *d = w.dx + off[S_DX] + sd * c_lo if what & OP_DX else NULL
    if what & OP_REDUCE:
        bnbw_reduce_row_run(x, sx, g, sg, L, n, w.mean + c_lo, sums, 2, w.s.sums, w.kdt)
    if what & OP_DX:
        if w.op & OP_TRAINING:
            bnbw_apply_row_run(x, sx, g, sg, d, sd, L, n, w.mean + c_lo, w.k1 + c_lo,
                               w.k2 + c_lo, w.k3 + c_lo, w.kdt)
        else:
            bnbw_scale_row_run(g, sg, d, sd, L, n, w.k1 + c_lo, w.kdt)


# ---------------------------------------------------------------------------------------
# Channel-last items
# ---------------------------------------------------------------------------------------

cdef inline const char *stage_rows(const Work *w, int t, int64_t r0, int64_t nr, int64_t c0,
                                   int64_t width, float *tile,
                                   int64_t *row_stride) noexcept nogil:
    """Rows r0..r0+nr of channels c0..c0+width of big operand t (x or dy), `row_stride`
    elements apart: in place when direct, else gathered (converted, and dy masked) into `tile`
    as f32."""
    cdef const Plan *p = w.p
    cdef int64_t off[N_BIG]
    cdef int64_t isz = itemsize(p.big_dtype), msz = itemsize(p.mask_dtype), i
    cdef const char *base = w.x if t == S_X else w.dy
    row_origin(p, r0, off)
    if w.s.direct:
        row_stride[0] = p.outer_stride[t][0] // isz if p.n_outer == 1 else width
        return base + off[t] + c0 * isz
    row_stride[0] = width
    if p.n_outer == 1 and p.outer_stride[t][0] == width * isz and not (
            t == S_DY and w.mask != NULL):
        return load_x(w, base + off[t] + c0 * isz, isz, nr * width, tile)     # packed
    for i in range(nr):
        if i:
            row_origin(p, r0 + i, off)
        copy_row(p.big_dtype, base + off[t] + c0 * isz, isz, width, tile + i * width)
        if t == S_DY and w.mask != NULL:
            mask_row(w, w.mask + off[S_MASK] + c0 * msz, msz, width, tile + i * width)
    return <const char *> tile


cdef inline void unstage_rows(const Work *w, int64_t r0, int64_t nr, int64_t c0, int64_t width,
                              const float *tile) noexcept nogil:
    cdef const Plan *p = w.p
    cdef int64_t off[N_BIG]
    cdef int64_t isz = itemsize(p.big_dtype), i
    row_origin(p, r0, off)
    if p.n_outer == 1 and p.outer_stride[S_DX][0] == width * isz:
        store_row(w, tile, nr * width, w.dx + off[S_DX] + c0 * isz, isz)
        return
    for i in range(nr):
        if i:
            row_origin(p, r0 + i, off)
        store_row(w, tile + i * width, width, w.dx + off[S_DX] + c0 * isz, isz)


cdef inline void residual_rows(const Work *w, int64_t r0, int64_t nr, int64_t c0,
                               int64_t width) noexcept nogil:
    cdef const Plan *p = w.p
    cdef int64_t off[N_BIG]
    cdef int64_t isz = itemsize(p.big_dtype), msz = itemsize(p.mask_dtype), i
    for i in range(nr):
        row_origin(p, r0 + i, off)
        residual_row(w, w.dy + off[S_DY] + c0 * isz, isz, w.mask + off[S_MASK] + c0 * msz, msz,
                     w.dres + off[S_DRES] + c0 * isz, isz, width)


cdef void last_block(const Work *w, int64_t rb, int64_t grp, int what, float *tiles,
                     double *sum_g, double *sum_xg) noexcept nogil:
    """Row block rb, channel group grp.  Rows go to the kernels in slabs: direct rows at one
    stride in place (the whole block at once), anything else staged through the tiles,
    TILE // width rows at a time.  Sums accumulate row by row, in row order, into the block's
    own partial arrays, whatever the slab size."""
    cdef const Plan *p = w.p
    cdef int64_t c0 = grp * w.s.group
    cdef int64_t width = imin(w.s.group, p.channels - c0)
    cdef int64_t r0 = rb * p.block, nr
    cdef int64_t r_end = imin((rb + 1) * p.block, p.count)
    cdef int64_t isz = itemsize(p.big_dtype)
    cdef const char *xs = NULL
    cdef const char *gs
    cdef char *ds
    cdef int64_t xr = 0, gr, dr
    cdef int64_t off[N_BIG]
    while r0 < r_end:
        if not w.s.direct:
            # blocked sums: whole blocks per slab, as the direct call has them
            nr = TILE // width
            if w.s.sums != BNBW_EXACT_SUMS:
                nr -= nr % BNBW_BLOCK_ROWS
            nr = imin(nr, r_end - r0)
        elif p.n_outer <= 1:
            nr = r_end - r0
        else:
            nr = 1                 # rows that do not share one stride: one at a time
        gs = stage_rows(w, S_DY, r0, nr, c0, width, tiles + TILE, &gr)
        if what & OP_REDUCE or (what & OP_DX and w.op & OP_TRAINING):
            xs = stage_rows(w, S_X, r0, nr, c0, width, tiles, &xr)
        if what & OP_REDUCE:
            bnbw_reduce_rows(xs, xr, gs, gr, nr, width, w.mean + c0, sum_g + c0, sum_xg + c0,
                             w.s.streaming, w.s.sums, w.kdt)
        if what & OP_DX:
            if w.dres != NULL:     # before dx, which may overwrite dy in place
                residual_rows(w, r0, nr, c0, width)
            if w.s.direct:
                row_origin(p, r0, off)
                ds = w.dx + off[S_DX] + c0 * isz
                dr = p.outer_stride[S_DX][0] // isz if p.n_outer == 1 else width
            else:
                ds = <char *> (tiles + 2 * TILE)
                dr = width
            if w.op & OP_TRAINING:
                bnbw_apply_rows(xs, xr, gs, gr, ds, dr, nr, width, w.mean + c0, w.k1 + c0,
                                w.k2 + c0, w.k3 + c0, w.kdt)
            else:
                bnbw_scale_rows(gs, gr, ds, dr, nr, width, w.k1 + c0, w.kdt)
            if not w.s.direct:
                unstage_rows(w, r0, nr, c0, width, <const float *> ds)
        r0 += nr


# ---------------------------------------------------------------------------------------
# The items of each schedule
# ---------------------------------------------------------------------------------------

cdef inline double *block_sums(const Work *w, int64_t b) noexcept nogil:
    """Block b's sums: whole 64-byte lines of their own, so that threads summing different
    blocks never write to one line (channel-last: Sum dy of every channel, then Sum (x - mean)
    dy; channel-major: the two sums of each channel in turn)."""
    return w.partial + b * w.s.partial_stride


cdef void _last_item(const Work *w, int64_t i, float *tiles) noexcept nogil:
    cdef const Plan *p = w.p
    cdef double *sums = NULL
    if w.what & OP_REDUCE:
        sums = block_sums(w, i // w.s.ngroups)
    last_block(w, i // w.s.ngroups, i % w.s.ngroups, w.what, tiles, sums,
               sums + p.channels if sums != NULL else NULL)


cdef void _sweep_item(const Work *w, int64_t i, float *tiles) noexcept nogil:
    sweep_block(w, i // w.s.ngroups, (i % w.s.ngroups) * w.s.group,
                imin(w.p.channels, (i % w.s.ngroups + 1) * w.s.group), w.what, tiles)


cdef void _major_item(const Work *w, int64_t i, float *tiles) noexcept nogil:
    cdef int64_t c = i // w.p.nblocks, b = i % w.p.nblocks
    major_block(w, c, b, w.what, tiles,
                block_sums(w, b) + 2 * c if w.what & OP_REDUCE else NULL)


cdef void _combine(const Work *w, int64_t c) noexcept nogil:
    """Channel c's sums: its block sums added in block order."""
    cdef const Plan *p = w.p
    cdef int64_t b, C = p.channels
    cdef double acc_g = 0.0, acc_xg = 0.0
    cdef const double *block
    for b in range(p.nblocks):
        block = block_sums(w, b)
        if p.channel_last:
            acc_g = acc_g + block[c]
            acc_xg = acc_xg + block[C + c]
        else:
            acc_g = acc_g + block[2 * c]
            acc_xg = acc_xg + block[2 * c + 1]
    w.sums[2 * c] = acc_g
    w.sums[2 * c + 1] = acc_xg


cdef void _channel_coefficients(const Work *w, int64_t c) noexcept nogil:
    cdef const Plan *p = w.p
    cdef float var = load_stat(w.ptr[S_VAR], p.stat_dtype, chan_origin(p, S_VAR, c))
    cdef float scale = 1.0
    if w.ptr[S_SCALE] != NULL:
        scale = load_stat(w.ptr[S_SCALE], p.stat_dtype, chan_origin(p, S_SCALE, c))
    coefficients(w.op, w.sums[2 * c], w.sums[2 * c + 1], w.count, var, scale, w.eps,
                 &w.k1[c], &w.k2[c], &w.k3[c], &w.dscale[c], &w.dbias[c])


cdef void _fused_group_item(const Work *w, int64_t g, float *tiles) noexcept nogil:
    """MAJOR_SWEEP_FUSED: reduce channels [c_lo, c_hi) in memory order, finish their sums and
    coefficients, then apply them while their rows are still cached."""
    cdef const Plan *p = w.p
    cdef int64_t b, c
    cdef int64_t c_lo = g * w.s.group
    cdef int64_t c_hi = imin(p.channels, c_lo + w.s.group)
    for b in range(p.nblocks):
        sweep_block(w, b, c_lo, c_hi, OP_REDUCE, tiles)
    for c in range(c_lo, c_hi):
        _combine(w, c)
        _channel_coefficients(w, c)
    for b in range(p.nblocks - 1, -1, -1):     # newest blocks first: they are still cached
        sweep_block(w, b, c_lo, c_hi, OP_DX, tiles)


cdef void _fused_channel_item(const Work *w, int64_t c, float *tiles) noexcept nogil:
    """MAJOR_CHANNEL_FUSED: reduce channel c, then apply it while its rows are still cached."""
    cdef const Plan *p = w.p
    cdef int64_t b
    cdef double part[2]
    cdef double acc_g = 0.0, acc_xg = 0.0
    for b in range(p.nblocks):
        major_block(w, c, b, OP_REDUCE, tiles, part)
        acc_g = acc_g + part[0]
        acc_xg = acc_xg + part[1]
    w.sums[2 * c] = acc_g
    w.sums[2 * c + 1] = acc_xg
    _channel_coefficients(w, c)
    for b in range(p.nblocks - 1, -1, -1):     # newest blocks first: they are still cached
        major_block(w, c, b, OP_DX, tiles, NULL)


cdef void _pass(Work *w, int what) noexcept nogil:
    """One pass of a split schedule over every block of the plan."""
    w.what = what
    if w.s.kind == SCHED_LAST_SPLIT:
        run_items(w, _last_item, w.s.items)
    elif w.s.kind == SCHED_MAJOR_SWEEP:
        run_items(w, _sweep_item, w.s.items)
    else:
        run_items(w, _major_item, w.s.items)


# ---------------------------------------------------------------------------------------
# execute
# ---------------------------------------------------------------------------------------

cdef int execute(const Plan *p, const Schedule *s, char **ptr, int op, double eps,
                 double count, double *sums_io) noexcept nogil:
    """Carry out schedule `s` of plan `p` on the operands ptr[N_SLOTS] (NULL scale means 1,
    NULL mask means no ReLU mask).  `count` is M of the formula (the global count in two-phase
    use).  Returns 0, or -1 when out of memory (nothing written then)."""
    cdef char *slots[N_SLOTS]
    cdef char *temp[N_BIG]
    cdef int t, rc = 0
    memcpy(slots, ptr, N_SLOTS * sizeof(char *))
    for t in range(N_BIG):
        temp[t] = NULL
        if p.via_temp[t] and slots[t] != NULL:
            temp[t] = <char *> malloc(p.temp_bytes[t])
            if temp[t] == NULL:
                rc = -1
                break
            slots[t] = temp[t] - p.temp_low[t]
            if t == S_MASK:
                _copy_strided(p.ndim, p.sizes, ptr[t], p.given_strides[t], slots[t],
                              p.temp_strides[t], itemsize(p.mask_dtype))
    if rc == 0:
        rc = _run(p, s, slots, op, eps, count, sums_io)
    for t in range(N_BIG):
        if temp[t] != NULL:
            if rc == 0 and t != S_MASK:
                _copy_strided(p.ndim, p.sizes, slots[t], p.temp_strides[t], ptr[t],
                              p.given_strides[t], itemsize(p.big_dtype))
            free(temp[t])
    return rc


cdef void _copy_strided(int ndim, const int64_t *sizes, const char *src,
                        const int64_t *src_strides, char *dst, const int64_t *dst_strides,
                        int64_t size) noexcept nogil:
    """dst[i] = src[i] for every index i of `sizes` (byte strides; elements of `size` bytes)."""
    cdef int64_t idx[MAX_DIMS]
    cdef int64_t k, s_off = 0, d_off = 0
    cdef int d
    for d in range(ndim):
        idx[d] = 0
        if sizes[d] == 0:
            return
    while True:
        for k in range(sizes[ndim - 1]):       # the last dim in a loop, the others counted
            memcpy(dst + d_off + k * dst_strides[ndim - 1],
                   src + s_off + k * src_strides[ndim - 1], size)
        d = ndim - 2
        while d >= 0:
            idx[d] += 1
            s_off += src_strides[d]
            d_off += dst_strides[d]
            if idx[d] < sizes[d]:
                break
            s_off -= idx[d] * src_strides[d]
            d_off -= idx[d] * dst_strides[d]
            idx[d] = 0
            d -= 1
        if d < 0:
            return


cdef int _run(const Plan *p, const Schedule *s, char **ptr, int op, double eps, double count,
              double *sums_io) noexcept nogil:
    """execute() on operands laid out as the plan visits them."""
    cdef int64_t C = p.channels, c
    cdef Work w
    cdef float *stats = NULL
    cdef double *sums = NULL
    cdef bint need_sums = op & OP_REDUCE
    cdef bint fused = s.kind == SCHED_MAJOR_SWEEP_FUSED or s.kind == SCHED_MAJOR_CHANNEL_FUSED
    cdef bint want_coef = (op & (OP_DX | OP_PARAMS)) != 0     # a reduce-only call needs none
    cdef int first
    cdef double *partial_memory = NULL
    if C == 0:
        return 0
    stats = <float *> malloc(4 * C * sizeof(float))
    sums = <double *> calloc(4 * C, sizeof(double))
    w.partial = NULL
    w.tiles = NULL
    if stats == NULL or sums == NULL:
        free(stats)
        free(sums)
        return -1
    w.p = p
    w.s = s
    w.x = ptr[S_X]
    w.dy = ptr[S_DY]
    w.dx = ptr[S_DX]
    w.mask = ptr[S_MASK]
    w.dres = ptr[S_DRES] if ptr[S_MASK] != NULL else NULL
    w.ptr = ptr
    w.mean = stats
    w.k1 = stats + C
    w.k2 = stats + 2 * C
    w.k3 = stats + 3 * C
    w.op = op
    w.kdt = p.big_dtype if s.direct else DT_F32
    w.eps = eps
    w.count = count
    w.sums = sums
    w.dscale = sums + 2 * C
    w.dbias = sums + 3 * C
    for c in range(C):
        w.mean[c] = load_stat(ptr[S_MEAN], p.stat_dtype, chan_origin(p, S_MEAN, c))
    if op & OP_GIVEN_SUMS:
        memcpy(sums, sums_io, 2 * C * sizeof(double))
    if want_coef and (not (op & OP_TRAINING) or not need_sums):
        # frozen statistics, or given sums: the constants are known before any pass
        for c in range(C):
            _channel_coefficients(&w, c)

    if s.kind != SCHED_NOTHING:
        w.tiles = <float *> malloc(s.nthreads * s.tile_floats * sizeof(float))
        if s.partial_doubles:
            partial_memory = <double *> calloc(s.partial_doubles + 8, sizeof(double))
            w.partial = <double *> ((<size_t> partial_memory + 63) & ~(<size_t> 63))
        if w.tiles == NULL or (s.partial_doubles and partial_memory == NULL):
            free(w.tiles)
            free(partial_memory)
            free(stats)
            free(sums)
            return -1
    if s.kind == SCHED_MAJOR_SWEEP_FUSED:
        run_items(&w, _fused_group_item, s.items)
    elif s.kind == SCHED_MAJOR_CHANNEL_FUSED:
        run_items(&w, _fused_channel_item, s.items)
    elif s.kind != SCHED_NOTHING:
        first = OP_REDUCE if need_sums else 0
        if op & OP_DX and not (op & OP_TRAINING):
            first = first | OP_DX          # frozen: dx in the same pass as the sums
        if first:
            _pass(&w, first)
        if need_sums:
            for c in range(C):     # serial: C x nblocks additions, a tiny part of a pass
                _combine(&w, c)
            if want_coef:
                for c in range(C):
                    _channel_coefficients(&w, c)
        if op & OP_DX and op & OP_TRAINING:
            _pass(&w, OP_DX)
    elif want_coef and op & OP_TRAINING and need_sums:
        for c in range(C):         # nothing to read (M = 0): the coefficients of empty sums
            _channel_coefficients(&w, c)

    if op & OP_RETURN_SUMS:
        memcpy(sums_io, sums, 2 * C * sizeof(double))
    if op & OP_PARAMS:
        for c in range(C):
            store_stat(ptr[S_DSCALE], p.stat_dtype, chan_origin(p, S_DSCALE, c), w.dscale[c])
            store_stat(ptr[S_DBIAS], p.stat_dtype, chan_origin(p, S_DBIAS, c), w.dbias[c])
    free(w.tiles)
    free(partial_memory)
    free(stats)
    free(sums)
    return 0
