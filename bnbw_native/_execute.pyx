# cython: language_level=3
"""Carrying out a schedule: the items of its passes, the formulas' kernels, the combine.

execute() runs the schedule bnbw_native._schedules chose for a plan.  A call is one formula -
the training backward, the backward with frozen statistics, or the training forward - and each
formula is one row of FORMULAS: the kernels its reduce and apply passes call on a piece of a
row, on channel-last rows and on runs of rows, and its per-channel constants from the final
sums (bnbw_native._formulas).  Everything else - the schedules' items, the combine of block
sums in block order, the temporaries, the scratch - is the same code for every formula, so a
new formula (a forward with a residual add, say) is a new row of the table and its kernels.

    reduce pass  -> block sums -> combine (block order) -> constants -> apply pass
    (the frozen backward applies in its reduce pass; the fused schedules do all of it per
    group of channels while their rows are cached)

Every operand reaches the kernels of bnbw_kernels.h where it lies, with its own step in
elements (validation guarantees aligned elements and whole-element strides), the ReLU mask
included.  Channel-major rows go to the kernels in pieces of at most TILE elements cut at the
same places on every schedule, so that where a kernel call starts never changes a sum.
"""
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, free
from libc.math cimport NAN
from libc.string cimport memcpy, memmove, memset
from cython.parallel cimport prange

from bnbw_native._vocabulary cimport (
    Plan, N_BIG, N_SLOTS, S_X, S_DY, S_DX, S_MASK, S_DRES, S_MEAN, S_VAR, S_SCALE,
    S_DSCALE, S_DBIAS, S_BETA, S_RUN_MEAN, S_BATCH_MEAN, S_MEAN_LOW, OP_REDUCE, OP_GIVEN_SUMS, OP_TRAINING,
    OP_DX, OP_PARAMS, OP_RETURN_SUMS, OP_FORWARD, OP_RELU, OP_TORCH_RUNNING, OP_ADD_RESIDUAL,
    SERIAL_BELOW,
    itemsize, imin, chan_origin, f32_channels, row_origin, load_stat, store_stat,
    applies_after_sums)
from bnbw_native._headers cimport (bnbw_io, bnbw_run, bnbw_kernel_table, BNBW_NO_MASK,
                                   BNBW_RELU, BNBW_ADD_RELU)
from bnbw_native._plan cimport plan_scratch, copy_runs, copy_strided
from bnbw_native._formulas cimport (coefficients, forward_coefficients, forward_recentre,
                                    running_statistic)
from bnbw_native._schedules cimport (
    Schedule, SCHED_NOTHING, SCHED_LAST_SPLIT, SCHED_LAST_SLAB, SCHED_MAJOR_SWEEP,
    SCHED_MAJOR_SWEEP_FUSED, SCHED_MAJOR_CHANNEL_FUSED, TILE, COMBINE_CHUNK, first_item)


cdef extern from *:
    """
    /* A plan's scratch is taken by one execute at a time (atomically: operators may run from
       many threads at once). */
    #if defined(_MSC_VER) && !defined(__clang__)
    #include <intrin.h>
    static int scratch_take(int *taken)
    { return _InterlockedExchange((long *) taken, 1) == 0; }
    static void scratch_give_back(int *taken) { _InterlockedExchange((long *) taken, 0); }
    #else
    static int scratch_take(int *taken)
    { return __atomic_exchange_n(taken, 1, __ATOMIC_ACQUIRE) == 0; }
    static void scratch_give_back(int *taken) { __atomic_store_n(taken, 0, __ATOMIC_RELEASE); }
    #endif
    """
    bint scratch_take(int *taken) nogil
    void scratch_give_back(int *taken) nogil


# Scratch poisoning (tests): block sums and per-channel floats start as NaN instead of
# whatever malloc returns, so that a pass reading scratch it did not write shows in the result.
cdef bint poison_scratch = False


def set_scratch_poison(bint on):
    """Fill every call's scratch with NaN before its passes (True) or not; returns the previous
    setting.  Results never change when every pass writes before it reads."""
    global poison_scratch
    previous = poison_scratch
    poison_scratch = on
    return previous


cdef void _fill_nan(double *a, int64_t n) noexcept nogil:
    cdef int64_t i
    for i in range(n):
        a[i] = NAN


# ---------------------------------------------------------------------------------------
# What every item of a call shares
# ---------------------------------------------------------------------------------------

cdef struct Work

# A formula's kernels on one piece of work (reduce: its sums out; apply: `sums` unused).
ctypedef void (*RowFn)(const Work *w, const bnbw_io *io, int64_t n, int64_t c,
                       double *sums) noexcept nogil        # a piece of channel c's row
ctypedef void (*RowsFn)(const Work *w, const bnbw_io *io, int64_t rows, int64_t n, int64_t c0,
                        double *sum_a, double *sum_b) noexcept nogil   # channel-last rows
ctypedef void (*RunFn)(const Work *w, const bnbw_io *io, const bnbw_run *run, int64_t n,
                       int64_t c0, double *sums) noexcept nogil   # a run of channels' rows
ctypedef void (*ChannelsFn)(const Work *w, int64_t lo, int64_t hi) noexcept nogil


cdef struct Formula:
    # One formula's passes, chosen once per call (FORMULAS).
    RowFn reduce_row
    RowsFn reduce_rows
    RunFn reduce_run
    RowFn apply_row
    RowsFn apply_rows
    RunFn apply_run
    ChannelsFn constants      # channels [lo, hi)'s constants (and outputs) from final sums


cdef struct Work:
    const Plan *p
    const Schedule *s
    const bnbw_kernel_table *kernels
    const Formula *f
    char *x
    char *dy              # the forward: x (it reads x only)
    char *dx              # the big output: dx, or the forward's y
    char *mask            # NULL: no ReLU mask
    char *dres            # NULL: no residual gradient to write
    char **ptr            # every slot (statistics read by the constants)
    float *mean           # [C] f32: the backward's mean; the forward's shift, then fl32(mean)
    float *k1             # [C] f32: the backward's dx = k1*dy + k2*(x - mean) + k3
    float *k2
    float *k3
    float *k              # [C] f32: the forward's y = k*(x - mean) + b (k1's memory)
    float *b              # (k3's memory)
    unsigned char *again  # [C] the forward: channels whose sums are taken again
    int op
    int what              # this pass: OP_REDUCE and/or OP_DX
    int relu              # the forward's y through a ReLU: 0, BNBW_RELU or BNBW_ADD_RELU
    double eps
    double count
    double *sums          # [C][2]: Sum dy, Sum (x - mean) dy; the forward's Sum d, Sum d^2
    double *dscale        # [C] f64: the backward's parameter gradients
    double *dbias
    double *batch_mean    # [C] f64: the forward's batch statistics (dscale's, dbias's memory)
    double *batch_var
    double *partial       # block sums (NULL when the pass keeps none)

ctypedef void (*ItemFn)(const Work *w, int64_t i) noexcept nogil


cdef void run_items(const Work *w, ItemFn item, int64_t n) noexcept nogil:
    """item(w, i) for every i < n.  One thread runs them in this thread: even a one-thread
    OpenMP region costs microseconds, more than a tiny call's work.  Items write disjoint
    outputs and never depend on the thread that runs them.  Threads take fixed runs of items
    (static): every pass of a call, and the next call, hands a thread the same items, whose
    data are then still in its core's caches (handed out one by one, they moved between cores
    at every pass: measured, small calls on 2 threads ran slower than on 1)."""
    cdef int64_t i
    cdef int nt = w.s.nthreads
    if nt <= 1:
        for i in range(n):
            item(w, i)
    else:
        for i in prange(n, num_threads=nt, schedule='static'):
            item(w, i)


cdef void run_split_items(const Work *w, ItemFn item) noexcept nogil:
    """item(w, i) for every item of LAST_SPLIT, each thread on its run of equal work
    (first_item): items of unequal size - a short last block - balance too."""
    cdef int64_t i
    cdef int t, nt = w.s.nthreads
    if nt <= 1:
        for i in range(w.s.items):
            item(w, i)
    else:
        for t in prange(nt, num_threads=nt, schedule='static', chunksize=1):
            for i in range(first_item(w.p, w.s, t), first_item(w.p, w.s, t + 1)):
                item(w, i)


# ---------------------------------------------------------------------------------------
# The formulas
# ---------------------------------------------------------------------------------------

# The backward's sums, for training and frozen statistics alike: Sum dy, Sum (x - mean) dy.
cdef void _sum_row(const Work *w, const bnbw_io *io, int64_t n, int64_t c,
                   double *sums) noexcept nogil:
    w.kernels.reduce_row(io, n, w.mean[c], sums, w.s.sums)

cdef void _sum_rows(const Work *w, const bnbw_io *io, int64_t rows, int64_t n, int64_t c0,
                    double *sum_g, double *sum_xg) noexcept nogil:
    w.kernels.reduce_rows(io, rows, n, w.mean + c0, sum_g, sum_xg, w.s.streaming, w.s.sums)

cdef void _sum_run(const Work *w, const bnbw_io *io, const bnbw_run *run, int64_t n,
                   int64_t c0, double *sums) noexcept nogil:
    w.kernels.reduce_row_run(io, run, n, w.mean + c0, sums, 2, w.s.sums)

# The training dx: k1*dy + k2*(x - mean) + k3.
cdef void _train_row(const Work *w, const bnbw_io *io, int64_t n, int64_t c,
                     double *unused) noexcept nogil:
    w.kernels.apply_row(io, n, w.mean[c], w.k1[c], w.k2[c], w.k3[c])

cdef void _train_rows(const Work *w, const bnbw_io *io, int64_t rows, int64_t n, int64_t c0,
                      double *unused_a, double *unused_b) noexcept nogil:
    w.kernels.apply_rows(io, rows, n, w.mean + c0, w.k1 + c0, w.k2 + c0, w.k3 + c0)

cdef void _train_run(const Work *w, const bnbw_io *io, const bnbw_run *run, int64_t n,
                     int64_t c0, double *unused) noexcept nogil:
    w.kernels.apply_row_run(io, run, n, w.mean + c0, w.k1 + c0, w.k2 + c0, w.k3 + c0)

# The frozen dx: k1*dy.
cdef void _frozen_row(const Work *w, const bnbw_io *io, int64_t n, int64_t c,
                      double *unused) noexcept nogil:
    w.kernels.scale_row(io, n, w.k1[c])

cdef void _frozen_rows(const Work *w, const bnbw_io *io, int64_t rows, int64_t n, int64_t c0,
                       double *unused_a, double *unused_b) noexcept nogil:
    w.kernels.scale_rows(io, rows, n, w.k1 + c0)

cdef void _frozen_run(const Work *w, const bnbw_io *io, const bnbw_run *run, int64_t n,
                      int64_t c0, double *unused) noexcept nogil:
    w.kernels.scale_row_run(io, run, n, w.k1 + c0)

# The forward's sums around the shift: Sum d, Sum d^2 (d = x - shift).
cdef void _stats_row(const Work *w, const bnbw_io *io, int64_t n, int64_t c,
                     double *sums) noexcept nogil:
    w.kernels.stats_row(io, n, w.mean[c], sums)

cdef void _stats_rows(const Work *w, const bnbw_io *io, int64_t rows, int64_t n, int64_t c0,
                      double *sum, double *sum_sq) noexcept nogil:
    w.kernels.stats_rows(io, rows, n, w.mean + c0, sum, sum_sq, w.s.streaming)

cdef void _stats_run(const Work *w, const bnbw_io *io, const bnbw_run *run, int64_t n,
                     int64_t c0, double *sums) noexcept nogil:
    w.kernels.stats_row_run(io, run, n, w.mean + c0, sums, 2)

# The forward's y: k*(x - mean) + b, through a ReLU where asked.
cdef void _normalize_row(const Work *w, const bnbw_io *io, int64_t n, int64_t c,
                         double *unused) noexcept nogil:
    w.kernels.normalize_row(io, n, w.mean[c], w.k[c], w.b[c], w.relu)

cdef void _normalize_rows(const Work *w, const bnbw_io *io, int64_t rows, int64_t n, int64_t c0,
                          double *unused_a, double *unused_b) noexcept nogil:
    w.kernels.normalize_rows(io, rows, n, w.mean + c0, w.k + c0, w.b + c0, w.relu)

cdef void _normalize_run(const Work *w, const bnbw_io *io, const bnbw_run *run, int64_t n,
                         int64_t c0, double *unused) noexcept nogil:
    w.kernels.normalize_row_run(io, run, n, w.mean + c0, w.k + c0, w.b + c0, w.relu)


# The per-channel work runs over many channels per call, in loops without calls or type
# tests inside (plain float32 statistics read and written as arrays): with one call per channel
# it was most of a small call's time.  Statistics are gathered STAT_RUN channels at a time.
cdef enum:
    STAT_RUN = 64


cdef void _gather(const Work *w, int slot, int64_t lo, int64_t n, float absent,
                  float *out) noexcept nogil:
    """Channels [lo, lo + n) of a per-channel slot as f32, `absent` when the call has none."""
    cdef int64_t i
    cdef const char *base = w.ptr[slot]
    cdef const float *plain = f32_channels(w.p, w.ptr[slot], slot, w.p.stat_dtype)
    if base == NULL:
        for i in range(n):
            out[i] = absent
    elif plain != NULL:
        memcpy(out, plain + lo, n * sizeof(float))
    else:
        for i in range(n):
            out[i] = load_stat(base, w.p.stat_dtype, chan_origin(w.p, slot, lo + i))


cdef void _scatter(const Work *w, int slot, const double *values) noexcept nogil:
    """Every channel's value (f64) stored in a per-channel output slot, rounded once."""
    cdef int64_t c
    cdef float *plain = f32_channels(w.p, w.ptr[slot], slot, w.p.stat_dtype)
    if plain != NULL:
        for c in range(w.p.channels):
            plain[c] = <float> values[c]
    else:
        for c in range(w.p.channels):
            store_stat(w.ptr[slot], w.p.stat_dtype, chan_origin(w.p, slot, c), values[c])


# The constants of a run of channels are computed from local arrays into local arrays: the
# compiler then knows nothing aliases and computes two channels a vector (SSE2, NEON), which
# doubles the divider's rate - divisions and square roots are most of a channel's cost, and
# each lane rounds exactly as a scalar does.

cdef inline void _channel_sums(const Work *w, int64_t c0, int64_t n, double *first,
                               double *second) noexcept nogil:
    """Channels [c0, c0 + n)'s two sums, each in an array of its own."""
    cdef int64_t i
    for i in range(n):
        first[i] = w.sums[2 * (c0 + i)]
        second[i] = w.sums[2 * (c0 + i) + 1]


cdef void _backward_constants(const Work *w, int64_t lo, int64_t hi) noexcept nogil:
    cdef float var[STAT_RUN]
    cdef float scale[STAT_RUN]
    cdef float mean_low[STAT_RUN]
    cdef double sum_g[STAT_RUN]
    cdef double sum_xg[STAT_RUN]
    cdef float k1[STAT_RUN]
    cdef float k2[STAT_RUN]
    cdef float k3[STAT_RUN]
    cdef double dscale[STAT_RUN]
    cdef double dbias[STAT_RUN]
    cdef int64_t r, c0, i, n
    cdef int op = w.op
    cdef double count = w.count, eps = w.eps
    for r in range((hi - lo + STAT_RUN - 1) // STAT_RUN):
        c0 = lo + r * STAT_RUN
        n = imin(STAT_RUN, hi - c0)
        _gather(w, S_VAR, c0, n, 1.0, var)
        _gather(w, S_SCALE, c0, n, 1.0, scale)
        _gather(w, S_MEAN_LOW, c0, n, 0.0, mean_low)
        _channel_sums(w, c0, n, sum_g, sum_xg)
        for i in range(n):
            coefficients(op, sum_g[i], sum_xg[i], count, var[i], scale[i], eps, mean_low[i],
                         &k1[i], &k2[i], &k3[i], &dscale[i], &dbias[i])
        memcpy(w.k1 + c0, k1, n * sizeof(float))
        memcpy(w.k2 + c0, k2, n * sizeof(float))
        memcpy(w.k3 + c0, k3, n * sizeof(float))
        memcpy(w.dscale + c0, dscale, n * sizeof(double))
        memcpy(w.dbias + c0, dbias, n * sizeof(double))


cdef void _forward_constants(const Work *w, int64_t lo, int64_t hi) noexcept nogil:
    cdef float scale[STAT_RUN]
    cdef float beta[STAT_RUN]
    cdef float shift[STAT_RUN]
    cdef double s1[STAT_RUN]
    cdef double s2[STAT_RUN]
    cdef float mean_hi[STAT_RUN]
    cdef float k[STAT_RUN]
    cdef float b[STAT_RUN]
    cdef double mean[STAT_RUN]
    cdef double var[STAT_RUN]
    cdef int64_t r, c0, i, n
    cdef double count = w.count, eps = w.eps
    for r in range((hi - lo + STAT_RUN - 1) // STAT_RUN):
        c0 = lo + r * STAT_RUN
        n = imin(STAT_RUN, hi - c0)
        _gather(w, S_SCALE, c0, n, 1.0, scale)
        _gather(w, S_BETA, c0, n, 0.0, beta)
        memcpy(shift, w.mean + c0, n * sizeof(float))
        _channel_sums(w, c0, n, s1, s2)
        for i in range(n):
            forward_coefficients(shift[i], s1[i], s2[i], count, scale[i], beta[i], eps,
                                 &mean_hi[i], &k[i], &b[i], &mean[i], &var[i])
        memcpy(w.mean + c0, mean_hi, n * sizeof(float))
        memcpy(w.k + c0, k, n * sizeof(float))
        memcpy(w.b + c0, b, n * sizeof(float))
        memcpy(w.batch_mean + c0, mean, n * sizeof(double))
        memcpy(w.batch_var + c0, var, n * sizeof(double))


cdef enum:
    FORMULA_TRAINING = 0
    FORMULA_FROZEN = 1
    FORMULA_FORWARD = 2

cdef Formula FORMULAS[3]
FORMULAS[FORMULA_TRAINING] = Formula(_sum_row, _sum_rows, _sum_run,
                                     _train_row, _train_rows, _train_run, _backward_constants)
FORMULAS[FORMULA_FROZEN] = Formula(_sum_row, _sum_rows, _sum_run,
                                   _frozen_row, _frozen_rows, _frozen_run, _backward_constants)
FORMULAS[FORMULA_FORWARD] = Formula(_stats_row, _stats_rows, _stats_run,
                                    _normalize_row, _normalize_rows, _normalize_run,
                                    _forward_constants)


cdef inline const Formula *formula_of(int op) noexcept nogil:
    if op & OP_FORWARD:
        return &FORMULAS[FORMULA_FORWARD]
    return &FORMULAS[FORMULA_TRAINING if op & OP_TRAINING else FORMULA_FROZEN]
# ---------------------------------------------------------------------------------------
# The operands of one kernel call
# ---------------------------------------------------------------------------------------

cdef inline void io_start(const Work *w, bnbw_io *io) noexcept nogil:
    """The parts of a kernel call every row shares: storage types, which operands it has."""
    io.dt = w.p.big_dtype
    io.stream_dx = w.s.stream_dx
    io.from_line = w.s.from_line
    io.mask_dt = w.p.mask_dtype if w.mask != NULL else BNBW_NO_MASK
    io.mask = NULL
    io.dx = NULL
    io.dres = NULL
    io.x_step = io.dy_step = io.mask_step = io.dx_step = io.dres_step = 1


cdef inline void io_at(const Work *w, bnbw_io *io, const int64_t *off, int what) noexcept nogil:
    """Each operand at byte offsets `off` (N_BIG of them, from the operand's base)."""
    io.x = w.x + off[S_X]
    io.dy = w.dy + off[S_DY]
    if w.mask != NULL:
        io.mask = w.mask + off[S_MASK]
    if what & OP_DX:
        io.dx = w.dx + off[S_DX]
        if w.dres != NULL:
            io.dres = w.dres + off[S_DRES]


cdef inline void io_steps(const Work *w, bnbw_io *io, const int64_t *stride) noexcept nogil:
    """Steps in elements from byte strides (N_BIG of them)."""
    cdef const Plan *p = w.p
    cdef int64_t isz = itemsize(p.big_dtype)
    io.x_step = stride[S_X] // isz
    io.dy_step = stride[S_DY] // isz
    io.dx_step = stride[S_DX] // isz
    io.dres_step = stride[S_DRES] // isz
    io.mask_step = stride[S_MASK] // itemsize(p.mask_dtype)


# ---------------------------------------------------------------------------------------
# Channel-major items
# ---------------------------------------------------------------------------------------

cdef void row_span(const Work *w, int64_t c, const int64_t *off, int64_t col, int64_t end,
                   int what, double *sums) noexcept nogil:
    """Columns [col, end) of one channel-major row (channel c, row origin `off`), cut at TILE
    boundaries counted from the row start, the same cuts for every layout and schedule."""
    cdef const Plan *p = w.p
    cdef int64_t n, seg_end, t
    cdef int64_t at[N_BIG]
    cdef bnbw_io io
    cdef double part[2]
    io_start(w, &io)
    io_steps(w, &io, p.inner_stride)
    while col < end:
        seg_end = imin((col // TILE + 1) * TILE, end)
        n = seg_end - col
        for t in range(N_BIG):
            at[t] = chan_origin(p, t, c) + off[t] + col * p.inner_stride[t]
        io_at(w, &io, at, what)
        if what & OP_REDUCE:
            w.f.reduce_row(w, &io, n, c, part)
            sums[0] += part[0]
            sums[1] += part[1]
        if what & OP_DX:
            w.f.apply_row(w, &io, n, c, NULL)
        col = seg_end


cdef void major_block(const Work *w, int64_t c, int64_t b, int what, double *sums) noexcept nogil:
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
        row_span(w, c, off, col, end, what, sums)
        pos += end - col
        row += 1
        col = 0


cdef bint _runs(const Plan *p, bint mask) noexcept nogil:
    """Whether short rows of adjacent channels can go to the kernels as one run per outer row:
    contiguous rows, one channel stride per operand."""
    cdef int t
    if p.inner_size > TILE:
        return False
    for t in range(N_BIG):
        if not p.present[t] or (t == S_MASK and not mask):
            continue
        if p.chan_offset[t] != NULL or (
                p.inner_size > 1 and p.inner_stride[t] != (itemsize(p.mask_dtype) if t == S_MASK
                                                           else itemsize(p.big_dtype))):
            return False
    return True


cdef void sweep_block(const Work *w, int64_t b, int64_t c_lo, int64_t c_hi,
                      int what) noexcept nogil:
    """The whole rows of block b, each for channels c_lo..c_hi in turn (memory order for NCX).
    Channel c's block sum, block b's pair for c (block_sums), adds the same rows in the order
    as major_block(c, b).  Contiguous rows of channels a fixed stride apart go to the kernels
    as one run per outer row (row_run): the same row sums, one call instead of c_hi - c_lo."""
    cdef const Plan *p = w.p
    cdef int64_t k = p.block // p.inner_size
    cdef int64_t row, c, r_end = imin((b + 1) * k, p.count // p.inner_size)
    cdef int64_t off[N_BIG]
    cdef double *sums
    cdef bint runs = _runs(p, w.mask != NULL)
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
            row_span(w, c, off, 0, p.inner_size, what, sums)


cdef inline void row_run(const Work *w, const int64_t *off, int64_t c_lo, int64_t c_hi,
                         int what, double *sums) noexcept nogil:
    """The whole contiguous rows (at most TILE) of channels c_lo..c_hi at row origin `off`, one
    kernel call per step; `sums` is channel c_lo's block sum, the next channel's 2 on.  Row by
    row it does what row_span does: reduce, then apply or scale."""
    cdef const Plan *p = w.p
    cdef int64_t L = p.inner_size
    cdef int64_t at[N_BIG]
    cdef bnbw_io io
    cdef bnbw_run run
    cdef int t
    for t in range(N_BIG):
        at[t] = off[t] + p.chan_stride[t] * c_lo
    io_start(w, &io)
    io_at(w, &io, at, what)
    run.count = c_hi - c_lo
    run.x = p.chan_stride[S_X]
    run.dy = p.chan_stride[S_DY]
    run.mask = p.chan_stride[S_MASK]
    run.dx = p.chan_stride[S_DX]
    run.dres = p.chan_stride[S_DRES]
    if what & OP_REDUCE:
        w.f.reduce_run(w, &io, &run, L, c_lo, sums)
    if what & OP_DX:
        w.f.apply_run(w, &io, &run, L, c_lo, NULL)


# ---------------------------------------------------------------------------------------
# Channel-last items
# ---------------------------------------------------------------------------------------

cdef void last_rows(const Work *w, int64_t r0, int64_t r_end, int64_t c0, int64_t width,
                    int what, double *sum_g, double *sum_xg) noexcept nogil:
    """Rows [r0, r_end) of channels [c0, c0 + width): in one kernel call when they share one
    stride, else one at a time.  Sums accumulate row by row, in row order, into sum_g[c0:]
    and sum_xg[c0:], which a reduce clears first (a forward's second pass reuses them)."""
    cdef const Plan *p = w.p
    cdef int64_t nr, t
    cdef int64_t off[N_BIG]
    cdef int64_t row_stride[N_BIG]
    cdef bnbw_io io
    if what & OP_REDUCE:
        memset(sum_g + c0, 0, width * sizeof(double))
        memset(sum_xg + c0, 0, width * sizeof(double))
    io_start(w, &io)
    if p.n_outer == 1:
        for t in range(N_BIG):
            row_stride[t] = p.outer_stride[t][0]
        io_steps(w, &io, row_stride)
    while r0 < r_end:
        nr = r_end - r0 if p.n_outer <= 1 else 1
        row_origin(p, r0, off)
        for t in range(N_BIG):
            off[t] += c0 * p.inner_stride[t]
        io_at(w, &io, off, what)
        if what & OP_REDUCE:
            w.f.reduce_rows(w, &io, nr, width, c0, sum_g + c0, sum_xg + c0)
        if what & OP_DX:
            w.f.apply_rows(w, &io, nr, width, c0, NULL, NULL)
        r0 += nr


cdef inline void last_block(const Work *w, int64_t rb, int64_t grp, int what, double *sum_g,
                            double *sum_xg) noexcept nogil:
    """Row block rb, channel group grp (last_rows)."""
    cdef const Plan *p = w.p
    cdef int64_t c0 = grp * w.s.group
    last_rows(w, rb * p.block, imin((rb + 1) * p.block, p.count), c0,
              imin(w.s.group, p.channels - c0), what, sum_g, sum_xg)


# ---------------------------------------------------------------------------------------
# The items of each schedule
# ---------------------------------------------------------------------------------------

cdef inline double *block_sums(const Work *w, int64_t b) noexcept nogil:
    """Block b's sums: whole 64-byte lines of their own, so that threads summing different
    blocks never write to one line (channel-last: Sum dy of every channel, then Sum (x - mean)
    dy; channel-major: the two sums of each channel in turn)."""
    return w.partial + b * w.p.partial_stride


cdef void _group_block(const Work *w, int64_t b, int64_t g, int what) noexcept nogil:
    """Block b of channel group g (the schedule's group channels from g * group on), in
    either layout."""
    cdef double *sums = NULL
    if w.p.channel_last:
        if what & OP_REDUCE:
            sums = block_sums(w, b)
        last_block(w, b, g, what, sums, sums + w.p.channels if sums != NULL else NULL)
    else:
        sweep_block(w, b, g * w.s.group, imin(w.p.channels, (g + 1) * w.s.group), what)


cdef void _group_item(const Work *w, int64_t i) noexcept nogil:
    """LAST_SPLIT and MAJOR_SWEEP: item i is block i // ngroups of group i % ngroups."""
    _group_block(w, i // w.s.ngroups, i % w.s.ngroups, w.what)


cdef void _major_item(const Work *w, int64_t i) noexcept nogil:
    cdef int64_t c = i // w.p.nblocks, b = i % w.p.nblocks
    major_block(w, c, b, w.what,
                block_sums(w, b) + 2 * c if w.what & OP_REDUCE else NULL)


cdef void _combine(const Work *w, int64_t lo, int64_t hi) noexcept nogil:
    """Channels [lo, hi)'s sums: each channel's block sums added in block order."""
    cdef const Plan *p = w.p
    cdef int64_t b, c, C = p.channels
    cdef const double *block
    cdef double *sums = w.sums
    for c in range(lo, hi):
        sums[2 * c] = 0.0
        sums[2 * c + 1] = 0.0
    for b in range(p.nblocks):
        block = block_sums(w, b)
        if p.channel_last:
            for c in range(lo, hi):
                sums[2 * c] = sums[2 * c] + block[c]
                sums[2 * c + 1] = sums[2 * c + 1] + block[C + c]
        else:
            for c in range(lo, hi):
                sums[2 * c] = sums[2 * c] + block[2 * c]
                sums[2 * c + 1] = sums[2 * c + 1] + block[2 * c + 1]


cdef inline bint _settled(const Work *w, int64_t c) noexcept nogil:
    """Whether channel c's sums are final: the backward's always are; the forward's are unless
    they cancel too much around the shift, which then moves to fl32(mean) for one more pass."""
    if not (w.op & OP_FORWARD) or w.op & OP_RETURN_SUMS:
        return True       # (two-phase sums: around the caller's shift, whatever they give)
    return not forward_recentre(w.mean[c], w.sums[2 * c], w.sums[2 * c + 1], w.count,
                                &w.mean[c])


cdef void _combine_item(const Work *w, int64_t i) noexcept nogil:
    """Channels [i, i + 1) * COMBINE_CHUNK: sums combined, and their coefficients unless the
    call only returns sums (or the channel's forward sums are taken again)."""
    cdef int64_t c
    cdef int64_t lo = i * COMBINE_CHUNK, hi = imin(w.p.channels, (i + 1) * COMBINE_CHUNK)
    cdef bint again = False
    _combine(w, lo, hi)
    for c in range(lo, hi):
        if not _settled(w, c):
            w.again[c] = True
            again = True
    if not (w.op & (OP_DX | OP_PARAMS)):
        return
    if not again:
        w.f.constants(w, lo, hi)
        return
    for c in range(lo, hi):
        if not w.again[c]:
            w.f.constants(w, c, c + 1)


cdef void _group_sums_item(const Work *w, int64_t g) noexcept nogil:
    """Reduce channel group g over every block, finish its sums and coefficients (the first
    half of _fused_group_item; LAST_SLAB's first pass where its apply goes by rows)."""
    cdef const Plan *p = w.p
    cdef int64_t b, c
    cdef int64_t c_lo = g * w.s.group
    cdef int64_t c_hi = imin(p.channels, c_lo + w.s.group)
    cdef bint again = False
    for b in range(p.nblocks):
        _group_block(w, b, g, OP_REDUCE)
    _combine(w, c_lo, c_hi)
    for c in range(c_lo, c_hi):
        again = not _settled(w, c) or again
    if again:          # settled channels sum the same terms again: the same bits
        for b in range(p.nblocks):
            _group_block(w, b, g, OP_REDUCE)
        _combine(w, c_lo, c_hi)
    w.f.constants(w, c_lo, c_hi)


cdef void _fused_group_item(const Work *w, int64_t g) noexcept nogil:
    """MAJOR_SWEEP_FUSED and LAST_SLAB: reduce channel group g over every block, finish its
    sums and coefficients, then apply them while its x and dy are still cached."""
    cdef int64_t b
    _group_sums_item(w, g)
    for b in range(w.p.nblocks - 1, -1, -1):     # newest blocks first: they are still cached
        _group_block(w, b, g, OP_DX)


cdef void _rows_item(const Work *w, int64_t t) noexcept nogil:
    """The channel-last apply by rows (the schedule's apply_rows): thread t's equal run of
    whole rows, every channel (at most TILE a kernel call)."""
    cdef const Plan *p = w.p
    cdef int64_t c0 = 0, nt = w.s.nthreads
    while c0 < p.channels:
        last_rows(w, t * p.count // nt, (t + 1) * p.count // nt, c0,
                  imin(TILE, p.channels - c0), OP_DX, NULL, NULL)
        c0 += TILE


cdef void _fused_channel_item(const Work *w, int64_t c) noexcept nogil:
    """MAJOR_CHANNEL_FUSED: reduce channel c, then apply it while its rows are still cached."""
    cdef const Plan *p = w.p
    cdef int64_t b
    cdef double part[2]
    cdef double acc_g, acc_xg
    cdef int passes
    for passes in range(2):          # a second one only for forward sums taken again
        acc_g = 0.0
        acc_xg = 0.0
        for b in range(p.nblocks):
            major_block(w, c, b, OP_REDUCE, part)
            acc_g = acc_g + part[0]
            acc_xg = acc_xg + part[1]
        w.sums[2 * c] = acc_g
        w.sums[2 * c + 1] = acc_xg
        if passes == 1 or _settled(w, c):
            break
    w.f.constants(w, c, c + 1)
    for b in range(p.nblocks - 1, -1, -1):     # newest blocks first: they are still cached
        major_block(w, c, b, OP_DX, NULL)


cdef void _nthreads_one_combine(const Work *w) noexcept nogil:
    """_combine_item over every channel, on this thread."""
    cdef int64_t i
    for i in range((w.p.channels + COMBINE_CHUNK - 1) // COMBINE_CHUNK):
        _combine_item(w, i)


cdef void _pass(Work *w, int what) noexcept nogil:
    """One pass of a split schedule over every block of the plan."""
    w.what = what
    if w.s.kind == SCHED_LAST_SPLIT:
        run_split_items(w, _group_item)
    elif w.s.kind == SCHED_MAJOR_SWEEP:
        run_items(w, _group_item, w.s.items)
    else:
        run_items(w, _major_item, w.s.items)


# ---------------------------------------------------------------------------------------
# execute
# ---------------------------------------------------------------------------------------

cdef int execute(const Plan *p, const Schedule *s, const bnbw_kernel_table *k, char **ptr,
                 int op, double eps, double momentum, double count,
                 double *sums_io) noexcept nogil:
    """Carry out schedule `s` of plan `p` with the kernels `k` on the operands ptr[N_SLOTS]
    (NULL scale means 1, NULL beta 0, NULL mask no ReLU mask).  `count` is M of the formula (the
    global count in two-phase use); `momentum` weighs the forward's old running statistics.
    Returns 0, or -1 when out of memory (nothing written then)."""
    cdef char *slots[N_SLOTS]
    cdef char *temp[N_BIG]
    cdef char *given
    cdef int t, rc = 0
    memcpy(slots, ptr, N_SLOTS * sizeof(char *))
    if op & OP_FORWARD and not (op & OP_ADD_RESIDUAL):
        slots[S_DY] = slots[S_X]     # it reads x only, planned in dy's place (layout_of)
    for t in range(N_BIG):
        temp[t] = NULL             # all of them first: a failed allocation frees the ones before
    for t in range(N_BIG):
        if p.via_temp[t] and slots[t] != NULL:
            if t == S_DY and _same_operand(p, slots, ptr):
                slots[S_DY] = slots[S_X]      # the forward's x, gathered once
                continue
            temp[t] = <char *> malloc(p.temp_bytes[t])
            if temp[t] == NULL:
                rc = -1
                break
            given = slots[t]
            slots[t] = temp[t] - p.temp_low[t]
            if _is_input(t):
                _copy(p, s.nthreads, given, p.given_strides[t], slots[t], p.temp_strides[t],
                      itemsize(p.mask_dtype if t == S_MASK else p.big_dtype))
    if rc == 0:
        rc = _run(p, s, k, slots, op, eps, momentum, count, sums_io)
    for t in range(N_BIG):
        if temp[t] != NULL:
            if rc == 0 and not _is_input(t):
                _copy(p, s.nthreads, slots[t], p.temp_strides[t], ptr[t], p.given_strides[t],
                      itemsize(p.big_dtype))
            free(temp[t])
    return rc


cdef void _copy(const Plan *p, int nt, const char *src, const int64_t *src_strides, char *dst,
                const int64_t *dst_strides, int64_t size) noexcept nogil:
    """An operand into or out of its temporary, on the call's threads, each a run of its own."""
    cdef int64_t runs = copy_runs(p.ndim, p.sizes, src_strides, dst_strides)
    cdef int t
    if nt > runs:
        nt = <int> runs
    if nt <= 1:
        copy_strided(p.ndim, p.sizes, src, src_strides, dst, dst_strides, size, 0, runs)
        return
    for t in prange(nt, num_threads=nt, schedule='static', chunksize=1):
        copy_strided(p.ndim, p.sizes, src, src_strides, dst, dst_strides, size,
                     runs * t // nt, runs * (t + 1) // nt - runs * t // nt)


cdef inline bint _is_input(int t) noexcept nogil:
    """Whether a temporary holds what the kernels read (filled before the run) or what they
    write (emptied into the caller's operand after it)."""
    return t == S_X or t == S_DY or t == S_MASK


cdef bint _same_operand(const Plan *p, char **slots, char **ptr) noexcept nogil:
    """Whether dy's slot holds x itself (the forward's), so that x's temporary serves both."""
    cdef int d
    if not p.via_temp[S_X] or ptr[S_X] == NULL:
        return False
    for d in range(p.ndim):
        if p.given_strides[S_X][d] != p.given_strides[S_DY][d]:
            return False
    return slots[S_DY] == ptr[S_X]


cdef int _run(const Plan *p, const Schedule *s, const bnbw_kernel_table *k, char **ptr, int op,
              double eps, double momentum, double count, double *sums_io) noexcept nogil:
    """execute() on operands laid out as the plan visits them."""
    cdef int64_t C = p.channels, c
    cdef Work w
    cdef float *stats
    cdef double *sums
    cdef bint need_sums = op & OP_REDUCE
    cdef bint want_coef = (op & (OP_DX | OP_PARAMS)) != 0     # a reduce-only call needs none
    cdef bint again = False
    cdef int first
    cdef char *own = NULL
    if C == 0:
        return 0
    if not scratch_take(<int *> &p.scratch_taken):
        own = <char *> malloc(p.scratch_bytes)
        if own == NULL:
            return -1
    plan_scratch(p, own if own != NULL else p.scratch, &sums, &stats, &w.again, &w.partial)
    memset(sums, 0, 4 * C * sizeof(double))
    memset(w.again, 0, C)
    if poison_scratch:        # every item clears the block sums it adds to
        _fill_nan(w.partial, p.partial_stride * p.nblocks)
        for c in range(4 * C):
            stats[c] = <float> NAN
    w.p = p
    w.s = s
    w.kernels = k
    w.f = formula_of(op)
    w.x = ptr[S_X]
    w.dy = ptr[S_DY]
    w.dx = ptr[S_DX]
    w.mask = ptr[S_MASK]
    w.dres = ptr[S_DRES] if ptr[S_MASK] != NULL else NULL
    w.ptr = ptr
    w.mean = stats
    w.k1 = w.k = stats + C
    w.k2 = stats + 2 * C
    w.k3 = w.b = stats + 3 * C
    w.op = op
    w.relu = (BNBW_ADD_RELU if op & OP_ADD_RESIDUAL else
              BNBW_RELU if op & OP_RELU else 0)
    w.eps = eps
    w.count = count
    w.sums = sums
    w.dscale = w.batch_mean = sums + 2 * C
    w.dbias = w.batch_var = sums + 3 * C
    if op & OP_FORWARD and not (op & (OP_RETURN_SUMS | OP_GIVEN_SUMS)):
        _first_shifts(p, ptr[S_X], w.mean)
    else:                 # the mean, or the two-phase forward's shift
        _gather(&w, S_MEAN, 0, C, 0.0, w.mean)
    if op & OP_GIVEN_SUMS:
        memcpy(sums, sums_io, 2 * C * sizeof(double))
    if want_coef and (not applies_after_sums(op) or not need_sums):
        # frozen statistics, or given sums: the constants are known before any pass
        w.f.constants(&w, 0, C)

    if s.kind == SCHED_LAST_SLAB and s.apply_rows:
        run_items(&w, _group_sums_item, s.items)
        run_items(&w, _rows_item, s.nthreads)
    elif s.kind == SCHED_MAJOR_SWEEP_FUSED or s.kind == SCHED_LAST_SLAB:
        run_items(&w, _fused_group_item, s.items)
    elif s.kind == SCHED_MAJOR_CHANNEL_FUSED:
        run_items(&w, _fused_channel_item, s.items)
    elif s.kind != SCHED_NOTHING:
        first = OP_REDUCE if need_sums else 0
        if op & OP_DX and not applies_after_sums(op):
            first = first | OP_DX          # frozen: dx in the same pass as the sums
        if first:
            _pass(&w, first)
        if need_sums:
            # C x nblocks additions and C coefficients: in parallel over channels when they
            # are many (each channel's sums in block order, whatever runs them)
            if C * p.nblocks >= SERIAL_BELOW:
                run_items(&w, _combine_item, (C + COMBINE_CHUNK - 1) // COMBINE_CHUNK)
            else:
                _nthreads_one_combine(&w)
            for c in range(C):
                again = again or w.again[c]
            if again:      # forward sums taken again; settled channels sum the same terms
                _pass(&w, OP_REDUCE)
                for c in range(C):
                    if w.again[c]:
                        _combine(&w, c, c + 1)
                        w.f.constants(&w, c, c + 1)
        if op & OP_DX and applies_after_sums(op):
            if s.apply_rows:
                run_items(&w, _rows_item, s.nthreads)
            else:
                _pass(&w, OP_DX)
    elif want_coef and op & OP_TRAINING and need_sums:
        w.f.constants(&w, 0, C)    # nothing to read (M = 0): the coefficients of empty sums

    if op & OP_RETURN_SUMS:
        memcpy(sums_io, sums, 2 * C * sizeof(double))
    if op & OP_PARAMS:
        _scatter(&w, S_DSCALE, w.dscale)
        _scatter(&w, S_DBIAS, w.dbias)
    if op & OP_FORWARD and not (op & OP_RETURN_SUMS):
        _store_forward_statistics(&w, momentum)
    if own != NULL:
        free(own)
    else:
        scratch_give_back(<int *> &p.scratch_taken)
    return 0


cdef void _first_shifts(const Plan *p, const char *x, float *shift) noexcept nogil:
    """Where the forward sums each channel's terms around first: its element at index 0 of
    every reduced dim, a value of the batch (or 0 when it is not finite, or there is none)."""
    cdef int64_t c
    cdef float v
    cdef const float *plain = f32_channels(p, <char *> x, S_X, p.big_dtype)
    for c in range(p.channels):
        if p.count == 0:
            v = 0.0
        elif plain != NULL:
            v = plain[c]
        else:
            v = load_stat(x, p.big_dtype, chan_origin(p, S_X, c))
        shift[c] = v if v - v == 0 else 0.0


cdef void _store_forward_statistics(const Work *w, double momentum) noexcept nogil:
    """The batch mean and variance, and the running ones (bnbw_native._formulas), each rounded
    once.  An empty batch (M = 0) leaves the running statistics as they were and has zero
    batch statistics.  (A running statistic may be its old one's very view: each run of
    channels reads the old values before it writes the new.)"""
    cdef const Plan *p = w.p
    cdef int s, run, bat
    cdef int64_t r, c0, c, n, C = p.channels
    cdef float old[STAT_RUN]
    cdef double running[STAT_RUN]
    cdef double count = w.count
    cdef bint torch_running = (w.op & OP_TORCH_RUNNING) != 0
    cdef const double *batch
    cdef float *plain
    for s in range(2):
        batch = w.batch_mean if s == 0 else w.batch_var
        run = S_RUN_MEAN + s
        bat = S_BATCH_MEAN + s
        if count <= 0:
            for c in range(C):
                store_stat(w.ptr[bat], p.stat_dtype, chan_origin(p, bat, c), 0.0)
                memmove(w.ptr[run] + chan_origin(p, run, c),
                        w.ptr[S_MEAN + s] + chan_origin(p, S_MEAN + s, c),
                        itemsize(p.stat_dtype))
            continue
        _scatter(w, bat, batch)
        plain = f32_channels(p, w.ptr[run], run, p.stat_dtype)
        for r in range((C + STAT_RUN - 1) // STAT_RUN):
            c0 = r * STAT_RUN
            n = imin(STAT_RUN, C - c0)
            _gather(w, S_MEAN + s, c0, n, 0.0, old)
            for c in range(n):
                running[c] = running_statistic(old[c], batch[c0 + c], momentum, count,
                                               torch_running, s == 1)
            for c in range(n):
                if plain != NULL:
                    plain[c0 + c] = <float> running[c]
                else:
                    store_stat(w.ptr[run], p.stat_dtype, chan_origin(p, run, c0 + c),
                               running[c])
    if w.ptr[S_MEAN_LOW] != NULL:
        _store_mean_low(w)


cdef void _store_mean_low(const Work *w) noexcept nogil:
    """The batch mean's low part: what rounding it to the statistics' type left out, for a
    backward that centres on the exact mean (0 for an empty batch or a mean that is not
    finite)."""
    cdef const Plan *p = w.p
    cdef int64_t c
    cdef char rounded[8]
    cdef double m, low
    cdef float *plain = f32_channels(p, w.ptr[S_MEAN_LOW], S_MEAN_LOW, p.stat_dtype)
    if plain != NULL and w.count > 0:        # (the same rounding as store_stat's, in a plain loop)
        for c in range(p.channels):
            low = w.batch_mean[c] - <double> <float> w.batch_mean[c]
            plain[c] = <float> (low if low - low == 0 else 0.0)
        return
    for c in range(p.channels):
        m = w.batch_mean[c] if w.count > 0 else 0.0
        store_stat(rounded, p.stat_dtype, 0, m)
        low = m - <double> load_stat(rounded, p.stat_dtype, 0)
        store_stat(w.ptr[S_MEAN_LOW], p.stat_dtype, chan_origin(p, S_MEAN_LOW, c),
                   low if low - low == 0 else 0.0)
