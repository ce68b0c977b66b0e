# cython: language_level=3
"""The DirectML operators at C level: the C API table and the descriptor checks.

Design
------
Everything C callers reach runs without the GIL and touches no Python object: descriptor
checks (`layout_check`, `tensor_check`: what makes a DML_BUFFER_TENSOR_DESC valid), the
operator's rules (the validation layer's `check_call`, bnbw_native._call, under the DirectML
convention), planning (`op_create`) and execution (`op_execute`).  bnbw_native.dml calls these
same functions through the small Python layer at the bottom (`tensor_sizes`, `Operator`), so
every DirectML rule and message exists once.  A failed check returns a bnbw_status and writes a
message naming the member into the caller's buffer; the functions of the C table use a
per-thread buffer that error_message() reads back.

Descriptors hold strides in elements; the engine gets byte strides, 0 on size-1 dims (so a
huge stride on a size-1 dim can never overflow), and the reduced-dims mask "mean size is 1".
Buffers bound at execute time are raw memory regions: two of them overlap when their byte
ranges [address, address + minimum size) do.
"""
from libc.stdint cimport int64_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.stdio cimport snprintf
from libc.string cimport strncpy
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBuffer_IsContiguous,
                             PyBUF_FULL_RO)
from cpython.pycapsule cimport PyCapsule_New

from bnbw_native._engine cimport (
    Plan, MAX_DIMS, N_SLOTS, N_BIG, N_ROLES, S_X, S_DY, S_DX, S_MEAN, S_VAR, S_SCALE, S_DSCALE,
    S_DBIAS, DT_F32, DT_F16, DT_BF16, OP_REDUCE, OP_TRAINING, OP_DX, OP_PARAMS, bnbw_data_type,
    BNBW_DATA_TYPE_FLOAT32, BNBW_DATA_TYPE_FLOAT16, BNBW_DATA_TYPE_BFLOAT16, bnbw_tensor_desc,
    bnbw_operator_type, BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD,
    BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD, bnbw_batch_normalization_grad_desc,
    bnbw_bindings, bnbw_status, BNBW_OK, BNBW_ERROR_NULL_POINTER, BNBW_ERROR_DATA_TYPE,
    BNBW_ERROR_DIMENSION_COUNT, BNBW_ERROR_SIZES, BNBW_ERROR_STRIDES, BNBW_ERROR_TOTAL_SIZE,
    BNBW_ERROR_OVERLAP, BNBW_ERROR_EPSILON, BNBW_ERROR_NUM_THREADS, BNBW_ERROR_ALIGNMENT,
    BNBW_ERROR_OPERATOR_TYPE, BNBW_ERROR_OUT_OF_MEMORY, bnbw_operator, bnbw_api_table,
    BNBW_API_VERSION, BNBW_CAPSULE_NAME)
from bnbw_native._plan cimport plan_build, plan_free
from bnbw_native._schedules cimport Schedule, schedule_choose, execute
from bnbw_native._call cimport (Arg, Rules, Epsilon, Convention, check_call, engine_layout,
                                resolve_threads, epsilon_of_float)

cdef extern from *:
    """
    #if defined(_MSC_VER)
    #define BNBW_TLS __declspec(thread)
    #else
    #define BNBW_TLS __thread
    #endif
    #define BNBW_MESSAGE_CAP 512
    static BNBW_TLS char bnbw_tls_message[BNBW_MESSAGE_CAP];
    static char *bnbw_thread_message(void) { return bnbw_tls_message; }
    static char bnbw_version_text[32];
    """
    enum: BNBW_MESSAGE_CAP
    char *bnbw_thread_message() nogil
    char bnbw_version_text[32]


# ---------------------------------------------------------------------------------------
# Members, in the order of the DirectML descriptor
# ---------------------------------------------------------------------------------------

cdef enum:
    M_INPUT = 0
    M_INPUT_GRADIENT = 1
    M_MEAN = 2
    M_VARIANCE = 3
    M_SCALE = 4
    M_OUTPUT_GRADIENT = 5
    M_OUTPUT_SCALE_GRADIENT = 6
    M_OUTPUT_BIAS_GRADIENT = 7
    N_MEMBERS = 8
    FIRST_OUTPUT = 5

cdef const char *MEMBER_NAMES[8]
MEMBER_NAMES[:] = [b"input", b"input_gradient", b"mean", b"variance", b"scale",
                   b"output_gradient", b"output_scale_gradient", b"output_bias_gradient"]
cdef int MEMBER_SLOT[8]
MEMBER_SLOT[:] = [S_X, S_DY, S_MEAN, S_VAR, S_SCALE, S_DX, S_DSCALE, S_DBIAS]
MEMBERS = tuple(MEMBER_NAMES[i].decode() for i in range(N_MEMBERS))

# The DirectML convention of the validation layer: descriptors here, arrays in bnbw_native.dml.
CONVENTION = Convention({role: MEMBERS[i] for i, role in enumerate(
    ("x", "dy", "mean", "var", "scale", "dx", "dscale", "dbias"))}, family="directml",
    dtype_rule="same", ranks=(1, MAX_DIMS), data_format=False)
cdef const Rules *RULES = &(<Convention> CONVENTION).rules

cdef int64_t LIMIT = 0x7FFFFFFFFFFFFFFF     # byte extents must fit int64 (engine offsets)


ctypedef struct Tensor:
    int dtype                    # bnbw_data_type
    int ndim
    int64_t itemsize
    int64_t sizes[MAX_DIMS]
    int64_t strides[MAX_DIMS]    # elements, packed ones filled in
    int64_t minimum              # bytes
    uint64_t total


ctypedef struct OperatorImpl:
    int type
    int op_flags
    Epsilon eps
    bint in_place_ok             # output_gradient may be bound over input_gradient
    Tensor t[N_MEMBERS]
    Arg a[N_ROLES]               # the members as the validation layer and the engine see them
    Plan plan


cdef inline const char *sep(const char *member) noexcept nogil:
    return ": " if member[0] != 0 else ""


cdef inline const char *type_name(int dtype) noexcept nogil:
    if dtype == BNBW_DATA_TYPE_FLOAT32:
        return "float32"
    if dtype == BNBW_DATA_TYPE_FLOAT16:
        return "float16"
    if dtype == BNBW_DATA_TYPE_BFLOAT16:
        return "bfloat16"
    return "unknown"


# ---------------------------------------------------------------------------------------
# Descriptor checks
# ---------------------------------------------------------------------------------------

cdef bnbw_status layout_check(int dtype, uint32_t ndim, const int64_t *sizes,
                              const int64_t *strides, const char *m, Tensor *t, char *msg,
                              size_t cap) noexcept nogil:
    """data_type, dimension count, sizes, strides and the minimum size of one tensor."""
    cdef const char *s = sep(m)
    cdef int d
    cdef int64_t elems = 1, span = 0, term
    if dtype != BNBW_DATA_TYPE_FLOAT32 and dtype != BNBW_DATA_TYPE_FLOAT16 \
            and dtype != BNBW_DATA_TYPE_BFLOAT16:
        snprintf(msg, cap, "%s%sdata_type must be float32, float16 or bfloat16, got code %d",
                 m, s, dtype)
        return BNBW_ERROR_DATA_TYPE
    if ndim < 1 or ndim > MAX_DIMS:
        snprintf(msg, cap, "%s%ssizes must have 1 to 8 dimensions (dimension count), got %u",
                 m, s, ndim)
        return BNBW_ERROR_DIMENSION_COUNT
    if sizes == NULL:
        snprintf(msg, cap, "%s%ssizes is NULL", m, s)
        return BNBW_ERROR_NULL_POINTER
    t.dtype = dtype
    t.ndim = <int> ndim
    t.itemsize = 4 if dtype == BNBW_DATA_TYPE_FLOAT32 else 2
    for d in range(t.ndim):
        if sizes[d] < 1:
            snprintf(msg, cap, "%s%ssizes[%d] must be a positive integer, got %lld",
                     m, s, d, <long long> sizes[d])
            return BNBW_ERROR_SIZES
        t.sizes[d] = sizes[d]
    if strides == NULL:
        for d in range(t.ndim - 1, -1, -1):
            t.strides[d] = elems
            if elems > LIMIT // t.sizes[d]:
                snprintf(msg, cap, "%s%ssizes describe more than 2^63 - 1 bytes "
                         "(the byte count overflows 64 bits)", m, s)
                return BNBW_ERROR_SIZES
            elems *= t.sizes[d]
    else:
        for d in range(t.ndim):
            if strides[d] < 0:
                snprintf(msg, cap, "%s%sstrides[%d] must be non-negative (in elements), "
                         "got %lld", m, s, d, <long long> strides[d])
                return BNBW_ERROR_STRIDES
            t.strides[d] = strides[d]
        for d in range(t.ndim):
            if t.sizes[d] == 1 or strides[d] == 0:
                continue
            if t.sizes[d] - 1 > LIMIT // strides[d]:
                term = LIMIT
            else:
                term = (t.sizes[d] - 1) * strides[d]
            if term > LIMIT - 1 - span:
                snprintf(msg, cap, "%s%ssizes and strides reach beyond 2^63 - 1 bytes "
                         "(the byte count overflows 64 bits)", m, s)
                return BNBW_ERROR_STRIDES
            span += term
        elems = span + 1
    if elems > LIMIT // t.itemsize:
        snprintf(msg, cap, "%s%ssizes and strides reach beyond 2^63 - 1 bytes "
                 "(the byte count overflows 64 bits)", m, s)
        return BNBW_ERROR_SIZES if strides == NULL else BNBW_ERROR_STRIDES
    t.minimum = elems * t.itemsize
    return BNBW_OK


cdef inline uint64_t default_total(int64_t minimum) noexcept nogil:
    return ((<uint64_t> minimum) + 3) & ~(<uint64_t> 3)


cdef bnbw_status tensor_check(const bnbw_tensor_desc *desc, const char *m, Tensor *t,
                              char *msg, size_t cap) noexcept nogil:
    cdef bnbw_status rc
    if desc == NULL:
        snprintf(msg, cap, "%s%sthe tensor descriptor pointer is NULL", m, sep(m))
        return BNBW_ERROR_NULL_POINTER
    rc = layout_check(<int> desc.data_type, desc.dimension_count, desc.sizes, desc.strides,
                      m, t, msg, cap)
    if rc != BNBW_OK:
        return rc
    t.total = desc.total_tensor_size_in_bytes
    if t.total < <uint64_t> t.minimum:
        snprintf(msg, cap, "%s%stotal_tensor_size_in_bytes is %llu, below the minimum size "
                 "of %lld bytes", m, sep(m), <unsigned long long> t.total,
                 <long long> t.minimum)
        return BNBW_ERROR_TOTAL_SIZE
    return BNBW_OK


# ---- the operator -------------------------------------------------------------------------

cdef bnbw_status operator_check(const bnbw_batch_normalization_grad_desc *desc, Tensor *t,
                                Arg *a, char *msg, size_t cap) noexcept nogil:
    """Every member's descriptor, then the operator's rules (the validation layer's, under the
    DirectML convention); fills t[N_MEMBERS] and a[N_ROLES]."""
    cdef const bnbw_tensor_desc *descs[N_MEMBERS]
    cdef Epsilon eps
    cdef bnbw_status rc
    cdef int i, d, role
    if desc == NULL:
        snprintf(msg, cap, "desc: the operator descriptor pointer is NULL")
        return BNBW_ERROR_NULL_POINTER
    descs[0] = desc.input
    descs[1] = desc.input_gradient
    descs[2] = desc.mean
    descs[3] = desc.variance
    descs[4] = desc.scale
    descs[5] = desc.output_gradient
    descs[6] = desc.output_scale_gradient
    descs[7] = desc.output_bias_gradient
    for i in range(N_ROLES):
        a[i].present = False
        a[i].data = NULL
    for i in range(N_MEMBERS):
        rc = tensor_check(descs[i], MEMBER_NAMES[i], &t[i], msg, cap)
        if rc != BNBW_OK:
            return rc
        role = MEMBER_SLOT[i]
        a[role].present = True
        a[role].dtype = t[i].dtype - 1            # bnbw_data_type -> the engine's DType
        strncpy(a[role].type_name, type_name(t[i].dtype), 39)
        a[role].ndim = t[i].ndim
        a[role].writable = True
        a[role].aligned = True
        for d in range(t[i].ndim):
            a[role].shape[d] = t[i].sizes[d]
            a[role].strides[d] = t[i].strides[d] * t[i].itemsize
    epsilon_of_float(desc.epsilon, &eps)
    return check_call(RULES, a, 0, 0, &eps, -1, msg, cap)


cdef bint same_layout(const Tensor *a, const Tensor *b) noexcept nogil:
    cdef int d
    if a.dtype != b.dtype or a.ndim != b.ndim:
        return False
    for d in range(a.ndim):
        if a.sizes[d] != b.sizes[d] or (a.sizes[d] > 1 and a.strides[d] != b.strides[d]):
            return False
    return True


cdef bnbw_status op_create(int type, const bnbw_batch_normalization_grad_desc *desc,
                           OperatorImpl **out, char *msg, size_t cap) noexcept nogil:
    cdef OperatorImpl *op
    cdef bnbw_status rc
    cdef int ndim
    cdef int64_t sizes[MAX_DIMS]
    cdef unsigned char reduced[MAX_DIMS]
    cdef int64_t strides[N_SLOTS * MAX_DIMS]
    cdef unsigned char present[N_BIG]
    if out == NULL:
        snprintf(msg, cap, "op: the pointer receiving the operator is NULL")
        return BNBW_ERROR_NULL_POINTER
    out[0] = NULL
    if type != BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD \
            and type != BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD:
        snprintf(msg, cap, "type must be BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD (1) or "
                 "BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD (2), got %d", type)
        return BNBW_ERROR_OPERATOR_TYPE
    op = <OperatorImpl *> calloc(1, sizeof(OperatorImpl))
    if op == NULL:
        snprintf(msg, cap, "out of memory")
        return BNBW_ERROR_OUT_OF_MEMORY
    rc = operator_check(desc, op.t, op.a, msg, cap)
    if rc != BNBW_OK:
        free(op)
        return rc
    op.type = type
    epsilon_of_float(desc.epsilon, &op.eps)
    op.op_flags = OP_REDUCE | OP_DX | OP_PARAMS
    if type == BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD:
        op.op_flags = op.op_flags | OP_TRAINING
    op.in_place_ok = same_layout(&op.t[M_INPUT_GRADIENT], &op.t[M_OUTPUT_GRADIENT])
    ndim = engine_layout(RULES, op.a, 0, sizes, reduced, strides, present)
    if plan_build(&op.plan, ndim, sizes, reduced, strides, present, op.a[S_X].dtype,
                  op.a[S_X].dtype, op.a[S_X].dtype) != 0:
        free(op)
        snprintf(msg, cap, "out of memory while planning")
        return BNBW_ERROR_OUT_OF_MEMORY
    out[0] = op
    return BNBW_OK


cdef void op_destroy(OperatorImpl *op) noexcept nogil:
    if op != NULL:
        plan_free(&op.plan)
        free(op)


cdef bnbw_status op_execute(const OperatorImpl *op, const void **ptr, int num_threads,
                            char *msg, size_t cap) noexcept nogil:
    """ptr: the N_MEMBERS buffer addresses in member order.  num_threads 0: the package
    default (OpenMP's unless bnbw_native.set_num_threads set one)."""
    cdef char *slots[N_SLOTS]
    cdef Schedule sched
    cdef int i, j
    cdef uintptr_t a, b
    if op == NULL:
        snprintf(msg, cap, "op: the operator pointer is NULL")
        return BNBW_ERROR_NULL_POINTER
    for i in range(N_MEMBERS):
        if ptr[i] == NULL:
            snprintf(msg, cap, "%s: the buffer pointer is NULL", MEMBER_NAMES[i])
            return BNBW_ERROR_NULL_POINTER
    for i in range(N_MEMBERS):
        if (<uintptr_t> ptr[i]) % <uintptr_t> op.t[i].itemsize != 0:
            snprintf(msg, cap, "%s: address %p is not aligned to the item size (%d bytes)",
                     MEMBER_NAMES[i], ptr[i], <int> op.t[i].itemsize)
            return BNBW_ERROR_ALIGNMENT
    if num_threads < 0:
        snprintf(msg, cap, "num_threads must be >= 0 (0 = the default), got %d", num_threads)
        return BNBW_ERROR_NUM_THREADS
    for i in range(FIRST_OUTPUT, N_MEMBERS):
        a = <uintptr_t> ptr[i]
        for j in range(N_MEMBERS):
            if j == i or (j >= FIRST_OUTPUT and j < i):
                continue          # each pair of outputs once
            b = <uintptr_t> ptr[j]
            if not (a < b + <uintptr_t> op.t[j].minimum and b < a + <uintptr_t> op.t[i].minimum):
                continue
            if i == M_OUTPUT_GRADIENT and j == M_INPUT_GRADIENT and a == b and op.in_place_ok:
                continue          # in place: the very same layout at the very same address
            if i == M_OUTPUT_GRADIENT and j == M_INPUT_GRADIENT:
                snprintf(msg, cap, "output_gradient overlaps input_gradient (in place needs "
                         "the same address and identical descriptors)")
            elif j >= FIRST_OUTPUT:
                snprintf(msg, cap, "%s overlaps %s; outputs must not overlap each other",
                         MEMBER_NAMES[i], MEMBER_NAMES[j])
            else:
                snprintf(msg, cap, "%s overlaps the input %s; output buffers must not "
                         "overlap input buffers", MEMBER_NAMES[i], MEMBER_NAMES[j])
            return BNBW_ERROR_OVERLAP
    for i in range(N_SLOTS):
        slots[i] = NULL
    for i in range(N_MEMBERS):
        slots[MEMBER_SLOT[i]] = <char *> ptr[i]
    schedule_choose(&op.plan, op.op_flags, resolve_threads(num_threads), &sched)
    if execute(&op.plan, &sched, slots, op.op_flags, <float> op.eps.value,
               <double> op.plan.count, NULL) != 0:
        snprintf(msg, cap, "out of memory for the reduction buffers")
        return BNBW_ERROR_OUT_OF_MEMORY
    return BNBW_OK


# ---------------------------------------------------------------------------------------
# The C table: thin shells that report through the per-thread message buffer
# ---------------------------------------------------------------------------------------

cdef const char *c_library_version() noexcept nogil:
    return bnbw_version_text


cdef bnbw_status c_calc_buffer_tensor_size(bnbw_data_type data_type, uint32_t dimension_count,
                                           const int64_t *sizes, const int64_t *strides,
                                           uint64_t *minimum_size,
                                           uint64_t *total_size) noexcept nogil:
    cdef Tensor t
    cdef bnbw_status rc = layout_check(<int> data_type, dimension_count, sizes, strides, "",
                                       &t, bnbw_thread_message(), BNBW_MESSAGE_CAP)
    if rc != BNBW_OK:
        return rc
    if minimum_size != NULL:
        minimum_size[0] = <uint64_t> t.minimum
    if total_size != NULL:
        total_size[0] = default_total(t.minimum)
    return BNBW_OK


cdef bnbw_status c_create_operator(bnbw_operator_type type,
                                   const bnbw_batch_normalization_grad_desc *desc,
                                   bnbw_operator **op) noexcept nogil:
    return op_create(<int> type, desc, <OperatorImpl **> op, bnbw_thread_message(),
                     BNBW_MESSAGE_CAP)


cdef bnbw_status c_execute(const bnbw_operator *op, const bnbw_bindings *bindings,
                           int num_threads) noexcept nogil:
    cdef const void *ptr[N_MEMBERS]
    if bindings == NULL:
        snprintf(bnbw_thread_message(), BNBW_MESSAGE_CAP, "bindings: the pointer is NULL")
        return BNBW_ERROR_NULL_POINTER
    ptr[0] = bindings.input
    ptr[1] = bindings.input_gradient
    ptr[2] = bindings.mean
    ptr[3] = bindings.variance
    ptr[4] = bindings.scale
    ptr[5] = bindings.output_gradient
    ptr[6] = bindings.output_scale_gradient
    ptr[7] = bindings.output_bias_gradient
    return op_execute(<const OperatorImpl *> op, ptr, num_threads, bnbw_thread_message(),
                      BNBW_MESSAGE_CAP)


cdef void c_destroy_operator(bnbw_operator *op) noexcept nogil:
    op_destroy(<OperatorImpl *> op)


cdef const char *c_error_message() noexcept nogil:
    return bnbw_thread_message()


cdef const char *c_status_name(bnbw_status status) noexcept nogil:
    if status == BNBW_OK:
        return "OK"
    if status == BNBW_ERROR_NULL_POINTER:
        return "ERROR_NULL_POINTER"
    if status == BNBW_ERROR_DATA_TYPE:
        return "ERROR_DATA_TYPE"
    if status == BNBW_ERROR_DIMENSION_COUNT:
        return "ERROR_DIMENSION_COUNT"
    if status == BNBW_ERROR_SIZES:
        return "ERROR_SIZES"
    if status == BNBW_ERROR_STRIDES:
        return "ERROR_STRIDES"
    if status == BNBW_ERROR_TOTAL_SIZE:
        return "ERROR_TOTAL_SIZE"
    if status == BNBW_ERROR_OVERLAP:
        return "ERROR_OVERLAP"
    if status == BNBW_ERROR_EPSILON:
        return "ERROR_EPSILON"
    if status == BNBW_ERROR_NUM_THREADS:
        return "ERROR_NUM_THREADS"
    if status == BNBW_ERROR_ALIGNMENT:
        return "ERROR_ALIGNMENT"
    if status == BNBW_ERROR_OPERATOR_TYPE:
        return "ERROR_OPERATOR_TYPE"
    if status == BNBW_ERROR_OUT_OF_MEMORY:
        return "ERROR_OUT_OF_MEMORY"
    return "UNKNOWN_STATUS"


cdef bnbw_api_table TABLE
TABLE.version = BNBW_API_VERSION
TABLE.size = sizeof(bnbw_api_table)
TABLE.library_version = c_library_version
TABLE.calc_buffer_tensor_size = c_calc_buffer_tensor_size
TABLE.create_operator = c_create_operator
TABLE.execute = c_execute
TABLE.destroy_operator = c_destroy_operator
TABLE.error_message = c_error_message
TABLE.status_name = c_status_name

cdef void _set_version(bytes text):
    strncpy(bnbw_version_text, text, 31)

from bnbw_native._config import __version__ as _version
_set_version(_version.encode()[:31])

_C_API = PyCapsule_New(<void *> &TABLE, BNBW_CAPSULE_NAME, NULL)


# ---------------------------------------------------------------------------------------
# Python layer for bnbw_native.dml: marshal arguments, call the functions above
# ---------------------------------------------------------------------------------------

import numbers

import numpy as np

POINTER_MAX = <uintptr_t> -1

STATUS = {c_status_name(<bnbw_status> code).decode(): code for code in range(13)}
DATA_TYPES = {"float32": BNBW_DATA_TYPE_FLOAT32, "float16": BNBW_DATA_TYPE_FLOAT16,
              "bfloat16": BNBW_DATA_TYPE_BFLOAT16}
OPERATOR_TYPES = {"grad": BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD,
                  "training_grad": BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD}


class Error(Exception):
    """A check of the C layer refused: .status is the bnbw_status code, str() the message."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


cdef int64_t _int64(value, int status, str what) except? -1:
    if not -LIMIT - 1 <= value <= LIMIT:
        raise Error(status, f"{what} is {value}, beyond the 64-bit integer range")
    return value


cdef struct DescStore:
    bnbw_tensor_desc desc
    int64_t sizes[MAX_DIMS]
    int64_t strides[MAX_DIMS]


cdef int _marshal(DescStore *store, spec, str prefix) except -1:
    """spec: (data type code, sizes tuple, strides tuple or None, total or None)."""
    data_type, sizes, strides, total = spec
    cdef int d
    store.desc.data_type = <bnbw_data_type> <int> data_type
    store.desc.dimension_count = len(sizes)
    store.desc.sizes = store.sizes
    store.desc.strides = store.strides if strides is not None else NULL
    for d in range(min(len(sizes), MAX_DIMS)):
        store.sizes[d] = _int64(sizes[d], BNBW_ERROR_SIZES, f"{prefix}sizes[{d}]")
        if strides is not None and d < len(strides):
            store.strides[d] = _int64(strides[d], BNBW_ERROR_STRIDES, f"{prefix}strides[{d}]")
    if total is None:
        store.desc.total_tensor_size_in_bytes = 0
    elif not 0 <= total < 2 ** 64:
        raise Error(BNBW_ERROR_TOTAL_SIZE,
                    f"{prefix}total_tensor_size_in_bytes is {total}, outside 0 to 2^64 - 1")
    else:
        store.desc.total_tensor_size_in_bytes = total
    return 0


def tensor_sizes(spec):
    """(minimum size, total size) of a descriptor spec; the total defaults to the minimum
    rounded up to 4 bytes.  Raises Error."""
    cdef DescStore store
    cdef Tensor t
    cdef char msg[BNBW_MESSAGE_CAP]
    cdef bnbw_status rc
    _marshal(&store, spec, "")
    with nogil:
        rc = layout_check(<int> store.desc.data_type, store.desc.dimension_count,
                          store.desc.sizes, store.desc.strides, "", &t, msg, BNBW_MESSAGE_CAP)
    if rc != BNBW_OK:
        raise Error(rc, msg.decode())
    if spec[3] is None:
        store.desc.total_tensor_size_in_bytes = default_total(t.minimum)
    with nogil:
        rc = tensor_check(&store.desc, "", &t, msg, BNBW_MESSAGE_CAP)
    if rc != BNBW_OK:
        raise Error(rc, msg.decode())
    return t.minimum, t.total


cdef class Operator:
    """A compiled operator: type "grad" or "training_grad", eight descriptor specs in member
    order and the f32 epsilon.  execute() binds buffers and runs it."""
    cdef OperatorImpl *impl

    def __cinit__(self, str type, specs, float epsilon):
        cdef DescStore store[N_MEMBERS]
        cdef bnbw_batch_normalization_grad_desc desc
        cdef char msg[BNBW_MESSAGE_CAP]
        cdef bnbw_status rc
        cdef int i, code = OPERATOR_TYPES[type]
        self.impl = NULL
        for i in range(N_MEMBERS):
            _marshal(&store[i], specs[i], MEMBERS[i] + ": ")
        desc.input = &store[0].desc
        desc.input_gradient = &store[1].desc
        desc.mean = &store[2].desc
        desc.variance = &store[3].desc
        desc.scale = &store[4].desc
        desc.output_gradient = &store[5].desc
        desc.output_scale_gradient = &store[6].desc
        desc.output_bias_gradient = &store[7].desc
        desc.epsilon = epsilon
        with nogil:
            rc = op_create(code, &desc, &self.impl, msg, BNBW_MESSAGE_CAP)
        if rc != BNBW_OK:
            raise Error(rc, msg.decode())

    def __dealloc__(self):
        op_destroy(self.impl)
        self.impl = NULL

    @property
    def kind(self):
        """The engine's plan: "channel-last", "channel-major" or "empty"."""
        if self.impl.plan.empty:
            return "empty"
        return "channel-last" if self.impl.plan.channel_last else "channel-major"

    @property
    def count(self):
        """M: elements summed per statistics element."""
        return self.impl.plan.count

    @property
    def channels(self):
        return self.impl.plan.channels

    @property
    def minimum_sizes(self):
        return tuple(self.impl.t[i].minimum for i in range(N_MEMBERS))

    def execute(self, buffers, int num_threads):
        """buffers: N_MEMBERS objects in member order, each a buffer-protocol object, a NumPy
        array (any dtype, raw memory) or a positive int address.  Raises TypeError/ValueError
        for the objects themselves, Error for the C checks."""
        cdef Py_buffer views[N_MEMBERS]
        cdef bint held[N_MEMBERS]
        cdef const void *ptr[N_MEMBERS]
        cdef char msg[BNBW_MESSAGE_CAP]
        cdef bnbw_status rc = BNBW_OK
        cdef int i
        cdef bint output
        cdef Py_ssize_t nbytes
        keep = [None] * N_MEMBERS
        for i in range(N_MEMBERS):
            held[i] = False
        try:
            for i in range(N_MEMBERS):
                obj = buffers[i]
                name = MEMBERS[i]
                output = i >= FIRST_OUTPUT
                nbytes = -1
                if isinstance(obj, (bool, np.bool_)):
                    raise TypeError(f"{name} must be a buffer or an int address, got bool")
                if isinstance(obj, numbers.Integral):
                    address = int(obj)
                    if not 0 < address <= POINTER_MAX:
                        raise ValueError(f"{name}: an integer address must be positive and "
                                         f"fit a pointer, got {address}")
                    ptr[i] = <const void *> <uintptr_t> address
                elif isinstance(obj, np.ndarray):
                    if obj.dtype.hasobject:
                        raise TypeError(f"{name}: an array of Python objects is not raw "
                                        "memory")
                    if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
                        raise ValueError(f"{name}: the array is not contiguous; a buffer must "
                                         "be contiguous raw memory")
                    if output and not obj.flags.writeable:
                        raise ValueError(f"{name}: the array is read-only; output buffers must "
                                         "be writable")
                    keep[i] = obj
                    ptr[i] = <const void *> <uintptr_t> obj.__array_interface__["data"][0]
                    nbytes = obj.nbytes
                else:
                    try:
                        PyObject_GetBuffer(obj, &views[i], PyBUF_FULL_RO)
                    except (TypeError, BufferError, ValueError) as exc:
                        raise TypeError(f"{name} must be a buffer (bytes-like object, NumPy "
                                        f"array) or an int address, got "
                                        f"{type(obj).__name__}") from None
                    held[i] = True
                    if not PyBuffer_IsContiguous(&views[i], b'A'):
                        raise ValueError(f"{name}: the buffer is not contiguous; a buffer must "
                                         "be contiguous raw memory")
                    if output and views[i].readonly:
                        raise ValueError(f"{name}: the buffer is read-only; output buffers "
                                         "must be writable")
                    ptr[i] = views[i].buf
                    nbytes = views[i].len
                if nbytes >= 0 and nbytes < self.impl.t[i].minimum:
                    raise ValueError(f"{name}: the buffer holds {nbytes} bytes, the descriptor "
                                     f"needs at least {self.impl.t[i].minimum} (its minimum "
                                     "size)")
            with nogil:
                rc = op_execute(self.impl, ptr, num_threads, msg, BNBW_MESSAGE_CAP)
        finally:
            for i in range(N_MEMBERS):
                if held[i]:
                    PyBuffer_Release(&views[i])
        if rc != BNBW_OK:
            raise Error(rc, msg.decode())
