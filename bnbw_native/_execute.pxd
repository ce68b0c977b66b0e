from bnbw_native._vocabulary cimport Plan
from bnbw_native._headers cimport bnbw_kernel_table
from bnbw_native._schedules cimport Schedule

cdef int execute(const Plan *p, const Schedule *s, const bnbw_kernel_table *k, char **ptr,
                 int op, double eps, double momentum, double count,
                 double *sums_io) noexcept nogil
