# The engine's vocabulary: every name the native modules share, each defined once here.
#
# Glossary
#   slot      an operand of the engine, by role (S_*): the big tensors (x's shape) first, then
#             the per-channel ones, then the arguments only validation reads.  Arg, Rules and
#             the DirectML members are all indexed by slot.
#   op        what a call does, as flags (OP_*); the public formulas are fixed combinations (DO_*).
#   dtype     a storage type (DT_*); the first three are the kernels' codes.
#   layout    a validated call as the engine sees it: sizes, reduced dims, byte strides per slot.
#   plan      how a layout's tensors are visited (bnbw_native._plan).
#   schedule  who visits which part of a plan on which thread (bnbw_native._schedules).
#   body      one compilation of the kernels for an instruction set (src/body_*.c).
#   status    a bnbw_status: how every refusal is reported, to C callers and to Python alike.
#   formula   the per-channel arithmetic on a channel's sums (bnbw_native._formulas).
# What the C headers declare (kernels, half conversions, the public API, statuses) is in
# bnbw_native._headers.
from libc.stdint cimport int64_t
from libc.string cimport memcpy

from bnbw_native._headers cimport (bnbw_f16, bnbw_bf16, bnbw_f16_to_f32, bnbw_bf16_to_f32,
                                   bnbw_f64_to_f16, bnbw_f64_to_bf16, BNBW_ITEMSIZE, BNBW_F32,
                                   BNBW_F16, BNBW_BF16, BNBW_BOOL)


cdef enum:
    MAX_DIMS = 8

# Storage types; the first four are the kernels' codes (bnbw_kernels.h).
cdef enum:  # DType
    DT_OTHER = -1        # anything the engine does not take (named in messages)
    DT_F32 = BNBW_F32
    DT_F16 = BNBW_F16
    DT_BF16 = BNBW_BF16
    DT_BOOL = BNBW_BOOL  # a ReLU mask
    DT_F64 = 4           # the two-phase sums only

# Slots.  The big tensors (the shape of x) come first, then the per-channel ones; S_PARTIAL is
# an argument that validation checks and the engine never reads.
cdef enum:  # Slot
    S_X = 0              # x (the forward's src)
    S_DY = 1             # dy (the forward plans with x here, or its residual)
    S_DX = 2             # the big output: dx, or the forward's y
    S_MASK = 3           # the forward's ReLU output, or its bool mask
    S_DRES = 4           # the gradient of the residual (the masked dy), an output
    S_MEAN = 5           # the mean (the forward: the old running mean)
    S_VAR = 6            # the variance (the forward: the old running variance)
    S_SCALE = 7
    S_BETA = 8           # the forward's shift (nGraph's backward: validated only)
    S_DSCALE = 9
    S_DBIAS = 10
    S_RUN_MEAN = 11      # the forward's outputs
    S_RUN_VAR = 12
    S_BATCH_MEAN = 13
    S_BATCH_VAR = 14
    S_MEAN_LOW = 15      # the mean's low part: the backward centres on mean + mean_low (an
                         # input), the forward writes batch mean's (an output; the torch layers)
    S_PARTIAL = 16       # the two-phase sums given to backward_apply, copied in
    N_BIG = 5
    N_SLOTS = 16         # the slots the engine reads or writes
    N_ROLES = 17         # every slot validation knows

# What a call does (flags), and what one pass of a schedule does (a subset: OP_REDUCE and/or
# OP_DX; the call's formula - OP_FORWARD, OP_TRAINING or neither - says which kernels).
cdef enum:  # Op
    OP_REDUCE = 1        # Sum dy and Sum (x - mean) dy from x and dy
    OP_GIVEN_SUMS = 2    # the sums come from the caller (two-phase apply)
    OP_TRAINING = 4      # the backward's training dx (else frozen statistics: dx = scale * r * dy)
    OP_DX = 8
    OP_PARAMS = 16       # dscale, dbias
    OP_RETURN_SUMS = 32  # copy the sums out (two-phase reduce)
    OP_EXACT_SUMS = 64   # every term in f64, halves too (no f32 blocks)
    OP_FORWARD = 128     # the training forward: Sum (x - shift), Sum (x - shift)^2, then y
    OP_RELU = 256        # the forward's y through a ReLU
    OP_TORCH_RUNNING = 512   # the forward's running statistics as PyTorch keeps them: the
                             # momentum weighs the batch, whose variance is unbiased (M / (M-1))
    OP_ADD_RESIDUAL = 1024   # the forward's y: max(y + residual, 0), the residual in dy's slot
                             # laid out like x (with OP_RELU; the torch layers' BatchNormAddReLU)

# The public formulas, as the front-ends ask for them.
cdef enum:  # Formula
    DO_TRAINING = OP_REDUCE | OP_TRAINING | OP_DX | OP_PARAMS    # dx, dscale, dbias
    DO_FROZEN_DX = OP_DX          # oneDNN Graph's diff_src only: scale validated, then ignored
    DO_FROZEN = OP_REDUCE | OP_DX | OP_PARAMS    # DirectML's BatchNormalizationGrad
    DO_REDUCE = OP_REDUCE | OP_RETURN_SUMS       # the two-phase sums
    DO_APPLY = OP_GIVEN_SUMS | OP_TRAINING | OP_DX | OP_PARAMS   # the two-phase apply
    # y and the statistics
    DO_FORWARD = OP_FORWARD | OP_REDUCE | OP_DX
    # the forward in two phases: sums around a given shift (in mean's slot), then y from
    # given sums (the torch layers' SyncBatchNorm)
    DO_FORWARD_REDUCE = OP_FORWARD | OP_REDUCE | OP_RETURN_SUMS
    DO_FORWARD_APPLY = OP_FORWARD | OP_GIVEN_SUMS | OP_DX
    # dscale and dbias only, from x and dy or from given sums (the torch layers)
    DO_PARAMS = OP_REDUCE | OP_PARAMS
    DO_PARAMS_FROM_SUMS = OP_GIVEN_SUMS | OP_PARAMS

cdef inline bint applies_after_sums(int op) noexcept nogil:
    """Whether the call's apply needs its final sums (the training dx, the forward's y), so
    runs in a pass of its own; the frozen dx runs in the reduce pass."""
    return (op & (OP_TRAINING | OP_FORWARD)) != 0


# Elements below which threads cost more than they bring: such calls run on the calling thread.
cdef enum:
    SERIAL_BELOW = 65536


ctypedef struct Layout:
    # A validated call as the engine sees it (built once, by the validation layer).
    int ndim
    int64_t sizes[MAX_DIMS]
    unsigned char reduced[MAX_DIMS]          # the dims every channel's sums run over
    int64_t strides[N_SLOTS][MAX_DIMS]       # bytes; 0 on dims of size 1
    unsigned char present[N_BIG]             # which big slots the call has (x and dy always)
    int big_dtype            # storage type of x, dy, dx, dres
    int mask_dtype           # storage type of the mask (DT_BOOL or big_dtype)
    int stat_dtype           # storage type of the per-channel slots
    int64_t channels         # C: the product of the kept dims


ctypedef struct Plan:
    # How x, dy and the other big tensors are visited: canonical dims, rows, the fixed
    # partition of each channel's reduction into blocks.  Built from sizes and strides only.
    bint empty               # no channel or no element: nothing to read
    bint channel_last        # channels are the unit-stride inner dim of every big tensor
    int big_dtype            # storage type of x, dy, dx, dres
    int mask_dtype           # storage type of the mask (DT_BOOL or big_dtype)
    int stat_dtype           # storage type of mean, variance, scale, dscale, dbias
    unsigned char present[N_BIG]     # which big operands the call has (x and dy always)
    int64_t channels         # C
    int64_t count            # M, elements per channel
    # Rows: the reduced index space minus the inner dimension (channel-major) or all of it
    # (channel-last); a row's offset comes from its index by mixed-radix decomposition.
    int n_outer
    int64_t outer_size[MAX_DIMS]
    int64_t outer_stride[N_BIG][MAX_DIMS]
    int64_t inner_size       # channel-major: innermost reduced dim; channel-last: C
    int64_t inner_stride[N_BIG]
    int64_t base[N_BIG]      # byte offset of the first element visited (negative dims flipped)
    # channel c starts at chan_stride[t] * c, or chan_offset[t][c] when that table exists
    int64_t chan_stride[N_SLOTS]
    int64_t *chan_offset[N_SLOTS]
    # the fixed reduction partition: never depends on the thread count
    bint whole_rows          # channel-major blocks hold whole rows
    int64_t block            # channel-major: elements per block; channel-last: rows per block
    int64_t nblocks
    # Big operands laid out so that they would change the visiting order of x and dy go
    # through dense temporaries laid out like x: inputs copied in, outputs copied out.
    int ndim
    int64_t sizes[MAX_DIMS]
    unsigned char via_temp[N_BIG]
    int64_t given_strides[N_BIG][MAX_DIMS]    # the caller's byte strides
    int64_t temp_strides[N_BIG][MAX_DIMS]     # the temporary's
    int64_t temp_low[N_BIG]                   # byte offset of its lowest element (<= 0)
    int64_t temp_bytes[N_BIG]
    # The scratch of execute, sized and laid out here (the partition fixes it: plan_scratch)
    # and allocated with the plan, so that an operator run many times allocates nothing.  An
    # execute takes it for its duration; one that finds it taken (an operator run from two
    # threads at once) allocates its own.
    int64_t partial_stride    # doubles between two blocks' sums (whole 64-byte lines)
    int64_t scratch_bytes
    char *scratch
    int scratch_taken


cdef inline int engine_dtype(int data_type) noexcept nogil:
    """The DType of a C API bnbw_data_type (its codes are the kernels' plus one)."""
    return data_type - 1


cdef inline int64_t itemsize(int dtype) noexcept nogil:
    if dtype == DT_BOOL:
        return 1
    if dtype == DT_F64:
        return 8
    return BNBW_ITEMSIZE(dtype)


cdef inline int64_t imin(int64_t a, int64_t b) noexcept nogil:
    return a if a < b else b


cdef inline int64_t chan_origin(const Plan *p, int t, int64_t c) noexcept nogil:
    if p.chan_offset[t] != NULL:
        return p.chan_offset[t][c]
    return p.chan_stride[t] * c


cdef inline float *f32_channels(const Plan *p, char *base, int t, int dtype) noexcept nogil:
    """Slot t's channels (of `dtype`) as a plain float32 array, or NULL when they are not one
    (absent, another type, or not one element apart): the per-channel loops' fast path."""
    if base == NULL or dtype != DT_F32 or p.chan_offset[t] != NULL or p.chan_stride[t] != 4:
        return NULL
    return <float *> base


cdef inline void row_origin(const Plan *p, int64_t row, int64_t *off) noexcept nogil:
    """Byte offsets of row `row` (mixed radix over the outer dims) in every big tensor."""
    cdef int d, t
    cdef int64_t q, i
    for t in range(N_BIG):
        off[t] = p.base[t]
    for d in range(p.n_outer - 1, -1, -1):
        q = row // p.outer_size[d]
        i = row - q * p.outer_size[d]
        for t in range(N_BIG):
            off[t] += i * p.outer_stride[t][d]
        row = q


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
