# cython: language_level=3
"""Whether memory is shared, decided exactly: the overlap solver of the validation layer.

An output must share no byte with another output or with an input (but its own in-place
input, when it is the very same view), and no two of its elements may share memory.  Strided
views make both questions integer problems: does some index vector put two elements' bytes
within an item size of each other?  A bounding-range test answers most calls at once; the
rest are searched, largest stride first, within OVERLAP_BUDGET nodes, so a refusal is either
proven or reported as undecided (-1), never guessed.  Everything here runs without the GIL on
bnbw_native._rules' Arg, whose checks (`check_call`) turn the answers into messages.
"""
from libc.stdint cimport int64_t, uint64_t, uintptr_t

from bnbw_native._vocabulary cimport DT_OTHER, itemsize
from bnbw_native._rules cimport Arg, ARG_DIMS

cdef enum:
    OVERLAP_BUDGET = 1000000     # search nodes before an overlap is refused as undecided


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


cdef bint ranges_overlap(uintptr_t a, uint64_t a_bytes, uintptr_t b,
                         uint64_t b_bytes) noexcept nogil:
    """Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte, by differences only: no
    end address is formed, so nothing wraps near the top of memory."""
    if a_bytes == 0 or b_bytes == 0:
        return False
    if a <= b:
        return b - a < a_bytes
    return a - b < b_bytes


cdef void _bounds(const Arg *a, uintptr_t *lo, uint64_t *nbytes) noexcept nogil:
    """The byte range [lo, lo + nbytes) the elements of `a` occupy (nbytes 0: none)."""
    cdef int64_t extent, low = 0, high = 0
    cdef int d
    lo[0] = <uintptr_t> a.data
    nbytes[0] = 0
    for d in range(a.ndim):
        if a.shape[d] == 0:
            return
    for d in range(a.ndim):
        extent = (a.shape[d] - 1) * a.strides[d]
        if extent < 0:
            low += extent
        else:
            high += extent
    lo[0] = lo[0] + <uintptr_t> low          # wraps back below data: low <= 0
    nbytes[0] = <uint64_t> (high - low) + (itemsize(a.dtype) if a.dtype != DT_OTHER else 1)


cdef void _sort_terms(int m, int64_t *n, int64_t *c) noexcept nogil:
    """Orders the m terms (c[i], n[i]) by descending c: an insertion sort, m being a few
    dimensions."""
    cdef int64_t tmp
    cdef int i, j
    for i in range(1, m):
        j = i
        while j > 0 and c[j - 1] < c[j]:
            tmp = c[j - 1]; c[j - 1] = c[j]; c[j] = tmp
            tmp = n[j - 1]; n[j - 1] = n[j]; n[j] = tmp
            j -= 1


cdef void _fill_reach(int m, const int64_t *n, const int64_t *c, int64_t *reach) noexcept nogil:
    """reach[i] = sum over j >= i of (n[j] - 1) * c[j]: how far terms i.. can move a sum."""
    cdef int i
    reach[m] = 0
    for i in range(m - 1, -1, -1):
        reach[i] = reach[i + 1] + (n[i] - 1) * c[i]


cdef int may_share(const Arg *a, const Arg *b) noexcept nogil:
    """0 when no element of a shares a byte with an element of b, 1 when one does, -1 when
    the search could not decide."""
    cdef uintptr_t alo, blo
    cdef uint64_t abytes, bbytes
    cdef int64_t v, size
    cdef int64_t n[2 * ARG_DIMS]
    cdef int64_t c[2 * ARG_DIMS]
    cdef int64_t reach[2 * ARG_DIMS + 1]
    cdef int64_t const = 0, budget = OVERLAP_BUDGET
    cdef int m = 0, d, i
    _bounds(a, &alo, &abytes)
    _bounds(b, &blo, &bbytes)
    if not ranges_overlap(alo, abytes, blo, bbytes):
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
    _sort_terms(m, n, c)
    _fill_reach(m, n, c, reach)
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


cdef int self_overlap(const Arg *a, int *zero_dim) noexcept nogil:
    """0 when no two elements of `a` share memory, 1 when two do, -1 when undecided.  Strides
    are whole elements (outputs are aligned)."""
    cdef int64_t n[ARG_DIMS]
    cdef int64_t s[ARG_DIMS]
    cdef int64_t reach[ARG_DIMS + 1]
    cdef int64_t extent = 0, budget = OVERLAP_BUDGET, isz = itemsize(a.dtype)
    cdef int m = 0, d, i
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
    _sort_terms(m, n, s)
    # sufficient: each stride beyond everything the smaller strides reach
    i = m - 1
    while i >= 0 and s[i] > extent:
        extent += (n[i] - 1) * s[i]
        i -= 1
    if i < 0:
        return 0
    _fill_reach(m, n, s, reach)
    return _collide(n, s, reach, 0, m, 0, False, &budget)


cdef bint same_view(const Arg *a, const Arg *b) noexcept nogil:
    cdef int d
    if a.data != b.data or a.dtype != b.dtype or a.ndim != b.ndim:
        return False
    for d in range(a.ndim):
        if a.shape[d] != b.shape[d] or a.strides[d] != b.strides[d]:
            return False
    return True
