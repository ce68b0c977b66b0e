# cython: language_level=3
"""The schedules: who visits which part of a plan, in which order, on which thread.

A call runs one named schedule, chosen by schedule_choose from the plan, what the call does,
the thread count and the machine's caches, and carried out by bnbw_native._execute.  Every
schedule adds the same block sums in the same order (the plan's fixed partition, each block
summed by one sequential function, block sums added in block order), so which schedule runs,
and on how many threads, never changes a bit.

    LAST_SPLIT           channel-last (NXC).  Items are (row block, channel slice): a reduce
                         pass writes each block's sums to its own partial arrays, the block sums
                         are combined per channel in block order (in parallel over channels),
                         then an apply pass.  Each thread takes a run of items holding an
                         equal share of the elements; slices are whole rows where such runs
                         balance, else whole 128-byte lines of a row, as wide as balances them.
                         Frozen statistics write dx in the reduce pass.
    LAST_SLAB            channel-last training (and the forward), one row block, or one thread
                         whose x and dy fit its L2: one item is a slab, a slice of whole lines
                         of every row, that it reduces block by block, combines and applies
                         while still cached, all in one parallel region (_slab).
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

Threads: a call takes one thread per thread_work_floor bytes it reads, at most those given
(docs/architecture.md, "Threads").
"""
from libc.stdint cimport int64_t

from bnbw_native._vocabulary cimport (
    Plan, DT_F32, DT_BF16, OP_REDUCE, OP_DX, OP_EXACT_SUMS, OP_FORWARD, SERIAL_BELOW, itemsize,
    imin, applies_after_sums)
from bnbw_native._headers cimport BNBW_EXACT_SUMS, BNBW_BLOCKS, BNBW_BLOCKS_EVEN_ODD

cdef enum:
    LINE = 128            # bytes: channel-last slices hold whole lines (and line pairs, which
                          # the L2 prefetchers fetch together) of each row
    ITEMS_PER_THREAD = 4  # channel-major sweeps: items per thread, for balance
    ROW_SHARE = 4096      # bytes: a page of a channel-last row (_row_block_threads)
    THIN_SHARE = 512      # bytes: the least share of a row a thread takes (128- and 256-byte
                          # shares ran slower on two threads than one)
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
# region (the team's wake-up, the barrier at its end) costs 1.5 us while the team spins and
# ~4 us once it sleeps, and a call opens up to three; one thread takes ~25 us over 128 KiB of
# a call (two passes from its cache): past that a second thread brings more than it costs
# (docs/architecture.md, "Threads").  Results never change (tests set it to 0, so that small
# inputs reach every team).
cdef int64_t thread_work_floor = 128 * 1024


def set_thread_work_floor(int64_t nbytes):
    """Bytes read per thread below which a call runs on fewer threads (0: as many as given,
    past SERIAL_BELOW elements, channel-last rows shared however thinly); returns the previous
    setting."""
    global thread_work_floor
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    previous = thread_work_floor
    thread_work_floor = nbytes
    return previous


cdef int64_t cache_share(int nthreads) noexcept nogil:
    """Bytes one of `nthreads` threads may keep for re-reading: its L2 and its part of the L3
    (shared by the CPUs that share it, or by the threads when there are more).  L2 and L3 add
    up: the L3s of the CPUs this package targets do not hold copies of the L2s' lines."""
    cdef int64_t sharers = cache_l3_sharers if cache_l3_sharers > nthreads else nthreads
    return cache_l2_bytes + cache_l3_bytes // sharers


cdef int64_t long_row_budget(int nthreads) noexcept nogil:
    """Bytes of x and dy one of `nthreads` threads groups when its channel-major rows are long
    (STREAM_ROW_MIN or more): its L2, and of the L3 a quarter of one CPU's part split among
    the threads, at most four L2s.  A group's first read comes from memory and its second from
    the caches; the larger the group, the fewer times a thread switches between the two, which
    a lone thread feels (the memory bus idles while it applies) and a team less (the others
    keep the bus busy, and groups that crowd the L3 together lose).  The four-L2 cap keeps
    the L3 part to what a core of its own would hold where the L3 is shared with cores the
    process cannot count (docs/benchmark-history.md, 5h and 8b)."""
    cdef int64_t l3_part = (cache_share(nthreads) - cache_l2_bytes) // (4 * nthreads)
    return cache_l2_bytes + imin(4 * cache_l2_bytes, l3_part)


SCHEDULE_NAMES = {0: "nothing", 1: "last-split", 2: "major-sweep", 3: "major-blocks",
                  4: "major-sweep-fused", 5: "major-channel-fused", 6: "last-slab"}
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


cdef inline double _work_before(const Plan *p, const Schedule *s, int64_t i) noexcept nogil:
    """Elements of the items before item i of LAST_SPLIT: row blocks in turn, each in its
    slices of s.group channels (the last block and the last slice may be shorter)."""
    cdef int64_t b = i // s.ngroups, g = i % s.ngroups
    cdef int64_t before = imin(b * p.block, p.count)
    cdef int64_t rows = imin(p.block, p.count - before)
    return <double> before * p.channels + <double> rows * imin(g * s.group, p.channels)


cdef int64_t first_item(const Plan *p, const Schedule *s, int t) noexcept nogil:
    """The first of thread t's items in LAST_SPLIT on s.nthreads threads: each item goes to the
    thread whose equal share of the elements holds its middle, so that threads take runs of
    items of equal work, however unequal the items (a short last block, a narrow last slice).
    Where that would leave a thread idle (items as large as a share), runs of equal counts.
    Which thread runs an item never changes a bit."""
    cdef int64_t lo = 0, hi = s.items, mid
    cdef int nt = s.nthreads
    cdef double total = <double> p.count * p.channels
    if t <= 0:
        return 0
    if t >= nt:
        return s.items
    if not s.weighted_runs:
        return t * s.items // nt
    while lo < hi:         # the first item whose middle lies in thread t's share or later
        mid = (lo + hi) // 2
        if (_work_before(p, s, mid) + _work_before(p, s, mid + 1)) * nt >= 2.0 * t * total:
            hi = mid
        else:
            lo = mid + 1
    return lo


cdef double run_elements(const Plan *p, const Schedule *s, int t) noexcept nogil:
    """Elements of thread t's run of items (first_item)."""
    return (_work_before(p, s, first_item(p, s, t + 1))
            - _work_before(p, s, first_item(p, s, t)))


cdef bint _balanced_work(const Plan *p, const Schedule *s) noexcept nogil:
    """Whether first_item's runs keep every thread busy and the busiest within an eighth of
    the mean."""
    cdef int t, nt = s.nthreads
    cdef double total = <double> p.count * p.channels, share
    for t in range(nt):
        share = run_elements(p, s, t)
        if share <= 0 or 8.0 * share * nt > 9.0 * total:
            return False
    return True


cdef void _slices(const Plan *p, Schedule *s, int64_t width) noexcept nogil:
    """Make the split's items (row block, slice of `width` channels)."""
    s.group = width
    s.ngroups = (p.channels + width - 1) // width
    s.items = p.nblocks * s.ngroups


cdef void _fit_threads(const Plan *p, Schedule *s) noexcept nogil:
    """No more threads than items; runs of equal counts where equal work would leave a
    thread idle."""
    cdef int t
    if s.nthreads > s.items:
        s.nthreads = <int> s.items if s.items > 0 else 1
    s.weighted_runs = True
    for t in range(s.nthreads):
        if run_elements(p, s, t) <= 0:
            s.weighted_runs = False
            break


cdef int _row_block_threads(const Plan *p, int nt, bint slices_written) noexcept nogil:
    """Threads for a call of one row block, which all take slices of the same rows at once:
    each THIN_SHARE bytes of a row at least.  Where they write their slices (the frozen dx,
    written in the pass that sums), as many as take a page each (ROW_SHARE), or the thin
    shares where that makes more than twice as many.  Threads writing slices of one page of
    the outputs at once drag its lines between their cores (the L2 prefetchers fetch ahead
    within a page): measured on two threads of the Xeon model 167 guest, two calls writing
    the two 512-byte halves of the same 1 KiB rows each ran 2.2-2.6x slower than alone, the
    4 KiB halves of 8 KiB rows 1.25x, about what calls writing rows of their own paid
    (1.1-1.4x; docs/benchmark-history.md, 7b).  An apply after the sums goes by runs of
    whole rows instead (apply_rows)."""
    cdef int64_t row = p.channels * itemsize(p.big_dtype)
    cdef int64_t paged = max(row // ROW_SHARE, 1), thin = max(row // THIN_SHARE, 1)
    if not slices_written or imin(nt, thin) > 2 * paged:
        return <int> imin(nt, thin)
    return <int> imin(nt, paged)


cdef int64_t _narrower(int64_t width, int64_t line) noexcept nogil:
    """The next width down: whole lines."""
    return (width - 1) // line * line if width % line else width - line


cdef bint _slab(const Plan *p, Schedule *s) noexcept nogil:
    """LAST_SLAB where it reads nothing the split would not: a call of one row block, whose
    rows the split cuts between threads alike (slabs then spare it a parallel region; on
    several threads the sums go by slices and the apply by runs of whole rows), or
    a call on one thread whose x and dy fit its L2 (one slab, applied newest block first,
    from the L2).  A slab cutting rows of several blocks between threads reads strided
    pieces where the split streams whole rows: measured up to 2x slower.  False leaves `s`
    to the split."""
    cdef int64_t C = p.channels, isz = itemsize(p.big_dtype)
    cdef int64_t line = LINE // isz, width
    cdef int nt = s.nthreads
    if p.nblocks > 1 and not (nt == 1 and 2 * isz * C * p.count <= cache_l2_bytes):
        return False
    width = imin(TILE, ((C + nt - 1) // nt + line - 1) // line * line)
    while width > line and not _balanced((C + width - 1) // width, nt):
        width -= line
    if width >= C:
        width = C
    if not _balanced((C + width - 1) // width, nt):
        return False
    s.kind = SCHED_LAST_SLAB
    s.group = width
    s.ngroups = (C + width - 1) // width
    s.items = s.ngroups
    # (one row block: threads writing slices thinner than a page of its rows at once slow each
    # other down, _row_block_threads; wider ones gain from applying their slices while they
    # are still in their caches)
    s.apply_rows = nt > 1 and width * isz < ROW_SHARE
    return True


cdef void _choose_last(const Plan *p, int op, Schedule *s) noexcept nogil:
    """LAST_SPLIT: items (row block, slice of whole lines), the threads' runs of them balanced
    by the elements they hold (first_item).  The row blocks are the plan's: the slice width
    never changes a sum (each channel is one lane of the kernels)."""
    cdef int64_t C = p.channels, isz = itemsize(p.big_dtype)
    cdef int64_t line = LINE // isz, width
    cdef bint sums = (op & OP_REDUCE) != 0
    s.partial_doubles = p.partial_stride * p.nblocks if sums else 0
    s.kind = SCHED_LAST_SPLIT
    # (Off with the floor: tests reach every team on small inputs.)
    if thread_work_floor > 0 and p.nblocks == 1:
        s.nthreads = _row_block_threads(p, s.nthreads,
                                        op & OP_DX and not applies_after_sums(op))
    if sums and op & OP_DX and applies_after_sums(op) and _slab(p, s):
        return
    # Whole rows where the threads' runs of blocks balance; else slices of whole lines, as
    # wide as balance them (a short last block weighs what it holds)
    s.weighted_runs = True
    width = imin(C, TILE)
    while True:
        _slices(p, s, width)
        if s.nthreads <= 1 or width <= line or _balanced_work(p, s):
            break
        width = _narrower(width, line)
    _fit_threads(p, s)
    # An apply after the sums goes by runs of whole rows where the items' runs would cut rows
    # between threads (slices thinner than a row) or leave them unequal
    s.apply_rows = (s.nthreads > 1 and op & OP_DX and applies_after_sums(op)
                    and (width < C or not _balanced_work(p, s)))


cdef void schedule_choose(const Plan *p, int op, int nthreads, Schedule *s) noexcept nogil:
    cdef int64_t C = p.channels
    cdef int64_t budget, most, g, paid
    # the bytes of the call's three big tensors, x, dy and dx (the forward's two count as three)
    cdef int64_t tensors = 3 * itemsize(p.big_dtype) * C * p.count
    cdef bint sums = (op & OP_REDUCE) != 0
    cdef bint dx = (op & OP_DX) != 0
    s.nthreads = nthreads if nthreads > 0 else 1
    s.sums = BNBW_EXACT_SUMS
    s.streaming = False
    s.stream_dx = False
    s.from_line = False
    s.group = 1
    s.ngroups = 0
    s.items = 0
    s.weighted_runs = False
    s.apply_rows = False
    s.partial_doubles = 0
    if p.empty or not (sums or dx):
        s.kind = SCHED_NOTHING
        s.nthreads = 1
        return
    s.sums = _sum_mode(p, op)
    # dx past the caches when the call's big tensors cannot stay in them anyway (its lines
    # then skip the read for ownership a cached store pays), in channel-major rows long enough
    # that the partial lines at their ends, stored plainly, are few.  Channel-last slices are
    # not streamed: measured, a wash at best (docs/benchmark-history.md, 4c)
    s.stream_dx = (dx and p.big_dtype == DT_F32 and not p.channel_last and stream_policy != 0
                   and (stream_policy == 1
                        or (4 * p.inner_size >= STREAM_ROW_MIN
                            and tensors > cache_l3_bytes + s.nthreads * cache_l2_bytes)))
    if C * p.count < SERIAL_BELOW:
        s.nthreads = 1
    elif thread_work_floor > 0:
        paid = (itemsize(p.big_dtype) * C * p.count * (1 if op & OP_FORWARD else 2)
                // thread_work_floor)
        if s.nthreads > paid:
            s.nthreads = <int> paid if paid > 1 else 1
    # How the kernels walk channel-last rows depends on where the rows come from, and only
    # the threads' own L2s are taken to hold them: inside a model a batch norm's tensors were
    # last touched layers earlier, so they come from memory even where they would fit the L3.
    # From memory rows go one at a time (`streaming`), the order the prefetchers follow, and
    # rows starting inside a line are walked as they lie; within the L2s, rows go four at a
    # time and from x's first line (`from_line`: straddling loads cost in the caches).
    # Measured in converted ResNets on a 2-core Zen 4 guest, the batch norms' native calls
    # took 0.85-1.01 of their time under the L3 rule of before; repeated on the same arrays,
    # the calls this moves run up to 17% slower (docs/benchmark-history.md, 8a)
    s.from_line = p.channel_last and tensors <= s.nthreads * cache_l2_bytes
    s.streaming = p.channel_last and not s.from_line
    if p.channel_last:
        _choose_last(p, op, s)
        return
    s.items = C * p.nblocks
    if s.nthreads > s.items:
        s.nthreads = <int> s.items if s.items > 0 else 1
    if sums and dx and applies_after_sums(op) and C >= 2 * s.nthreads:
        if p.whole_rows:
            s.kind = SCHED_MAJOR_SWEEP_FUSED
            # channels per item: as many as keep the group's x and dy within this thread's
            # share of the cache (FUSE_MIN at least), and at least two items per thread.
            # Rows of STREAM_ROW_MIN bytes or more are streams of their own, read from memory:
            # their groups take less of the L3 (long_row_budget)
            budget = (long_row_budget(s.nthreads)
                      if p.inner_size * itemsize(p.big_dtype) >= STREAM_ROW_MIN
                      else cache_share(s.nthreads))
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
            s.partial_doubles = p.partial_stride * p.nblocks
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
    s.partial_doubles = p.partial_stride * p.nblocks if sums else 0
