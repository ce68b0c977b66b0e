# cython: language_level=3
"""The schedules: who visits which part of a plan, in which order, on which thread.

A call runs one named schedule, chosen by schedule_choose from the plan, what the call does
and the thread count, and carried out by execute().  Every schedule adds the same block sums
in the same order (the plan's fixed partition, each block summed by one sequential function,
block sums added in block order), so which schedule runs, and on how many threads, never
changes a bit.

    LAST_SPLIT           channel-last (NXC).  Items are (row block, channel slice): a reduce
                         pass writes each block's sums to its own partial arrays, the block sums
                         are combined per channel in block order (in parallel over channels),
                         then an apply pass.  Slices are whole 128-byte lines of a row, as wide
                         as leaves about four items per thread.  Frozen statistics write dx in
                         the reduce pass.
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
                         of the cache).
    MAJOR_CHANNEL_FUSED  the same with rows longer than a block, one channel per item.

Every operand reaches the kernels of bnbw_kernels.h where it lies, with its own step in
elements (validation guarantees aligned elements and whole-element strides), the ReLU mask
included.  Channel-major rows go to the kernels in pieces of at most TILE elements cut at the
same places on every schedule, so that where a kernel call starts never changes a sum.
"""
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, calloc, free
from libc.math cimport NAN
from libc.string cimport memcpy, memmove, memset
from cython.parallel cimport prange

from bnbw_native._vocabulary cimport (
    Plan, MAX_DIMS, N_BIG, N_SLOTS, S_X, S_DY, S_DX, S_MASK, S_DRES, S_MEAN, S_VAR, S_SCALE,
    S_DSCALE, S_DBIAS, DT_F32, DT_BF16, OP_REDUCE, OP_GIVEN_SUMS, OP_TRAINING, OP_DX,
    OP_PARAMS, OP_RETURN_SUMS, OP_EXACT_SUMS, SERIAL_BELOW, itemsize, imin, chan_origin,
    S_BETA, S_RUN_MEAN, S_BATCH_MEAN, OP_FORWARD, OP_RELU, OP_TORCH_RUNNING, row_origin,
    load_stat, store_stat, coefficients, forward_coefficients, forward_recentre, bnbw_io,
    bnbw_run, bnbw_kernel_table, BNBW_NO_MASK, BNBW_EXACT_SUMS, BNBW_BLOCKS, BNBW_BLOCKS_EVEN_ODD)

cdef enum:
    TILE = 2048           # channel-major rows reach the kernels in pieces of at most this many
                          # elements; channel-last items span at most this many channels
    LINE = 128            # bytes: channel-last slices hold whole lines (and line pairs, which
                          # the L2 prefetchers fetch together) of each row
    ITEMS_PER_THREAD = 4  # split schedules: items per thread, for balance
    COMBINE_CHUNK = 256   # channels per parallel item of the combine
    FUSE_MIN = 1 << 19    # fused: a group never gets less than this (x and dy)
    STREAM_ROW_MIN = 8192 # bytes: the shortest channel-major dx row written past the caches

cdef extern from "bnbw_caches.h":
    long bnbw_cache_bytes(int level) nogil
    long bnbw_l3_sharers() nogil

# The machine's caches, read once (where the OS does not say: a common 1 MiB L2, 32 MiB L3).
cache_l2_bytes = bnbw_cache_bytes(2) or (1 << 20)
cache_l3_bytes = bnbw_cache_bytes(3) or (32 << 20)
cache_l3_sharers = bnbw_l3_sharers()


def cache_model():
    """(L2 bytes per core, L3 bytes, CPUs sharing the L3) as the schedules assume them."""
    return cache_l2_bytes, cache_l3_bytes, cache_l3_sharers


def set_cache_model(l2, l3, sharers):
    """Make the schedules assume other caches (tests, benchmarks); results never change."""
    global cache_l2_bytes, cache_l3_bytes, cache_l3_sharers
    cache_l2_bytes, cache_l3_bytes, cache_l3_sharers = l2, l3, sharers


# Streaming dx: "auto" follows the rule in schedule_choose; "never" and "always" are for tests
# and benchmarks (results never change).
cdef int stream_policy = -1
STREAM_POLICIES = {"auto": -1, "never": 0, "always": 1}


def set_stream_policy(str policy):
    """Whether f32 dx is written past the caches: "auto", "never" or "always"; returns the
    previous policy."""
    global stream_policy
    previous = {v: k for k, v in STREAM_POLICIES.items()}[stream_policy]
    stream_policy = STREAM_POLICIES[policy]
    return previous


# Threads that pay for themselves: a call takes one thread per this many bytes of the big
# tensors it reads (x, and dy in the backward), at most the threads it was given.  A parallel
# region costs ~5-15 us (team wake-up, the barrier at its end; measured on 2-core KVM guests),
# about what one core takes to read 512 KiB from its L2 twice: below that a second thread
# costs more than it brings.  Results never change (tests set it to 0, so that small inputs
# reach every team).
cdef int64_t thread_work_floor = 512 * 1024


def set_thread_work_floor(int64_t nbytes):
    """Bytes read per thread below which a call runs on fewer threads (0: as many as given,
    past SERIAL_BELOW elements); returns the previous setting."""
    global thread_work_floor
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    previous = thread_work_floor
    thread_work_floor = nbytes
    return previous


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


cdef int64_t cache_share(int nthreads) noexcept nogil:
    """Bytes one of `nthreads` threads may keep for re-reading: its L2 and its part of the L3
    (shared by the CPUs that share it, or by the threads when there are more).  L2 and L3 add
    up: the L3s of the CPUs this package targets do not hold copies of the L2s' lines."""
    cdef int64_t sharers = cache_l3_sharers if cache_l3_sharers > nthreads else nthreads
    return cache_l2_bytes + cache_l3_bytes // sharers

SCHEDULE_NAMES = {0: "nothing", 1: "last-split", 2: "major-sweep", 3: "major-blocks",
                  4: "major-sweep-fused", 5: "major-channel-fused"}
TILE_ELEMENTS = TILE


# ---------------------------------------------------------------------------------------
# Choosing
# ---------------------------------------------------------------------------------------

cdef int _sum_mode(const Plan *p, int op) noexcept nogil:
    """f16 and bf16 sums go through f32 blocks (a half's own precision is far coarser, and
    widening every term costs more than reading it), bf16 in the lane order it loads
    cheapest.  A block must span the same terms on every schedule: channel-major rows are cut
    alike everywhere (row_span), and channel-last calls hold whole blocks - except rows that do
    not share one stride, which go to the kernels one at a time and so keep f64 terms."""
    if (op & (OP_EXACT_SUMS | OP_FORWARD) or p.big_dtype == DT_F32
            or (p.channel_last and p.n_outer > 1)):
        return BNBW_EXACT_SUMS
    return BNBW_BLOCKS_EVEN_ODD if p.big_dtype == DT_BF16 else BNBW_BLOCKS


cdef bint _balanced(int64_t items, int nt) noexcept nogil:
    """Whether `items` equal items handed out to `nt` threads keep each one busy and the
    busiest within an eighth of the mean (5 items on 2 threads are not: 3 against 2.5)."""
    return items >= nt and 8 * ((items + nt - 1) // nt) * nt <= 9 * items


cdef void _choose_last(const Plan *p, int op, Schedule *s) noexcept nogil:
    """LAST_SPLIT with slices of whole lines leaving about ITEMS_PER_THREAD balanced items per
    thread.  The row blocks are the plan's: the slice width never changes a sum (each channel
    is one lane of the kernels)."""
    cdef int64_t C = p.channels, isz = itemsize(p.big_dtype)
    cdef int64_t line = LINE // isz, width
    cdef int nt = s.nthreads
    cdef bint sums = (op & OP_REDUCE) != 0
    s.partial_doubles = s.partial_stride * p.nblocks if sums else 0
    s.kind = SCHED_LAST_SPLIT
    width = imin(C, TILE)
    if nt > 1 and p.nblocks * ((C + width - 1) // width) < ITEMS_PER_THREAD * nt:
        width = (C * p.nblocks + ITEMS_PER_THREAD * nt - 1) // (ITEMS_PER_THREAD * nt)
        width = (width + line - 1) // line * line
        width = imin(imin(width, C), TILE)
        while width > line and not _balanced(p.nblocks * ((C + width - 1) // width), nt):
            width -= line
    s.group = width
    s.ngroups = (C + width - 1) // width
    s.items = p.nblocks * s.ngroups
    if s.nthreads > s.items:
        s.nthreads = <int> s.items if s.items > 0 else 1


cdef void schedule_choose(const Plan *p, int op, int nthreads, Schedule *s) noexcept nogil:
    cdef int64_t C = p.channels
    cdef int64_t budget, most, g, paid
    cdef bint sums = (op & OP_REDUCE) != 0
    cdef bint dx = (op & OP_DX) != 0
    s.nthreads = nthreads if nthreads > 0 else 1
    s.sums = BNBW_EXACT_SUMS
    s.streaming = False
    s.stream_dx = False
    s.group = 1
    s.ngroups = 0
    s.items = 0
    s.partial_doubles = 0
    s.partial_stride = (2 * C + 7) // 8 * 8
    if p.empty or not (sums or dx):
        s.kind = SCHED_NOTHING
        s.nthreads = 1
        return
    s.sums = _sum_mode(p, op)
    s.streaming = 2 * itemsize(p.big_dtype) * C * p.count > cache_l2_bytes
    # dx past the caches when the call's big tensors cannot stay in them anyway (its lines
    # then skip the read for ownership a cached store pays), in channel-major rows long enough
    # that the partial lines at their ends, stored plainly, are few.  Channel-last slices are
    # not streamed: measured, a wash at best (docs/benchmark-history.md, 4c)
    s.stream_dx = (dx and p.big_dtype == DT_F32 and not p.channel_last and stream_policy != 0
                   and (stream_policy == 1
                        or (4 * p.inner_size >= STREAM_ROW_MIN
                            and 3 * 4 * C * p.count > cache_l3_bytes + s.nthreads * cache_l2_bytes)))
    if C * p.count < SERIAL_BELOW:
        s.nthreads = 1
    elif thread_work_floor > 0:
        paid = (itemsize(p.big_dtype) * C * p.count * (1 if op & OP_FORWARD else 2)
                // thread_work_floor)
        if s.nthreads > paid:
            s.nthreads = <int> paid if paid > 1 else 1
    if p.channel_last:
        _choose_last(p, op, s)
        return
    s.items = C * p.nblocks
    if s.nthreads > s.items:
        s.nthreads = <int> s.items if s.items > 0 else 1
    if sums and dx and op & OP_TRAINING and C >= 2 * s.nthreads:
        if p.whole_rows:
            s.kind = SCHED_MAJOR_SWEEP_FUSED
            # channels per item: as many as keep the group's x and dy within this thread's
            # share of the cache (FUSE_MIN at least), and at least two items per thread
            budget = cache_share(s.nthreads)
            if budget < FUSE_MIN:
                budget = FUSE_MIN
            g = budget // (2 * itemsize(p.big_dtype) * p.count)
            most = (C + 2 * s.nthreads - 1) // (2 * s.nthreads)
            g = most if g > most else g
            while g > 1 and not _balanced((C + g - 1) // g, s.nthreads):
                g -= 1
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
    const bnbw_kernel_table *k
    char *x
    char *dy
    char *dx
    char *mask            # NULL: no ReLU mask
    char *dres            # NULL: no residual gradient to write
    char **ptr            # every slot (statistics read by the fused coefficients)
    float *mean           # [C] f32: the mean; the forward's shift, then fl32(mean)
    float *k1             # [C] f32 coefficients (the forward: k in k1, b in k3)
    float *k2
    float *k3
    unsigned char *again  # [C] the forward: channels whose sums are taken again
    int op
    int what              # this pass: OP_REDUCE and/or OP_DX
    int relu              # the forward's y through a ReLU
    double eps
    double count
    double *sums          # [C][2] channel sums
    double *dscale        # [C] f64: dscale; the forward's batch mean
    double *dbias         # [C] f64: dbias; the forward's batch variance
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


# ---------------------------------------------------------------------------------------
# The operands of one kernel call
# ---------------------------------------------------------------------------------------

cdef inline void io_start(const Work *w, bnbw_io *io) noexcept nogil:
    """The parts of a kernel call every row shares: storage types, which operands it has."""
    io.dt = w.p.big_dtype
    io.stream_dx = w.s.stream_dx
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
    cdef float mean = w.mean[c]
    io_start(w, &io)
    io_steps(w, &io, p.inner_stride)
    while col < end:
        seg_end = imin((col // TILE + 1) * TILE, end)
        n = seg_end - col
        for t in range(N_BIG):
            at[t] = chan_origin(p, t, c) + off[t] + col * p.inner_stride[t]
        io_at(w, &io, at, what)
        if what & OP_REDUCE:
            if w.op & OP_FORWARD:
                w.k.stats_row(&io, n, mean, part)
            else:
                w.k.reduce_row(&io, n, mean, part, w.s.sums)
            sums[0] += part[0]
            sums[1] += part[1]
        if what & OP_DX:
            if w.op & OP_FORWARD:
                w.k.normalize_row(&io, n, mean, w.k1[c], w.k3[c], w.relu)
            elif w.op & OP_TRAINING:
                w.k.apply_row(&io, n, mean, w.k1[c], w.k2[c], w.k3[c])
            else:
                w.k.scale_row(&io, n, w.k1[c])
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


cdef void sweep_block(const Work *w, int64_t b, int64_t c_lo, int64_t c_hi, int what) noexcept nogil:
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
        if w.op & OP_FORWARD:
            w.k.stats_row_run(&io, &run, L, w.mean + c_lo, sums, 2)
        else:
            w.k.reduce_row_run(&io, &run, L, w.mean + c_lo, sums, 2, w.s.sums)
    if what & OP_DX:
        if w.op & OP_FORWARD:
            w.k.normalize_row_run(&io, &run, L, w.mean + c_lo, w.k1 + c_lo, w.k3 + c_lo, w.relu)
        elif w.op & OP_TRAINING:
            w.k.apply_row_run(&io, &run, L, w.mean + c_lo, w.k1 + c_lo, w.k2 + c_lo,
                              w.k3 + c_lo)
        else:
            w.k.scale_row_run(&io, &run, L, w.k1 + c_lo)


# ---------------------------------------------------------------------------------------
# Channel-last items
# ---------------------------------------------------------------------------------------

cdef void last_block(const Work *w, int64_t rb, int64_t grp, int what, double *sum_g,
                     double *sum_xg) noexcept nogil:
    """Row block rb, channel group grp: the block's rows in one kernel call when they share
    one stride, else one at a time.  Sums accumulate row by row, in row order, into the
    block's own partial arrays, which a reduce clears first (a forward's second pass reuses
    them)."""
    cdef const Plan *p = w.p
    cdef int64_t c0 = grp * w.s.group
    cdef int64_t width = imin(w.s.group, p.channels - c0)
    cdef int64_t r0 = rb * p.block, nr, t
    cdef int64_t r_end = imin((rb + 1) * p.block, p.count)
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
            if w.op & OP_FORWARD:
                w.k.stats_rows(&io, nr, width, w.mean + c0, sum_g + c0, sum_xg + c0,
                               w.s.streaming)
            else:
                w.k.reduce_rows(&io, nr, width, w.mean + c0, sum_g + c0, sum_xg + c0,
                                w.s.streaming, w.s.sums)
        if what & OP_DX:
            if w.op & OP_FORWARD:
                w.k.normalize_rows(&io, nr, width, w.mean + c0, w.k1 + c0, w.k3 + c0, w.relu)
            elif w.op & OP_TRAINING:
                w.k.apply_rows(&io, nr, width, w.mean + c0, w.k1 + c0, w.k2 + c0, w.k3 + c0)
            else:
                w.k.scale_rows(&io, nr, width, w.k1 + c0)
        r0 += nr


# ---------------------------------------------------------------------------------------
# The items of each schedule
# ---------------------------------------------------------------------------------------

cdef inline double *block_sums(const Work *w, int64_t b) noexcept nogil:
    """Block b's sums: whole 64-byte lines of their own, so that threads summing different
    blocks never write to one line (channel-last: Sum dy of every channel, then Sum (x - mean)
    dy; channel-major: the two sums of each channel in turn)."""
    return w.partial + b * w.s.partial_stride


cdef void _last_item(const Work *w, int64_t i) noexcept nogil:
    cdef const Plan *p = w.p
    cdef double *sums = NULL
    if w.what & OP_REDUCE:
        sums = block_sums(w, i // w.s.ngroups)
    last_block(w, i // w.s.ngroups, i % w.s.ngroups, w.what, sums,
               sums + p.channels if sums != NULL else NULL)


cdef void _sweep_item(const Work *w, int64_t i) noexcept nogil:
    sweep_block(w, i // w.s.ngroups, (i % w.s.ngroups) * w.s.group,
                imin(w.p.channels, (i % w.s.ngroups + 1) * w.s.group), w.what)


cdef void _major_item(const Work *w, int64_t i) noexcept nogil:
    cdef int64_t c = i // w.p.nblocks, b = i % w.p.nblocks
    major_block(w, c, b, w.what,
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


cdef inline float _stat(const Work *w, int slot, int64_t c, float absent) noexcept nogil:
    """Channel c's value of a per-channel slot, or `absent` when the call has none."""
    if w.ptr[slot] == NULL:
        return absent
    return load_stat(w.ptr[slot], w.p.stat_dtype, chan_origin(w.p, slot, c))


cdef void _channel_coefficients(const Work *w, int64_t c) noexcept nogil:
    if w.op & OP_FORWARD:
        forward_coefficients(w.mean[c], w.sums[2 * c], w.sums[2 * c + 1], w.count,
                             _stat(w, S_SCALE, c, 1.0), _stat(w, S_BETA, c, 0.0), w.eps,
                             &w.mean[c], &w.k1[c], &w.k3[c], &w.dscale[c], &w.dbias[c])
        return
    coefficients(w.op, w.sums[2 * c], w.sums[2 * c + 1], w.count, _stat(w, S_VAR, c, 1.0),
                 _stat(w, S_SCALE, c, 1.0), w.eps, &w.k1[c], &w.k2[c], &w.k3[c],
                 &w.dscale[c], &w.dbias[c])


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
    for c in range(i * COMBINE_CHUNK, imin(w.p.channels, (i + 1) * COMBINE_CHUNK)):
        _combine(w, c)
        if not _settled(w, c):
            w.again[c] = True
        elif w.op & (OP_DX | OP_PARAMS):
            _channel_coefficients(w, c)


cdef void _fused_group_item(const Work *w, int64_t g) noexcept nogil:
    """MAJOR_SWEEP_FUSED: reduce channels [c_lo, c_hi) in memory order, finish their sums and
    coefficients, then apply them while their rows are still cached."""
    cdef const Plan *p = w.p
    cdef int64_t b, c
    cdef int64_t c_lo = g * w.s.group
    cdef int64_t c_hi = imin(p.channels, c_lo + w.s.group)
    cdef bint again = False
    for b in range(p.nblocks):
        sweep_block(w, b, c_lo, c_hi, OP_REDUCE)
    for c in range(c_lo, c_hi):
        _combine(w, c)
        again = not _settled(w, c) or again
    if again:          # settled channels sum the same terms again: the same bits
        for b in range(p.nblocks):
            sweep_block(w, b, c_lo, c_hi, OP_REDUCE)
        for c in range(c_lo, c_hi):
            _combine(w, c)
    for c in range(c_lo, c_hi):
        _channel_coefficients(w, c)
    for b in range(p.nblocks - 1, -1, -1):     # newest blocks first: they are still cached
        sweep_block(w, b, c_lo, c_hi, OP_DX)


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
    _channel_coefficients(w, c)
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
        run_items(w, _last_item, w.s.items)
    elif w.s.kind == SCHED_MAJOR_SWEEP:
        run_items(w, _sweep_item, w.s.items)
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
    cdef int t, rc = 0
    memcpy(slots, ptr, N_SLOTS * sizeof(char *))
    for t in range(N_BIG):
        temp[t] = NULL             # all of them first: a failed allocation frees the ones before
    for t in range(N_BIG):
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
        rc = _run(p, s, k, slots, op, eps, momentum, count, sums_io)
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


cdef int _run(const Plan *p, const Schedule *s, const bnbw_kernel_table *k, char **ptr, int op,
              double eps, double momentum, double count, double *sums_io) noexcept nogil:
    """execute() on operands laid out as the plan visits them."""
    cdef int64_t C = p.channels, c
    cdef Work w
    cdef float *stats = NULL
    cdef double *sums = NULL
    cdef bint need_sums = op & OP_REDUCE
    cdef bint want_coef = (op & (OP_DX | OP_PARAMS)) != 0     # a reduce-only call needs none
    cdef bint again = False
    cdef int first
    cdef double *partial_memory = NULL
    if C == 0:
        return 0
    stats = <float *> malloc(4 * C * sizeof(float))
    sums = <double *> calloc(4 * C, sizeof(double))
    w.again = <unsigned char *> calloc(C, 1)
    w.partial = NULL
    if s.kind != SCHED_NOTHING and s.partial_doubles:
        # every item clears the block sums it adds to: no zeroing here
        partial_memory = <double *> malloc((s.partial_doubles + 8) * sizeof(double))
        w.partial = <double *> ((<size_t> partial_memory + 63) & ~(<size_t> 63))
    if (stats == NULL or sums == NULL or w.again == NULL
            or (s.kind != SCHED_NOTHING and s.partial_doubles and partial_memory == NULL)):
        free(stats)
        free(sums)
        free(w.again)
        free(partial_memory)
        return -1
    if poison_scratch:
        _fill_nan(<double *> partial_memory, s.partial_doubles + 8 if partial_memory else 0)
        for c in range(4 * C):
            stats[c] = <float> NAN
    w.p = p
    w.s = s
    w.k = k
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
    w.relu = (op & OP_RELU) != 0
    w.eps = eps
    w.count = count
    w.sums = sums
    w.dscale = sums + 2 * C
    w.dbias = sums + 3 * C
    for c in range(C):
        if op & OP_FORWARD and not (op & (OP_RETURN_SUMS | OP_GIVEN_SUMS)):
            w.mean[c] = _first_shift(p, ptr, c)
        else:             # the mean, or the two-phase forward's shift
            w.mean[c] = load_stat(ptr[S_MEAN], p.stat_dtype, chan_origin(p, S_MEAN, c))
    if op & OP_GIVEN_SUMS:
        memcpy(sums, sums_io, 2 * C * sizeof(double))
    if want_coef and (not (op & OP_TRAINING) or not need_sums):
        # frozen statistics, or given sums: the constants are known before any pass
        for c in range(C):
            _channel_coefficients(&w, c)

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
                        _combine(&w, c)
                        _channel_coefficients(&w, c)
        if op & OP_DX and op & OP_TRAINING:
            _pass(&w, OP_DX)
    elif want_coef and op & OP_TRAINING and need_sums and not (op & OP_FORWARD):
        for c in range(C):         # nothing to read (M = 0): the coefficients of empty sums
            _channel_coefficients(&w, c)

    if op & OP_RETURN_SUMS:
        memcpy(sums_io, sums, 2 * C * sizeof(double))
    if op & OP_PARAMS:
        for c in range(C):
            store_stat(ptr[S_DSCALE], p.stat_dtype, chan_origin(p, S_DSCALE, c), w.dscale[c])
            store_stat(ptr[S_DBIAS], p.stat_dtype, chan_origin(p, S_DBIAS, c), w.dbias[c])
    if op & OP_FORWARD and not (op & OP_RETURN_SUMS):
        for c in range(C):
            _store_forward_statistics(&w, c, momentum)
    free(partial_memory)
    free(stats)
    free(sums)
    free(w.again)
    return 0


cdef float _first_shift(const Plan *p, char **ptr, int64_t c) noexcept nogil:
    """Where the forward sums channel c's terms around first: its element at index 0 of every
    reduced dim, a value of the batch (or 0 when it is not finite, or there is none)."""
    cdef float v
    if p.count == 0:
        return 0.0
    v = load_stat(ptr[S_X], p.big_dtype, chan_origin(p, S_X, c))
    return v if v - v == 0 else 0.0


cdef void _store_forward_statistics(const Work *w, int64_t c, double momentum) noexcept nogil:
    """The batch mean and variance, and the running ones: momentum * old + (1 - momentum) *
    batch in f64, each rounded once (OP_TORCH_RUNNING: (1 - momentum) * old + momentum *
    batch, the variance unbiased).  An empty batch (M = 0) leaves the running statistics as
    they were and has zero batch statistics."""
    cdef const Plan *p = w.p
    cdef int s, old
    cdef double batch, run, keep = momentum, take = 1.0 - momentum
    cdef int64_t isz = itemsize(p.stat_dtype)
    if w.op & OP_TORCH_RUNNING:
        keep, take = 1.0 - momentum, momentum
    for s in range(2):
        batch = (w.dscale if s == 0 else w.dbias)[c] if w.count > 0 else 0.0
        store_stat(w.ptr[S_BATCH_MEAN + s], p.stat_dtype, chan_origin(p, S_BATCH_MEAN + s, c),
                   batch)
        old = S_MEAN + s
        if w.count > 0:
            run = batch
            if s == 1 and w.op & OP_TORCH_RUNNING and w.count > 1:
                run = batch * (w.count / (w.count - 1.0))
            store_stat(w.ptr[S_RUN_MEAN + s], p.stat_dtype, chan_origin(p, S_RUN_MEAN + s, c),
                       keep * load_stat(w.ptr[old], p.stat_dtype, chan_origin(p, old, c))
                       + take * run)
        else:
            memmove(w.ptr[S_RUN_MEAN + s] + chan_origin(p, S_RUN_MEAN + s, c),
                    w.ptr[old] + chan_origin(p, old, c), isz)
