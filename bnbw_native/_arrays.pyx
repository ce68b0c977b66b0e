# cython: language_level=3
"""Array calls: Python objects in, marshalled, checked, outputs allocated, run.

The array conventions (oneDNN Graph, the Intel spec, nGraph, the two phases, DirectML's array
conveniences; the torch layers through them) call `backward` with their `Convention`:

    marshal (Python objects -> Args, with the GIL) -> check_call (bnbw_native._rules, no GIL)
    -> allocate the outputs not given -> layout -> bnbw_native._engine

NumPy arrays are read directly; anything else goes through NumPy once (DLPack, buffers, lists:
bnbw_native._dlpack, which also says how lazy torch views and bfloat16 over DLPack are read).
"""
import numpy as np

cimport numpy as cnp
from cpython.mem cimport PyMem_Malloc, PyMem_Free
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.string cimport memcpy, strncpy

from bnbw_native._vocabulary cimport (
    Layout, N_SLOTS, N_ROLES, S_X, S_DY, S_DX, S_MASK, S_DRES, S_MEAN, S_VAR, S_SCALE, S_DSCALE,
    S_DBIAS, S_BETA, S_MEAN_LOW, S_PARTIAL, DT_OTHER, DT_F32, DT_F16, DT_BF16, DT_BOOL, DT_F64, S_RUN_MEAN,
    S_RUN_VAR, S_BATCH_MEAN, S_BATCH_VAR, OP_GIVEN_SUMS, OP_RETURN_SUMS, OP_PARAMS, OP_EXACT_SUMS,
    OP_FORWARD, OP_RELU, OP_TORCH_RUNNING, OP_ADD_RESIDUAL, OP_DX, DO_TRAINING, DO_FROZEN_DX, DO_FROZEN, DO_REDUCE,
    DO_APPLY, DO_FORWARD, DO_FORWARD_REDUCE, DO_FORWARD_APPLY, DO_PARAMS, DO_PARAMS_FROM_SUMS)
from bnbw_native._headers cimport bnbw_status, BNBW_OK
from bnbw_native._rules cimport (Arg, ARG_DIMS, Rules, Epsilon, Momentum, Convention,
                                 FAMILY_ARRAYS, FAMILY_DIRECTML, MESSAGE_CAP, check_call,
                                 layout_of, copy_name, parse_real, raise_status,
                                 check_apart_from_caller)
from bnbw_native._engine cimport engine_run, engine_describe

from bnbw_native._dlpack import as_array, output_array, resolved_values
from bnbw_native._rules import check_count, requested_threads

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    object PyArray_NewLikeArray(cnp.ndarray prototype, cnp.NPY_ORDER order, void *descr,
                                int subok)

# What a call does, as the front-ends name it.
TRAINING, FROZEN_DX, FROZEN, REDUCE, APPLY = DO_TRAINING, DO_FROZEN_DX, DO_FROZEN, DO_REDUCE, DO_APPLY
FORWARD, FORWARD_REDUCE, FORWARD_APPLY = DO_FORWARD, DO_FORWARD_REDUCE, DO_FORWARD_APPLY
PARAMS, PARAMS_FROM_SUMS = DO_PARAMS, DO_PARAMS_FROM_SUMS


# ---------------------------------------------------------------------------------------
# Marshalling: Python objects -> Args (the only part that needs the GIL)
# ---------------------------------------------------------------------------------------

cdef int _bfloat16_type = -1      # ml_dtypes' bfloat16, a user dtype: its number once seen


cdef void _fill(Arg *a, cnp.ndarray arr) except *:
    """a describes arr's memory; dtype codes for the types the layer knows, named others."""
    global _bfloat16_type
    cdef int t = cnp.PyArray_TYPE(arr), d
    cdef int code = DT_OTHER
    cdef const char *name = NULL
    a.present = True
    a.data = <char *> cnp.PyArray_DATA(arr)
    a.ndim = cnp.PyArray_NDIM(arr)
    for d in range(a.ndim):
        a.shape[d] = cnp.PyArray_DIMS(arr)[d]
        a.strides[d] = cnp.PyArray_STRIDES(arr)[d]
    a.writable = cnp.PyArray_ISWRITEABLE(arr)
    a.aligned = cnp.PyArray_ISALIGNED(arr)
    if cnp.PyArray_ISNOTSWAPPED(arr):
        if t == cnp.NPY_FLOAT:
            code, name = DT_F32, "float32"
        elif t == cnp.NPY_FLOAT16:
            code, name = DT_F16, "float16"
        elif t == cnp.NPY_BOOL:
            code, name = DT_BOOL, "bool"
        elif t == cnp.NPY_DOUBLE:
            code, name = DT_F64, "float64"
        elif t == _bfloat16_type:
            code, name = DT_BF16, "bfloat16"
        elif t >= 256 and _bfloat16_type < 0 and arr.dtype.name == "bfloat16":
            _bfloat16_type = t
            code, name = DT_BF16, "bfloat16"
    a.dtype = code
    if name != NULL:
        strncpy(a.type_name, name, 39)
    elif cnp.PyArray_ISNOTSWAPPED(arr):
        copy_name(a.type_name, str(arr.dtype), 40)
    else:
        copy_name(a.type_name, f"{arr.dtype.str} (non-native byte order)", 40)
    a.type_name[39] = 0


# ---- torch tensors read in place: no NumPy view (the torch layers' calls) ----

cdef tuple _tensor_types = ()     # exactly these types (torch.Tensor, torch.nn.Parameter)
cdef dict _tensor_dtypes = {}     # torch dtype -> (DType code, itemsize, name)
cdef object _strided = None       # torch.strided


cdef inline bint _lazy_tensor(t) except -1:
    """A tensor whose memory holds -x or conj(x), not its values (see bnbw_native._dlpack)."""
    return t.is_neg() or t.is_conj()


def register_tensor_types(types, dtypes, strided):
    """Let calls made with tensors=True read tensors of exactly `types` in place, from their
    address, sizes and strides; `dtypes` maps the torch dtypes the kernels take to their names,
    `strided` is torch.strided.  _torch_ops registers torch's: torch is never imported here."""
    global _tensor_types, _strided
    codes = {"float32": (DT_F32, 4), "float16": (DT_F16, 2), "bfloat16": (DT_BF16, 2),
             "float64": (DT_F64, 8), "bool": (DT_BOOL, 1)}
    _tensor_types = tuple(types)
    _tensor_dtypes.clear()
    for dtype, name in dtypes.items():
        _tensor_dtypes[dtype] = (*codes[name], name.encode())
    _strided = strided


cdef bint _fill_tensor(Arg *a, t) except -1:
    """a describes a plain CPU tensor's memory (of a registered type and dtype, strided, its
    memory its values); False, a untouched, for anything else, which then goes through
    NumPy."""
    cdef int d, code, size
    if type(t) not in _tensor_types:
        return False
    entry = _tensor_dtypes.get(t.dtype)
    # (the dtypes registered are real: torch sets the conjugate bit on complex tensors only)
    if entry is None or not t.is_cpu or t.layout is not _strided or t.is_neg():
        return False
    shape = t.shape
    strides = t.stride()
    if len(shape) > ARG_DIMS:
        return False
    code, size, name = entry          # name: bytes
    a.present = True
    a.data = <char *> <uintptr_t> <uint64_t> t.data_ptr()
    a.ndim = len(shape)
    for d in range(a.ndim):
        a.shape[d] = shape[d]
        a.strides[d] = strides[d] * size
    a.writable = True
    a.aligned = (<uintptr_t> a.data) % size == 0
    a.dtype = code
    strncpy(a.type_name, <bytes> name, 39)
    a.type_name[39] = 0
    return True


cdef bint _memory_not_values(obj) except -1:
    """A tensor (of any registered type or none) with the negative or conjugate bit: its
    memory holds -x or conj(x), so it is read through a copy of its values."""
    is_neg, is_conj = getattr(obj, "is_neg", None), getattr(obj, "is_conj", None)
    return is_neg is not None and is_conj is not None and (is_neg() or is_conj())


cdef void _fill_memory(Arg *a, t) except *:
    """a describes the memory of `t`, a tensor read through a copy (_memory_not_values): its
    address, sizes and strides, for keeping outputs apart from it."""
    cdef int d
    shape = tuple(t.shape)
    strides = t.stride()
    size = t.element_size()
    a.present = len(shape) <= ARG_DIMS     # (more dims: the call is refused by its rank)
    a.ndim = len(shape) if a.present else 0
    a.data = <char *> <uintptr_t> <uint64_t> t.data_ptr()
    for d in range(a.ndim):
        a.shape[d] = shape[d]
        a.strides[d] = strides[d] * size


cdef cnp.ndarray _input(object obj, Arg *a, Convention conv, int role, list keep,
                        bint tensors, list copied=None):
    """An input argument: any array-like; copied only when the kernels could not read it in
    place (non-native byte order, misaligned), the caller's array then added to `copied` as
    (role, array).  Returns the array the engine reads (None for a tensor read in place, when
    `tensors`)."""
    cdef cnp.ndarray arr
    if tensors and type(obj) in _tensor_types:
        if _fill_tensor(a, obj) and a.aligned:
            return None
        if _lazy_tensor(obj):       # its memory is not its values: read them (a copy)
            if copied is not None:
                copied.append((role, obj))
            obj = resolved_values(obj, conv.rules.names[role].decode())
            keep.append(obj)
            if _fill_tensor(a, obj) and a.aligned:
                return None
    if cnp.PyArray_Check(obj):
        arr = <cnp.ndarray> obj
    else:
        if copied is not None and _memory_not_values(obj):   # (as_array reads a copy)
            copied.append((role, obj))
        arr = as_array(obj, conv.rules.names[role].decode())
        keep.append(arr)
    if not (cnp.PyArray_ISNOTSWAPPED(arr) and cnp.PyArray_ISALIGNED(arr)):
        if copied is not None:
            copied.append((role, arr))
        if not cnp.PyArray_ISNOTSWAPPED(arr):
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if not cnp.PyArray_ISALIGNED(arr):
            arr = arr.copy()
        keep.append(arr)
    _fill(a, arr)
    return arr


cdef object _output(object obj, Arg *a, const char *label, bint tensors):
    """A given output: a NumPy array, or a DLPack producer written in place (a tensor in place
    when `tensors`).  Returns the array that views it."""
    if tensors and _fill_tensor(a, obj):
        return obj
    if cnp.PyArray_Check(obj):
        arr = obj
    elif hasattr(obj, "__dlpack__"):
        arr = output_array(obj, label.decode())
    else:
        raise TypeError(f"{label.decode()} must be a NumPy array, got {type(obj).__name__}")
    _fill(a, <cnp.ndarray> arr)
    return arr


# ---------------------------------------------------------------------------------------
# The array call
# ---------------------------------------------------------------------------------------

ctypedef struct Call:
    # A checked array call, ready for the engine (its Args live on the caller's stack).
    int op               # DO_* (and OP_EXACT_SUMS, OP_RELU)
    int axis             # x's channel axis, 0..ndim-1 (array conventions)
    Epsilon eps
    Momentum momentum     # the forward's
    int64_t count        # the two-phase global count, -1 otherwise
    int64_t channels     # C, as the checks found it
    int requested        # num_threads as given (0: none)


# Where each output stands in `out`: the backward's three (or its parameter gradients alone)
# and the forward's five.
cdef int _OUT_ROLES[3]
_OUT_ROLES[:] = [S_DX, S_DSCALE, S_DBIAS]
cdef int _FORWARD_OUT_ROLES[5]
_FORWARD_OUT_ROLES[:] = [S_DX, S_RUN_MEAN, S_RUN_VAR, S_BATCH_MEAN, S_BATCH_VAR]


cdef void _check_copied_inputs(const Rules *r, const Arg *a, int op, list copied) except *:
    """The given outputs apart from the caller's memory of the inputs the call reads from a
    copy."""
    cdef Arg caller
    cdef int role
    cdef bnbw_status rc
    cdef char msg[MESSAGE_CAP]
    for role, original in copied:
        if cnp.PyArray_Check(original):
            _fill(&caller, <cnp.ndarray> original)
        else:                       # a tensor whose memory holds -x: that memory
            _fill_memory(&caller, original)
            if not caller.present:
                continue
        caller.dtype = a[role].dtype          # the copy's type: the same item size, native
        rc = check_apart_from_caller(r, a, op, role, &caller, msg, MESSAGE_CAP)
        if rc != BNBW_OK:
            raise_status(rc, msg)


cdef object _prepare(Convention conv, Call *c, Arg *a, x, dy, mean, var, scale, epsilon,
                     data_format, out, num_threads, beta, relu_dst, diff_residual, partial,
                     count, momentum, bint tensors=False, mean_low=None):
    """Marshal, check and allocate: everything of a call but running it.  Returns (results,
    keep): the output arrays, and the arrays the call must keep alive.  tensors: torch tensors
    are read and written in place (the layers' calls, which give every output)."""
    cdef const Rules *r = &conv.rules
    cdef char msg[MESSAGE_CAP]
    cdef bnbw_status rc
    cdef int t, n_out
    cdef int op = c.op
    cdef const int *out_roles = &_OUT_ROLES[0]
    cdef bint params_only = op & OP_PARAMS and not (op & OP_DX)
    cdef cnp.npy_intp C
    cdef cnp.ndarray X, M, V = None
    cdef list keep = []
    cdef list copied = []
    cdef bint reduce_only = (op & OP_RETURN_SUMS) != 0
    tensors = tensors and (out is not None or reduce_only)   # nothing allocated like them
    if op & OP_FORWARD:
        out_roles = &_FORWARD_OUT_ROLES[0]
    elif params_only:
        out_roles = &_OUT_ROLES[1]
    for t in range(N_ROLES):
        a[t].present = False
        a[t].data = NULL
    X = _input(x, &a[S_X], conv, S_X, keep, tensors, copied)
    c.axis = 0
    if r.family == FAMILY_ARRAYS:
        c.axis = 1 if data_format == "NCX" else a[S_X].ndim - 1
    if not (op & OP_FORWARD) or op & OP_ADD_RESIDUAL:
        _input(dy, &a[S_DY], conv, S_DY, keep, tensors, copied)
    M = _input(mean, &a[S_MEAN], conv, S_MEAN, keep, tensors, copied)
    if var is not None or not reduce_only:
        V = _input(var, &a[S_VAR], conv, S_VAR, keep, tensors, copied)
    if scale is not None or r.scale_required:
        _input(scale, &a[S_SCALE], conv, S_SCALE, keep, tensors, copied)
    if beta is not None or r.beta_required:
        _input(beta, &a[S_BETA], conv, S_BETA, keep, tensors, copied)
    if relu_dst is not None:
        _input(relu_dst, &a[S_MASK], conv, S_MASK, keep, tensors, copied)
    if mean_low is not None and (r.family != FAMILY_ARRAYS or reduce_only):
        raise TypeError("mean_low is for the one-call and apply formulas of the array "
                        "conventions (the torch layers'); this call has no use for it")
    if mean_low is not None and not (op & OP_FORWARD):
        _input(mean_low, &a[S_MEAN_LOW], conv, S_MEAN_LOW, keep, tensors, copied)
    c.eps.value = 1.0
    if not reduce_only:
        parse_real(epsilon, &c.eps, "epsilon")
    if op & OP_FORWARD and not reduce_only:
        parse_real(momentum, &c.momentum, "momentum")
    c.requested = requested_threads(num_threads)
    c.count = -1
    if op & OP_GIVEN_SUMS:
        try:
            _input(partial, &a[S_PARTIAL], conv, S_PARTIAL, keep, tensors, copied)
        except TypeError:
            raise TypeError("partial must be a float64 array of shape (2, C) from "
                            "backward_reduce") from None
        c.count = check_count(count)
    n_out = 0
    if reduce_only or r.family != FAMILY_ARRAYS:
        n_out = 0
    elif op & OP_FORWARD:
        n_out = 5
    elif params_only:
        n_out = 2
    else:
        n_out = 3 if op & OP_PARAMS else 1
    given = None
    if out is not None:
        if type(out) is not tuple and type(out) is not list:
            raise TypeError(f"out must be a tuple of {n_out} arrays, got {type(out).__name__}")
        if len(out) != n_out:
            raise ValueError(f"out must hold {n_out} arrays (one per output), got {len(out)}")
        given = []
        for t in range(n_out):
            o = out[t]
            if tensors and o is mean and M is None:      # a tensor updated in place, read once
                a[out_roles[t]] = a[S_MEAN]
            elif tensors and o is var and V is None and var is not None:
                a[out_roles[t]] = a[S_VAR]
            else:
                o = _output(o, &a[out_roles[t]], r.labels[out_roles[t]], tensors)
            given.append(o)
    if diff_residual is not None:
        keep.append(_output(diff_residual, &a[S_DRES], r.labels[S_DRES], tensors))
    if mean_low is not None and op & OP_FORWARD:
        keep.append(_output(mean_low, &a[S_MEAN_LOW], r.labels[S_MEAN_LOW], tensors))

    with nogil:
        rc = check_call(r, a, op, c.axis, NULL if reduce_only else &c.eps,
                        &c.momentum if op & OP_FORWARD and not reduce_only else NULL, c.count,
                        &c.channels, msg, MESSAGE_CAP)
    if rc != BNBW_OK:
        raise_status(rc, msg)
    if copied:
        _check_copied_inputs(r, a, op, copied)

    # outputs the caller did not give
    if reduce_only or given is not None:
        return given, keep
    C = c.channels
    if r.family == FAMILY_DIRECTML:
        shape = tuple(a[S_MEAN].shape[t] for t in range(a[S_MEAN].ndim))
        results = [PyArray_NewLikeArray(X, cnp.NPY_KEEPORDER, NULL, 0),
                   np.empty(shape, X.dtype), np.empty(shape, X.dtype)]
    else:
        results = [PyArray_NewLikeArray(X, cnp.NPY_KEEPORDER, NULL, 0) if out_roles[t] == S_DX
                   else cnp.PyArray_EMPTY(1, &C, cnp.PyArray_TYPE(M), 0) for t in range(n_out)]
    for t in range(len(results)):
        _fill(&a[out_roles[t]], <cnp.ndarray> results[t])
    return results, keep


cdef object _run(Convention conv, const Call *c, Arg *a, results):
    cdef Layout layout
    cdef char *ptr[N_SLOTS]
    cdef int t
    cdef bnbw_status rc
    cdef int64_t C = c.channels, ch, pstride0, pstride1
    cdef double *sums = NULL
    cdef const char *pdata
    cdef cnp.ndarray partial_out = None
    layout_of(&conv.rules, a, c.axis, &layout)
    for t in range(N_SLOTS):
        ptr[t] = a[t].data if a[t].present else NULL
    if c.op & ~OP_EXACT_SUMS == DO_FROZEN_DX:
        ptr[S_SCALE] = NULL          # diff_src only: gamma validated, then ignored
    if not (c.op & OP_FORWARD):
        ptr[S_BETA] = NULL           # nGraph's beta: validated only
    if c.op & (OP_RETURN_SUMS | OP_GIVEN_SUMS):
        sums = <double *> PyMem_Malloc((2 * C + 1) * sizeof(double))
        if sums == NULL:
            raise MemoryError("bnbw_native: out of memory for the sums")
    if c.op & OP_GIVEN_SUMS:       # the caller's (2, C) sums, any strides, as [Sg, Sxg] per channel
        pdata = a[S_PARTIAL].data
        pstride0 = a[S_PARTIAL].strides[0]
        pstride1 = a[S_PARTIAL].strides[1]
        for ch in range(C):
            memcpy(&sums[2 * ch], pdata + ch * pstride1, 8)
            memcpy(&sums[2 * ch + 1], pdata + pstride0 + ch * pstride1, 8)
    try:
        with nogil:
            rc = engine_run(&layout, ptr, c.op, <float> c.eps.value,
                            _engine_momentum(c),
                            <double> c.count, sums, c.requested)
        if rc != BNBW_OK:
            raise MemoryError("bnbw_native: out of memory")
        if c.op & OP_RETURN_SUMS:
            partial_out = np.empty((2, C))
            for ch in range(C):
                (<double *> cnp.PyArray_DATA(partial_out))[ch] = sums[2 * ch]
                (<double *> cnp.PyArray_DATA(partial_out))[C + ch] = sums[2 * ch + 1]
            return partial_out, _local_count(&layout)
    finally:
        PyMem_Free(sums)
    if len(results) == 1:
        return results[0], None, None
    return tuple(results)


cdef inline double _engine_momentum(const Call *c) noexcept nogil:
    """The forward's momentum as the engine takes it: rounded to float32 as the conventions
    define it; PyTorch's (OP_TORCH_RUNNING), a Python float, as it is."""
    if not (c.op & OP_FORWARD):
        return 0.0
    if c.op & OP_TORCH_RUNNING:
        return c.momentum.value
    return <float> c.momentum.value


cdef int64_t _local_count(const Layout *l):
    """M of this call: the product of the reduced sizes."""
    cdef int64_t m = 1
    cdef int d
    for d in range(l.ndim):
        if l.reduced[d]:
            m *= l.sizes[d]
    return m


def backward(Convention conv, int formula, x, dy, mean, var, scale, epsilon=None,
             data_format="NXC", out=None, num_threads=None, *, beta=None, relu_dst=None,
             diff_residual=None, partial=None, count=None, bint exact_sums=False,
             bint tensors=False, mean_low=None):
    """Check and run one array call of `conv`.  Returns (dx, dscale, dbias) - dscale and dbias
    None for FROZEN_DX - or, for REDUCE, ((2, C) float64 sums, count).  tensors: torch tensors
    read and written in place when every output is given (the torch layers).  mean_low (the
    statistics' type, C values): the mean is mean + mean_low, as a forward's mean_low gives
    it (REDUCE's sums stay around mean; the apply that takes them corrects them)."""
    cdef Arg a[N_ROLES]
    cdef Call c
    c.op = formula | (OP_EXACT_SUMS if exact_sums else 0)
    results, keep = _prepare(conv, &c, a, x, dy, mean, var, scale, epsilon, data_format, out,
                             num_threads, beta, relu_dst, diff_residual, partial, count, None,
                             tensors, mean_low)
    try:
        return _run(conv, &c, a, results)
    finally:
        del keep          # the copies the kernels read live until they are done


def describe(Convention conv, int formula, x, dy, mean, var, scale, epsilon=None,
             data_format="NXC", num_threads=None, *, beta=None, relu_dst=None,
             diff_residual=None, partial=None, count=None, bint exact_sums=False,
             momentum=0.5):
    """What the engine would do with this call, without running it: the plan and the schedule
    as a dict (for tests and benchmarks).  Forward formulas take dy None."""
    cdef Arg a[N_ROLES]
    cdef Call c
    cdef Layout layout
    c.op = formula | (OP_EXACT_SUMS if exact_sums else 0)
    _prepare(conv, &c, a, x, dy, mean, var, scale, epsilon, data_format, None, num_threads,
             beta, relu_dst, diff_residual, partial, count, momentum)
    layout_of(&conv.rules, a, c.axis, &layout)
    return engine_describe(&layout, c.op, c.requested)


def forward(Convention conv, src, mean, variance, gamma, beta, epsilon, momentum,
            data_format="NXC", bint relu=False, out=None, num_threads=None, *,
            int formula=DO_FORWARD, partial=None, count=None, bint torch_running=False,
            bint tensors=False, residual=None, mean_low=None):
    """Check and run one training forward of `conv`.  Returns (y, running_mean,
    running_variance, batch_mean, batch_variance); FORWARD_REDUCE: the sums around `mean` (a
    shift) and the local count; FORWARD_APPLY: the outputs from the given sums and count.
    torch_running: the running statistics as PyTorch keeps them (momentum weighs the batch,
    the variance unbiased); tensors: as for `backward`.  residual (FORWARD with relu; src's
    shape, type and strides): y = max(bn(src) rounded to its type + residual, 0), in the pass
    that writes y.  mean_low: an output (the statistics' type, C values) that receives the
    exact batch mean minus batch_mean, for a backward's mean_low."""
    cdef Arg a[N_ROLES]
    cdef Call c
    c.op = formula | (OP_RELU if relu else 0) | (OP_TORCH_RUNNING if torch_running else 0)
    if residual is not None:
        if formula != DO_FORWARD or not relu:
            raise ValueError("a residual is added before the ReLU of a one-phase forward: "
                             "it needs relu=True and the FORWARD formula")
        c.op |= OP_ADD_RESIDUAL
    results, keep = _prepare(conv, &c, a, src, residual, mean, variance, gamma, epsilon,
                             data_format, out, num_threads, beta, None, None, partial, count,
                             momentum, tensors, mean_low)
    try:
        return _run(conv, &c, a, results)
    finally:
        del keep
