# cython: language_level=3
"""The rules of every public convention, checked without the GIL: one validation layer.

Design
------
A front-end names its arguments and rules once, as a `Convention` (oneDNN Graph, the Intel spec,
nGraph, the two phases, DirectML).  Its arguments arrive here as `Arg`s - an address, a dtype
code, shape, byte strides, flags; marshalled by bnbw_native._arrays for array calls and by
bnbw_native._directml for descriptors - and `check_call` holds every rule: storage types and the
convention's dtype rule, ranks, shapes, the statistics' form, epsilon, the two-phase sums,
outputs (dtype, shape, writable, aligned, no self-overlap) and overlaps between arguments.  A
refusal is a bnbw_status and a message naming the argument as the convention calls it; nothing
has been written then.  `raise_status` is the one map from a status to a Python exception.

`layout_of` turns checked arguments into the engine's Layout, once per call.  Nothing above
touches a Python object but the Convention constructor and `raise_status`.

What a Python caller gives besides arrays is checked here too, before any array is read: the
choices (data_format, num_outputs), flags, epsilon, the two-phase count.  `check_threads` is the
one rule for num_threads: Python callers' through `requested_threads`, C callers' through the
DirectML operator's execute (where 0 is the default, as include/bnbw_native.h says).
"""
from libc.stdint cimport int64_t
from libc.stdio cimport snprintf
from libc.string cimport memset, strcmp, strncpy
from libc.math cimport isfinite, INFINITY

import decimal
import numbers
import warnings

import numpy as np

cimport numpy as cnp
from bnbw_native._overlap cimport may_share, self_overlap, same_view
from bnbw_native._vocabulary cimport (
    Layout, N_BIG, N_SLOTS, S_X, S_DY, S_DX, S_MASK, S_DRES, S_MEAN, S_VAR, S_SCALE, S_DSCALE,
    S_DBIAS, S_BETA, S_MEAN_LOW, S_PARTIAL, DT_OTHER, DT_F32, DT_F16, DT_BF16, DT_BOOL, DT_F64, OP_GIVEN_SUMS,
    OP_FORWARD, OP_ADD_RESIDUAL, S_RUN_MEAN, S_RUN_VAR, S_BATCH_MEAN, S_BATCH_VAR)
from bnbw_native._headers cimport (
    bnbw_status, BNBW_OK, BNBW_ERROR_NULL_POINTER, BNBW_ERROR_DATA_TYPE,
    BNBW_ERROR_DIMENSION_COUNT, BNBW_ERROR_SIZES, BNBW_ERROR_STRIDES, BNBW_ERROR_OVERLAP,
    BNBW_ERROR_EPSILON,
    BNBW_ERROR_NUM_THREADS, BNBW_ERROR_ALIGNMENT, BNBW_ERROR_OUT_OF_MEMORY, bnbw_omp_num_procs)

cnp.import_array()

# ---------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------

cdef const char *type_text(int dtype) noexcept nogil:
    if dtype == DT_F32:
        return "float32"
    if dtype == DT_F16:
        return "float16"
    if dtype == DT_BF16:
        return "bfloat16"
    if dtype == DT_BOOL:
        return "bool"
    if dtype == DT_F64:
        return "float64"
    return "unknown"


cdef void _shape_text(char *buf, size_t cap, int ndim, const int64_t *shape) noexcept nogil:
    """A shape as Python prints a tuple: (), (3,), (2, 3)."""
    cdef size_t used = 0
    cdef int d
    buf[0] = 0
    used += snprintf(buf, cap, "(")
    for d in range(ndim):
        if used >= cap:
            return
        used += snprintf(buf + used, cap - used, "%lld%s", <long long> shape[d],
                         "," if ndim == 1 else (", " if d + 1 < ndim else ""))
    if used < cap:
        snprintf(buf + used, cap - used, ")")


# ---------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------


cdef bnbw_status _kind(const Rules *r, const Arg *a, int role, char *msg,
                       size_t cap) noexcept nogil:
    """A storage type the engine computes from."""
    cdef const char *hint = ""
    if a.dtype == DT_F32 or a.dtype == DT_F16 or a.dtype == DT_BF16:
        return BNBW_OK
    if a.dtype == DT_OTHER and strcmp(a.type_name, "uint16") == 0:
        hint = ("; bfloat16 bit patterns in uint16 arrays go through bnbw_native.dml "
                "descriptors or bnbw_native.half")
    elif a.dtype == DT_F64:
        hint = "; the engine takes 16- and 32-bit storage: convert it, e.g. .astype(np.float32)"
    snprintf(msg, cap, "%s must be a float32, float16 or bfloat16 (ml_dtypes) array, got %s%s",
             r.names[role], a.type_name, hint)
    return BNBW_ERROR_DATA_TYPE


cdef bnbw_status _same_shape(const Rules *r, const Arg *a, int role, const Arg *ref,
                             int ref_role, char *msg, size_t cap) noexcept nogil:
    cdef char want[256]
    cdef char got[256]
    cdef int d
    cdef bint same = a.ndim == ref.ndim
    for d in range(a.ndim if same else 0):
        same = same and a.shape[d] == ref.shape[d]
    if same:
        return BNBW_OK
    _shape_text(want, 256, ref.ndim, ref.shape)
    _shape_text(got, 256, a.ndim, a.shape)
    snprintf(msg, cap, "%s must have the shape of %s %s, got %s", r.names[role],
             r.names[ref_role], want, got)
    return BNBW_ERROR_SIZES


cdef bnbw_status check_epsilon_value(const Rules *r, const Epsilon *eps, char *msg,
                                size_t cap) noexcept nogil:
    # beyond FLT_MAX by half an ulp or more rounds to infinity; below 2^-150 to zero
    cdef double v = eps.value
    if isfinite(v) and v > 0 and v < 3.4028235677973366e38 and <float> v > 0:
        return BNBW_OK
    snprintf(msg, cap, "%s must be finite and > 0 after conversion to float32, got %s",
             r.names[NAME_EPSILON], eps.text)
    return BNBW_ERROR_EPSILON


cdef bnbw_status _check_output(const Rules *r, const Arg *a, int role, int want_dtype,
                               int want_ndim, const int64_t *want_shape, char *msg,
                               size_t cap) noexcept nogil:
    """A given output: dtype, shape, writable, aligned, no element shares memory with
    another."""
    cdef char want[256]
    cdef char got[256]
    cdef char strides[512]
    cdef int d, zero_dim, rc
    cdef const char *label = r.labels[role]
    if a.dtype != want_dtype:
        snprintf(msg, cap, "%s must have dtype %s, got %s", label, type_text(want_dtype),
                 a.type_name)
        return BNBW_ERROR_DATA_TYPE
    if r.family == FAMILY_ARRAYS:
        rc = a.ndim == want_ndim
        for d in range(a.ndim if rc else 0):
            rc = rc and a.shape[d] == want_shape[d]
        if not rc:
            _shape_text(want, 256, want_ndim, want_shape)
            _shape_text(got, 256, a.ndim, a.shape)
            snprintf(msg, cap, "%s must have shape %s, got %s", label, want, got)
            return BNBW_ERROR_SIZES
        if not a.writable:
            snprintf(msg, cap, "%s is read-only; outputs must be writable", label)
            return BNBW_ERROR_SIZES
        if not a.aligned:
            snprintf(msg, cap, "%s must be aligned to its item size", label)
            return BNBW_ERROR_ALIGNMENT
    rc = self_overlap(a, &zero_dim)
    if rc == 0:
        return BNBW_OK
    if r.family == FAMILY_DIRECTML:
        if zero_dim >= 0:
            snprintf(msg, cap, "%s: strides[%d] is 0 on a dim of size %lld, so its elements "
                     "share memory; an output must not overlap itself", label, zero_dim,
                     <long long> a.shape[zero_dim])
        elif rc > 0:
            snprintf(msg, cap, "%s: the strides make two distinct elements share memory; an "
                     "output must not overlap itself", label)
        else:
            snprintf(msg, cap, "%s: cannot prove that the strides keep every element apart "
                     "(search budget exhausted); use strides where each exceeds the extent of "
                     "the smaller ones", label)
        return BNBW_ERROR_OVERLAP
    _shape_text(strides, 512, a.ndim, a.strides)
    if rc > 0:
        snprintf(msg, cap, "%s has elements that share memory (zero or overlapping strides "
                 "%s); an output must not overlap itself", label, strides)
    else:
        snprintf(msg, cap, "%s: cannot prove that its strides %s keep every element apart; "
                 "an output must not overlap itself", label, strides)
    return BNBW_ERROR_OVERLAP


cdef int in_place_input(int op, int output) noexcept nogil:
    """The input an output may be the very same view of (in place), or -1: the backward's dx and
    residual gradient over dy; the forward's y over x and running statistics over the old."""
    if op & OP_FORWARD:
        if output == S_DX:
            return S_X
        if output == S_RUN_MEAN:
            return S_MEAN
        if output == S_RUN_VAR:
            return S_VAR
        return -1
    return S_DY if output == S_DX or output == S_DRES else -1


cdef int _OUTPUTS[9]
_OUTPUTS[:] = [S_DX, S_DSCALE, S_DBIAS, S_DRES, S_RUN_MEAN, S_RUN_VAR, S_BATCH_MEAN, S_BATCH_VAR,
               S_MEAN_LOW]
cdef int _INPUTS[9]
_INPUTS[:] = [S_X, S_DY, S_MEAN, S_VAR, S_SCALE, S_BETA, S_MASK, S_PARTIAL, S_MEAN_LOW]


cdef inline bint _writes(int op, int slot) noexcept nogil:
    """Whether `slot` of _OUTPUTS is an output of `op`: mean_low is the forward's only."""
    return slot != S_MEAN_LOW or (op & OP_FORWARD) != 0


cdef bnbw_status _check_overlaps(const Rules *r, const Arg *a, int op, char *msg,
                                 size_t cap) noexcept nogil:
    """Outputs apart from each other and from every input, except each output's in-place
    input (in_place_input) when it is the very same view."""
    cdef const int *outputs = &_OUTPUTS[0]
    cdef const int *inputs = &_INPUTS[0]
    cdef int i, j, o, k, rc, same
    for i in range(9):
        o = outputs[i]
        if not a[o].present or a[o].data == NULL or not _writes(op, o):
            continue
        same = in_place_input(op, o)
        for j in range(i + 1, 9):
            k = outputs[j]
            if (a[k].present and a[k].data != NULL and _writes(op, k)
                    and may_share(&a[o], &a[k]) != 0):
                snprintf(msg, cap, "%s overlaps %s; outputs must not overlap", r.labels[o],
                         r.labels[k])
                return BNBW_ERROR_OVERLAP
        for j in range(9):
            k = inputs[j]
            if not a[k].present or a[k].data == NULL or k == o:
                continue
            if k == same and same_view(&a[o], &a[k]):
                continue
            rc = may_share(&a[o], &a[k])
            if rc != 0:
                if same >= 0:
                    snprintf(msg, cap, "%s overlaps the input %s (only the very same array "
                             "as %s is allowed)", r.labels[o], r.names[k], r.names[same])
                else:
                    snprintf(msg, cap, "%s overlaps the input %s", r.labels[o], r.names[k])
                return BNBW_ERROR_OVERLAP
    return BNBW_OK


cdef bnbw_status check_apart_from_caller(const Rules *r, const Arg *a, int op, int role,
                                         const Arg *caller, char *msg, size_t cap) noexcept nogil:
    """The given outputs of `op` apart from `caller`, the caller's memory of input `role`
    where the call reads a copy of it (check_call saw only the copy)."""
    cdef int i
    for i in range(9):
        if (a[_OUTPUTS[i]].present and a[_OUTPUTS[i]].data != NULL and _writes(op, _OUTPUTS[i])
                and may_share(&a[_OUTPUTS[i]], caller) != 0):
            snprintf(msg, cap, "%s overlaps the input %s", r.labels[_OUTPUTS[i]], r.names[role])
            return BNBW_ERROR_OVERLAP
    return BNBW_OK


cdef bnbw_status _check_momentum(const Rules *r, const Momentum *m, char *msg,
                                 size_t cap) noexcept nogil:
    """An average's weight: finite and in [0, 1] once rounded to float32."""
    cdef float v = <float> m.value
    if v >= 0 and v <= 1:
        return BNBW_OK
    snprintf(msg, cap, "%s must be finite and in [0, 1] after conversion to float32, got %s",
             r.names[NAME_MOMENTUM], m.text)
    return BNBW_ERROR_EPSILON


cdef bnbw_status _check_reals(const Rules *r, const Epsilon *eps, const Momentum *momentum,
                              char *msg, size_t cap) noexcept nogil:
    """epsilon and momentum, where the call has them (NULL where not)."""
    if eps != NULL and check_epsilon_value(r, eps, msg, cap) != BNBW_OK:
        return BNBW_ERROR_EPSILON
    if momentum != NULL:
        return _check_momentum(r, momentum, msg, cap)
    return BNBW_OK


cdef bnbw_status _check_rank(const Rules *r, const Arg *x, char *msg, size_t cap) noexcept nogil:
    """x's rank within the convention's."""
    if x.ndim < r.min_rank or x.ndim > r.max_rank:
        snprintf(msg, cap, "%s must have %d to %d dimensions, got %d", r.names[S_X],
                 r.min_rank, r.max_rank, x.ndim)
        return BNBW_ERROR_DIMENSION_COUNT
    return BNBW_OK


cdef bnbw_status _check_arrays(const Rules *r, Arg *a, int op, int axis, const Epsilon *eps,
                               const Momentum *momentum, int64_t count, int64_t *channels,
                               char *msg, size_t cap) noexcept nogil:
    """oneDNN Graph, the Intel spec, nGraph, the two phases and the forward: x (and dy) of rank
    min_rank..max_rank, the statistics 1-D of length C along `axis`."""
    cdef const Arg *x = &a[S_X]
    cdef const Arg *dy = &a[S_DY]
    cdef char text[256]
    cdef const char *hint
    cdef int roles[5]
    cdef int stat_outputs[5]
    cdef int i, role, t2 = -1, t2_role = S_MEAN
    cdef int64_t C, local = 1
    cdef bnbw_status rc
    rc = _kind(r, x, S_X, msg, cap)
    if rc != BNBW_OK:
        return rc
    if _check_rank(r, x, msg, cap) != BNBW_OK:
        return BNBW_ERROR_DIMENSION_COUNT
    if not (op & OP_FORWARD) or op & OP_ADD_RESIDUAL:
        rc = _kind(r, dy, S_DY, msg, cap)
        if rc != BNBW_OK:
            return rc
        if dy.dtype != x.dtype:
            snprintf(msg, cap, "%s must have the dtype of %s (%s), got %s", r.names[S_DY],
                     r.names[S_X], x.type_name, dy.type_name)
            return BNBW_ERROR_DATA_TYPE
        rc = _same_shape(r, dy, S_DY, x, S_X, msg, cap)
        if rc != BNBW_OK:
            return rc
    if op & OP_ADD_RESIDUAL:
        # read in x's visiting order: the plan (and so every sum's rounding) stays x's alone
        for i in range(x.ndim):
            if x.shape[i] > 1 and dy.strides[i] != x.strides[i]:
                snprintf(msg, cap, "%s must be laid out like %s (the same strides)",
                         r.names[S_DY], r.names[S_X])
                return BNBW_ERROR_STRIDES
    C = x.shape[axis]
    channels[0] = C
    # mean_low: the backward's, read (the forward writes one: an output, below)
    roles[:] = [S_MEAN, S_VAR, S_SCALE, S_BETA, -1 if op & OP_FORWARD else S_MEAN_LOW]
    for i in range(5):
        role = roles[i]
        if role < 0 or not a[role].present:
            continue
        rc = _kind(r, &a[role], role, msg, cap)
        if rc != BNBW_OK:
            return rc
        if t2 < 0:
            t2 = a[role].dtype
            t2_role = role
            if r.dtype_rule == RULE_GRAPH and not (
                    t2 == DT_F32 or (t2 == DT_BF16 and x.dtype == DT_BF16)):
                if op & OP_FORWARD:
                    snprintf(msg, cap, "%s has dtype %s with %s of dtype %s; allowed (%s, "
                             "%s/%s/%s/%s): (float32, float32), (bfloat16, float32), "
                             "(bfloat16, bfloat16), (float16, float32)", r.names[role],
                             a[role].type_name, r.names[S_X], x.type_name, r.names[S_X],
                             r.names[S_MEAN], r.names[S_VAR], r.names[S_SCALE],
                             r.names[S_BETA])
                else:
                    snprintf(msg, cap, "%s has dtype %s with %s of dtype %s; allowed (%s/%s, "
                             "%s/%s/%s): (float32, float32), (bfloat16, float32), (bfloat16, "
                             "bfloat16), (float16, float32)", r.names[role], a[role].type_name,
                             r.names[S_X], x.type_name, r.names[S_X], r.names[S_DY],
                             r.names[S_MEAN], r.names[S_VAR], r.names[S_SCALE])
                return BNBW_ERROR_DATA_TYPE
            if r.dtype_rule == RULE_SAME and t2 != x.dtype:
                snprintf(msg, cap, "%s must have the element type of %s (%s), got %s",
                         r.names[role], r.names[S_X], x.type_name, a[role].type_name)
                return BNBW_ERROR_DATA_TYPE
        elif a[role].dtype != t2:
            snprintf(msg, cap, "%s must have the dtype of %s (%s), got %s", r.names[role],
                     r.names[t2_role], type_text(t2), a[role].type_name)
            return BNBW_ERROR_DATA_TYPE
        if a[role].ndim != 1 or a[role].shape[0] != C:
            _shape_text(text, 256, a[role].ndim, a[role].shape)
            hint = ""
            if a[role].ndim == 1 and r.names[NAME_DATA_FORMAT][0] and x.ndim > 2:
                if axis == x.ndim - 1 and a[role].shape[0] == x.shape[1]:
                    hint = ("; did you mean data_format='NCX'? (with data_format='NXC' the "
                            "channels are the last axis)")
                elif axis == 1 and a[role].shape[0] == x.shape[x.ndim - 1]:
                    hint = ("; did you mean data_format='NXC'? (with data_format='NCX' the "
                            "channels are axis 1)")
            snprintf(msg, cap, "%s must be 1-D of length C = %lld (the channel count), got "
                     "shape %s%s", r.names[role], <long long> C, text, hint)
            return BNBW_ERROR_SIZES
    if a[S_MASK].present:
        if a[S_MASK].dtype != x.dtype and a[S_MASK].dtype != DT_BOOL:
            snprintf(msg, cap, "%s must have the dtype of %s (%s) or bool, got %s",
                     r.names[S_MASK], r.names[S_X], x.type_name, a[S_MASK].type_name)
            return BNBW_ERROR_DATA_TYPE
        rc = _same_shape(r, &a[S_MASK], S_MASK, x, S_X, msg, cap)
        if rc != BNBW_OK:
            return rc
    elif a[S_DRES].present:
        snprintf(msg, cap, "%s needs %s: it receives the gradient that passes the ReLU of the "
                 "forward", r.labels[S_DRES], r.names[S_MASK])
        return BNBW_ERROR_NULL_POINTER
    rc = _check_reals(r, eps, momentum, msg, cap)
    if rc != BNBW_OK:
        return rc
    if op & OP_GIVEN_SUMS:
        if a[S_PARTIAL].dtype != DT_F64:
            snprintf(msg, cap, "%s must be a float64 array of shape (2, C) from "
                     "backward_reduce", r.names[S_PARTIAL])
            return BNBW_ERROR_DATA_TYPE
        if a[S_PARTIAL].ndim != 2 or a[S_PARTIAL].shape[0] != 2 or a[S_PARTIAL].shape[1] != C:
            _shape_text(text, 256, a[S_PARTIAL].ndim, a[S_PARTIAL].shape)
            snprintf(msg, cap, "%s must have shape (2, %lld), got %s", r.names[S_PARTIAL],
                     <long long> C, text)
            return BNBW_ERROR_SIZES
        for i in range(x.ndim):
            if i != axis:
                local *= x.shape[i]
        if count < local:
            snprintf(msg, cap, "count must be at least the local element count per channel "
                     "(%lld), got %lld", <long long> local, <long long> count)
            return BNBW_ERROR_SIZES
    # outputs, in the order of `out`
    if a[S_DX].present:
        rc = _check_output(r, &a[S_DX], S_DX, x.dtype, x.ndim, x.shape, msg, cap)
        if rc != BNBW_OK:
            return rc
    stat_outputs[:] = [S_DSCALE, S_DBIAS, -1, -1, -1]
    if op & OP_FORWARD:
        stat_outputs[:] = [S_RUN_MEAN, S_RUN_VAR, S_BATCH_MEAN, S_BATCH_VAR, S_MEAN_LOW]
    for i in range(5):
        if stat_outputs[i] >= 0 and a[stat_outputs[i]].present:
            rc = _check_output(r, &a[stat_outputs[i]], stat_outputs[i], t2, 1, &C, msg, cap)
            if rc != BNBW_OK:
                return rc
    if a[S_DRES].present:
        rc = _check_output(r, &a[S_DRES], S_DRES, x.dtype, x.ndim, x.shape, msg, cap)
        if rc != BNBW_OK:
            return rc
    return _check_overlaps(r, a, op, msg, cap)


cdef bnbw_status _check_directml(const Rules *r, Arg *a, int op, const Epsilon *eps,
                                 const Momentum *momentum, int64_t *channels, char *msg,
                                 size_t cap) noexcept nogil:
    """DirectML: the operator's tensors share one data type and dimension count; the big ones
    the input's sizes, the per-channel ones mean's, whose sizes are 1 on the summed dims and the
    input's on the others.  Its members go in the convention's order: the inputs, then the
    outputs."""
    cdef int i, d, m
    cdef const Arg *x = &a[S_X]
    cdef const char *big_text = "input, input_gradient and output_gradient"
    cdef const char *stat_text = ("mean, variance, scale, output_scale_gradient and "
                                  "output_bias_gradient")
    cdef bnbw_status rc
    if op & OP_FORWARD:
        big_text = "input and output"
        stat_text = "mean, variance, scale, bias and the four statistics outputs"
    for i in range(r.n_named):
        m = r.order[i]
        if a[m].present:
            rc = _kind(r, &a[m], m, msg, cap)
            if rc != BNBW_OK:
                return rc
    if _check_rank(r, x, msg, cap) != BNBW_OK:
        return BNBW_ERROR_DIMENSION_COUNT
    for i in range(r.n_named):
        m = r.order[i]
        if a[m].present and a[m].dtype != x.dtype:
            snprintf(msg, cap, "%s: data_type %s differs from input's %s; all tensors share "
                     "one data type", r.labels[m], a[m].type_name, x.type_name)
            return BNBW_ERROR_DATA_TYPE
    for i in range(r.n_named):       # (after every data type: a type mismatch is reported first)
        m = r.order[i]
        if a[m].present and a[m].ndim != x.ndim:
            snprintf(msg, cap, "%s: sizes have %d dimensions, input's %d; all tensors share "
                     "one dimension count", r.labels[m], a[m].ndim, x.ndim)
            return BNBW_ERROR_DIMENSION_COUNT
    for i in range(r.n_named):
        m = r.order[i]
        if not a[m].present or (m != S_DY and m != S_DX):
            continue
        for d in range(x.ndim):
            if a[m].shape[d] != x.shape[d]:
                snprintf(msg, cap, "%s: sizes[%d] is %lld, input's is %lld; %s share sizes",
                         r.labels[m], d, <long long> a[m].shape[d], <long long> x.shape[d],
                         big_text)
                return BNBW_ERROR_SIZES
    for d in range(x.ndim):
        if a[S_MEAN].shape[d] != 1 and a[S_MEAN].shape[d] != x.shape[d]:
            snprintf(msg, cap, "%s: sizes[%d] must be 1 (a summed dim) or input's %lld, got "
                     "%lld", r.names[S_MEAN], d, <long long> x.shape[d],
                     <long long> a[S_MEAN].shape[d])
            return BNBW_ERROR_SIZES
    for i in range(r.n_named):
        m = r.order[i]
        if not a[m].present or m < N_BIG:       # the big ones (checked above)
            continue
        for d in range(x.ndim):
            if a[m].shape[d] != a[S_MEAN].shape[d]:
                snprintf(msg, cap, "%s: sizes[%d] is %lld, mean's is %lld; %s share sizes",
                         r.labels[m], d, <long long> a[m].shape[d],
                         <long long> a[S_MEAN].shape[d], stat_text)
                return BNBW_ERROR_SIZES
    channels[0] = 1
    for d in range(x.ndim):
        channels[0] *= a[S_MEAN].shape[d]
    rc = _check_reals(r, eps, momentum, msg, cap)
    if rc != BNBW_OK:
        return rc
    for i in range(r.n_named):
        m = r.order[i]
        if a[m].present and _is_output(m):
            rc = _check_output(r, &a[m], m, x.dtype, a[m].ndim, a[m].shape, msg, cap)
            if rc != BNBW_OK:
                return rc
    return BNBW_OK


cdef bint _is_output(int slot) noexcept nogil:
    return (slot == S_DX or slot == S_DSCALE or slot == S_DBIAS or slot == S_DRES
            or slot == S_RUN_MEAN or slot == S_RUN_VAR or slot == S_BATCH_MEAN
            or slot == S_BATCH_VAR)


cdef bnbw_status check_call(const Rules *r, Arg *a, int op, int axis, const Epsilon *eps,
                            const Momentum *momentum, int64_t count, int64_t *channels,
                            char *msg, size_t cap) noexcept nogil:
    """Every rule of the convention `r` on the arguments a[N_ROLES]; `axis` is x's channel axis
    (0..ndim-1; array conventions); eps and momentum NULL where the call has none.  Outputs
    without an address yet (descriptors, or arrays the layer allocates) are checked for their
    layout only.  BNBW_OK with C in *channels, or the refusal with its message in msg."""
    if r.family == FAMILY_DIRECTML:
        return _check_directml(r, a, op, eps, momentum, channels, msg, cap)
    return _check_arrays(r, a, op, axis, eps, momentum, count, channels, msg, cap)


cdef void layout_of(const Rules *r, const Arg *a, int axis, Layout *l) noexcept nogil:
    """The engine's view of checked arguments: sizes, the reduced dims, byte strides per slot
    (0 on dims of size 1), which big slots are present, the storage types and C."""
    cdef int d, t
    memset(l, 0, sizeof(Layout))
    l.ndim = a[S_X].ndim
    l.big_dtype = a[S_X].dtype
    l.mask_dtype = a[S_MASK].dtype if a[S_MASK].present else a[S_X].dtype
    l.stat_dtype = a[S_MEAN].dtype
    l.channels = 1
    for t in range(N_BIG):
        l.present[t] = a[t].present
    l.present[S_DY] = True                  # the forward plans with x in dy's place
    for d in range(l.ndim):
        l.sizes[d] = a[S_X].shape[d]
        if r.family == FAMILY_DIRECTML:
            l.reduced[d] = a[S_MEAN].shape[d] == 1
        else:
            l.reduced[d] = d != axis
        if not l.reduced[d]:
            l.channels *= l.sizes[d]
        for t in range(N_SLOTS):
            if not a[t].present:
                continue
            if t < N_BIG or r.family == FAMILY_DIRECTML:
                if a[t].shape[d] > 1:
                    l.strides[t][d] = a[t].strides[d]
            elif d == axis:
                l.strides[t][d] = a[t].strides[0]
        if not a[S_DY].present:
            l.strides[S_DY][d] = l.strides[S_X][d]


# parse_real's last two floats (immutable: epsilon and momentum) and their texts
cdef object _real_a = None, _real_b = None
cdef str _text_a = "", _text_b = ""


def _short_text(value):
    """A real as Python prints it, in at most 47 characters: an integer of more digits in
    scientific form (10**400 -> 1.000000e+400), anything else cut with an ellipsis."""
    text = repr(value)
    if len(text) <= 47:
        return text
    if isinstance(value, numbers.Integral):
        return f"{decimal.Decimal(int(value)):.6e}"       # (rounded, not cut)
    return text[:44] + "..."


cdef int parse_real(object value, Real *e, str name) except -1:
    """A real argument (epsilon, momentum) as a Python caller gave it: a real number
    (TypeError naming it otherwise), kept as a double with its text for messages; the value
    rules are the checks'."""
    if type(value) is not float:
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value[()]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    global _real_a, _text_a, _real_b, _text_b
    try:
        e.value = float(value)
    except (OverflowError, ValueError):    # beyond the float range
        e.value = INFINITY
    if type(value) is not float:
        copy_name(e.text, _short_text(value), 48)
    elif value is _real_a:  # a layer passes the same float objects every call: repr them once
        copy_name(e.text, _text_a, 48)
    elif value is _real_b:
        copy_name(e.text, _text_b, 48)
    else:
        _real_b, _text_b = _real_a, _text_a
        _real_a, _text_a = value, repr(value)
        copy_name(e.text, _text_a, 48)
    return 0


cdef void real_of_float(float value, Real *e) noexcept nogil:
    e.value = value
    snprintf(e.text, 48, "%g", <double> value)


# ---------------------------------------------------------------------------------------
# Conventions
# ---------------------------------------------------------------------------------------

ROLES = {"x": S_X, "dy": S_DY, "dx": S_DX, "relu_dst": S_MASK, "diff_residual": S_DRES,
         "mean": S_MEAN, "var": S_VAR, "scale": S_SCALE, "beta": S_BETA, "dscale": S_DSCALE,
         "dbias": S_DBIAS, "run_mean": S_RUN_MEAN, "run_var": S_RUN_VAR,
         "batch_mean": S_BATCH_MEAN, "batch_var": S_BATCH_VAR, "mean_low": S_MEAN_LOW,
         "partial": S_PARTIAL}
# where each output stands in `out` (the backward's three, the forward's five)
OUT_INDEX = {"dx": 0, "dscale": 1, "dbias": 2, "run_mean": 1, "run_var": 2, "batch_mean": 3,
             "batch_var": 4}


cdef class Convention:
    """A public convention for the validation layer: the name of each argument role and the
    rules.  names: role -> name (roles as in ROLES); family "arrays" (1-D statistics of length
    C, outputs named "out[i] (name)") or "directml"; dtype_rule "graph" or "same"; ranks of x;
    data_format: whether the convention takes a data_format (its messages can then hint);
    scale_required, beta_required: None is not a scale of 1 (a beta of 0) here."""

    def __init__(self, names, *, family="arrays", dtype_rule="graph", ranks=(2, 8),
                 data_format=True, scale_required=False, beta_required=False):
        cdef int role
        memset(&self.rules, 0, sizeof(Rules))
        self.rules.family = FAMILY_DIRECTML if family == "directml" else FAMILY_ARRAYS
        self.rules.dtype_rule = RULE_SAME if dtype_rule == "same" else RULE_GRAPH
        self.rules.min_rank, self.rules.max_rank = ranks
        for key, name in names.items():
            role = ROLES[key]
            self.rules.order[self.rules.n_named] = role
            self.rules.n_named += 1
            copy_name(self.rules.names[role], name, NAME_CAP)
            if self.rules.family == FAMILY_ARRAYS and key in OUT_INDEX:
                label = f"out[{OUT_INDEX[key]}] ({name})"
            else:
                label = name
            copy_name(self.rules.labels[role], label, NAME_CAP + 16)
        copy_name(self.rules.names[NAME_EPSILON], "epsilon", NAME_CAP)
        copy_name(self.rules.names[NAME_DATA_FORMAT], "data_format" if data_format else "",
                   NAME_CAP)
        copy_name(self.rules.names[NAME_MOMENTUM], "momentum", NAME_CAP)
        self.rules.scale_required = scale_required
        self.rules.beta_required = beta_required
        for key in ("partial", "mean_low"):      # (the private ones: the same everywhere)
            if key not in names:
                copy_name(self.rules.names[ROLES[key]], key, NAME_CAP)
                copy_name(self.rules.labels[ROLES[key]], key, NAME_CAP + 16)

    def name(self, role):
        return self.rules.names[ROLES[role]].decode()


cdef void copy_name(char *dst, str text, size_t cap):
    encoded = text.encode()[:cap - 1]
    strncpy(dst, encoded, cap - 1)
    dst[cap - 1] = 0


# ---------------------------------------------------------------------------------------
# A Python caller's options, checked before any array is read
# ---------------------------------------------------------------------------------------

def check_choice(value, name, choices):
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, one of {', '.join(choices)}; "
                        f"got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


class DataFormatWarning(UserWarning):
    """A torch tensor of rank 3 or more reached an array front-end under the default
    data_format "NXC" (channels last): torch tensors carry (N, C, *) sizes whatever their
    memory format, so such a call most likely wants data_format="NCX"."""


# The default data_format: "NXC" as the conventions define it, a plain str, but an object of
# its own (made at run time, so never the interned "NXC" of a caller's code): identity tells
# the default from a caller's explicit "NXC".
NXC_DEFAULT = str(bytearray(b"NXC"), "ascii")

# what each data_format is called elsewhere: named when a caller passes one of those
_FORMAT_NAMES = {"NXC": "channels last: NWC, NHWC, NDHWC", "NCX": "channel axis 1: NCW, NCHW, "
                                                                  "NCDHW"}


def check_data_format(value, src, int stacklevel=2):
    """`value` as a plain "NXC" or "NCX".  The default with a torch tensor of rank 3 or more
    as `src` warns (DataFormatWarning): its sizes are (N, C, *) in any memory format.
    `stacklevel`: the caller's Python frame to name (2: the front-end's caller)."""
    if value is NXC_DEFAULT:
        if not cnp.PyArray_Check(src):
            _warn_if_torch(src, stacklevel)      # (compiled frames do not count)
        return "NXC"
    if isinstance(value, str):
        if value in _FORMAT_NAMES:
            return str(value)
        raise ValueError(f"data_format must be one of NXC, NCX (NXC: "
                         f"{_FORMAT_NAMES['NXC']}; NCX: {_FORMAT_NAMES['NCX']}), got {value!r}")
    return check_choice(value, "data_format", tuple(_FORMAT_NAMES))     # raises TypeError


cdef _warn_if_torch(src, int stacklevel):
    """The DataFormatWarning of check_data_format, for a torch tensor of rank 3 or more."""
    if type(src).__module__.split(".")[0] == "torch" and getattr(src, "ndim", 0) >= 3:
        sizes = tuple(src.shape)
        warnings.warn(
            f"data_format defaults to 'NXC' (channels on the last axis), so this torch tensor "
            f"of sizes {sizes} is normalised over {sizes[len(sizes) - 1]} channels; "
            f"torch tensors have (N, C, *) sizes in any memory format: pass data_format='NCX' "
            f"for them (or data_format='NXC' for a tensor that really is channels-last)",
            DataFormatWarning, stacklevel=stacklevel)


def check_int_choice(value, name, choices):
    """`value` as an int among `choices` (TypeError or ValueError naming `name` otherwise)."""
    if type(value) is int and value in choices:
        return value          # the common case, without the abstract type's check (~250 ns)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, one of {choices}, got {type(value).__name__}")
    if int(value) not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value}")
    return int(value)


def check_epsilon(value, name="epsilon"):
    """The f32 epsilon as a Python float, or TypeError / ValueError."""
    cdef Epsilon e
    cdef Rules r
    cdef char msg[MESSAGE_CAP]
    parse_real(value, &e, name)
    copy_name(r.names[NAME_EPSILON], name, NAME_CAP)
    if check_epsilon_value(&r, &e, msg, MESSAGE_CAP) != BNBW_OK:
        raise ValueError(msg.decode())
    return float(<float> e.value)


def check_int(value, name):
    """`value` as an int: a Python or NumPy integer, not a bool (TypeError naming `name`)."""
    if type(value) is int:
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def check_flag(value, name):
    """A True/False option (NumPy's bool too); TypeError naming `name` for anything else."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")


def check_count(count):
    """The two-phase global element count per channel, an int in 0..2**63 - 1, as given."""
    check_int(count, "count")
    if count < 0:
        raise ValueError(f"count must be a non-negative int, the global element count "
                         f"per channel (at least the local one), got {count}")
    if count >= 2 ** 63:
        raise ValueError(f"count must be below 2**63, got {count}")
    return count


# ---------------------------------------------------------------------------------------
# Threads: what a caller may ask for (what a call then runs on is the engine's)
# ---------------------------------------------------------------------------------------

# More than this is not a thread count but a mistake: refused (a ValueError naming it).
MAX_THREADS = MAX_REQUEST


cdef bnbw_status check_threads(int64_t n, bint zero_is_default, const char *name,
                               const char *text, char *msg, size_t cap) noexcept nogil:
    """The one thread rule.  A Python caller's num_threads (None, the default, never reaches
    here) is 1..MAX_THREADS; a C caller's (zero_is_default: include/bnbw_native.h) is >= 0, 0
    the default, and any larger count runs on the CPUs there are.  `text`: n as the caller's
    language prints it (NULL: printed from n)."""
    cdef char number[32]
    if text == NULL:
        snprintf(number, 32, "%lld", <long long> n)
        text = number
    if zero_is_default:
        if n >= 0:
            return BNBW_OK
        snprintf(msg, cap, "%s must be >= 0 (0 = the default), got %s", name, text)
        return BNBW_ERROR_NUM_THREADS
    if n <= 0:
        snprintf(msg, cap, "%s must be a positive int, got %s", name, text)
        return BNBW_ERROR_NUM_THREADS
    if n > MAX_REQUEST:
        snprintf(msg, cap, "%s must be at most %d, got %s (a call runs on at most the %d CPUs "
                 "this process may use)", name, <int> MAX_REQUEST, text, bnbw_omp_num_procs())
        return BNBW_ERROR_NUM_THREADS
    return BNBW_OK


def requested_threads(value, name="num_threads"):
    """A num_threads argument as given: 0 for None, else an int in 1..MAX_THREADS (TypeError
    or ValueError naming `name` otherwise)."""
    if value is None:
        return 0
    if type(value) is int and 0 < value <= MAX_REQUEST:
        return value          # the common case, without the checks' messages
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be None or a positive int, got {type(value).__name__}")
    value = int(value)
    # beyond int64 only the sign and "too many" matter; the message prints the value itself,
    # in full however many digits it has
    label = name.encode()
    text = str(value).encode()
    msg = bytearray(len(label) + len(text) + MESSAGE_CAP)
    if check_threads(max(-1, min(value, MAX_REQUEST + 1)), False, label, text, msg,
                     len(msg)) != BNBW_OK:
        raise ValueError(msg.split(b"\0", 1)[0].decode())
    return value


# ---------------------------------------------------------------------------------------
# Refusals as Python exceptions
# ---------------------------------------------------------------------------------------

cdef raise_status(bnbw_status rc, const char *msg):
    if rc == BNBW_ERROR_DATA_TYPE:
        raise TypeError(msg.decode())
    if rc == BNBW_ERROR_OUT_OF_MEMORY:
        raise MemoryError(msg.decode())
    raise ValueError(msg.decode())
