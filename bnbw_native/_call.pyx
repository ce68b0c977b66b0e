# cython: language_level=3
"""The one way into the engine: every front-end's arguments are checked here, then run.

Design
------
A call flows one way: front-end -> marshal -> check -> allocate -> plan -> schedule -> kernels.

* A front-end (oneDNN Graph, Intel spec, nGraph, the two phases, DirectML's array
  conveniences) names its arguments and rules once, as a `Convention`, and calls `backward`.
  DirectML operators and the C API (bnbw_native._capi) describe their tensors as descriptors and
  call the same `check_call`.
* Marshalling (with the GIL) turns each Python object into an `Arg` - an address, a dtype code,
  shape, byte strides, flags - or refuses what is not an array at all (TypeError).  NumPy
  arrays are read directly; anything else goes through NumPy once (DLPack, buffers, lists).
* `check_call` (no GIL, no Python object) holds every rule: storage types and the
  convention's dtype rule, ranks, shapes, the statistics' form, epsilon, the two-phase sums,
  outputs (dtype, shape, writable, aligned, no self-overlap) and overlaps between arguments.
  A refusal is a bnbw_status and a message naming the argument as the convention calls it;
  nothing has been written then.
* The thread count is resolved once, by `resolve_threads`, for Python and C callers alike.

Statistics and edge cases (an empty batch) are the engine's business (`bnbw_native._schedules`),
never the front-ends'.
"""
import numbers

import numpy as np

cimport numpy as cnp
from cpython.mem cimport PyMem_Malloc, PyMem_Free
from libc.stdint cimport int64_t, uintptr_t
from libc.stdio cimport snprintf
from libc.string cimport memcpy, memset, strcmp, strncpy
from libc.math cimport isfinite, INFINITY

from bnbw_native._engine cimport (
    Plan, MAX_DIMS, N_BIG, N_SLOTS, N_ROLES, S_X, S_DY, S_DX, S_MASK, S_DRES, S_MEAN, S_VAR,
    S_SCALE, S_DSCALE, S_DBIAS, R_BETA, R_PARTIAL, DT_OTHER, DT_F32, DT_F16, DT_BF16, DT_BOOL,
    DT_F64, OP_REDUCE, OP_GIVEN_SUMS, OP_TRAINING, OP_DX, OP_PARAMS, OP_RETURN_SUMS,
    OP_EXACT_SUMS, itemsize, bnbw_status, BNBW_OK, BNBW_ERROR_NULL_POINTER,
    BNBW_ERROR_DATA_TYPE, BNBW_ERROR_DIMENSION_COUNT, BNBW_ERROR_SIZES, BNBW_ERROR_STRIDES,
    BNBW_ERROR_OVERLAP, BNBW_ERROR_EPSILON, BNBW_ERROR_ALIGNMENT, BNBW_ERROR_OUT_OF_MEMORY,
    bnbw_omp_max_threads, bnbw_openmp_version, bnbw_half_simd_path)
from bnbw_native._plan cimport plan_build, plan_free
from bnbw_native._schedules cimport (Schedule, schedule_choose, execute, kernel_body,
                                     cpu_kernel_body, set_kernel_cap, kernel_body_name,
                                     simd_converters)

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    object PyArray_NewLikeArray(cnp.ndarray prototype, cnp.NPY_ORDER order, void *descr,
                                int subok)

cdef extern from "float.h":
    float FLT_MAX

cdef enum:
    MAX_THREADS = 256            # more buys nothing on any machine this runs on
    OVERLAP_BUDGET = 1000000     # search nodes before an overlap is refused as undecided

MAX_THREADS_PY = MAX_THREADS

# What a call does, as the Python front-ends name it (Formula).
TRAINING, FROZEN_DX, FROZEN, REDUCE, APPLY = F_TRAINING, F_FROZEN_DX, F_FROZEN, F_REDUCE, F_APPLY


# ---------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------

cdef int _default_threads = 0    # 0: what OpenMP would use now, read per call
cdef bint _forked = False        # libgomp's pool does not survive fork(): run serial there


cdef int resolve_threads(int requested) noexcept nogil:
    """The thread count of one call: `requested` when > 0, else the package default (which
    follows OpenMP unless set), within 1..MAX_THREADS.  Results never depend on it."""
    cdef int n = requested
    if _forked:
        return 1
    if n <= 0:
        n = _default_threads if _default_threads > 0 else bnbw_omp_max_threads()
    if n < 1:
        n = 1
    return MAX_THREADS if n > MAX_THREADS else n


def set_default_threads(int n):
    """The package default (0: follow OpenMP)."""
    global _default_threads
    _default_threads = n


def default_threads():
    return _default_threads


def threads_for(int requested):
    return resolve_threads(requested)


def after_fork_in_child():
    global _forked
    _forked = True


def omp_max_threads():
    """What OpenMP would use now (read per call, so threadpoolctl limits are seen)."""
    return bnbw_omp_max_threads()


def build_info():
    return {
        "openmp": bnbw_openmp_version(),
        "kernels": kernel_body_name(kernel_body()).decode(),
        "cpu_kernels": kernel_body_name(cpu_kernel_body()).decode(),
        "half_path": bnbw_half_simd_path(simd_converters()).decode(),
    }


def _set_body_cap(int cap):
    """Run the kernels and the half converters on the best body up to `cap` (0 portable,
    1 AVX2, 2 AVX-512): one setting for the whole process."""
    set_kernel_cap(cap)


# ---------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------

cdef const char *_type_text(int dtype) noexcept nogil:
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


cdef inline const char *_sep(const Rules *r) noexcept nogil:
    return ": " if r.family == FAMILY_DIRECTML else " "


# ---------------------------------------------------------------------------------------
# Overlap: exact, within a search budget
# ---------------------------------------------------------------------------------------

cdef inline int64_t _floor_div(int64_t a, int64_t b) noexcept nogil:
    cdef int64_t q = a // b     # cdivision: truncates toward zero
    if a % b != 0 and (a < 0) != (b < 0):
        q -= 1
    return q


cdef int _solve(int m, const int64_t *n, const int64_t *c, const int64_t *reach, int i,
                int64_t lo, int64_t hi, int64_t *budget) noexcept nogil:
    """1 when integers 0 <= k_j < n_j (j >= i) make lo <= sum k_j c_j <= hi, 0 when none do,
    -1 when the budget ran out.  c sorted descending and positive; reach[j] is the largest
    sum dims j.. can make."""
    cdef int64_t k, k_lo, k_hi
    cdef int r
    if hi < 0 or lo > reach[i]:
        return 0
    if i == m:
        return 1
    budget[0] -= 1
    if budget[0] < 0:
        return -1
    k_lo = -_floor_div(reach[i + 1] - lo, c[i])      # ceil((lo - reach) / c)
    k_hi = _floor_div(hi, c[i])
    if k_lo < 0:
        k_lo = 0
    if k_hi > n[i] - 1:
        k_hi = n[i] - 1
    k = k_lo
    while k <= k_hi:
        r = _solve(m, n, c, reach, i + 1, lo - k * c[i], hi - k * c[i], budget)
        if r != 0:
            return r
        k += 1
    return 0


cdef void _bounds(const Arg *a, int64_t *lo, int64_t *hi) noexcept nogil:
    """The byte range [lo, hi) the elements of `a` occupy; lo == hi when it has none."""
    cdef int64_t extent
    cdef int d
    lo[0] = <int64_t> <uintptr_t> a.data
    hi[0] = lo[0]
    for d in range(a.ndim):
        if a.shape[d] == 0:
            return
    for d in range(a.ndim):
        extent = (a.shape[d] - 1) * a.strides[d]
        if extent < 0:
            lo[0] += extent
        else:
            hi[0] += extent
    hi[0] += itemsize(a.dtype) if a.dtype != DT_OTHER else 1


cdef int _may_share(const Arg *a, const Arg *b) noexcept nogil:
    """0 when no element of a shares a byte with an element of b, 1 when one does, -1 when
    the search could not decide."""
    cdef int64_t alo, ahi, blo, bhi, v, size, tmp
    cdef int64_t n[2 * ARG_DIMS]
    cdef int64_t c[2 * ARG_DIMS]
    cdef int64_t reach[2 * ARG_DIMS + 1]
    cdef int64_t const = 0, budget = OVERLAP_BUDGET
    cdef int m = 0, d, i, j
    _bounds(a, &alo, &ahi)
    _bounds(b, &blo, &bhi)
    if alo == ahi or blo == bhi or ahi <= blo or bhi <= alo:
        return 0
    # address(a) - address(b) = const + sum of positive coefficients times 0..n-1 indices;
    # the elements' bytes meet when that lies in (-size of a, size of b)
    const = <int64_t> <uintptr_t> a.data - <int64_t> <uintptr_t> b.data
    for i in range(2):
        for d in range((a if i == 0 else b).ndim):
            size = (a if i == 0 else b).shape[d]
            v = (a if i == 0 else b).strides[d] * (1 if i == 0 else -1)
            if size <= 1 or v == 0:
                continue
            if v < 0:
                const += v * (size - 1)
                v = -v
            n[m] = size
            c[m] = v
            m += 1
    for i in range(1, m):                  # insertion sort, descending coefficients
        j = i
        while j > 0 and c[j - 1] < c[j]:
            tmp = c[j - 1]; c[j - 1] = c[j]; c[j] = tmp
            tmp = n[j - 1]; n[j - 1] = n[j]; n[j] = tmp
            j -= 1
    reach[m] = 0
    for i in range(m - 1, -1, -1):
        reach[i] = reach[i + 1] + (n[i] - 1) * c[i]
    return _solve(m, n, c, reach, 0, -(itemsize(a.dtype) - 1) - const,
                  itemsize(b.dtype) - 1 - const, &budget)


cdef int _collide(const int64_t *n, const int64_t *s, const int64_t *reach, int i, int m,
                  int64_t target, bint nonzero, int64_t *budget) noexcept nogil:
    """Is there k_i..k_{m-1}, |k_j| < n_j, with sum k_j * s_j == target (and k nonzero
    overall)?  1 yes, 0 no, -1 budget exhausted.  s sorted descending."""
    cdef int64_t lo, hi, k
    cdef int r
    if i == m:
        return 1 if (target == 0 and nonzero) else 0
    budget[0] -= 1
    if budget[0] < 0:
        return -1
    lo = -_floor_div(reach[i + 1] - target, s[i])
    hi = _floor_div(target + reach[i + 1], s[i])
    if lo < 1 - n[i]:
        lo = 1 - n[i]
    if hi > n[i] - 1:
        hi = n[i] - 1
    k = lo
    while k <= hi:
        r = _collide(n, s, reach, i + 1, m, target - k * s[i], nonzero or k != 0, budget)
        if r != 0:
            return r
        k += 1
    return 0


cdef int _self_overlap(const Arg *a, int *zero_dim) noexcept nogil:
    """0 when no two elements of `a` share memory, 1 when two do, -1 when undecided.  Strides
    are whole elements (outputs are aligned)."""
    cdef int64_t n[ARG_DIMS]
    cdef int64_t s[ARG_DIMS]
    cdef int64_t reach[ARG_DIMS + 1]
    cdef int64_t extent = 0, tmp, budget = OVERLAP_BUDGET, isz = itemsize(a.dtype)
    cdef int m = 0, d, i, j
    zero_dim[0] = -1
    for d in range(a.ndim):
        if a.shape[d] == 0:
            return 0
    for d in range(a.ndim):
        if a.shape[d] > 1:
            if a.strides[d] == 0:
                zero_dim[0] = d
                return 1
            n[m] = a.shape[d]
            s[m] = a.strides[d] // isz if a.strides[d] > 0 else -a.strides[d] // isz
            m += 1
    for i in range(1, m):                  # insertion sort, descending strides
        j = i
        while j > 0 and s[j - 1] < s[j]:
            tmp = s[j - 1]; s[j - 1] = s[j]; s[j] = tmp
            tmp = n[j - 1]; n[j - 1] = n[j]; n[j] = tmp
            j -= 1
    # sufficient: each stride beyond everything the smaller strides reach
    i = m - 1
    while i >= 0 and s[i] > extent:
        extent += (n[i] - 1) * s[i]
        i -= 1
    if i < 0:
        return 0
    reach[m] = 0
    for i in range(m - 1, -1, -1):
        reach[i] = reach[i + 1] + (n[i] - 1) * s[i]
    return _collide(n, s, reach, 0, m, 0, False, &budget)


cdef bint _same_view(const Arg *a, const Arg *b) noexcept nogil:
    cdef int d
    if a.data != b.data or a.dtype != b.dtype or a.ndim != b.ndim:
        return False
    for d in range(a.ndim):
        if a.shape[d] != b.shape[d] or a.strides[d] != b.strides[d]:
            return False
    return True


# ---------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------

cdef int formula_op(int formula) noexcept nogil:
    if formula == F_TRAINING:
        return OP_REDUCE | OP_TRAINING | OP_DX | OP_PARAMS
    if formula == F_FROZEN_DX:
        return OP_DX
    if formula == F_FROZEN:
        return OP_REDUCE | OP_DX | OP_PARAMS
    if formula == F_REDUCE:
        return OP_REDUCE | OP_RETURN_SUMS
    return OP_GIVEN_SUMS | OP_TRAINING | OP_DX | OP_PARAMS


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


cdef bnbw_status _check_epsilon(const Rules *r, const Epsilon *eps, char *msg,
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
    cdef size_t used
    cdef const char *label = r.labels[role]
    if a.dtype != want_dtype:
        snprintf(msg, cap, "%s must have dtype %s, got %s", label, _type_text(want_dtype),
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
    rc = _self_overlap(a, &zero_dim)
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


cdef bnbw_status _check_overlaps(const Rules *r, const Arg *a, char *msg,
                                 size_t cap) noexcept nogil:
    """Outputs apart from each other and from every input, except that dx and the residual
    gradient may each be the very same view as dy (in place)."""
    cdef int outputs[4]
    cdef int inputs[7]
    cdef int i, j, o, k, rc
    outputs[:] = [S_DX, S_DSCALE, S_DBIAS, S_DRES]
    inputs[:] = [S_X, S_DY, S_MEAN, S_VAR, S_SCALE, R_BETA, S_MASK]
    for i in range(4):
        o = outputs[i]
        if not a[o].present or a[o].data == NULL:
            continue
        for j in range(i + 1, 4):
            k = outputs[j]
            if a[k].present and a[k].data != NULL and _may_share(&a[o], &a[k]) != 0:
                snprintf(msg, cap, "%s overlaps %s; outputs must not overlap", r.labels[o],
                         r.labels[k])
                return BNBW_ERROR_OVERLAP
        for j in range(7):
            k = inputs[j]
            if not a[k].present or a[k].data == NULL:
                continue
            if k == S_DY and (o == S_DX or o == S_DRES) and _same_view(&a[o], &a[k]):
                continue
            rc = _may_share(&a[o], &a[k])
            if rc != 0:
                if o == S_DX or o == S_DRES:
                    snprintf(msg, cap, "%s overlaps the input %s (only the very same array "
                             "as %s is allowed)", r.labels[o], r.names[k], r.names[S_DY])
                else:
                    snprintf(msg, cap, "%s overlaps the input %s", r.labels[o], r.names[k])
                return BNBW_ERROR_OVERLAP
    return BNBW_OK


cdef bnbw_status _check_arrays(const Rules *r, Arg *a, int op, int axis, const Epsilon *eps,
                               int64_t count, char *msg, size_t cap) noexcept nogil:
    """oneDNN Graph, the Intel spec, nGraph, the two phases: x and dy of rank
    min_rank..max_rank, the statistics 1-D of length C along `axis`."""
    cdef const Arg *x = &a[S_X]
    cdef const Arg *dy = &a[S_DY]
    cdef char text[256]
    cdef const char *hint
    cdef int roles[4]
    cdef int i, role, t2 = -1, t2_role = S_MEAN
    cdef int64_t C, local = 1
    cdef bnbw_status rc
    rc = _kind(r, x, S_X, msg, cap)
    if rc != BNBW_OK:
        return rc
    if x.ndim < r.min_rank or x.ndim > r.max_rank:
        snprintf(msg, cap, "%s must have %d to %d dimensions, got %d", r.names[S_X],
                 r.min_rank, r.max_rank, x.ndim)
        return BNBW_ERROR_DIMENSION_COUNT
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
    if axis < 0:
        axis += x.ndim
    C = x.shape[axis]
    roles[:] = [S_MEAN, S_VAR, S_SCALE, R_BETA]
    for i in range(4):
        role = roles[i]
        if not a[role].present:
            continue
        rc = _kind(r, &a[role], role, msg, cap)
        if rc != BNBW_OK:
            return rc
        if t2 < 0:
            t2 = a[role].dtype
            t2_role = role
            if r.dtype_rule == RULE_GRAPH and not (
                    t2 == DT_F32 or (t2 == DT_BF16 and x.dtype == DT_BF16)):
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
                     r.names[t2_role], _type_text(t2), a[role].type_name)
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
    if eps != NULL:
        rc = _check_epsilon(r, eps, msg, cap)
        if rc != BNBW_OK:
            return rc
    if op & OP_GIVEN_SUMS:
        if a[R_PARTIAL].dtype != DT_F64:
            snprintf(msg, cap, "%s must be a float64 array of shape (2, C) from "
                     "backward_reduce", r.names[R_PARTIAL])
            return BNBW_ERROR_DATA_TYPE
        if a[R_PARTIAL].ndim != 2 or a[R_PARTIAL].shape[0] != 2 or a[R_PARTIAL].shape[1] != C:
            _shape_text(text, 256, a[R_PARTIAL].ndim, a[R_PARTIAL].shape)
            snprintf(msg, cap, "%s must have shape (2, %lld), got %s", r.names[R_PARTIAL],
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
    roles[0] = S_DSCALE
    roles[1] = S_DBIAS
    for i in range(2):
        if a[roles[i]].present:
            rc = _check_output(r, &a[roles[i]], roles[i], t2, 1, &C, msg, cap)
            if rc != BNBW_OK:
                return rc
    if a[S_DRES].present:
        rc = _check_output(r, &a[S_DRES], S_DRES, x.dtype, x.ndim, x.shape, msg, cap)
        if rc != BNBW_OK:
            return rc
    return _check_overlaps(r, a, msg, cap)


cdef bnbw_status _check_directml(const Rules *r, Arg *a, const Epsilon *eps, char *msg,
                                 size_t cap) noexcept nogil:
    """DirectML: eight tensors of one data type and dimension count; reduced dims are those
    where mean's size is 1, every other dim equals the input's."""
    cdef int members[8]
    cdef int i, d, m
    cdef const Arg *x = &a[S_X]
    cdef bnbw_status rc
    members[:] = [S_X, S_DY, S_MEAN, S_VAR, S_SCALE, S_DX, S_DSCALE, S_DBIAS]
    for i in range(8):
        if a[members[i]].present:
            rc = _kind(r, &a[members[i]], members[i], msg, cap)
            if rc != BNBW_OK:
                return rc
    if x.ndim < r.min_rank or x.ndim > r.max_rank:
        snprintf(msg, cap, "%s must have %d to %d dimensions, got %d", r.names[S_X],
                 r.min_rank, r.max_rank, x.ndim)
        return BNBW_ERROR_DIMENSION_COUNT
    for i in range(1, 8):
        m = members[i]
        if a[m].present and a[m].dtype != x.dtype:
            snprintf(msg, cap, "%s: data_type %s differs from input's %s; all tensors share "
                     "one data type", r.labels[m], a[m].type_name, x.type_name)
            return BNBW_ERROR_DATA_TYPE
    for i in range(1, 8):
        m = members[i]
        if a[m].present and a[m].ndim != x.ndim:
            snprintf(msg, cap, "%s: sizes have %d dimensions, input's %d; all tensors share "
                     "one dimension count", r.labels[m], a[m].ndim, x.ndim)
            return BNBW_ERROR_DIMENSION_COUNT
    for i in range(1, 8):
        m = members[i]
        if not a[m].present or (m != S_DY and m != S_DX):
            continue
        for d in range(x.ndim):
            if a[m].shape[d] != x.shape[d]:
                snprintf(msg, cap, "%s: sizes[%d] is %lld, input's is %lld; input, "
                         "input_gradient and output_gradient share sizes", r.labels[m], d,
                         <long long> a[m].shape[d], <long long> x.shape[d])
                return BNBW_ERROR_SIZES
    for d in range(x.ndim):
        if a[S_MEAN].shape[d] != 1 and a[S_MEAN].shape[d] != x.shape[d]:
            snprintf(msg, cap, "%s: sizes[%d] must be 1 (a summed dim) or input's %lld, got "
                     "%lld", r.names[S_MEAN], d, <long long> x.shape[d],
                     <long long> a[S_MEAN].shape[d])
            return BNBW_ERROR_SIZES
    for i in range(3, 8):
        m = members[i]
        if not a[m].present or m == S_DX:
            continue
        for d in range(x.ndim):
            if a[m].shape[d] != a[S_MEAN].shape[d]:
                snprintf(msg, cap, "%s: sizes[%d] is %lld, mean's is %lld; mean, variance, "
                         "scale, output_scale_gradient and output_bias_gradient share sizes",
                         r.labels[m], d, <long long> a[m].shape[d],
                         <long long> a[S_MEAN].shape[d])
                return BNBW_ERROR_SIZES
    if eps != NULL:
        rc = _check_epsilon(r, eps, msg, cap)
        if rc != BNBW_OK:
            return rc
    for i in range(5, 8):
        m = members[i]
        if a[m].present:
            rc = _check_output(r, &a[m], m, x.dtype, a[m].ndim, a[m].shape, msg, cap)
            if rc != BNBW_OK:
                return rc
    return BNBW_OK


cdef bnbw_status check_call(const Rules *r, Arg *a, int op, int axis, const Epsilon *eps,
                            int64_t count, char *msg, size_t cap) noexcept nogil:
    """Every rule of the convention `r` on the arguments a[N_ROLES].  Outputs without an address yet (descriptors, or arrays the layer allocates)
    are checked for their layout only.  BNBW_OK, or the refusal with its message in msg."""
    if r.family == FAMILY_DIRECTML:
        return _check_directml(r, a, eps, msg, cap)
    return _check_arrays(r, a, op, axis, eps, count, msg, cap)


cdef int engine_layout(const Rules *r, const Arg *a, int axis, int64_t *sizes,
                       unsigned char *reduced, int64_t *strides,
                       unsigned char *present) noexcept nogil:
    """The engine's view of checked arguments: sizes, the reduced dims, byte strides per slot
    (N_SLOTS rows of MAX_DIMS; 0 on dims of size 1) and which big slots are present.
    Returns the dimension count."""
    cdef int ndim = a[S_X].ndim, d, t
    if axis < 0:
        axis += ndim
    memset(strides, 0, N_SLOTS * MAX_DIMS * sizeof(int64_t))
    for t in range(N_BIG):
        present[t] = a[t].present
    for d in range(ndim):
        sizes[d] = a[S_X].shape[d]
        if r.family == FAMILY_DIRECTML:
            reduced[d] = a[S_MEAN].shape[d] == 1
        else:
            reduced[d] = d != axis
        for t in range(N_SLOTS):
            if not a[t].present:
                continue
            if t < N_BIG or r.family == FAMILY_DIRECTML:
                if a[t].shape[d] > 1:
                    strides[t * MAX_DIMS + d] = a[t].strides[d]
            elif d == axis:
                strides[t * MAX_DIMS + d] = a[t].strides[0]
    return ndim


cdef void epsilon_of_float(float value, Epsilon *e) noexcept nogil:
    e.value = value
    snprintf(e.text, 48, "%g", <double> value)


# ---------------------------------------------------------------------------------------
# Conventions
# ---------------------------------------------------------------------------------------

ROLES = {"x": S_X, "dy": S_DY, "dx": S_DX, "relu_dst": S_MASK, "diff_residual": S_DRES,
         "mean": S_MEAN, "var": S_VAR, "scale": S_SCALE, "dscale": S_DSCALE, "dbias": S_DBIAS,
         "beta": R_BETA, "partial": R_PARTIAL}


cdef class Convention:
    """A public convention for the validation layer: the name of each argument role and the
    rules.  names: role -> name (roles as in ROLES); family "arrays" (1-D statistics of length
    C, outputs named "out[i] (name)") or "directml"; dtype_rule "graph" or "same"; ranks of x;
    data_format: whether the convention takes a data_format (its messages can then hint);
    scale_required: None is no scale of 1 here."""

    def __init__(self, names, *, family="arrays", dtype_rule="graph", ranks=(2, 8),
                 data_format=True, scale_required=False):
        cdef int role
        memset(&self.rules, 0, sizeof(Rules))
        self.rules.family = FAMILY_DIRECTML if family == "directml" else FAMILY_ARRAYS
        self.rules.dtype_rule = RULE_SAME if dtype_rule == "same" else RULE_GRAPH
        self.rules.min_rank, self.rules.max_rank = ranks
        out_index = {"dx": 0, "dscale": 1, "dbias": 2}
        for key, name in names.items():
            role = ROLES[key]
            _copy_name(self.rules.names[role], name, NAME_CAP)
            if self.rules.family == FAMILY_ARRAYS and key in out_index:
                label = f"out[{out_index[key]}] ({name})"
            else:
                label = name
            _copy_name(self.rules.labels[role], label, NAME_CAP + 16)
        _copy_name(self.rules.names[NAME_EPSILON], "epsilon", NAME_CAP)
        _copy_name(self.rules.names[NAME_DATA_FORMAT], "data_format" if data_format else "",
                   NAME_CAP)
        self.rules.scale_required = scale_required
        if "partial" not in names:
            _copy_name(self.rules.names[R_PARTIAL], "partial", NAME_CAP)

    def name(self, role):
        return self.rules.names[ROLES[role]].decode()


cdef void _copy_name(char *dst, str text, size_t cap):
    encoded = text.encode()[:cap - 1]
    strncpy(dst, encoded, cap - 1)
    dst[cap - 1] = 0


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
        _copy_name(a.type_name, str(arr.dtype), 40)
    else:
        _copy_name(a.type_name, f"{arr.dtype.str} (non-native byte order)", 40)
    a.type_name[39] = 0


def as_array(obj, name):
    """An ndarray viewing `obj` (ndarray, DLPack producer, buffer or array interface), without
    a copy where NumPy can avoid one; TypeError naming `name` for anything that is not an
    array of numbers."""
    if isinstance(obj, np.ndarray):
        return obj
    if obj is None or isinstance(obj, (str, bytes, numbers.Number)):
        raise TypeError(f"{name} must be an array, got {type(obj).__name__}")
    try:
        if hasattr(obj, "__dlpack__"):
            return np.from_dlpack(obj)
        arr = np.asarray(obj)
    except Exception as exc:  # any failure to view the object is a wrong kind of object
        raise TypeError(f"{name} must be an array (NumPy, buffer or DLPack), "
                        f"got {type(obj).__name__} ({exc})") from exc
    if arr.dtype == object:
        raise TypeError(f"{name} must be an array of numbers, got {type(obj).__name__}")
    return arr


cdef cnp.ndarray _input(object obj, Arg *a, Convention conv, int role, list keep):
    """An input argument: any array-like; copied only when the kernels could not read it in
    place (non-native byte order, misaligned).  Returns the array the engine reads."""
    cdef cnp.ndarray arr
    if cnp.PyArray_Check(obj):
        arr = <cnp.ndarray> obj
    else:
        arr = as_array(obj, conv.rules.names[role].decode())
        keep.append(arr)
    if not (cnp.PyArray_ISNOTSWAPPED(arr) and cnp.PyArray_ISALIGNED(arr)):
        if not cnp.PyArray_ISNOTSWAPPED(arr):
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if not cnp.PyArray_ISALIGNED(arr):
            arr = arr.copy()
        keep.append(arr)
    _fill(a, arr)
    return arr


cdef object _output(object obj, Arg *a, str label):
    """A given output: a NumPy array, or a DLPack producer written in place.  Returns the
    array that views it."""
    if cnp.PyArray_Check(obj):
        arr = obj
    elif hasattr(obj, "__dlpack__"):
        try:
            arr = np.from_dlpack(obj)
        except Exception as exc:  # requires grad, a read-only legacy capsule, bf16, GPU
            if "readonly" in str(exc).replace("-", "").replace(" ", "").lower():
                raise ValueError(f"{label} is read-only; outputs must be writable") from exc
            raise TypeError(f"{label} must be a writable CPU array; its DLPack export "
                            f"failed: {exc}") from exc
    else:
        raise TypeError(f"{label} must be a NumPy array, got {type(obj).__name__}")
    _fill(a, <cnp.ndarray> arr)
    return arr


cdef int _epsilon(object value, Epsilon *e) except -1:
    if type(value) is not float:
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value[()]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise TypeError(f"epsilon must be a real number, got {type(value).__name__}")
    try:
        e.value = float(value)
    except (OverflowError, ValueError):    # beyond the float range
        e.value = INFINITY
    _copy_name(e.text, repr(value), 48)
    return 0


cpdef int requested_threads(object value) except -1:
    """num_threads as given: 0 for None, else a positive int (capped at MAX_THREADS)."""
    if value is None:
        return 0
    if type(value) is not int:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"num_threads must be None or a positive int, got "
                            f"{type(value).__name__}")
        value = int(value)
    if value <= 0:
        raise ValueError(f"num_threads must be a positive int, got {value}")
    return MAX_THREADS if value > MAX_THREADS else value


def check_choice(value, name, choices):
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, one of {', '.join(choices)}; "
                        f"got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def check_int_choice(value, name, choices):
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
    _epsilon(value, &e)
    _copy_name(r.names[NAME_EPSILON], name, NAME_CAP)
    if _check_epsilon(&r, &e, msg, MESSAGE_CAP) != BNBW_OK:
        raise ValueError(msg.decode())
    return float(<float> e.value)


cdef raise_status(bnbw_status rc, const char *msg):
    if rc == BNBW_ERROR_DATA_TYPE:
        raise TypeError(msg.decode())
    if rc == BNBW_ERROR_OUT_OF_MEMORY:
        raise MemoryError(msg.decode())
    raise ValueError(msg.decode())


# ---------------------------------------------------------------------------------------
# The array entry point
# ---------------------------------------------------------------------------------------

ctypedef struct Call:
    # A checked array call, ready for the engine (its Args live on the caller's stack).
    int formula
    int op
    int axis
    Epsilon eps
    int64_t count
    int requested


cdef object _prepare(Convention conv, Call *c, Arg *a, x, dy, mean, var, scale, epsilon,
                     data_format, out, num_threads, beta, relu_dst, diff_residual, partial,
                     count, bint exact_sums):
    """Marshal, check and allocate: everything of a call but running it.  Returns (results,
    keep): the output arrays, and the arrays the call must keep alive."""
    cdef const Rules *r = &conv.rules
    cdef char msg[MESSAGE_CAP]
    cdef bnbw_status rc
    cdef int t, n_out
    cdef int formula = c.formula
    cdef cnp.npy_intp C
    cdef cnp.ndarray X, M
    cdef list keep = []
    for t in range(N_ROLES):
        a[t].present = False
        a[t].data = NULL
    c.op = formula_op(formula) | (OP_EXACT_SUMS if exact_sums else 0)
    if r.family == FAMILY_ARRAYS:
        c.axis = 1 if data_format == "NCX" else -1
    else:
        c.axis = 0
    X = _input(x, &a[S_X], conv, S_X, keep)
    _input(dy, &a[S_DY], conv, S_DY, keep)
    M = _input(mean, &a[S_MEAN], conv, S_MEAN, keep)
    if var is not None or formula != F_REDUCE:
        _input(var, &a[S_VAR], conv, S_VAR, keep)
    if scale is not None or r.scale_required:
        _input(scale, &a[S_SCALE], conv, S_SCALE, keep)
    if r.names[R_BETA][0]:
        _input(beta, &a[R_BETA], conv, R_BETA, keep)
    if relu_dst is not None:
        _input(relu_dst, &a[S_MASK], conv, S_MASK, keep)
    c.eps.value = 1.0
    if formula != F_REDUCE:
        _epsilon(epsilon, &c.eps)
    c.requested = requested_threads(num_threads)
    c.count = -1
    if formula == F_APPLY:
        try:
            _input(partial, &a[R_PARTIAL], conv, R_PARTIAL, keep)
        except TypeError:
            raise TypeError("partial must be a float64 array of shape (2, C) from "
                            "backward_reduce") from None
        if isinstance(count, (bool, np.bool_)) or not isinstance(count, numbers.Integral):
            raise TypeError(f"count must be an int, got {type(count).__name__}")
        if count >= 2 ** 63:
            raise ValueError(f"count must be below 2**63, got {count}")
        c.count = count if count >= 0 else -1
    n_out = 0
    if r.family == FAMILY_ARRAYS and formula != F_REDUCE:
        n_out = 1 if formula == F_FROZEN_DX else 3
    given = None
    if out is not None:
        if type(out) is not tuple and type(out) is not list:
            raise TypeError(f"out must be a tuple of {n_out} arrays, got {type(out).__name__}")
        if len(out) != n_out:
            raise ValueError(f"out must hold {n_out} arrays (one per output), got {len(out)}")
        given = [_output(out[t], &a[_OUT_ROLES[t]], r.labels[_OUT_ROLES[t]].decode())
                 for t in range(n_out)]
    if diff_residual is not None:
        keep.append(_output(diff_residual, &a[S_DRES], r.labels[S_DRES].decode()))

    with nogil:
        rc = check_call(r, a, c.op, c.axis, &c.eps if formula != F_REDUCE else NULL, c.count,
                        msg, MESSAGE_CAP)
    if rc != BNBW_OK:
        raise_status(rc, msg)

    # outputs the caller did not give
    if formula == F_REDUCE or given is not None:
        return given, keep
    results = [PyArray_NewLikeArray(X, cnp.NPY_KEEPORDER, NULL, 0)]
    if r.family == FAMILY_DIRECTML:
        shape = tuple(a[S_MEAN].shape[t] for t in range(a[S_MEAN].ndim))
        results += [np.empty(shape, X.dtype), np.empty(shape, X.dtype)]
    elif n_out == 3:
        C = a[S_X].shape[c.axis if c.axis >= 0 else a[S_X].ndim - 1]
        results += [cnp.PyArray_EMPTY(1, &C, cnp.PyArray_TYPE(M), 0),
                    cnp.PyArray_EMPTY(1, &C, cnp.PyArray_TYPE(M), 0)]
    for t in range(len(results)):
        _fill(&a[_OUT_ROLES[t]], <cnp.ndarray> results[t])
    return results, keep


cdef int _OUT_ROLES[3]
_OUT_ROLES[:] = [S_DX, S_DSCALE, S_DBIAS]


cdef object _run(Convention conv, const Call *c, Arg *a, results):
    cdef Plan plan
    cdef Schedule sched
    cdef int64_t sizes[MAX_DIMS]
    cdef unsigned char reduced[MAX_DIMS]
    cdef int64_t strides[N_SLOTS * MAX_DIMS]
    cdef unsigned char present[N_BIG]
    cdef char *ptr[N_SLOTS]
    cdef int ndim, t, rc, nthreads
    cdef int64_t C, ch, pstride0, pstride1
    cdef double *sums = NULL
    cdef double m
    cdef const char *pdata
    cdef cnp.ndarray partial_out = None
    cdef int mask_dtype = a[S_MASK].dtype if a[S_MASK].present else a[S_X].dtype
    ndim = engine_layout(&conv.rules, a, c.axis, sizes, reduced, strides, present)
    for t in range(N_SLOTS):
        ptr[t] = a[t].data if a[t].present else NULL
    if c.formula == F_FROZEN_DX:
        ptr[S_SCALE] = NULL          # diff_src only: gamma validated, then ignored
    C = 1
    for t in range(ndim):
        if not reduced[t]:
            C *= sizes[t]
    nthreads = resolve_threads(c.requested)
    if c.formula == F_REDUCE or c.formula == F_APPLY:
        sums = <double *> PyMem_Malloc((2 * C + 1) * sizeof(double))
        if sums == NULL:
            raise MemoryError("bnbw_native: out of memory for the sums")
    if c.formula == F_APPLY:       # the caller's (2, C) sums, any strides, as [Sg, Sxg] per channel
        pdata = a[R_PARTIAL].data
        pstride0 = a[R_PARTIAL].strides[0]
        pstride1 = a[R_PARTIAL].strides[1]
        for ch in range(C):
            memcpy(&sums[2 * ch], pdata + ch * pstride1, 8)
            memcpy(&sums[2 * ch + 1], pdata + pstride0 + ch * pstride1, 8)
    try:
        with nogil:
            rc = plan_build(&plan, ndim, sizes, reduced, strides, present,
                            a[S_X].dtype, mask_dtype,
                            a[S_MEAN].dtype)
            if rc == 0:
                m = <double> plan.count if c.count < 0 else <double> c.count
                schedule_choose(&plan, c.op, nthreads, &sched)
                rc = execute(&plan, &sched, ptr, c.op, <float> c.eps.value, m, sums)
            plan_free(&plan)
        if rc != 0:
            raise MemoryError("bnbw_native: out of memory")
        if c.formula == F_REDUCE:
            partial_out = np.empty((2, C))
            for ch in range(C):
                (<double *> cnp.PyArray_DATA(partial_out))[ch] = sums[2 * ch]
                (<double *> cnp.PyArray_DATA(partial_out))[C + ch] = sums[2 * ch + 1]
            return partial_out, int(plan.count)
    finally:
        PyMem_Free(sums)
    if len(results) == 1:
        return results[0], None, None
    return tuple(results)


def backward(Convention conv, int formula, x, dy, mean, var, scale, epsilon=None,
             data_format="NXC", out=None, num_threads=None, *, beta=None, relu_dst=None,
             diff_residual=None, partial=None, count=None, bint exact_sums=False):
    """Check and run one array call of `conv`.  Returns (dx, dscale, dbias) - dscale and dbias
    None for F_FROZEN_DX - or, for F_REDUCE, ((2, C) float64 sums, count)."""
    cdef Arg a[N_ROLES]
    cdef Call c
    c.formula = formula
    results, keep = _prepare(conv, &c, a, x, dy, mean, var, scale, epsilon, data_format, out,
                             num_threads, beta, relu_dst, diff_residual, partial, count,
                             exact_sums)
    return _run(conv, &c, a, results)


def describe(Convention conv, int formula, x, dy, mean, var, scale, epsilon=None,
             data_format="NXC", num_threads=None, *, beta=None, relu_dst=None,
             diff_residual=None, partial=None, count=None, bint exact_sums=False):
    """What the engine would do with this call, without running it: the plan and the schedule
    as a dict (for tests and benchmarks)."""
    cdef Arg a[N_ROLES]
    cdef Call c
    cdef Plan plan
    cdef Schedule sched
    cdef int64_t sizes[MAX_DIMS]
    cdef unsigned char reduced[MAX_DIMS]
    cdef int64_t strides[N_SLOTS * MAX_DIMS]
    cdef unsigned char present[N_BIG]
    cdef int ndim, rc, mask_dtype
    c.formula = formula
    _prepare(conv, &c, a, x, dy, mean, var, scale, epsilon, data_format, None, num_threads,
             beta, relu_dst, diff_residual, partial, count, exact_sums)
    mask_dtype = a[S_MASK].dtype if a[S_MASK].present else a[S_X].dtype
    ndim = engine_layout(&conv.rules, a, c.axis, sizes, reduced, strides, present)
    rc = plan_build(&plan, ndim, sizes, reduced, strides, present, a[S_X].dtype, mask_dtype,
                    a[S_MEAN].dtype)
    if rc != 0:
        raise MemoryError("bnbw_native: out of memory while planning")
    try:
        schedule_choose(&plan, c.op, resolve_threads(c.requested), &sched)
        return plan_facts(&plan, &sched)
    finally:
        plan_free(&plan)


cdef dict plan_facts(const Plan *p, const Schedule *s):
    from bnbw_native._schedules import SCHEDULE_NAMES
    return {
        "layout": "empty" if p.empty else ("channel-last" if p.channel_last else
                                           "channel-major"),
        "channels": p.channels,
        "count": p.count,
        "row": p.inner_size,
        "rows_per_block" if p.channel_last else "block": p.block,
        "blocks": p.nblocks,
        "via_temp": [name for t, name in enumerate(("x", "dy", "dx", "relu_dst",
                                                    "diff_residual")) if p.via_temp[t]],
        "schedule": SCHEDULE_NAMES[s.kind],
        "threads": s.nthreads,
        "sums": ("exact", "blocked", "blocked-even-odd")[s.sums],
        "group": s.group,
        "items": s.items,
    }
