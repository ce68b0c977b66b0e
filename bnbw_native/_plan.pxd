from bnbw_native._vocabulary cimport Layout, Plan

cdef int plan_build(Plan *p, const Layout *l) noexcept nogil
cdef void plan_free(Plan *p) noexcept nogil
cdef void plan_scratch(const Plan *p, char *memory, double **sums, float **floats,
                       unsigned char **flags, double **partial) noexcept nogil
