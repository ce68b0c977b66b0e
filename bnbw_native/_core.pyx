# cython: language_level=3
"""The one engine behind every front-end of bnbw_native.

Design
------
Formulas (SPEC 1), per channel c with M elements, r = 1/sqrt(var + eps):
    dbias = Sum dy            dscale = r * Sum (x - mean) * dy
    training:  dx = k1*dy + k2*(x - mean) + k3,  k1 = scale*r,
               k2 = -scale*r*r*dscale/M,  k3 = -scale*r*dbias/M
    frozen:    dx = k1*dy
The per-channel constants are computed once, in f64, by `coefficients`, and rounded to f32
for the elementwise pass.

Layers: a plan (built once from sizes, strides and the reduced-dims mask, with no Python
object involved, so C callers can build one too) -> partitioned work items run under
`prange` with the GIL released -> the row kernels of bnbw_kernels.h.  Unit-stride rows go to
the kernels as they are, in f32, f16 or bf16 (halves are converted in registers); strided rows,
and halves on CPUs without the AVX2 kernels, are staged through per-thread f32 tiles of TILE
elements.  Rows are always cut at the same TILE boundaries, so the staging never changes the
arithmetic.

Plans.  Size-1 dims are dropped, reduced dims with negative strides (in x, dy and dx alike)
are flipped, sorted outermost-first by x's stride and merged where all three tensors allow.
A dx whose layout would change that order of x and dy (and so the rounding of the sums) is
written through a temporary laid out like x (plan_build).
"Channel-last" when the channel dims merge into one unit-stride dim of x, dy and dx (NXC);
otherwise "channel-major" (NCX, and every general strided case) with the innermost reduced
dim as the row.

Determinism.  The reduction of a channel is cut into fixed blocks (BLOCK elements, or rows of
channels), each block summed by one sequential function and the block sums added in block
order.  Which thread runs a block, and how many threads there are, never enters the
arithmetic, so every output is bit-identical for any thread count.  Schedules: channel-major
with enough channels runs "fused": one thread reduces a group of adjacent channels in memory
order (or one channel, when its rows are longer than a block) and applies it at once while its
data is still in cache; otherwise reduce, combine, apply as three steps.  All add the same
block sums in the same order.

Accuracy.  Sums are f64 (lanes of f64 in the row kernel, f64 block sums, f64 combination) of
exact f64 products of the f32 values (x - mean) and dy, x - mean being exact near the mean.
f16/bf16 storage first sums short f32 blocks per lane (_blocked_sums, bnbw_kernels.h).

Fast path.  fast_backward() takes a plain NumPy call from validation to result without Python
in between (a tiny call costs ~6 us instead of ~30-60); it declines whatever it cannot prove
valid, and the general path (_pipeline.py) runs or refuses that.
"""
from libc.stdint cimport int64_t, uint16_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy
from libc.math cimport sqrt
from cython.parallel cimport prange

cimport numpy as cnp

cnp.import_array()

cdef extern from "bnbw_half.h" nogil:
    ctypedef struct bnbw_f16:
        uint16_t bits
    ctypedef struct bnbw_bf16:
        uint16_t bits
    float bnbw_f16_to_f32(bnbw_f16 h)
    float bnbw_bf16_to_f32(bnbw_bf16 h)
    bnbw_f16 bnbw_f64_to_f16(double d)
    bnbw_bf16 bnbw_f64_to_bf16(double d)
    void bnbw_load_f32(const char *src, int64_t stride, int64_t n, float *dst)
    void bnbw_store_f32(const float *src, int64_t n, char *dst, int64_t stride)
    void bnbw_load_f16_arith(const char *src, int64_t stride, int64_t n, float *dst)
    void bnbw_store_f16(const float *src, int64_t n, char *dst, int64_t stride)
    void bnbw_load_bf16(const char *src, int64_t stride, int64_t n, float *dst)
    void bnbw_store_bf16(const float *src, int64_t n, char *dst, int64_t stride)
    const char *bnbw_half_simd_path()
    int bnbw_body()
    int bnbw_cpu_body()
    void bnbw_set_body_cap(int cap)
    const char *bnbw_body_name(int body)

cdef extern from "bnbw_kernels.h" nogil:
    void bnbw_reduce_row(const void *x, const void *dy, int64_t n, float mean, double *out,
                         int blocked, int dt)
    void bnbw_apply_row(const void *x, const void *dy, void *dx, int64_t n, float mean,
                        float k1, float k2, float k3, int dt)
    void bnbw_scale_row(const void *dy, void *dx, int64_t n, float k1, int dt)
    void bnbw_reduce_rows(const void *x, int64_t x_row, const void *dy, int64_t dy_row,
                          int64_t rows, int64_t n, const float *mean, double *sum_g,
                          double *sum_xg, int streaming, int blocked, int dt)
    void bnbw_apply_rows(const void *x, int64_t x_row, const void *dy, int64_t dy_row,
                         void *dx, int64_t dx_row, int64_t rows, int64_t n, const float *mean,
                         const float *k1, const float *k2, const float *k3, int dt)
    void bnbw_scale_rows(const void *dy, int64_t dy_row, void *dx, int64_t dx_row,
                         int64_t rows, int64_t n, const float *k1, int dt)
    void bnbw_reduce_row_run(const void *x, int64_t x_step, const void *dy, int64_t dy_step,
                             int64_t n, int64_t count, const float *mean, double *sums,
                             int64_t sums_step, int blocked, int dt)
    void bnbw_apply_row_run(const void *x, int64_t x_step, const void *dy, int64_t dy_step,
                            void *dx, int64_t dx_step, int64_t n, int64_t count,
                            const float *mean, const float *k1, const float *k2,
                            const float *k3, int dt)
    void bnbw_scale_row_run(const void *dy, int64_t dy_step, void *dx, int64_t dx_step,
                            int64_t n, int64_t count, const float *k1, int dt)
    int bnbw_kernels_take(int dt)
    int BNBW_BLOCK_ROWS
    int BNBW_EXACT_SUMS, BNBW_BLOCKS, BNBW_BLOCKS_EVEN_ODD
    int bnbw_avx2_kernels()

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    static int bnbw_omp_max_threads(void) { return omp_get_max_threads(); }
    static int bnbw_omp_thread_num(void) { return omp_get_thread_num(); }
    static int bnbw_openmp_version(void) { return _OPENMP; }
    #else
    static int bnbw_omp_max_threads(void) { return 1; }
    static int bnbw_omp_thread_num(void) { return 0; }
    static int bnbw_openmp_version(void) { return 0; }
    #endif
    """
    int bnbw_omp_max_threads() nogil
    int bnbw_omp_thread_num() nogil
    int bnbw_openmp_version() nogil

cdef enum:
    TILE = 2048           # elements per staged row segment (3 tiles per thread: 24 KiB)
    BLOCK = 32768         # elements per reduction block
    MIN_BLOCK_ROWS = 16   # channel-last: lower bound on rows per block (bounds partial sums)
    MAX_LAST_BLOCKS = 32  # channel-last: upper bound on blocks (partial sums <= 512 B/channel)
    PARTIAL_BYTES = 1 << 16   # channel-last: upper bound on all blocks' sums, so they stay
                              # cached (2048 channels: 2 blocks, not 16; 18% faster)
    SERIAL_BELOW = 32768  # elements below which threads cost more than they bring
    FUSE_BYTES = 1 << 24  # fused: x and dy of the channel groups in flight (one per thread)
                          # stay within half of a 32 MiB L3 (conv2 f32: 16 MiB 1.5x as fast
                          # as 512 KiB, 2-16 MiB within 5% of each other)
    FUSE_MIN = 1 << 19    # ... but never below half a 1 MiB L2

cdef inline int64_t itemsize(int dtype) noexcept nogil:
    return 4 if dtype == DT_F32 else 2

cdef inline int64_t imin(int64_t a, int64_t b) noexcept nogil:
    return a if a < b else b


# ---------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------

cdef int plan_build(Plan *p, int ndim, const int64_t *sizes, const unsigned char *reduced,
                    const int64_t *strides, int big_dtype, int stat_dtype) noexcept nogil:
    """Fill `p`.  strides: N_SLOTS rows of MAX_DIMS byte strides (row t = slot t).
    Returns 0, or -1 when out of memory.  The inputs are trusted (the front-ends validate).

    The order in which x and dy are visited (flipped, sorted and merged dims, rows, channel-last
    or not) decides how the sums round, so it must not depend on where dx lies: out of place
    or in place, any dx gives the same results.  When dx's layout would change that order, the
    plan writes a temporary laid out like x (dense, in x's order, which keeps it unless x has
    zero or overlapping strides) and plan_execute copies it into dx."""
    cdef int64_t alt[N_SLOTS * MAX_DIMS]
    cdef int64_t low = 0, size = itemsize(big_dtype)
    cdef int order[MAX_DIMS]
    cdef Plan other
    cdef int d, i, j, rc
    cdef bint like_x = True, like_dy = True
    rc = _plan_layout(p, ndim, sizes, reduced, strides, big_dtype, stat_dtype)
    p.dx_via_temp = False
    if rc != 0 or p.empty:
        return rc
    for d in range(ndim):
        if sizes[d] != 1:
            like_x = like_x and strides[SLOT_DX * MAX_DIMS + d] == strides[SLOT_X * MAX_DIMS + d]
            like_dy = like_dy and strides[SLOT_DX * MAX_DIMS + d] == strides[SLOT_DY * MAX_DIMS + d]
    if like_x or like_dy:
        return 0                   # dx adds nothing to what x and dy decide (in place too)
    # the temporary: dense, dims in x's order (outermost = largest |stride|, logical order on
    # ties), negative where x and dy both are (the dims the plan flips)
    for d in range(ndim):
        order[d] = d
    for i in range(1, ndim):
        j = i
        while j > 0 and _abs(strides[order[j - 1]]) < _abs(strides[order[j]]):
            order[j - 1], order[j] = order[j], order[j - 1]
            j -= 1
    memcpy(alt, strides, N_SLOTS * MAX_DIMS * sizeof(int64_t))
    for i in range(ndim - 1, -1, -1):
        d = order[i]
        if strides[SLOT_X * MAX_DIMS + d] < 0 and strides[SLOT_DY * MAX_DIMS + d] < 0:
            alt[SLOT_DX * MAX_DIMS + d] = -size
            low -= (sizes[d] - 1) * size
        else:
            alt[SLOT_DX * MAX_DIMS + d] = size
        size *= sizes[d]
    rc = _plan_layout(&other, ndim, sizes, reduced, alt, big_dtype, stat_dtype)
    if rc != 0:
        plan_free(p)
        return rc
    if _same_order(p, &other):
        plan_free(&other)
        return 0
    plan_free(p)
    p[0] = other
    p.dx_via_temp = True
    p.ndim = ndim
    p.temp_low = low
    p.temp_bytes = size
    for d in range(ndim):
        p.sizes[d] = sizes[d]
        p.dx_strides[d] = strides[SLOT_DX * MAX_DIMS + d]
        p.temp_strides[d] = alt[SLOT_DX * MAX_DIMS + d]
    return 0


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


cdef int _plan_layout(Plan *p, int ndim, const int64_t *sizes, const unsigned char *reduced,
                      const int64_t *strides, int big_dtype, int stat_dtype) noexcept nogil:
    """plan_build for the given strides of all three tensors."""
    cdef int kept[MAX_DIMS]
    cdef int red[MAX_DIMS]
    cdef int nkept = 0, nred = 0, d, t, i, j, k
    cdef int64_t C = 1, M = 1, s, c, idx, rem
    cdef int64_t rsize[MAX_DIMS]
    cdef int64_t rstride[3][MAX_DIMS]
    cdef bint merge
    cdef int64_t isz = itemsize(big_dtype)

    p.empty = False
    p.channel_last = False
    p.whole_rows = False
    p.big_dtype = big_dtype
    p.stat_dtype = stat_dtype
    p.n_outer = 0
    p.nblocks = 0
    p.ngroups = 0
    p.group = 0
    p.block = 1
    for t in range(N_SLOTS):
        p.chan_offset[t] = NULL
        p.chan_stride[t] = 0
    for t in range(3):
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
        return 0        # no element to visit; the channel origins above still place dscale, dbias

    # Reduced dims: flip negative ones, sort outermost first by |x stride|, merge.
    for i in range(nred):
        rsize[i] = sizes[red[i]]
        for t in range(3):
            rstride[t][i] = strides[t * MAX_DIMS + red[i]]
        if rstride[0][i] < 0 and rstride[1][i] < 0 and rstride[2][i] < 0:
            for t in range(3):
                p.base[t] += (rsize[i] - 1) * rstride[t][i]
                rstride[t][i] = -rstride[t][i]
    for i in range(1, nred):              # insertion sort, stable: logical order on ties
        j = i
        while j > 0 and _abs(rstride[0][j - 1]) < _abs(rstride[0][j]):
            _swap(&rsize[j - 1], &rsize[j])
            for t in range(3):
                _swap(&rstride[t][j - 1], &rstride[t][j])
            j -= 1
    k = 0
    for i in range(nred):
        if k > 0 and rstride[0][k - 1] == rsize[i] * rstride[0][i] \
                and rstride[1][k - 1] == rsize[i] * rstride[1][i] \
                and rstride[2][k - 1] == rsize[i] * rstride[2][i]:
            rsize[k - 1] *= rsize[i]
            for t in range(3):
                rstride[t][k - 1] = rstride[t][i]
        else:
            rsize[k] = rsize[i]
            for t in range(3):
                rstride[t][k] = rstride[t][i]
            k += 1
    nred = k

    p.channel_last = (C > 1 and p.chan_offset[SLOT_X] == NULL and p.chan_offset[SLOT_DY] == NULL
                      and p.chan_offset[SLOT_DX] == NULL and p.chan_stride[SLOT_X] == isz
                      and p.chan_stride[SLOT_DY] == isz and p.chan_stride[SLOT_DX] == isz)
    if p.channel_last:
        p.n_outer = nred
        p.inner_size = C
        for t in range(3):
            p.inner_stride[t] = isz
        # rows per block: at least BLOCK elements' worth, and few enough blocks that the
        # per-block sums (2 doubles per channel per block) stay within PARTIAL_BYTES
        s = PARTIAL_BYTES // (16 * C)
        s = 1 if s < 1 else (MAX_LAST_BLOCKS if s > MAX_LAST_BLOCKS else s)
        p.block = BLOCK // C if BLOCK // C > MIN_BLOCK_ROWS else MIN_BLOCK_ROWS
        if p.block < (M + s - 1) // s:
            p.block = (M + s - 1) // s
        p.nblocks = (M + p.block - 1) // p.block
    else:
        p.n_outer = nred - 1 if nred > 0 else 0
        if nred > 0:
            p.inner_size = rsize[nred - 1]
            for t in range(3):
                p.inner_stride[t] = rstride[t][nred - 1]
        # blocks of whole rows when rows are shorter than a block, so that rows can also be
        # visited in memory order (sweep_block) without changing any sum
        p.whole_rows = p.inner_size <= BLOCK
        p.block = (BLOCK // p.inner_size) * p.inner_size if p.whole_rows else BLOCK
        p.nblocks = (M + p.block - 1) // p.block
    for i in range(p.n_outer):
        p.outer_size[i] = rsize[i]
        for t in range(3):
            p.outer_stride[t][i] = rstride[t][i]
    if p.channel_last:
        # channels per item: whole rows up to TILE (narrower slices of wide rows read memory
        # in short strided pieces: (32, 14, 14, 1024) f16 reduce 1.6x, apply 2.7x slower in
        # 512-channel slices), except that staged halves need slabs of whole blocks of
        # blocked sums: BNBW_BLOCK_ROWS rows per tile
        p.group = TILE // BNBW_BLOCK_ROWS if big_dtype != DT_F32 and not _direct(p) else TILE
        p.ngroups = (C + p.group - 1) // p.group
    return 0


cdef void plan_free(Plan *p) noexcept nogil:
    cdef int t
    for t in range(N_SLOTS):
        free(p.chan_offset[t])
        p.chan_offset[t] = NULL


cdef inline int64_t _abs(int64_t v) noexcept nogil:
    return -v if v < 0 else v


cdef inline void _swap(int64_t *a, int64_t *b) noexcept nogil:
    cdef int64_t tmp = a[0]
    a[0] = b[0]
    b[0] = tmp


cdef inline int64_t chan_origin(const Plan *p, int t, int64_t c) noexcept nogil:
    if p.chan_offset[t] != NULL:
        return p.chan_offset[t][c]
    return p.chan_stride[t] * c


cdef inline void row_origin(const Plan *p, int64_t row, int64_t *off) noexcept nogil:
    """Byte offsets of row `row` (mixed radix over the outer dims) in x, dy, dx."""
    cdef int d
    cdef int64_t q, i
    off[0] = p.base[0]
    off[1] = p.base[1]
    off[2] = p.base[2]
    for d in range(p.n_outer - 1, -1, -1):
        q = row // p.outer_size[d]
        i = row - q * p.outer_size[d]
        off[0] += i * p.outer_stride[0][d]
        off[1] += i * p.outer_stride[1][d]
        off[2] += i * p.outer_stride[2][d]
        row = q


ctypedef struct Operands:
    char *x
    char *dy
    char *dx
    float *mean      # [C] gathered statistics and coefficients, f32
    float *k1
    float *k2
    float *k3
    int dtype        # storage type of x, dy, dx
    bint direct      # the kernels read and write x, dy, dx where they are, in their own type
    int kdt          # what the kernels are told the rows hold: dtype when direct, else f32
    int blocked      # sums in f32 blocks or not (bnbw_kernels.h's codes), see _blocked_sums
    bint streaming   # x and dy outgrow an L2 (2 * FUSE_MIN): a pass is likely to read them
                     # from memory (a call rarely finds its inputs still in L3)


# ---------------------------------------------------------------------------------------
# Staging: rows the kernels take as they are (o.direct, or unit-stride f32) are used in
# place; everything else is converted through a per-thread f32 tile
# ---------------------------------------------------------------------------------------

cdef inline const char *load_row(const Operands *o, const char *src, int64_t stride, int64_t n,
                                 float *tile) noexcept nogil:
    if o.direct or (o.dtype == DT_F32 and stride == 4):
        return src
    copy_row(o, src, stride, n, tile)
    return <const char *> tile


cdef inline void copy_row(const Operands *o, const char *src, int64_t stride, int64_t n,
                          float *tile) noexcept nogil:
    if o.dtype == DT_F32:
        bnbw_load_f32(src, stride, n, tile)
    elif o.dtype == DT_F16:
        bnbw_load_f16_arith(src, stride, n, tile)
    else:
        bnbw_load_bf16(src, stride, n, tile)


cdef inline char *row_target(const Operands *o, char *dst, int64_t stride,
                             float *tile) noexcept nogil:
    if o.direct or (o.dtype == DT_F32 and stride == 4):
        return dst
    return <char *> tile


cdef inline void store_row(const Operands *o, const float *src, int64_t n, char *dst,
                           int64_t stride) noexcept nogil:
    """Writes back a row that row_target put in a tile."""
    if <const char *> src == dst:
        return
    if o.dtype == DT_F32:
        bnbw_store_f32(src, n, dst, stride)
    elif o.dtype == DT_F16:
        bnbw_store_f16(src, n, dst, stride)
    else:
        bnbw_store_bf16(src, n, dst, stride)


cdef inline float load_stat(const char *base, int dtype, int64_t offset) noexcept nogil:
    cdef float f
    cdef bnbw_f16 h
    cdef bnbw_bf16 b
    if dtype == DT_F32:
        memcpy(&f, base + offset, 4)
        return f
    if dtype == DT_F16:
        memcpy(&h, base + offset, 2)
        return bnbw_f16_to_f32(h)
    memcpy(&b, base + offset, 2)
    return bnbw_bf16_to_f32(b)


cdef inline void store_stat(char *base, int dtype, int64_t offset, double v) noexcept nogil:
    cdef float f
    cdef bnbw_f16 h
    cdef bnbw_bf16 b
    if dtype == DT_F32:
        f = <float> v
        memcpy(base + offset, &f, 4)
    elif dtype == DT_F16:
        h = bnbw_f64_to_f16(v)          # one rounding, straight from f64
        memcpy(base + offset, &h, 2)
    else:
        b = bnbw_f64_to_bf16(v)
        memcpy(base + offset, &b, 2)


# ---------------------------------------------------------------------------------------
# Work items
# ---------------------------------------------------------------------------------------

cdef enum:
    DO_REDUCE = 1
    DO_APPLY = 2     # training dx
    DO_SCALE = 4     # frozen dx


cdef void row_span(const Plan *p, const Operands *o, int64_t c, const int64_t *off,
                   int64_t col, int64_t end, int what, float *tiles,
                   double *sums) noexcept nogil:
    """Columns [col, end) of one channel-major row (channel c, row origin `off`), cut at TILE
    boundaries counted from the row start, the same cuts for every layout and schedule."""
    cdef int64_t n, seg_end
    cdef int64_t sx = p.inner_stride[0], sg = p.inner_stride[1], sd = p.inner_stride[2]
    cdef const char *cx = o.x + chan_origin(p, SLOT_X, c) + off[0]
    cdef const char *cg = o.dy + chan_origin(p, SLOT_DY, c) + off[1]
    cdef char *cd = NULL
    cdef const char *xs = NULL
    cdef const char *gs
    cdef char *ds
    cdef double part[2]
    cdef float mean = o.mean[c]
    if what & (DO_APPLY | DO_SCALE):
        cd = o.dx + chan_origin(p, SLOT_DX, c) + off[2]
    while col < end:
        seg_end = imin((col // TILE + 1) * TILE, end)
        n = seg_end - col
        gs = load_row(o, cg + col * sg, sg, n, tiles + TILE)
        if what & (DO_REDUCE | DO_APPLY):
            xs = load_row(o, cx + col * sx, sx, n, tiles)
        if what & DO_REDUCE:
            bnbw_reduce_row(xs, gs, n, mean, part, o.blocked, o.kdt)
            sums[0] += part[0]
            sums[1] += part[1]
        if what & (DO_APPLY | DO_SCALE):
            ds = row_target(o, cd + col * sd, sd, tiles + 2 * TILE)
            if what & DO_APPLY:
                bnbw_apply_row(xs, gs, ds, n, mean, o.k1[c], o.k2[c], o.k3[c], o.kdt)
            else:
                bnbw_scale_row(gs, ds, n, o.k1[c], o.kdt)
            store_row(o, <const float *> ds, n, cd + col * sd, sd)
        col = seg_end


cdef void major_block(const Plan *p, const Operands *o, int64_t c, int64_t b, int what,
                      float *tiles, double *sums) noexcept nogil:
    """Channel-major item (channel c, block b): the reduced elements [b*block, +block)."""
    cdef int64_t lo = b * p.block
    cdef int64_t hi = imin(lo + p.block, p.count)
    cdef int64_t L = p.inner_size
    cdef int64_t row = lo // L
    cdef int64_t col = lo - row * L
    cdef int64_t pos = lo, end
    cdef int64_t off[3]
    if what & DO_REDUCE:
        sums[0] = 0.0
        sums[1] = 0.0
    while pos < hi:
        row_origin(p, row, off)
        end = imin(L, col + hi - pos)
        row_span(p, o, c, off, col, end, what, tiles, sums)
        pos += end - col
        row += 1
        col = 0


cdef void sweep_block(const Plan *p, const Operands *o, int64_t b, int64_t c_lo, int64_t c_hi,
                      int what, float *tiles, double *partial) noexcept nogil:
    """Channel-major in memory order: the rows of block b (whole rows: p.whole_rows), each for
    channels c_lo..c_hi in turn.  NCX rows of one n and consecutive channels are adjacent, so
    this streams through memory, where a channel at a time reads N short pieces far apart
    (56x56 f32 from DRAM: 27 GB/s a channel at a time, 43 GB/s four channels at once).  The
    block sum of channel c, partial[2*(c*nblocks + b)], adds the same rows in the same order as
    major_block(c, b).  Rows the kernels take in place, of channels a fixed stride apart, go
    to them as one run per outer row (row_run): same row sums, one call instead of c_hi - c_lo.
    Rows longer than TILE go through row_span, which cuts them where every schedule does."""
    cdef int64_t k = p.block // p.inner_size
    cdef int64_t row, c, r_end = imin((b + 1) * k, p.count // p.inner_size)
    cdef int64_t off[3]
    cdef double *sums
    cdef bint runs = (o.direct and p.inner_size <= TILE and p.chan_offset[SLOT_X] == NULL
                      and p.chan_offset[SLOT_DY] == NULL and p.chan_offset[SLOT_DX] == NULL)
    if what & DO_REDUCE:
        for c in range(c_lo, c_hi):
            partial[2 * (c * p.nblocks + b)] = 0.0
            partial[2 * (c * p.nblocks + b) + 1] = 0.0
    for row in range(b * k, r_end):
        row_origin(p, row, off)
        if runs:
            row_run(p, o, off, c_lo, c_hi, what,
                    partial + 2 * (c_lo * p.nblocks + b) if partial != NULL else NULL)
            continue
        for c in range(c_lo, c_hi):
            sums = partial + 2 * (c * p.nblocks + b) if partial != NULL else NULL
            row_span(p, o, c, off, 0, p.inner_size, what, tiles, sums)


cdef inline void row_run(const Plan *p, const Operands *o, const int64_t *off, int64_t c_lo,
                         int64_t c_hi, int what, double *sums) noexcept nogil:
    """The whole rows (shorter than TILE) of channels c_lo..c_hi at row origin `off`, in place,
    one kernel call per step; `sums` is channel c_lo's block sum, the next 2 * nblocks on.
    Row by row it does what row_span does: reduce, then apply or scale."""
    cdef int64_t L = p.inner_size, n = c_hi - c_lo
    cdef int64_t sx = p.chan_stride[SLOT_X], sg = p.chan_stride[SLOT_DY]
    cdef int64_t sd = p.chan_stride[SLOT_DX]
    cdef const char *x = o.x + off[0] + sx * c_lo
    cdef const char *g = o.dy + off[1] + sg * c_lo
    cdef char *d = o.dx + off[2] + sd * c_lo if what & (DO_APPLY | DO_SCALE) else NULL
    if what & DO_REDUCE:
        bnbw_reduce_row_run(x, sx, g, sg, L, n, o.mean + c_lo, sums, 2 * p.nblocks, o.blocked,
                            o.kdt)
    if what & DO_APPLY:
        bnbw_apply_row_run(x, sx, g, sg, d, sd, L, n, o.mean + c_lo, o.k1 + c_lo, o.k2 + c_lo,
                           o.k3 + c_lo, o.kdt)
    elif what & DO_SCALE:
        bnbw_scale_row_run(g, sg, d, sd, L, n, o.k1 + c_lo, o.kdt)


cdef inline const char *stage_rows(const Plan *p, const Operands *o, const char *base, int t,
                                   int64_t r0, int64_t nr, int64_t c0, int64_t w, float *tile,
                                   int64_t *row_stride) noexcept nogil:
    """Rows r0..r0+nr of channels c0..c0+w of operand t, `row_stride` elements apart: in
    place when o.direct, else gathered (and converted) into `tile` as f32."""
    cdef int64_t off[3]
    cdef int64_t isz = itemsize(p.big_dtype), i
    row_origin(p, r0, off)
    if o.direct:
        row_stride[0] = p.outer_stride[t][0] // isz if p.n_outer == 1 else w
        return base + off[t] + c0 * isz
    row_stride[0] = w
    if p.n_outer == 1 and p.outer_stride[t][0] == w * isz:
        return load_row(o, base + off[t] + c0 * isz, isz, nr * w, tile)   # packed
    for i in range(nr):
        if i:
            row_origin(p, r0 + i, off)
        copy_row(o, base + off[t] + c0 * isz, isz, w, tile + i * w)
    return <const char *> tile


cdef inline void unstage_rows(const Plan *p, const Operands *o, int64_t r0, int64_t nr,
                              int64_t c0, int64_t w, const float *tile) noexcept nogil:
    cdef int64_t off[3]
    cdef int64_t isz = itemsize(p.big_dtype), i
    row_origin(p, r0, off)
    if p.n_outer == 1 and p.outer_stride[2][0] == w * isz:
        store_row(o, tile, nr * w, o.dx + off[2] + c0 * isz, isz)
        return
    for i in range(nr):
        if i:
            row_origin(p, r0 + i, off)
        store_row(o, tile + i * w, w, o.dx + off[2] + c0 * isz, isz)


cdef void last_block(const Plan *p, const Operands *o, int64_t rb, int64_t grp, int what,
                     float *tiles, double *sum_g, double *sum_xg) noexcept nogil:
    """Channel-last item (row block rb, channel group grp).  Rows go to the kernels in slabs:
    direct rows at one stride in place (the whole block at once), anything else staged
    through the tiles, TILE // w rows at a time.  Sums accumulate row by row, in row order,
    into the block's own partial arrays, whatever the slab size."""
    cdef int64_t c0 = grp * p.group
    cdef int64_t w = imin(p.group, p.channels - c0)
    cdef int64_t r0 = rb * p.block, nr
    cdef int64_t r_end = imin((rb + 1) * p.block, p.count)
    cdef int64_t isz = itemsize(p.big_dtype)
    cdef const char *xs = NULL
    cdef const char *gs
    cdef char *ds
    cdef int64_t xr = 0, gr, dr
    cdef int64_t off[3]
    while r0 < r_end:
        if not o.direct:
            # blocked sums: whole blocks per slab, as the direct call has them
            nr = TILE // w - (TILE // w) % BNBW_BLOCK_ROWS if o.blocked else TILE // w
            nr = imin(nr, r_end - r0)
        elif p.n_outer <= 1:
            nr = r_end - r0
        else:
            nr = 1                 # rows that do not share one stride: one at a time
        gs = stage_rows(p, o, o.dy, 1, r0, nr, c0, w, tiles + TILE, &gr)
        if what & (DO_REDUCE | DO_APPLY):
            xs = stage_rows(p, o, o.x, 0, r0, nr, c0, w, tiles, &xr)
        if what & DO_REDUCE:
            bnbw_reduce_rows(xs, xr, gs, gr, nr, w, o.mean + c0, sum_g + c0, sum_xg + c0,
                             o.streaming, o.blocked, o.kdt)
        if what & (DO_APPLY | DO_SCALE):
            if o.direct:
                row_origin(p, r0, off)
                ds = o.dx + off[2] + c0 * isz
                dr = p.outer_stride[2][0] // isz if p.n_outer == 1 else w
            else:
                ds = <char *> (tiles + 2 * TILE)
                dr = w
            if what & DO_APPLY:
                bnbw_apply_rows(xs, xr, gs, gr, ds, dr, nr, w, o.mean + c0, o.k1 + c0,
                                o.k2 + c0, o.k3 + c0, o.kdt)
            else:
                bnbw_scale_rows(gs, gr, ds, dr, nr, w, o.k1 + c0, o.kdt)
            if not o.direct:
                unstage_rows(p, o, r0, nr, c0, w, <const float *> ds)
        r0 += nr


cdef inline void coefficients(int op, double sum_g, double sum_xg, double count, float var,
                              float scale, double eps, float *k1, float *k2, float *k3,
                              double *dscale, double *dbias) noexcept nogil:
    """The only place where the formulas of SPEC 1 meet the sums."""
    cdef double r = 1.0 / sqrt(<double> var + eps)
    cdef double sr = <double> scale * r
    dbias[0] = sum_g
    dscale[0] = r * sum_xg
    k1[0] = <float> sr
    if op & OP_TRAINING and count > 0:
        k2[0] = <float> (-sr * r * dscale[0] / count)
        k3[0] = <float> (-sr * sum_g / count)
    else:
        k2[0] = 0.0
        k3[0] = 0.0


# ---------------------------------------------------------------------------------------
# execute
# ---------------------------------------------------------------------------------------

cdef int plan_execute(const Plan *p, char **ptr, int op, double eps, double count,
                      double *sums_io, int nthreads) noexcept nogil:
    """Run one operation (Op flags) on the operands ptr[N_SLOTS] (NULL scale means 1).
    `count` is M of the formula (the global count in two-phase use).  Returns 0 or -1 (out of
    memory; nothing written then except possibly dx)."""
    cdef char *slots[N_SLOTS]
    cdef char *temp
    cdef int rc
    if not (p.dx_via_temp and op & OP_WRITE_DX):
        return _plan_run(p, ptr, op, eps, count, sums_io, nthreads)
    temp = <char *> malloc(p.temp_bytes)
    if temp == NULL:
        return -1
    memcpy(slots, ptr, N_SLOTS * sizeof(char *))
    slots[SLOT_DX] = temp - p.temp_low
    rc = _plan_run(p, slots, op, eps, count, sums_io, nthreads)
    if rc == 0:
        _copy_strided(p.ndim, p.sizes, slots[SLOT_DX], p.temp_strides, ptr[SLOT_DX],
                      p.dx_strides, itemsize(p.big_dtype))
    free(temp)
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


cdef int _plan_run(const Plan *p, char **ptr, int op, double eps, double count,
                   double *sums_io, int nthreads) noexcept nogil:
    """plan_execute on the operands the plan was laid out for."""
    cdef int64_t C = p.channels, c, b, i, n_items
    cdef Operands o
    cdef float *stats = NULL
    cdef double *sums = NULL
    cdef double *partial = NULL
    cdef double *dscale = NULL
    cdef double *dbias = NULL
    cdef float *tiles = NULL
    cdef Pass w
    cdef int nt, rc = 0
    cdef bint fused, need_sums = op & OP_COMPUTE_SUMS
    cdef bint write_dx = (op & OP_WRITE_DX) and not p.empty
    cdef bint want_coef = (op & (OP_WRITE_DX | OP_WRITE_PARAMS)) != 0   # reduce-only: none
    if C == 0:
        return 0

    stats = <float *> malloc(4 * C * sizeof(float))
    sums = <double *> calloc(4 * C, sizeof(double))
    if stats == NULL or sums == NULL:
        free(stats)
        free(sums)
        return -1
    dscale = sums + 2 * C
    dbias = sums + 3 * C
    o.x = ptr[SLOT_X]
    o.dy = ptr[SLOT_DY]
    o.dx = ptr[SLOT_DX]
    o.mean = stats
    o.k1 = stats + C
    o.k2 = stats + 2 * C
    o.k3 = stats + 3 * C
    o.dtype = p.big_dtype
    o.direct = _direct(p)
    o.kdt = p.big_dtype if o.direct else DT_F32
    o.blocked = BNBW_EXACT_SUMS if op & OP_EXACT_SUMS else _blocked_sums(p)
    o.streaming = 2 * itemsize(p.big_dtype) * C * p.count > 2 * FUSE_MIN
    for c in range(C):
        o.mean[c] = load_stat(ptr[SLOT_MEAN], p.stat_dtype, chan_origin(p, SLOT_MEAN, c))
    if op & OP_GIVEN_SUMS:
        memcpy(sums, sums_io, 2 * C * sizeof(double))

    nt = nthreads
    if p.empty or C * p.count < SERIAL_BELOW:
        nt = 1
    if p.channel_last:
        n_items = p.nblocks * p.ngroups
    else:
        n_items = C * p.nblocks
    if nt > n_items:
        nt = <int> n_items if n_items > 0 else 1
    fused = (not p.channel_last and need_sums and write_dx and op & OP_TRAINING
             and C >= 2 * nt)
    if want_coef and (not (op & OP_TRAINING) or not need_sums):
        # frozen statistics (or given sums): the constants are known before any pass
        _all_coefficients(p, ptr, op, eps, count, &o, sums, dscale, dbias)

    if not p.empty and (need_sums or write_dx):
        tiles = <float *> malloc(nt * 3 * TILE * sizeof(float))
        if p.channel_last and need_sums:
            partial = <double *> calloc(2 * C * p.nblocks, sizeof(double))
        elif need_sums and not (fused and not _sweeps(p)):
            partial = <double *> malloc(2 * C * p.nblocks * sizeof(double))
        if tiles == NULL or (need_sums and partial == NULL and not (fused and not _sweeps(p))):
            rc = -1
    if rc == 0 and not p.empty and (need_sums or write_dx):
        w.p = p
        w.o = &o
        w.ptr = ptr
        w.op = op
        w.eps = eps
        w.count = count
        w.sums = sums
        w.dscale = dscale
        w.dbias = dbias
        w.partial = partial
        w.what = 0
        if need_sums:
            w.what = DO_REDUCE
        if write_dx and not (op & OP_TRAINING):
            w.what = w.what | DO_SCALE     # frozen: dx in the same pass as the sums
        if fused and _sweeps(p):
            w.group = _fused_group(p, nt)
            w.ngroups = (C + w.group - 1) // w.group
            run_items(&w, _fused_group_item, w.ngroups, nt, tiles)
        elif fused:
            run_items(&w, _fused_item, C, nt, tiles)
        elif w.what:
            _pass(&w, nt, tiles)
        if need_sums and not fused:
            for c in range(C):     # serial: C x nblocks additions, a tiny fraction of a pass;
                _combine_item(&w, c, tiles)    # in parallel (2048 channels) it cost 50 us
            if want_coef:
                _all_coefficients(p, ptr, op, eps, count, &o, sums, dscale, dbias)
        if write_dx and op & OP_TRAINING and not fused:
            w.what = DO_APPLY
            w.partial = NULL
            _pass(&w, nt, tiles)
    elif rc == 0 and want_coef and op & OP_TRAINING and need_sums:
        _all_coefficients(p, ptr, op, eps, count, &o, sums, dscale, dbias)   # M == 0

    if rc == 0:
        if op & OP_RETURN_SUMS:
            memcpy(sums_io, sums, 2 * C * sizeof(double))
        if op & OP_WRITE_PARAMS:
            for c in range(C):
                store_stat(ptr[SLOT_DSCALE], p.stat_dtype, chan_origin(p, SLOT_DSCALE, c),
                           dscale[c])
                store_stat(ptr[SLOT_DBIAS], p.stat_dtype, chan_origin(p, SLOT_DBIAS, c),
                           dbias[c])
    free(tiles)
    free(partial)
    free(stats)
    free(sums)
    return rc


cdef bint _direct(const Plan *p) noexcept nogil:
    """Whether the kernels can take x, dy and dx where they lie: rows of unit stride in a
    storage type they read, and (channel-last) row strides whole in elements."""
    cdef int64_t isz = itemsize(p.big_dtype)
    cdef int t
    if not bnbw_kernels_take(p.big_dtype):
        return False
    for t in range(3):
        if p.inner_stride[t] != isz and p.inner_size > 1:
            return False
        if p.channel_last and p.n_outer == 1 and p.outer_stride[t][0] % isz != 0:
            return False
    return True


cdef int _blocked_sums(const Plan *p) noexcept nogil:
    """f16 and bf16 sums go through f32 blocks (bnbw_kernels.h: 4.5 widening operations per 16
    halves instead of 12, and a half's own precision is far coarser), bf16 in the lane order it
    loads cheapest - on every path, staged f32 rows included.  A block must span the same terms
    on every path: channel-major rows are cut alike everywhere (row_span), and channel-last
    slabs hold whole blocks - except rows that do not share one stride, which go to the kernels
    one at a time and so keep f64 terms."""
    if p.big_dtype == DT_F32 or (p.channel_last and p.n_outer > 1):
        return BNBW_EXACT_SUMS
    return BNBW_BLOCKS_EVEN_ODD if p.big_dtype == DT_BF16 else BNBW_BLOCKS


cdef inline bint _sweeps(const Plan *p) noexcept nogil:
    """Channel-major passes go in memory order (sweep_block) wherever a block holds whole
    rows; rows longer than a block go a channel at a time (major_block), already long streams."""
    return p.whole_rows


ctypedef struct Pass:          # one pass over the work items: what every item needs
    const Plan *p
    Operands *o
    char **ptr
    int op
    int what            # DO_* flags
    double eps
    double count
    double *sums        # [C][2] f64 channel sums
    double *dscale
    double *dbias
    double *partial     # block sums (NULL when the pass keeps none)
    int64_t group       # memory-order sweep: channels per item
    int64_t ngroups

ctypedef void (*ItemFn)(const Pass *w, int64_t i, float *tiles) noexcept nogil


cdef void run_items(const Pass *w, ItemFn item, int64_t n, int nt, float *tiles) noexcept nogil:
    """item(w, i, the running thread's tiles) for every i < n.  One thread runs them in this
    thread: even a one-thread OpenMP region costs microseconds, more than a tiny call's work.
    Items write disjoint outputs and never depend on the thread that runs them."""
    cdef int64_t i
    if nt <= 1:
        for i in range(n):
            item(w, i, tiles)
    else:
        for i in prange(n, num_threads=nt, schedule='dynamic'):
            item(w, i, tiles + bnbw_omp_thread_num() * 3 * TILE)


cdef void _pass(Pass *w, int nt, float *tiles) noexcept nogil:
    """One pass of w.what over every block of the plan; block sums go to w.partial."""
    cdef const Plan *p = w.p
    if p.channel_last:
        run_items(w, _last_item, p.nblocks * p.ngroups, nt, tiles)
    elif _sweeps(p):
        w.group = (p.channels + 4 * nt - 1) // (4 * nt)      # about 4 items per thread
        w.ngroups = (p.channels + w.group - 1) // w.group
        run_items(w, _sweep_item, p.nblocks * w.ngroups, nt, tiles)
    else:
        run_items(w, _major_item, p.channels * p.nblocks, nt, tiles)


cdef void _last_item(const Pass *w, int64_t i, float *tiles) noexcept nogil:
    cdef const Plan *p = w.p
    cdef double *block_sums = NULL
    if w.partial != NULL:
        block_sums = w.partial + 2 * p.channels * (i // p.ngroups)
    last_block(p, w.o, i // p.ngroups, i % p.ngroups, w.what, tiles, block_sums,
               block_sums + p.channels if block_sums != NULL else NULL)


cdef void _sweep_item(const Pass *w, int64_t i, float *tiles) noexcept nogil:
    sweep_block(w.p, w.o, i // w.ngroups, (i % w.ngroups) * w.group,
                imin(w.p.channels, (i % w.ngroups + 1) * w.group), w.what, tiles, w.partial)


cdef void _major_item(const Pass *w, int64_t i, float *tiles) noexcept nogil:
    major_block(w.p, w.o, i // w.p.nblocks, i % w.p.nblocks, w.what, tiles,
                w.partial + 2 * i if w.partial != NULL else NULL)


cdef void _combine_item(const Pass *w, int64_t c, float *tiles) noexcept nogil:
    """Channel c's sums: its block sums added in block order."""
    cdef const Plan *p = w.p
    cdef int64_t b, C = p.channels
    cdef double acc_g = 0.0, acc_xg = 0.0
    for b in range(p.nblocks):
        if p.channel_last:
            acc_g = acc_g + w.partial[2 * C * b + c]
            acc_xg = acc_xg + w.partial[2 * C * b + C + c]
        else:
            acc_g = acc_g + w.partial[2 * (c * p.nblocks + b)]
            acc_xg = acc_xg + w.partial[2 * (c * p.nblocks + b) + 1]
    w.sums[2 * c] = acc_g
    w.sums[2 * c + 1] = acc_xg


cdef int64_t _fused_group(const Plan *p, int nt) noexcept nogil:
    """Channels per fused item: as many as keep the group's x and dy within this thread's
    share of FUSE_BYTES (FUSE_MIN at least), and at least two items per thread."""
    cdef int64_t budget = FUSE_BYTES // nt if FUSE_BYTES // nt > FUSE_MIN else FUSE_MIN
    cdef int64_t g = budget // (2 * itemsize(p.big_dtype) * p.count)
    cdef int64_t most = (p.channels + 2 * nt - 1) // (2 * nt)
    if g > most:
        g = most
    return g if g > 0 else 1


cdef void _fused_group_item(const Pass *w, int64_t g, float *tiles) noexcept nogil:
    """Fused schedule over whole rows: reduce channels [c_lo, c_hi) in memory order (their
    rows of one outer index are adjacent), finish their sums and coefficients, then apply
    them while their rows are still cached.  The block sums are those of the split schedule,
    added in the same block order."""
    cdef const Plan *p = w.p
    cdef int64_t b, c
    cdef int64_t c_lo = g * w.group
    cdef int64_t c_hi = imin(p.channels, c_lo + w.group)
    for b in range(p.nblocks):
        sweep_block(p, w.o, b, c_lo, c_hi, DO_REDUCE, tiles, w.partial)
    for c in range(c_lo, c_hi):
        _combine_item(w, c, tiles)
        _channel_coefficients(p, w.ptr, w.op, w.eps, w.count, w.o, c, w.sums, w.dscale,
                              w.dbias)
    for b in range(p.nblocks - 1, -1, -1):     # newest blocks first: they are still cached
        sweep_block(p, w.o, b, c_lo, c_hi, DO_APPLY, tiles, NULL)


cdef void _fused_item(const Pass *w, int64_t c, float *tiles) noexcept nogil:
    _fused_channel(w.p, w.o, w.ptr, w.op, w.eps, w.count, c, tiles, w.sums, w.dscale,
                   w.dbias)


cdef void _channel_coefficients(const Plan *p, char **ptr, int op, double eps, double count,
                                Operands *o, int64_t c, double *sums, double *dscale,
                                double *dbias) noexcept nogil:
    cdef float var = load_stat(ptr[SLOT_VAR], p.stat_dtype, chan_origin(p, SLOT_VAR, c))
    cdef float scale = 1.0
    if ptr[SLOT_SCALE] != NULL:
        scale = load_stat(ptr[SLOT_SCALE], p.stat_dtype, chan_origin(p, SLOT_SCALE, c))
    coefficients(op, sums[2 * c], sums[2 * c + 1], count, var, scale, eps,
                 &o.k1[c], &o.k2[c], &o.k3[c], &dscale[c], &dbias[c])


cdef void _all_coefficients(const Plan *p, char **ptr, int op, double eps, double count,
                            Operands *o, double *sums, double *dscale,
                            double *dbias) noexcept nogil:
    cdef int64_t c
    for c in range(p.channels):
        _channel_coefficients(p, ptr, op, eps, count, o, c, sums, dscale, dbias)


cdef void _fused_channel(const Plan *p, Operands *o, char **ptr, int op, double eps,
                         double count, int64_t c, float *tiles, double *sums, double *dscale,
                         double *dbias) noexcept nogil:
    """Reduce channel c, then apply it while its rows are still in cache.  The block sums are
    added in block order, exactly as the split schedule's combine step does."""
    cdef int64_t b
    cdef double part[2]
    cdef double acc_g = 0.0, acc_xg = 0.0
    for b in range(p.nblocks):
        major_block(p, o, c, b, DO_REDUCE, tiles, part)
        acc_g = acc_g + part[0]
        acc_xg = acc_xg + part[1]
    sums[2 * c] = acc_g
    sums[2 * c + 1] = acc_xg
    _channel_coefficients(p, ptr, op, eps, count, o, c, sums, dscale, dbias)
    for b in range(p.nblocks - 1, -1, -1):     # newest blocks first: they are still cached
        major_block(p, o, c, b, DO_APPLY, tiles, NULL)


# ---------------------------------------------------------------------------------------
# Python surface (private: the front-ends validate everything before they get here)
# ---------------------------------------------------------------------------------------

DTYPE_CODES = {"float32": DT_F32, "float16": DT_F16, "bfloat16": DT_BF16}

OP_FLAGS = {
    "compute_sums": OP_COMPUTE_SUMS, "given_sums": OP_GIVEN_SUMS, "training": OP_TRAINING,
    "write_dx": OP_WRITE_DX, "write_params": OP_WRITE_PARAMS, "return_sums": OP_RETURN_SUMS,
    "exact_sums": OP_EXACT_SUMS,
}


cdef inline char *_address(object operand) except? NULL:
    if operand is None:
        return NULL
    if cnp.PyArray_Check(operand):
        return <char *> cnp.PyArray_DATA(<cnp.ndarray> operand)
    return <char *> <size_t> operand


cdef class Engine:
    """A plan over sizes, strides (bytes, one row per operand slot) and the reduced-dims mask,
    executed on any addresses with those strides."""
    cdef Plan plan

    def __cinit__(self, sizes, reduced, strides, int big_dtype, int stat_dtype):
        cdef int64_t c_sizes[MAX_DIMS]
        cdef unsigned char c_reduced[MAX_DIMS]
        cdef int64_t c_strides[N_SLOTS * MAX_DIMS]
        cdef int ndim = len(sizes), d, t, rc
        for t in range(N_SLOTS):
            self.plan.chan_offset[t] = NULL
        if not 1 <= ndim <= MAX_DIMS:
            raise ValueError("the engine takes 1 to 8 dimensions")
        for d in range(ndim):
            c_sizes[d] = sizes[d]
            c_reduced[d] = bool(reduced[d])
            for t in range(N_SLOTS):
                c_strides[t * MAX_DIMS + d] = strides[t][d]
        with nogil:
            rc = plan_build(&self.plan, ndim, c_sizes, c_reduced, c_strides, big_dtype,
                            stat_dtype)
        if rc != 0:
            raise MemoryError("bnbw_native: out of memory while planning")

    def __dealloc__(self):
        plan_free(&self.plan)

    @property
    def kind(self):
        if self.plan.empty:
            return "empty"
        return "channel-last" if self.plan.channel_last else "channel-major"

    @property
    def channels(self):
        return self.plan.channels

    @property
    def count(self):
        return self.plan.count

    @property
    def blocks(self):
        return self.plan.nblocks

    def execute(self, operands, int op, double eps, double count, sums=None, int num_threads=1):
        """operands: N_SLOTS entries, each an ndarray, an integer address or None."""
        cdef char *ptr[N_SLOTS]
        cdef double *sums_ptr = NULL
        cdef int t, rc
        for t in range(N_SLOTS):
            ptr[t] = _address(operands[t])
        if sums is not None:
            sums_ptr = <double *> cnp.PyArray_DATA(<cnp.ndarray> sums)
        with nogil:
            rc = plan_execute(&self.plan, ptr, op, eps, count, sums_ptr, num_threads)
        if rc != 0:
            raise MemoryError("bnbw_native: out of memory for the reduction buffers")


def omp_max_threads():
    """What OpenMP would use now (read per call, so threadpoolctl limits are seen)."""
    return bnbw_omp_max_threads()


def build_info():
    return {
        "openmp": bnbw_openmp_version(),
        "kernels": bnbw_body_name(bnbw_body()).decode(),
        "cpu_kernels": bnbw_body_name(bnbw_cpu_body()).decode(),
        "half_path": bnbw_half_simd_path().decode(),
    }


def _set_body_cap(int cap):
    """Run this module's kernels and conversions on the best body up to `cap` (0 portable,
    1 AVX2, 2 AVX-512); bnbw_native._config.use_kernels sets every module at once."""
    bnbw_set_body_cap(cap)


cdef int omp_max_threads_nogil() noexcept nogil:
    return bnbw_omp_max_threads()


cdef inline void _bounds(cnp.ndarray a, Py_ssize_t *lo, Py_ssize_t *hi) noexcept:
    cdef Py_ssize_t extent
    cdef int d
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(a)
    cdef cnp.npy_intp *strides = cnp.PyArray_STRIDES(a)
    lo[0] = <Py_ssize_t> cnp.PyArray_DATA(a)
    hi[0] = lo[0]
    for d in range(cnp.PyArray_NDIM(a)):
        if shape[d] == 0:
            return
        extent = (shape[d] - 1) * strides[d]
        if extent < 0:
            lo[0] += extent
        else:
            hi[0] += extent
    hi[0] += cnp.PyArray_ITEMSIZE(a)


def memory_bounds(cnp.ndarray a):
    """(low, high): the byte range [low, high) an array's elements occupy; low == high when
    the array is empty.  The fast twin of numpy's byte_bounds, for the overlap checks."""
    cdef Py_ssize_t lo, hi
    _bounds(a, &lo, &hi)
    return lo, hi


# ---- the fast path of a call ------------------------------------------------------------

cdef extern from "numpy/arrayobject.h":
    object PyArray_NewLikeArray(cnp.ndarray prototype, cnp.NPY_ORDER order, void *descr,
                                int subok)


cdef inline bint _plain(object a, int low_rank, int high_rank) noexcept:
    """A plain ndarray the engine reads in place: exact type, aligned, native byte order."""
    if not cnp.PyArray_CheckExact(a):
        return False
    cdef cnp.ndarray arr = <cnp.ndarray> a
    return (low_rank <= cnp.PyArray_NDIM(arr) <= high_rank and cnp.PyArray_ISALIGNED(arr)
            and cnp.PyArray_ISNOTSWAPPED(arr))


cdef int _bfloat16_type = -1      # ml_dtypes' bfloat16, a user dtype: its number once seen


cdef int _dtype_code(cnp.ndarray a) except -2:
    """The engine's code for a's dtype, or -1 (the general path decides)."""
    global _bfloat16_type
    cdef int t = cnp.PyArray_TYPE(a)
    if t == cnp.NPY_FLOAT:
        return DT_F32
    if t == cnp.NPY_FLOAT16:
        return DT_F16
    if t == _bfloat16_type:
        return DT_BF16
    if _bfloat16_type < 0 and t >= 256 and a.dtype.name == "bfloat16":    # NPY_USERDEF
        _bfloat16_type = t          # the name is what the general path goes by too
        return DT_BF16
    return -1


cdef inline bint _same_view(cnp.ndarray a, cnp.ndarray b) noexcept:
    cdef int d
    if (cnp.PyArray_DATA(a) != cnp.PyArray_DATA(b) or cnp.PyArray_TYPE(a) != cnp.PyArray_TYPE(b)
            or cnp.PyArray_NDIM(a) != cnp.PyArray_NDIM(b)):
        return False
    for d in range(cnp.PyArray_NDIM(a)):
        if (cnp.PyArray_DIMS(a)[d] != cnp.PyArray_DIMS(b)[d]
                or cnp.PyArray_STRIDES(a)[d] != cnp.PyArray_STRIDES(b)[d]):
            return False
    return True


cdef bint _distinct(cnp.ndarray a) noexcept:
    cdef cnp.npy_intp stride[MAX_DIMS]
    cdef cnp.npy_intp size[MAX_DIMS]
    cdef cnp.npy_intp extent = cnp.PyArray_ITEMSIZE(a), s, n
    cdef int d, k = 0, j
    if cnp.PyArray_SIZE(a) <= 1:
        return True
    if cnp.PyArray_NDIM(a) > MAX_DIMS:
        return False           # the callers never get here; refuse rather than overflow
    for d in range(cnp.PyArray_NDIM(a)):
        if cnp.PyArray_DIMS(a)[d] > 1:
            s = cnp.PyArray_STRIDES(a)[d]
            n = cnp.PyArray_DIMS(a)[d]
            j = k                                  # insertion sort by |stride|
            while j > 0 and stride[j - 1] > (s if s >= 0 else -s):
                stride[j] = stride[j - 1]
                size[j] = size[j - 1]
                j -= 1
            stride[j] = s if s >= 0 else -s
            size[j] = n
            k += 1
    for d in range(k):
        if stride[d] < extent:
            return False
        extent += stride[d] * (size[d] - 1)
    return True


def distinct_elements(cnp.ndarray a):
    """True when the elements of `a` provably occupy distinct bytes: sorted by |stride|,
    every stride clears the span of the smaller ones (zero strides never do)."""
    return _distinct(a)


cdef bint _fits_output(object a, int type_num, int ndim, const cnp.npy_intp *shape) noexcept:
    """An output the fast path can prove valid: a plain, writable array of exactly this dtype
    and shape whose elements do not overlap each other."""
    if not _plain(a, ndim, ndim):
        return False
    cdef cnp.ndarray arr = <cnp.ndarray> a
    if (cnp.PyArray_TYPE(arr) != type_num or not cnp.PyArray_ISWRITEABLE(arr)
            or not _distinct(arr)):
        return False
    return cnp.PyArray_CompareLists(cnp.PyArray_DIMS(arr), shape, ndim) != 0


def fast_backward(x, dy, mean, var, scale, epsilon, bint channel_last, int op,
                  bint ignore_scale, out, num_threads, resolve_threads, bint graph_rule,
                  int low_rank, int high_rank):
    """The common call - plain NumPy f32/f16/bf16 arrays, a float epsilon, fresh or given outputs
    apart from everything else - checked and run with no Python in between, for tiny tensors where the
    general path's checks cost more than the work.  Returns (dx, dscale, dbias), or None when
    the call is anything else (or invalid): the general path then runs it or raises, so every
    error message keeps one source.  The checks accept a subset of what the general path
    accepts; test_fast_path.py holds the two to the same answers."""
    cdef cnp.ndarray X, DY, arr
    cdef int ndim, d, t, k, big, stat_type, stat_code, rc, nthreads
    cdef int n_out = 3 if op & OP_WRITE_PARAMS else 1
    cdef cnp.npy_intp C
    cdef double eps
    cdef float eps32
    cdef Plan plan
    cdef int64_t c_sizes[MAX_DIMS]
    cdef unsigned char c_reduced[MAX_DIMS]
    cdef int64_t c_strides[N_SLOTS * MAX_DIMS]
    cdef char *ptr[N_SLOTS]
    cdef Py_ssize_t lo[N_SLOTS]
    cdef Py_ssize_t hi[N_SLOTS]

    # inputs
    if not (_plain(x, low_rank, high_rank) and _plain(dy, low_rank, high_rank)):
        return None
    X = <cnp.ndarray> x
    DY = <cnp.ndarray> dy
    ndim = cnp.PyArray_NDIM(X)
    big = _dtype_code(X)
    if (big < 0 or cnp.PyArray_TYPE(DY) != cnp.PyArray_TYPE(X) or cnp.PyArray_NDIM(DY) != ndim
            or not cnp.PyArray_CompareLists(cnp.PyArray_DIMS(X), cnp.PyArray_DIMS(DY), ndim)):
        return None
    C = cnp.PyArray_DIMS(X)[ndim - 1 if channel_last else 1]
    stats = [mean, var, scale]
    if not _plain(mean, 1, 1):
        return None
    stat_type = cnp.PyArray_TYPE(<cnp.ndarray> mean)
    if graph_rule:      # T2 = f32 with any T1, or T2 = T1 = bf16
        if not (stat_type == cnp.NPY_FLOAT
                or (big == DT_BF16 and stat_type == cnp.PyArray_TYPE(X))):
            return None
    elif stat_type != cnp.PyArray_TYPE(X):      # one type for every tensor
        return None
    for obj in stats:
        if obj is None and obj is scale:      # scale None means 1; any other None: decline
            continue
        if (not _plain(obj, 1, 1) or cnp.PyArray_TYPE(<cnp.ndarray> obj) != stat_type
                or cnp.PyArray_DIMS(<cnp.ndarray> obj)[0] != C):
            return None
    if type(epsilon) is not float:
        return None
    eps = epsilon
    if not (0.0 < eps < 3.0e38):           # beyond f32 range or not positive: general path
        return None
    eps32 = <float> eps
    if not eps32 > 0:                      # rounds to zero in f32
        return None
    if num_threads is not None and not (type(num_threads) is int and num_threads > 0):
        return None
    nthreads = resolve_threads(num_threads)

    # outputs
    if out is None:
        results = [PyArray_NewLikeArray(X, cnp.NPY_KEEPORDER, NULL, 0)]
        if n_out == 3:
            results.append(cnp.PyArray_EMPTY(1, &C, stat_type, 0))
            results.append(cnp.PyArray_EMPTY(1, &C, stat_type, 0))
    else:
        if type(out) is not tuple and type(out) is not list or len(out) != n_out:
            return None
        results = list(out)
        if not _fits_output(results[0], cnp.PyArray_TYPE(X), ndim, cnp.PyArray_DIMS(X)):
            return None
        for t in range(1, n_out):
            if not _fits_output(results[t], stat_type, 1, &C):
                return None
        # every output apart from every other operand, dx = dy itself excepted
        operands = [x, dy, mean, var, scale] + results
        for t in range(len(operands)):
            if operands[t] is None:
                lo[t] = hi[t] = 0
            else:
                _bounds(<cnp.ndarray> operands[t], &lo[t], &hi[t])
        for t in range(5, 5 + n_out):
            for k in range(5 + n_out):
                if k == t or lo[t] == hi[t] or lo[k] == hi[k] or hi[t] <= lo[k] or hi[k] <= lo[t]:
                    continue
                if t == 5 and k == 1 and _same_view(<cnp.ndarray> operands[t], DY):
                    continue
                return None

    # plan and run
    stat_code = _dtype_code(<cnp.ndarray> mean)
    for d in range(ndim):
        c_sizes[d] = cnp.PyArray_DIMS(X)[d]
        c_reduced[d] = d != (ndim - 1 if channel_last else 1)
        for t in range(N_SLOTS):
            c_strides[t * MAX_DIMS + d] = 0
        c_strides[SLOT_X * MAX_DIMS + d] = cnp.PyArray_STRIDES(X)[d]
        c_strides[SLOT_DY * MAX_DIMS + d] = cnp.PyArray_STRIDES(DY)[d]
        c_strides[SLOT_DX * MAX_DIMS + d] = cnp.PyArray_STRIDES(<cnp.ndarray> results[0])[d]
    d = ndim - 1 if channel_last else 1
    for t, obj in ((SLOT_MEAN, mean), (SLOT_VAR, var), (SLOT_SCALE, scale)):
        if obj is not None:
            c_strides[t * MAX_DIMS + d] = cnp.PyArray_STRIDES(<cnp.ndarray> obj)[0]
    if n_out == 3:
        c_strides[SLOT_DSCALE * MAX_DIMS + d] = cnp.PyArray_STRIDES(<cnp.ndarray> results[1])[0]
        c_strides[SLOT_DBIAS * MAX_DIMS + d] = cnp.PyArray_STRIDES(<cnp.ndarray> results[2])[0]
    ptr[SLOT_X] = <char *> cnp.PyArray_DATA(X)
    ptr[SLOT_DY] = <char *> cnp.PyArray_DATA(DY)
    ptr[SLOT_DX] = <char *> cnp.PyArray_DATA(<cnp.ndarray> results[0])
    ptr[SLOT_MEAN] = <char *> cnp.PyArray_DATA(<cnp.ndarray> mean)
    ptr[SLOT_VAR] = <char *> cnp.PyArray_DATA(<cnp.ndarray> var)
    ptr[SLOT_SCALE] = NULL
    if scale is not None and not ignore_scale:
        ptr[SLOT_SCALE] = <char *> cnp.PyArray_DATA(<cnp.ndarray> scale)
    ptr[SLOT_DSCALE] = ptr[SLOT_DBIAS] = NULL
    if n_out == 3:
        ptr[SLOT_DSCALE] = <char *> cnp.PyArray_DATA(<cnp.ndarray> results[1])
        ptr[SLOT_DBIAS] = <char *> cnp.PyArray_DATA(<cnp.ndarray> results[2])
    for t in range(N_SLOTS):
        plan.chan_offset[t] = NULL
    with nogil:
        rc = plan_build(&plan, ndim, c_sizes, c_reduced, c_strides, big, stat_code)
        if rc == 0:
            rc = plan_execute(&plan, ptr, op, eps32, <double> plan.count, NULL, nthreads)
        plan_free(&plan)
    if rc != 0:
        raise MemoryError("bnbw_native: out of memory")
    if n_out == 3:
        return results[0], results[1], results[2]
    return results[0], None, None
