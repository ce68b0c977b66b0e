from libc.stdint cimport uint64_t, uintptr_t

from bnbw_native._rules cimport Arg

# may_share, self_overlap: 0 apart, 1 shared, -1 undecided (the search budget ran out).
cdef bint ranges_overlap(uintptr_t a, uint64_t a_bytes, uintptr_t b,
                         uint64_t b_bytes) noexcept nogil
cdef int may_share(const Arg *a, const Arg *b) noexcept nogil
cdef int self_overlap(const Arg *a, int *zero_dim) noexcept nogil
cdef bint same_view(const Arg *a, const Arg *b) noexcept nogil
