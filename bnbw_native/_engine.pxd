from bnbw_native._vocabulary cimport Layout, Plan
from bnbw_native._headers cimport bnbw_status

# The one way into the engine (see _engine.pyx).
cdef bnbw_status engine_plan(const Layout *l, Plan *p) noexcept nogil
cdef bnbw_status engine_execute(const Plan *p, char **ptr, int op, double eps, double momentum,
                                double count, double *sums, int requested) noexcept nogil
cdef bnbw_status engine_run(const Layout *l, char **ptr, int op, double eps, double momentum,
                            double count, double *sums, int requested) noexcept nogil
cdef void engine_release(Plan *p) noexcept nogil
cdef dict engine_describe(const Layout *l, int op, int requested)

# Threads: the one resolver, for every caller (arrays, DirectML, C, the half helpers).
cdef int resolve_threads(int requested) noexcept nogil
cdef void team_started() noexcept nogil

# Whether the half converters may use their AVX2 code (the kernel body in use allows it).
cdef bint simd_converters() noexcept nogil
