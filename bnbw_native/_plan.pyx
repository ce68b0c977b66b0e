# cython: language_level=3
"""Plans: how a call's tensors are visited, from their sizes and strides alone.

A plan canonicalises the index space: size-1 dims are dropped, the reduced dims of x that are
negative in x and dy alike are flipped, sorted outermost-first by x's stride and merged where
every big tensor allows.  "Channel-last" when the channels are the unit-stride inner dim of
every big tensor (NXC); otherwise "channel-major" (NCX and every general strided case) with the
innermost reduced dim as the row.  Each channel's reduction is then cut into fixed blocks (of
BLOCK elements, or of rows of channels) that never depend on the thread count.

The visiting order of x and dy decides how the sums round, so it depends on x and dy only: an
output (dx, the residual gradient) or a mask whose layout would change it goes through a dense
temporary laid out like x instead (built here, filled and emptied by the schedules' execute),
and so does one whose elements along a row lie a cache line or more apart (an NXC dx of an NCX
x): the kernels would reach each of them as a line of its own, the copy reaches them in its
own memory order.
Where x's channels are its innermost dim but not at unit stride (a view of every other channel,
channels reversed), x, and dy unless its channels already lie at unit stride, are read from
dense channel-last temporaries (gathered; the same bits as a dense channel-last call): visited in
place, each channel's elements would lie a row apart, one cache line read per element.
Everything here runs without the GIL and touches no Python object, so the C API plans too.
"""
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

from bnbw_native._vocabulary cimport (
    Layout, Plan, MAX_DIMS, N_BIG, N_SLOTS, S_X, S_DY, itemsize)
from bnbw_native._headers cimport BNBW_BLOCK_ROWS

cdef enum:
    SCRATCH_PER_CHANNEL = 49   # bytes: 4 sums (f64), 4 floats (f32), a flag (plan_scratch)
    BLOCK = 32768         # channel-major: elements per reduction block
    LAST_BLOCK = 131072   # channel-last: elements per block, in whole multiples of the
                          # kernels' f32 blocks of halves (BNBW_BLOCK_ROWS rows, bnbw_kernels.h)
    LAST_MIN_ROWS = 128   # ... and at least this many rows: the blocks' sums (16 bytes per
                          # channel) stay within 1/64 of x and dy (f32)
    LAST_MAX_ROWS = 1024  # ... and at most this many: narrow rows still make blocks enough
                          # for many threads
    SCATTERED_STRIDE = 64 # bytes: an output, mask or residual gradient whose elements lie this
                          # far apart along a row goes through a temporary (_scattered)

BLOCK_ELEMENTS = BLOCK


cdef int plan_build(Plan *p, const Layout *l) noexcept nogil:
    """Fill `p` (plan_free releases it) for the validated layout `l`, its scratch allocated.
    Returns 0, or -1 when out of memory."""
    if _build(p, l) != 0:
        return -1
    p.partial_stride = (2 * p.channels + 7) // 8 * 8
    p.scratch_bytes = (SCRATCH_PER_CHANNEL * p.channels + 64
                       + p.partial_stride * p.nblocks * sizeof(double))
    p.scratch = <char *> malloc(p.scratch_bytes)
    if p.scratch == NULL:
        plan_free(p)
        return -1
    return 0


cdef void plan_scratch(const Plan *p, char *memory, double **sums, float **floats,
                       unsigned char **flags, double **partial) noexcept nogil:
    """The parts of execute's scratch at `memory` (p.scratch_bytes of it): the channels' sums
    (4 f64 each), their floats (4 f32), their flags (1 byte), then the block sums from a 64-byte
    boundary on."""
    cdef int64_t C = p.channels
    sums[0] = <double *> memory
    floats[0] = <float *> (memory + 32 * C)
    flags[0] = <unsigned char *> (memory + 48 * C)
    partial[0] = <double *> ((<size_t> (memory + 49 * C) + 63) & ~(<size_t> 63))


cdef inline void _copy_run(char *dst, int64_t ds, const char *src, int64_t ss, int64_t n,
                           int64_t size) noexcept nogil:
    """n elements of `size` bytes, a stride apart on each side (moves of a fixed size: one
    load and one store an element)."""
    cdef int64_t k
    if size == 4:
        for k in range(n):
            memcpy(dst + k * ds, src + k * ss, 4)
    elif size == 2:
        for k in range(n):
            memcpy(dst + k * ds, src + k * ss, 2)
    elif size == 1:
        for k in range(n):
            dst[k * ds] = src[k * ss]
    else:
        for k in range(n):
            memcpy(dst + k * ds, src + k * ss, size)


cdef void _outermost_first(const int64_t *strides, int *order, int n) noexcept nogil:
    """Sorts the n dims in `order` by |stride|, largest first (stable: their order on ties)."""
    cdef int i, j, tmp
    for i in range(1, n):
        j = i
        while j > 0 and _abs(strides[order[j - 1]]) < _abs(strides[order[j]]):
            tmp = order[j - 1]
            order[j - 1] = order[j]
            order[j] = tmp
            j -= 1


cdef int _copy_order(int ndim, const int64_t *sizes, const int64_t *src_strides,
                     const int64_t *dst_strides, int *order) noexcept nogil:
    """order: the dims outermost first by |dst stride| (logical order on ties), except that
    src's innermost dim (of more than one element), when it is not dst's, comes right outside
    dst's: consecutive runs then read the same lines of src, one element further.  Returns the
    number of runs along the innermost (the product of the other sizes)."""
    cdef int d, i, across = -1
    cdef int64_t runs = 1
    for d in range(ndim):
        order[d] = d
        if sizes[d] > 1 and (across < 0 or _abs(src_strides[d]) < _abs(src_strides[across])):
            across = d
    _outermost_first(dst_strides, order, ndim)
    for i in range(ndim - 2):
        if order[i] == across:                 # (a stable move: the others keep their order)
            for d in range(i, ndim - 2):
                order[d] = order[d + 1]
            order[ndim - 2] = across
            break
    for i in range(ndim - 1):
        runs *= sizes[order[i]]
    return runs


cdef int64_t copy_runs(int ndim, const int64_t *sizes, const int64_t *src_strides,
                       const int64_t *dst_strides) noexcept nogil:
    """How many runs copy_strided cuts the index space of `sizes` into (0 when it is empty)."""
    cdef int order[MAX_DIMS]
    cdef int d
    for d in range(ndim):
        if sizes[d] == 0:
            return 0
    return _copy_order(ndim, sizes, src_strides, dst_strides, order)


cdef void copy_strided(int ndim, const int64_t *sizes, const char *src,
                       const int64_t *src_strides, char *dst, const int64_t *dst_strides,
                       int64_t size, int64_t first, int64_t count) noexcept nogil:
    """dst[i] = src[i] (byte strides; elements of `size` bytes) for the indices of `sizes` in
    runs first..first+count - 1 (copy_runs): an operand into or out of its temporary.  Runs lie
    along dst's innermost dim and go in dst's memory order (_copy_order), so that the writes
    are sequential and threads can take runs of their own."""
    cdef int order[MAX_DIMS]
    cdef int64_t idx[MAX_DIMS]
    cdef int64_t r, rem, s_off = 0, d_off = 0
    cdef int d, i, inner
    if count <= 0:
        return
    _copy_order(ndim, sizes, src_strides, dst_strides, order)
    inner = order[ndim - 1]
    rem = first
    for i in range(ndim - 2, -1, -1):           # run `first` as an index of the outer dims
        d = order[i]
        idx[i] = rem % sizes[d]
        rem //= sizes[d]
        s_off += idx[i] * src_strides[d]
        d_off += idx[i] * dst_strides[d]
    for r in range(count):
        _copy_run(dst + d_off, dst_strides[inner], src + s_off, src_strides[inner],
                  sizes[inner], size)
        i = ndim - 2
        while i >= 0:                            # the next run: count on the outer dims
            d = order[i]
            idx[i] += 1
            s_off += src_strides[d]
            d_off += dst_strides[d]
            if idx[i] < sizes[d]:
                break
            s_off -= idx[i] * src_strides[d]
            d_off -= idx[i] * dst_strides[d]
            idx[i] = 0
            i -= 1


cdef int _build(Plan *p, const Layout *l) noexcept nogil:
    cdef int ndim = l.ndim
    cdef const int64_t *sizes = l.sizes
    cdef const unsigned char *reduced = l.reduced
    cdef const int64_t *strides = &l.strides[0][0]
    cdef const unsigned char *present = l.present
    cdef int big_dtype = l.big_dtype, mask_dtype = l.mask_dtype, stat_dtype = l.stat_dtype
    cdef int64_t s[N_SLOTS * MAX_DIMS]
    cdef Plan base
    cdef Plan probe
    cdef int t, rc
    cdef bint temp[N_BIG]
    cdef bint scattered[N_BIG]
    cdef bint any_temp = False
    cdef int64_t given[N_SLOTS * MAX_DIMS]
    cdef bint gathered[2]
    cdef int64_t gathered_bytes = 0
    # From here on, x and dy are read where they lie or from their gathered temporaries.
    memcpy(given, strides, N_SLOTS * MAX_DIMS * sizeof(int64_t))
    _choose_gathering(given, ndim, sizes, reduced, big_dtype, gathered, &gathered_bytes)
    strides = given
    memcpy(s, strides, N_SLOTS * MAX_DIMS * sizeof(int64_t))
    for t in range(2, N_BIG):
        temp[t] = False
        if not present[t]:
            _like_x(s, ndim, sizes, t, big_dtype, mask_dtype, False, NULL, NULL)
    rc = _layout(p, ndim, sizes, reduced, s, big_dtype, mask_dtype, stat_dtype)
    _clear_temps(p, ndim, sizes, present)
    if rc != 0 or p.empty:
        return rc
    for t in range(2, N_BIG):
        scattered[t] = present[t] and _scattered(p, t)
        if scattered[t] or (present[t] and not _follows(s, ndim, sizes, t, big_dtype,
                                                        mask_dtype)):
            temp[t] = True
            any_temp = True
    if not any_temp:
        _mark_gathered(p, &l.strides[0][0], given, gathered, gathered_bytes)
        return 0       # every operand adds nothing to what x and dy decide (in place too)

    # Which of those really change the order: compare with the plan of x and dy alone.
    memcpy(s, strides, N_SLOTS * MAX_DIMS * sizeof(int64_t))
    for t in range(2, N_BIG):
        _like_x(s, ndim, sizes, t, big_dtype, mask_dtype, False, NULL, NULL)
    rc = _layout(&base, ndim, sizes, reduced, s, big_dtype, mask_dtype, stat_dtype)
    if rc != 0:
        plan_free(p)
        return rc
    for t in range(2, N_BIG):
        if scattered[t]:
            _like_x(s, ndim, sizes, t, big_dtype, mask_dtype, True, NULL, NULL)
        elif temp[t]:
            memcpy(&s[t * MAX_DIMS], &strides[t * MAX_DIMS], MAX_DIMS * sizeof(int64_t))
            rc = _layout(&probe, ndim, sizes, reduced, s, big_dtype, mask_dtype, stat_dtype)
            if rc != 0:
                plan_free(&base)
                plan_free(p)
                return rc
            temp[t] = not _same_order(&probe, &base)
            plan_free(&probe)
            if not temp[t]:
                continue      # keeps its own strides in the final plan
            _like_x(s, ndim, sizes, t, big_dtype, mask_dtype, True, NULL, NULL)
    plan_free(&base)

    # The final plan: every operand either where it lies or in its temporary.
    plan_free(p)
    for t in range(2, N_BIG):
        if not temp[t] and present[t]:
            memcpy(&s[t * MAX_DIMS], &strides[t * MAX_DIMS], MAX_DIMS * sizeof(int64_t))
    rc = _layout(p, ndim, sizes, reduced, s, big_dtype, mask_dtype, stat_dtype)
    _clear_temps(p, ndim, sizes, present)
    if rc != 0:
        return rc
    _mark_gathered(p, &l.strides[0][0], given, gathered, gathered_bytes)
    for t in range(2, N_BIG):
        if temp[t]:
            p.via_temp[t] = True
            memcpy(p.given_strides[t], &strides[t * MAX_DIMS], MAX_DIMS * sizeof(int64_t))
            _like_x(s, ndim, sizes, t, big_dtype, mask_dtype, True, &p.temp_low[t],
                    &p.temp_bytes[t])
            memcpy(p.temp_strides[t], &s[t * MAX_DIMS], MAX_DIMS * sizeof(int64_t))
    return 0


cdef bint _scattered(const Plan *p, int t) noexcept nogil:
    """Whether the kernels would reach operand t's elements along a row (a channel-major row,
    or the channels of a channel-last call) a cache line or more apart: each element read or
    written would be a line of its own, evicted before its neighbours come."""
    return p.inner_size > 1 and _abs(p.inner_stride[t]) >= SCATTERED_STRIDE


cdef bint _channels_innermost(const int64_t *s, int ndim, const int64_t *sizes,
                              const unsigned char *reduced, int t,
                              int64_t *chan) noexcept nogil:
    """Whether operand t's channel dims (of size > 1) merge into one whose |stride| is below
    every reduced dim's (of size > 1): its channels are its innermost dim. chan: that stride
    (bytes)."""
    cdef int d, last = -1
    cdef int64_t step = 0
    for d in range(ndim - 1, -1, -1):
        if sizes[d] == 1 or reduced[d]:
            continue
        if last >= 0 and s[t * MAX_DIMS + d] != sizes[last] * s[t * MAX_DIMS + last]:
            return False
        if last < 0:
            step = s[t * MAX_DIMS + d]
        last = d
    if last < 0:
        return False        # one channel: nothing to gather
    for d in range(ndim):
        if reduced[d] and sizes[d] != 1 and _abs(s[t * MAX_DIMS + d]) <= _abs(step):
            return False
    chan[0] = step
    return True


cdef void _choose_gathering(int64_t *s, int ndim, const int64_t *sizes,
                            const unsigned char *reduced, int big_dtype, bint gathered[2],
                            int64_t *nbytes) noexcept nogil:
    """Where x's channels are its innermost dim but not at unit stride, rows S_X and S_DY of s
    become a dense channel-last layout (channels at unit stride in logical order, the reduced
    dims ordered as x's, outermost = largest |x stride|, logical order on ties) for those of x
    and dy whose channels are not already at unit stride: gathered[t] says which, nbytes the
    temporary's size."""
    cdef int64_t size = itemsize(big_dtype), step, chan
    cdef int order[MAX_DIMS]
    cdef int n = 0, d, i, t
    cdef int64_t dense[MAX_DIMS]
    gathered[0] = gathered[1] = False
    if not _channels_innermost(s, ndim, sizes, reduced, S_X, &chan):
        return
    for t in range(2):
        gathered[t] = not (_channels_innermost(s, ndim, sizes, reduced, t, &chan)
                           and chan == size)
    if not (gathered[0] or gathered[1]):
        return
    step = size
    for d in range(ndim - 1, -1, -1):        # the channels, innermost
        if not reduced[d]:
            dense[d] = step
            step *= sizes[d]
    for d in range(ndim):                    # the reduced dims, outermost first
        if reduced[d]:
            order[n] = d
            n += 1
    _outermost_first(&s[S_X * MAX_DIMS], order, n)
    for i in range(n - 1, -1, -1):
        dense[order[i]] = step
        step *= sizes[order[i]]
    for t in range(2):
        if gathered[t]:
            memcpy(&s[t * MAX_DIMS], dense, ndim * sizeof(int64_t))
    nbytes[0] = step


cdef void _mark_gathered(Plan *p, const int64_t *strides, const int64_t *given,
                         const bint gathered[2], int64_t nbytes) noexcept nogil:
    """Records in the final plan that x and dy (gathered[t]) are read from their temporaries."""
    cdef int t
    for t in range(2):
        if gathered[t]:
            p.via_temp[t] = True
            p.temp_low[t] = 0
            p.temp_bytes[t] = nbytes
            memcpy(p.given_strides[t], &strides[t * MAX_DIMS], MAX_DIMS * sizeof(int64_t))
            memcpy(p.temp_strides[t], &given[t * MAX_DIMS], MAX_DIMS * sizeof(int64_t))


cdef void _clear_temps(Plan *p, int ndim, const int64_t *sizes,
                       const unsigned char *present) noexcept nogil:
    cdef int t, d
    p.ndim = ndim
    for t in range(N_BIG):
        p.present[t] = present[t] or t < 2
    for d in range(ndim):
        p.sizes[d] = sizes[d]
    for t in range(N_BIG):
        p.via_temp[t] = False
        p.temp_low[t] = 0
        p.temp_bytes[t] = 0


cdef inline int64_t _abs(int64_t v) noexcept nogil:
    return -v if v < 0 else v


cdef inline int64_t _operand_size(int t, int big_dtype, int mask_dtype) noexcept nogil:
    return itemsize(mask_dtype) if t == 3 else itemsize(big_dtype)


cdef bint _follows(const int64_t *s, int ndim, const int64_t *sizes, int t, int big_dtype,
                   int mask_dtype) noexcept nogil:
    """Whether operand t is laid out like x or like dy (strides in elements equal on every dim
    of size > 1): then it merges, flips and runs channel-last wherever they do."""
    cdef int64_t ts = _operand_size(t, big_dtype, mask_dtype), bs = itemsize(big_dtype)
    cdef bint like_x = True, like_dy = True
    cdef int d
    for d in range(ndim):
        if sizes[d] != 1:
            like_x = like_x and s[t * MAX_DIMS + d] * bs == s[S_X * MAX_DIMS + d] * ts
            like_dy = like_dy and s[t * MAX_DIMS + d] * bs == s[S_DY * MAX_DIMS + d] * ts
    return like_x or like_dy


cdef void _like_x(int64_t *s, int ndim, const int64_t *sizes, int t, int big_dtype,
                  int mask_dtype, bint dense, int64_t *low, int64_t *nbytes) noexcept nogil:
    """Row t of s becomes x's layout: x's own strides scaled to t's element size, or (dense)
    a dense array with x's dim order - outermost = largest |x stride|, logical order on ties -
    negative where x and dy both are (the dims a plan flips), which keeps x's visiting order
    unless x has zero or overlapping strides.  low, nbytes: the dense array's lowest byte
    offset and size."""
    cdef int order[MAX_DIMS]
    cdef int64_t ts = _operand_size(t, big_dtype, mask_dtype), bs = itemsize(big_dtype)
    cdef int64_t size = ts, lo = 0
    cdef int d, i
    if not dense:
        for d in range(ndim):
            s[t * MAX_DIMS + d] = s[S_X * MAX_DIMS + d] // bs * ts
        return
    for d in range(ndim):
        order[d] = d
    _outermost_first(&s[S_X * MAX_DIMS], order, ndim)
    for i in range(ndim - 1, -1, -1):
        d = order[i]
        if s[S_X * MAX_DIMS + d] < 0 and s[S_DY * MAX_DIMS + d] < 0:
            s[t * MAX_DIMS + d] = -size
            lo -= (sizes[d] - 1) * size
        else:
            s[t * MAX_DIMS + d] = size
        size *= sizes[d]
    if low != NULL:
        low[0] = lo
        nbytes[0] = size


cdef bint _same_order(const Plan *a, const Plan *b) noexcept nogil:
    """Whether the two plans visit x and dy alike (and so round every sum alike)."""
    cdef int i, t
    if (a.channel_last != b.channel_last or a.n_outer != b.n_outer
            or a.inner_size != b.inner_size or a.block != b.block or a.nblocks != b.nblocks):
        return False
    for t in range(2):
        if a.base[t] != b.base[t] or a.inner_stride[t] != b.inner_stride[t]:
            return False
        for i in range(a.n_outer):
            if a.outer_size[i] != b.outer_size[i] or a.outer_stride[t][i] != b.outer_stride[t][i]:
                return False
    return True


cdef inline void _swap(int64_t *a, int64_t *b) noexcept nogil:
    cdef int64_t tmp = a[0]
    a[0] = b[0]
    b[0] = tmp


cdef int _layout(Plan *p, int ndim, const int64_t *sizes, const unsigned char *reduced,
                 const int64_t *strides, int big_dtype, int mask_dtype,
                 int stat_dtype) noexcept nogil:
    """The plan for exactly these strides of every operand."""
    cdef int kept[MAX_DIMS]
    cdef int red[MAX_DIMS]
    cdef int nkept = 0, nred = 0, d, t, i, j, k
    cdef int64_t C = 1, M = 1, s, c, idx, rem
    cdef int64_t rsize[MAX_DIMS]
    cdef int64_t rstride[N_BIG][MAX_DIMS]
    cdef bint merge, flip

    p.empty = False
    p.channel_last = False
    p.whole_rows = False
    p.big_dtype = big_dtype
    p.mask_dtype = mask_dtype
    p.stat_dtype = stat_dtype
    p.n_outer = 0
    p.nblocks = 0
    p.block = 1
    p.scratch = NULL
    p.scratch_bytes = 0
    p.scratch_taken = 0
    for t in range(N_SLOTS):
        p.chan_offset[t] = NULL
        p.chan_stride[t] = 0
    for t in range(N_BIG):
        p.base[t] = 0
        p.inner_stride[t] = 0

    for d in range(ndim):
        if reduced[d]:
            M *= sizes[d]
            if sizes[d] != 1:
                red[nred] = d
                nred += 1
        else:
            C *= sizes[d]
            if sizes[d] != 1:
                kept[nkept] = d
                nkept += 1
    p.channels = C
    p.count = M
    p.inner_size = 1
    p.empty = C == 0 or M == 0
    if C == 0:
        return 0

    # Channel origins, per slot: one stride when the kept dims merge, else a table.
    for t in range(N_SLOTS):
        merge = True
        for i in range(nkept - 1):
            if strides[t * MAX_DIMS + kept[i]] != \
                    sizes[kept[i + 1]] * strides[t * MAX_DIMS + kept[i + 1]]:
                merge = False
        if merge:
            p.chan_stride[t] = strides[t * MAX_DIMS + kept[nkept - 1]] if nkept else 0
        else:
            p.chan_offset[t] = <int64_t *> malloc(C * sizeof(int64_t))
            if p.chan_offset[t] == NULL:
                plan_free(p)
                return -1
            for c in range(C):
                rem = c
                s = 0
                for i in range(nkept - 1, -1, -1):
                    idx = rem % sizes[kept[i]]
                    rem = rem // sizes[kept[i]]
                    s += idx * strides[t * MAX_DIMS + kept[i]]
                p.chan_offset[t][c] = s

    if M == 0:
        return 0        # no element to visit; the channel origins still place dscale, dbias

    # Reduced dims: flip the ones negative in every big tensor, sort outermost first by
    # |x stride|, merge.
    for i in range(nred):
        rsize[i] = sizes[red[i]]
        flip = True
        for t in range(N_BIG):
            rstride[t][i] = strides[t * MAX_DIMS + red[i]]
            flip = flip and rstride[t][i] < 0
        if flip:
            for t in range(N_BIG):
                p.base[t] += (rsize[i] - 1) * rstride[t][i]
                rstride[t][i] = -rstride[t][i]
    for i in range(1, nred):              # insertion sort, stable: logical order on ties
        j = i
        while j > 0 and _abs(rstride[0][j - 1]) < _abs(rstride[0][j]):
            _swap(&rsize[j - 1], &rsize[j])
            for t in range(N_BIG):
                _swap(&rstride[t][j - 1], &rstride[t][j])
            j -= 1
    k = 0
    for i in range(nred):
        merge = k > 0
        for t in range(N_BIG):
            merge = merge and rstride[t][k - 1] == rsize[i] * rstride[t][i]
        if merge:
            rsize[k - 1] *= rsize[i]
            for t in range(N_BIG):
                rstride[t][k - 1] = rstride[t][i]
        else:
            rsize[k] = rsize[i]
            for t in range(N_BIG):
                rstride[t][k] = rstride[t][i]
            k += 1
    nred = k

    p.channel_last = C > 1
    for t in range(N_BIG):
        p.channel_last = (p.channel_last and p.chan_offset[t] == NULL
                          and p.chan_stride[t] == _operand_size(t, big_dtype, mask_dtype))
    if p.channel_last:
        p.n_outer = nred
        p.inner_size = C
        for t in range(N_BIG):
            p.inner_stride[t] = _operand_size(t, big_dtype, mask_dtype)
        # rows per block: about LAST_BLOCK elements, in multiples of 16 rows, within
        # LAST_MIN_ROWS..LAST_MAX_ROWS; as many blocks as the rows make, so that any number of threads finds work
        # (with channel slices: see the schedules)
        p.block = (LAST_BLOCK // C + BNBW_BLOCK_ROWS - 1) // BNBW_BLOCK_ROWS * BNBW_BLOCK_ROWS
        if p.block < LAST_MIN_ROWS:
            p.block = LAST_MIN_ROWS
        if p.block > LAST_MAX_ROWS:
            p.block = LAST_MAX_ROWS
        p.nblocks = (M + p.block - 1) // p.block
    else:
        p.n_outer = nred - 1 if nred > 0 else 0
        if nred > 0:
            p.inner_size = rsize[nred - 1]
            for t in range(N_BIG):
                p.inner_stride[t] = rstride[t][nred - 1]
        # blocks of whole rows when rows are shorter than a block, so that rows can also be
        # visited in memory order without changing any sum
        p.whole_rows = p.inner_size <= BLOCK
        p.block = (BLOCK // p.inner_size) * p.inner_size if p.whole_rows else BLOCK
        p.nblocks = (M + p.block - 1) // p.block
    for i in range(p.n_outer):
        p.outer_size[i] = rsize[i]
        for t in range(N_BIG):
            p.outer_stride[t][i] = rstride[t][i]
    return 0


cdef void plan_free(Plan *p) noexcept nogil:
    cdef int t
    free(p.scratch)
    p.scratch = NULL
    for t in range(N_SLOTS):
        free(p.chan_offset[t])
        p.chan_offset[t] = NULL
