# The engine's C-level types, shared by _core.pyx and (later) the C API table.
from libc.stdint cimport int64_t

cdef enum:
    MAX_DIMS = 8
    # operand slots: three big tensors, then the per-channel statistics tensors
    SLOT_X = 0
    SLOT_DY = 1
    SLOT_DX = 2
    SLOT_MEAN = 3
    SLOT_VAR = 4
    SLOT_SCALE = 5
    SLOT_DSCALE = 6
    SLOT_DBIAS = 7
    N_SLOTS = 8

cdef enum DType:
    DT_F32 = 0
    DT_F16 = 1
    DT_BF16 = 2

# What one execute() call does (bit flags, combined by the front-ends).
cdef enum Op:
    OP_COMPUTE_SUMS = 1    # reduce x, dy into Sum dy, Sum (x - mean) dy
    OP_GIVEN_SUMS = 2      # take the sums from the caller (two-phase apply)
    OP_TRAINING = 4        # training formula for dx (else frozen statistics)
    OP_WRITE_DX = 8
    OP_WRITE_PARAMS = 16   # write dscale, dbias
    OP_RETURN_SUMS = 32    # copy the sums out (two-phase reduce)
    OP_EXACT_SUMS = 64     # every term in f64, also for f16/bf16 storage (no f32 blocks)

ctypedef struct Plan:
    bint empty               # no channel or no element: nothing to read
    bint channel_last        # channels are the unit-stride inner dimension of x, dy, dx
    int big_dtype            # dtype of x, dy, dx
    int stat_dtype           # dtype of mean, variance, scale, dscale, dbias
    int64_t channels         # C
    int64_t count            # M, elements per channel
    # Rows: the reduced index space minus the inner dimension (channel-major) or all of it
    # (channel-last); a row's offset comes from its index by mixed-radix decomposition.
    int n_outer
    int64_t outer_size[MAX_DIMS]
    int64_t outer_stride[3][MAX_DIMS]
    int64_t inner_size       # channel-major: innermost reduced dim; channel-last: C
    int64_t inner_stride[3]
    int64_t base[3]          # byte offset of the first element visited (negative dims flipped)
    # channel c starts at chan_stride[t] * c, or chan_offset[t][c] when that table exists
    int64_t chan_stride[N_SLOTS]
    int64_t *chan_offset[N_SLOTS]
    # fixed reduction partition: never depends on the thread count
    bint whole_rows          # channel-major blocks hold whole rows (rows no longer than BLOCK)
    int64_t block            # channel-major: elements per block; channel-last: rows per block
    int64_t nblocks
    int64_t group            # channel-last: channels per work item
    int64_t ngroups
    # dx in a layout that would change the order of the sums (_plan_for_x_dy): the kernels
    # write a temporary laid out like x instead, copied into dx afterwards
    bint dx_via_temp
    int ndim
    int64_t sizes[MAX_DIMS]
    int64_t dx_strides[MAX_DIMS]     # dx's own byte strides
    int64_t temp_strides[MAX_DIMS]   # the temporary's
    int64_t temp_low                 # byte offset of the temporary's lowest element (<= 0)
    int64_t temp_bytes


# Engine entry points, callable without the GIL from other Cython modules (the C API table).
cdef int plan_build(Plan *p, int ndim, const int64_t *sizes, const unsigned char *reduced,
                    const int64_t *strides, int big_dtype, int stat_dtype) noexcept nogil
cdef void plan_free(Plan *p) noexcept nogil
cdef int plan_execute(const Plan *p, char **ptr, int op, double eps, double count,
                      double *sums_io, int nthreads) noexcept nogil
cdef int omp_max_threads_nogil() noexcept nogil
