# cython: language_level=3
"""DirectML's batch-normalization gradient operators: descriptors, operators, bound buffers.

Design
------
The vocabulary of DirectML lives here: its eight members (input, input_gradient, mean,
variance, scale, output_gradient, output_scale_gradient, output_bias_gradient), what makes a
DML_BUFFER_TENSOR_DESC valid (`layout_check`, `tensor_check`), its convention for the
validation layer (`RULES`), and the operator: `op_create` checks every descriptor once, runs the
validation layer's `check_call` and plans; `op_execute` checks the bound buffers and runs the
plan through the engine.  All of it runs without the GIL and touches no Python object, so the C
API (bnbw_native._capi, thin shells over these functions) and bnbw_native.dml (through the
Python layer at the bottom: `tensor_sizes`, `Operator`) share every rule and message.

Members are indexed by the engine's slots; each operator family's table (GRAD_TABLE,
TRAINING_TABLE) lists them in descriptor order with their names and roles.
Descriptors hold strides in elements; the engine gets byte strides, 0 on size-1 dims (so a huge
stride on a size-1 dim can never overflow), and the reduced dims "mean's size is 1".  Buffers
bound at execute time are raw memory regions: two of them overlap when their byte ranges
[address, address + minimum size) do.
"""
from libc.stdint cimport int64_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.stdio cimport snprintf
from libc.string cimport memcpy, strncpy
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBuffer_IsContiguous,
                             PyBUF_FULL_RO)

from bnbw_native._vocabulary cimport (
    Layout, MAX_DIMS, N_SLOTS, N_ROLES, S_X, S_DY, S_DX, S_MEAN, S_VAR, S_SCALE, S_DSCALE,
    S_DBIAS, S_BETA, S_RUN_MEAN, S_RUN_VAR, S_BATCH_MEAN, S_BATCH_VAR, OP_FORWARD, OP_RELU,
    DO_FROZEN, DO_TRAINING, DO_FORWARD, itemsize, engine_dtype)
from bnbw_native._headers cimport (
    bnbw_data_type, BNBW_DATA_TYPE_FLOAT32, BNBW_DATA_TYPE_FLOAT16, BNBW_DATA_TYPE_BFLOAT16,
    bnbw_tensor_desc, BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD,
    BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD, bnbw_batch_normalization_grad_desc,
    bnbw_batch_normalization_training_desc, bnbw_status, BNBW_OK, BNBW_ERROR_NULL_POINTER,
    BNBW_ERROR_DATA_TYPE, BNBW_ERROR_DIMENSION_COUNT, BNBW_ERROR_SIZES, BNBW_ERROR_STRIDES,
    BNBW_ERROR_TOTAL_SIZE, BNBW_ERROR_OVERLAP, BNBW_ERROR_NUM_THREADS, BNBW_ERROR_ALIGNMENT,
    BNBW_ERROR_OPERATOR_TYPE, BNBW_ERROR_OUT_OF_MEMORY, BNBW_ERROR_ADDRESS)
from bnbw_native._rules cimport (Arg, Rules, Epsilon, Momentum, Convention, MESSAGE_CAP,
                                 check_call, layout_of, type_text, parse_real, in_place_input,
                                 check_threads, raise_status)
from bnbw_native._overlap cimport ranges_overlap
from bnbw_native._engine cimport engine_plan, engine_execute, engine_release

import numbers

import numpy as np

from bnbw_native._rules import requested_threads


# ---------------------------------------------------------------------------------------
# Members: one table per operator family
# ---------------------------------------------------------------------------------------

# Each family's members in descriptor order: DirectML's name, the engine's slot, the role
# ("input", "optional": an input that may be absent, "output").  The order is that of the C
# structs' fields too; every other list of members - the conventions, the C structs as read
# here, the checks' order, bnbw_native.dml's operators - is derived from these rows.
GRAD_TABLE = (
    ("input", S_X, "input"),
    ("input_gradient", S_DY, "input"),
    ("mean", S_MEAN, "input"),
    ("variance", S_VAR, "input"),
    ("scale", S_SCALE, "input"),
    ("output_gradient", S_DX, "output"),
    ("output_scale_gradient", S_DSCALE, "output"),
    ("output_bias_gradient", S_DBIAS, "output"),
)
TRAINING_TABLE = (
    ("input", S_X, "input"),
    ("mean", S_MEAN, "input"),
    ("variance", S_VAR, "input"),
    ("scale", S_SCALE, "optional"),         # absent: 1
    ("bias", S_BETA, "optional"),           # absent: 0
    ("output", S_DX, "output"),
    ("output_running_mean", S_RUN_MEAN, "output"),
    ("output_running_variance", S_RUN_VAR, "output"),
    ("output_batch_mean", S_BATCH_MEAN, "output"),
    ("output_batch_variance", S_BATCH_VAR, "output"),
)

cdef extern from *:
    """
    /* The operator descriptors open with, and the bindings are, one pointer per member in
     * member order (include/bnbw_native.h), so _directml copies them as arrays of pointers
     * (copy_members).  The build stops here unless each descriptor's run of pointers is as
     * long as its bindings; tests/surfaces/test_capi.py holds every field's name and type to
     * the member tables. */
    #define BNBW_GRAD_MEMBERS (sizeof(bnbw_bindings) / sizeof(void *))
    #define BNBW_TRAINING_MEMBERS (sizeof(bnbw_training_bindings) / sizeof(void *))
    #define BNBW_MAX_MEMBERS (BNBW_GRAD_MEMBERS > BNBW_TRAINING_MEMBERS ? BNBW_GRAD_MEMBERS \
                                                                     : BNBW_TRAINING_MEMBERS)
    _Static_assert(sizeof(const bnbw_tensor_desc *) == sizeof(void *),
                   "descriptor pointers copy as void pointers");
    _Static_assert(sizeof(bnbw_bindings) % sizeof(void *) == 0
                   && offsetof(bnbw_batch_normalization_grad_desc, epsilon)
                      == BNBW_GRAD_MEMBERS * sizeof(void *),
                   "bnbw_batch_normalization_grad_desc: one pointer per member, then epsilon");
    _Static_assert(sizeof(bnbw_training_bindings) % sizeof(void *) == 0
                   && offsetof(bnbw_batch_normalization_training_desc, epsilon)
                      == BNBW_TRAINING_MEMBERS * sizeof(void *),
                   "bnbw_batch_normalization_training_desc: one pointer per member, then epsilon");
    """
    enum:
        BNBW_GRAD_MEMBERS
        BNBW_TRAINING_MEMBERS
        BNBW_MAX_MEMBERS


cdef Member GRAD_ROWS[BNBW_GRAD_MEMBERS]
cdef Member TRAINING_ROWS[BNBW_TRAINING_MEMBERS]


cdef int _rows(Member *rows, table, Py_ssize_t count) except -1:
    """A table's rows as the nogil code reads them."""
    if len(table) != count:
        raise ImportError(f"a DirectML member table has {len(table)} rows, its C structs "
                          f"{count} members")
    for i, (name, slot, role) in enumerate(table):
        rows[i].slot = slot
        rows[i].output = role == "output"
        rows[i].optional = role == "optional"
    return 0


_rows(GRAD_ROWS, GRAD_TABLE, BNBW_GRAD_MEMBERS)
_rows(TRAINING_ROWS, TRAINING_TABLE, BNBW_TRAINING_MEMBERS)
MEMBERS = tuple(row[0] for row in GRAD_TABLE)
TRAINING_MEMBERS = tuple(row[0] for row in TRAINING_TABLE)


cdef inline void copy_members(void *dst, const void *src, int n) noexcept nogil:
    """n members' pointers between a C descriptor or bindings struct and an array (the check
    above: the struct holds them in member order, one pointer each)."""
    memcpy(dst, src, n * sizeof(void *))


def _convention(table):
    """DirectML's convention for the validation layer, its names in member order (the order its
    checks go in): descriptors here, arrays in bnbw_native.dml."""
    from bnbw_native._rules import ROLES
    role = {slot: key for key, slot in ROLES.items()}
    return Convention({role[slot]: name for name, slot, _ in table}, family="directml",
                      dtype_rule="same", ranks=(1, MAX_DIMS), data_format=False)


CONVENTION = _convention(GRAD_TABLE)
TRAINING_CONVENTION = _convention(TRAINING_TABLE)
cdef const Rules *RULES = &(<Convention> CONVENTION).rules
cdef const Rules *TRAINING_RULES = &(<Convention> TRAINING_CONVENTION).rules

cdef int64_t LIMIT = 0x7FFFFFFFFFFFFFFF     # byte extents must fit int64 (engine offsets)


cdef inline const char *member_name(const OperatorImpl *op, int slot) noexcept nogil:
    return op.rules.names[slot]


cdef inline const char *sep(const char *member) noexcept nogil:
    return ": " if member[0] != 0 else ""


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
    t.itemsize = itemsize(engine_dtype(dtype))
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


cdef uint64_t default_total(int64_t minimum) noexcept nogil:
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


# ---------------------------------------------------------------------------------------
# The operator
# ---------------------------------------------------------------------------------------

cdef bnbw_status operator_check(OperatorImpl *op, const bnbw_tensor_desc **descs,
                                const Epsilon *eps, const Momentum *momentum, Arg *a, char *msg,
                                size_t cap) noexcept nogil:
    """Every member's descriptor, once (op.members of them, NULL where optional and absent),
    then the operator's rules (the validation layer's, under op.rules); fills op.t and
    a[N_ROLES]."""
    cdef bnbw_status rc
    cdef int64_t channels
    cdef int i, d, slot
    for i in range(N_ROLES):
        a[i].present = False
        a[i].data = NULL
    for i in range(op.n_members):
        slot = op.members[i].slot
        if descs[i] == NULL and op.members[i].optional:
            continue
        rc = tensor_check(descs[i], member_name(op, slot), &op.t[slot], msg, cap)
        if rc != BNBW_OK:
            return rc
        a[slot].present = True
        a[slot].dtype = engine_dtype(op.t[slot].dtype)
        strncpy(a[slot].type_name, type_text(a[slot].dtype), 39)
        a[slot].ndim = op.t[slot].ndim
        a[slot].writable = True
        a[slot].aligned = True
        for d in range(op.t[slot].ndim):
            a[slot].shape[d] = op.t[slot].sizes[d]
            a[slot].strides[d] = op.t[slot].strides[d] * op.t[slot].itemsize
    return check_call(op.rules, a, op.op, 0, eps, momentum, -1, &channels, msg, cap)


cdef bint same_layout(const Tensor *a, const Tensor *b) noexcept nogil:
    cdef int d
    if a.dtype != b.dtype or a.ndim != b.ndim:
        return False
    for d in range(a.ndim):
        if a.sizes[d] != b.sizes[d] or (a.sizes[d] > 1 and a.strides[d] != b.strides[d]):
            return False
    return True


cdef bnbw_status _op_build(int kind, const Rules *rules, const Member *members, int n_members,
                           const bnbw_tensor_desc **descs, const Epsilon *eps,
                           const Momentum *momentum, OperatorImpl **out, char *msg,
                           size_t cap) noexcept nogil:
    """A new operator of `kind` (its op) over `members` (descs in their order): every check,
    then the plan."""
    cdef OperatorImpl *op
    cdef Arg a[N_ROLES]
    cdef Layout layout
    cdef bnbw_status rc
    op = <OperatorImpl *> calloc(1, sizeof(OperatorImpl))
    if op == NULL:
        snprintf(msg, cap, "out of memory")
        return BNBW_ERROR_OUT_OF_MEMORY
    op.op = kind
    op.rules = rules
    op.members = members
    op.n_members = n_members
    rc = operator_check(op, descs, eps, momentum, a, msg, cap)
    if rc != BNBW_OK:
        free(op)
        return rc
    op.eps = eps[0]
    if momentum != NULL:
        op.momentum = momentum[0]
    layout_of(op.rules, a, 0, &layout)
    if engine_plan(&layout, &op.plan) != BNBW_OK:
        free(op)
        snprintf(msg, cap, "out of memory while planning")
        return BNBW_ERROR_OUT_OF_MEMORY
    out[0] = op
    return BNBW_OK


cdef bnbw_status _no_operator_yet(const void *desc, OperatorImpl **out, char *msg,
                                  size_t cap) noexcept nogil:
    """The pointers every create needs: where the operator goes (cleared), its descriptor."""
    if out == NULL:
        snprintf(msg, cap, "op: the pointer receiving the operator is NULL")
        return BNBW_ERROR_NULL_POINTER
    out[0] = NULL
    if desc == NULL:
        snprintf(msg, cap, "desc: the operator descriptor pointer is NULL")
        return BNBW_ERROR_NULL_POINTER
    return BNBW_OK


cdef bnbw_status op_create(int type, const bnbw_batch_normalization_grad_desc *desc,
                           const Epsilon *eps, OperatorImpl **out, char *msg,
                           size_t cap) noexcept nogil:
    """A new gradient operator.  eps: the epsilon as the caller gave it (C: desc.epsilon)."""
    cdef const bnbw_tensor_desc *descs[BNBW_GRAD_MEMBERS]
    if type != BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD \
            and type != BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD and out != NULL:
        out[0] = NULL
        snprintf(msg, cap, "type must be BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD (1) or "
                 "BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD (2), got %d", type)
        return BNBW_ERROR_OPERATOR_TYPE
    if _no_operator_yet(desc, out, msg, cap) != BNBW_OK:
        return BNBW_ERROR_NULL_POINTER
    copy_members(descs, desc, BNBW_GRAD_MEMBERS)
    return _op_build(DO_TRAINING if type == BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD
                     else DO_FROZEN, RULES, GRAD_ROWS, BNBW_GRAD_MEMBERS, descs, eps, NULL, out,
                     msg, cap)


cdef bnbw_status op_create_training(const bnbw_batch_normalization_training_desc *desc,
                                    const Epsilon *eps, const Momentum *momentum,
                                    OperatorImpl **out, char *msg, size_t cap) noexcept nogil:
    """A new training-forward operator; eps and momentum as the caller gave them."""
    cdef const bnbw_tensor_desc *descs[BNBW_TRAINING_MEMBERS]
    if _no_operator_yet(desc, out, msg, cap) != BNBW_OK:
        return BNBW_ERROR_NULL_POINTER
    copy_members(descs, desc, BNBW_TRAINING_MEMBERS)
    return _op_build(DO_FORWARD | (OP_RELU if desc.fuse_relu else 0), TRAINING_RULES,
                     TRAINING_ROWS, BNBW_TRAINING_MEMBERS, descs, eps, momentum, out, msg, cap)


cdef void op_destroy(OperatorImpl *op) noexcept nogil:
    if op != NULL:
        engine_release(&op.plan)
        free(op)


cdef void op_bind(const OperatorImpl *op, const void *bindings, const void **ptr) noexcept nogil:
    """ptr by slot from the C bindings struct of op's family (its members' pointers in member
    order); all NULL when op is NULL."""
    cdef const void *members[BNBW_MAX_MEMBERS]
    cdef int i
    for i in range(N_SLOTS):
        ptr[i] = NULL
    if op == NULL:
        return
    copy_members(members, bindings, op.n_members)
    for i in range(op.n_members):
        ptr[op.members[i].slot] = members[i]


cdef bnbw_status op_execute(const OperatorImpl *op, const void **ptr, int num_threads,
                            char *msg, size_t cap) noexcept nogil:
    """ptr: the buffer addresses by slot (NULL for absent optional members).  num_threads as a
    C caller gives it (check_threads), 0 the package default (OpenMP's unless
    bnbw_native.set_num_threads set one)."""
    cdef int i, j, s, o, same
    cdef uintptr_t a, b
    if op == NULL:
        snprintf(msg, cap, "op: the operator pointer is NULL")
        return BNBW_ERROR_NULL_POINTER
    for i in range(op.n_members):
        s = op.members[i].slot
        a = <uintptr_t> ptr[s]
        if op.t[s].ndim == 0:          # an optional member the operator was made without
            if a != 0:
                snprintf(msg, cap, "%s: the operator was made without this member; its buffer "
                         "pointer must be NULL", member_name(op, s))
                return BNBW_ERROR_NULL_POINTER
            continue
        if a == 0:
            snprintf(msg, cap, "%s: the buffer pointer is NULL", member_name(op, s))
            return BNBW_ERROR_NULL_POINTER
        if a % <uintptr_t> op.t[s].itemsize != 0:
            snprintf(msg, cap, "%s: address %p is not aligned to the item size (%d bytes)",
                     member_name(op, s), ptr[s], <int> op.t[s].itemsize)
            return BNBW_ERROR_ALIGNMENT
        if <uint64_t> op.t[s].minimum - 1 > <uint64_t> (<uintptr_t> -1 - a):
            snprintf(msg, cap, "%s: a buffer of %lld bytes at address %p runs past the end of "
                     "the address space", member_name(op, s), <long long> op.t[s].minimum,
                     ptr[s])
            return BNBW_ERROR_ADDRESS
    if check_threads(num_threads, True, "num_threads", NULL, msg, cap) != BNBW_OK:
        return BNBW_ERROR_NUM_THREADS
    for i in range(op.n_members):
        o = op.members[i].slot
        if not op.members[i].output:
            continue
        same = in_place_input(op.op, o)
        for j in range(op.n_members):
            s = op.members[j].slot
            if j == i or (op.members[j].output and j < i) or op.t[s].ndim == 0:
                continue          # each pair of outputs once
            a = <uintptr_t> ptr[o]
            b = <uintptr_t> ptr[s]
            if not ranges_overlap(a, op.t[o].minimum, b, op.t[s].minimum):
                continue
            if s == same and a == b and same_layout(&op.t[o], &op.t[s]):
                continue          # in place: the very same layout at the very same address
            if s == same:
                snprintf(msg, cap, "%s overlaps %s (in place needs the same address and "
                         "identical descriptors)", member_name(op, o), member_name(op, s))
            elif op.members[j].output:
                snprintf(msg, cap, "%s overlaps %s; outputs must not overlap each other",
                         member_name(op, o), member_name(op, s))
            else:
                snprintf(msg, cap, "%s overlaps the input %s; output buffers must not "
                         "overlap input buffers", member_name(op, o), member_name(op, s))
            return BNBW_ERROR_OVERLAP
    if engine_execute(&op.plan, <char **> ptr, op.op, <float> op.eps.value,
                      <float> op.momentum.value, -1, NULL, num_threads) != BNBW_OK:
        snprintf(msg, cap, "out of memory for the reduction buffers")
        return BNBW_ERROR_OUT_OF_MEMORY
    return BNBW_OK


# ---------------------------------------------------------------------------------------
# The Python layer under bnbw_native.dml: marshal arguments, call the functions above
# ---------------------------------------------------------------------------------------

POINTER_MAX = <uintptr_t> -1
DATA_TYPES = {"float32": BNBW_DATA_TYPE_FLOAT32, "float16": BNBW_DATA_TYPE_FLOAT16,
              "bfloat16": BNBW_DATA_TYPE_BFLOAT16}
ITEMSIZES = {name: itemsize(engine_dtype(code)) for name, code in DATA_TYPES.items()}
OPERATOR_TYPES = {"grad": BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD,
                  "training_grad": BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD}
OPERATOR_KINDS = ("grad", "training_grad", "training")


cdef int64_t _int64(value, str what) except? -1:
    if not -LIMIT - 1 <= value <= LIMIT:
        raise ValueError(f"{what} is {value}, beyond the 64-bit integer range")
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
        store.sizes[d] = _int64(sizes[d], f"{prefix}sizes[{d}]")
        if strides is not None and d < len(strides):
            store.strides[d] = _int64(strides[d], f"{prefix}strides[{d}]")
    if total is None:
        store.desc.total_tensor_size_in_bytes = 0
    elif not 0 <= total < 2 ** 64:
        raise ValueError(f"{prefix}total_tensor_size_in_bytes is {total}, outside 0 to 2^64 - 1")
    else:
        store.desc.total_tensor_size_in_bytes = total
    return 0


def tensor_sizes(spec):
    """(minimum size, total size, strides in elements) of a descriptor spec, checked once; the
    total defaults to the minimum rounded up to 4 bytes."""
    cdef DescStore store
    cdef Tensor t
    cdef char msg[MESSAGE_CAP]
    cdef bnbw_status rc
    _marshal(&store, spec, "")
    with nogil:
        rc = layout_check(<int> store.desc.data_type, store.desc.dimension_count,
                          store.desc.sizes, store.desc.strides, "", &t, msg, MESSAGE_CAP)
    if rc != BNBW_OK:
        raise_status(rc, msg)
    total = default_total(t.minimum) if spec[3] is None else spec[3]
    if total < t.minimum:
        raise ValueError(f"total_tensor_size_in_bytes is {total}, below the minimum size of "
                         f"{t.minimum} bytes")
    return t.minimum, total, tuple(t.strides[d] for d in range(t.ndim))


cdef str _pointer_object(Py_buffer *view):
    """Why a buffer is not raw memory but a ctypes pointer object, or None: ctypes pointers
    export their own 8 bytes (formats "<P", "&<f", "<z"; "X{}" for function pointers)."""
    if view.format == NULL:
        return None
    fmt = view.format.decode("ascii", "replace").lstrip("@=<>!")
    if fmt.startswith(("&", "X")) or fmt in ("P", "z", "Z", "O"):
        return fmt
    return None


cdef class Operator:
    """A compiled operator: type "grad", "training_grad" (eight descriptor specs in member order)
    or "training" (ten, None for an absent scale or bias), the epsilon as given and, for
    "training", the momentum and fuse_relu.  execute() binds buffers and runs it."""
    cdef OperatorImpl *impl
    cdef tuple members

    def __cinit__(self, str type, specs, epsilon, momentum=None, fuse_relu=False):
        cdef DescStore store[BNBW_MAX_MEMBERS]
        cdef const bnbw_tensor_desc *descs[BNBW_MAX_MEMBERS]
        cdef bnbw_batch_normalization_grad_desc grad
        cdef bnbw_batch_normalization_training_desc training
        cdef Epsilon eps
        cdef Momentum m
        cdef char msg[MESSAGE_CAP]
        cdef bnbw_status rc
        cdef int i, code = 0
        self.impl = NULL
        self.members = TRAINING_MEMBERS if type == "training" else MEMBERS
        if type != "training":
            code = OPERATOR_TYPES[type]
        for i in range(len(self.members)):
            descs[i] = NULL
            if specs[i] is not None:
                _marshal(&store[i], specs[i], self.members[i] + ": ")
                descs[i] = &store[i].desc
        parse_real(epsilon, &eps, "epsilon")
        if type == "training":
            parse_real(momentum, &m, "momentum")
            copy_members(&training, descs, BNBW_TRAINING_MEMBERS)
            training.epsilon = <float> eps.value
            training.momentum = <float> m.value
            training.fuse_relu = bool(fuse_relu)
            with nogil:
                rc = op_create_training(&training, &eps, &m, &self.impl, msg, MESSAGE_CAP)
        else:
            copy_members(&grad, descs, BNBW_GRAD_MEMBERS)
            grad.epsilon = <float> eps.value
            with nogil:
                rc = op_create(code, &grad, &eps, &self.impl, msg, MESSAGE_CAP)
        if rc != BNBW_OK:
            raise_status(rc, msg)

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
    def epsilon(self):
        """The f32 epsilon, as a float."""
        return float(<float> self.impl.eps.value)

    @property
    def momentum(self):
        """The f32 momentum, as a float (training only)."""
        return float(<float> self.impl.momentum.value)

    def execute(self, buffers, num_threads):
        """buffers: one per member in member order, each a buffer-protocol object, a NumPy
        array (any dtype, raw memory) or a positive int address; None for a member the operator
        was made without; num_threads as given."""
        cdef Py_buffer views[BNBW_MAX_MEMBERS]
        cdef bint held[BNBW_MAX_MEMBERS]
        cdef const void *ptr[N_SLOTS]
        cdef char msg[MESSAGE_CAP]
        cdef bnbw_status rc = BNBW_OK
        cdef int i, slot, threads = requested_threads(num_threads)
        cdef Py_ssize_t nbytes
        for i in range(BNBW_MAX_MEMBERS):
            held[i] = False
        for i in range(N_SLOTS):
            ptr[i] = NULL
        try:
            for i in range(self.impl.n_members):
                slot = self.impl.members[i].slot
                if buffers[i] is None and self.impl.t[slot].ndim == 0:
                    continue
                if self.impl.t[slot].ndim == 0:
                    raise ValueError(f"{self.members[i]}: the operator was made without it (its "
                                     "descriptor was None), so its buffer must be None")
                ptr[slot] = _address(buffers[i], self.members[i], self.impl.members[i].output,
                                     &views[i], &held[i], &nbytes)
                if nbytes >= 0 and nbytes < self.impl.t[slot].minimum:
                    raise ValueError(f"{self.members[i]}: the buffer holds {nbytes} bytes, the "
                                     f"descriptor needs at least {self.impl.t[slot].minimum} "
                                     "(its minimum size)")
            with nogil:
                rc = op_execute(self.impl, ptr, threads, msg, MESSAGE_CAP)
        finally:
            for i in range(BNBW_MAX_MEMBERS):
                if held[i]:
                    PyBuffer_Release(&views[i])
        if rc != BNBW_OK:
            raise_status(rc, msg)


cdef const void *_address(object obj, str name, bint output, Py_buffer *view, bint *held,
                          Py_ssize_t *nbytes) except? NULL:
    """The memory a bound buffer gives: an int address (trusted; nbytes -1), a NumPy array's
    data (read as raw contiguous memory), or a buffer-protocol object's (held in `view` until
    the call is done).  TypeError / ValueError naming the member for anything else."""
    nbytes[0] = -1
    if isinstance(obj, (bool, np.bool_)) or obj is None:
        raise TypeError(f"{name} must be a buffer or an int address, got "
                        f"{type(obj).__name__}")
    if isinstance(obj, numbers.Integral):
        address = int(obj)
        if not 0 < address <= POINTER_MAX:
            raise ValueError(f"{name}: an integer address must be positive and fit a pointer, "
                             f"got {address}")
        return <const void *> <uintptr_t> address
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError(f"{name}: an array of Python objects is not raw memory")
        if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
            raise ValueError(f"{name}: the array is not contiguous; a buffer must be contiguous "
                             "raw memory")
        if output and not obj.flags.writeable:
            raise ValueError(f"{name}: the array is read-only; output buffers must be writable")
        nbytes[0] = obj.nbytes
        return <const void *> <uintptr_t> obj.__array_interface__["data"][0]
    try:
        PyObject_GetBuffer(obj, view, PyBUF_FULL_RO)
    except (TypeError, BufferError, ValueError):
        raise TypeError(f"{name} must be a buffer (bytes-like object, NumPy array) or an int "
                        f"address, got {type(obj).__name__}") from None
    held[0] = True
    pointer = _pointer_object(view)
    if pointer is not None:
        raise TypeError(f"{name}: {type(obj).__name__} is a pointer object (buffer format "
                        f"{pointer!r}): its buffer is the pointer's own bytes, not the memory "
                        "it points to; pass the address as an int instead (ptr.value, or "
                        "ctypes.cast(ptr, ctypes.c_void_p).value)")
    if not PyBuffer_IsContiguous(view, b'A'):
        raise ValueError(f"{name}: the buffer is not contiguous; a buffer must be contiguous "
                         "raw memory")
    if output and view.readonly:
        raise ValueError(f"{name}: the buffer is read-only; output buffers must be writable")
    nbytes[0] = view.len
    return view.buf
