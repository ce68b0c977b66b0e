from libc.stdint cimport int64_t

from bnbw_native._vocabulary cimport Layout, Plan

cdef int plan_build(Plan *p, const Layout *l) noexcept nogil
cdef void plan_free(Plan *p) noexcept nogil
cdef void plan_scratch(const Plan *p, char *memory, double **sums, float **floats,
                       unsigned char **flags, double **partial) noexcept nogil
cdef int64_t copy_runs(int ndim, const int64_t *sizes, const int64_t *src_strides,
                       const int64_t *dst_strides) noexcept nogil
cdef void copy_strided(int ndim, const int64_t *sizes, const char *src,
                       const int64_t *src_strides, char *dst, const int64_t *dst_strides,
                       int64_t size, int64_t first, int64_t count) noexcept nogil
