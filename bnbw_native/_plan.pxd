from libc.stdint cimport int64_t

from bnbw_native._engine cimport Plan

cdef int plan_build(Plan *p, int ndim, const int64_t *sizes, const unsigned char *reduced,
                    const int64_t *strides, const unsigned char *present, int big_dtype,
                    int mask_dtype, int stat_dtype) noexcept nogil
cdef void plan_free(Plan *p) noexcept nogil
