# cython: language_level=3
"""The one way into the engine: run (or describe) a validated call.

Every surface ends here - array calls (bnbw_native._arrays: oneDNN Graph, the Intel spec, nGraph,
the two phases, DirectML's array conveniences, the torch layers) and DirectML operators with the
C API (bnbw_native._directml):

    layout (checked by bnbw_native._rules) -> plan -> schedule -> execute

on the kernel body this process chose and the thread count resolved here.

* The kernels (src/body_*.c) are linked into this module only, so one process has one choice of
  body: the best the CPU and the OS support, at most the cap (BNBW_KERNELS, tests, benchmarks).
  Its table goes to the schedules with every call.
* Threads: `resolve_threads` is the one rule for every caller (what a caller may request is
  bnbw_native._rules' `check_threads`).  A request of n threads runs on min(n, CPUs this
  process may use); without a request, the package default, which follows OpenMP read at call
  time unless set.  Results never depend on it.
* fork(): libgomp's thread pool does not survive it.  A child whose parent started a team runs
  on its calling thread; a child of a parent that never did keeps its threads.
"""
from bnbw_native._vocabulary cimport Layout, Plan, S_DY, OP_FORWARD, OP_ADD_RESIDUAL
from bnbw_native._headers cimport (
    bnbw_status, BNBW_OK, BNBW_ERROR_OUT_OF_MEMORY, BNBW_BODY_AVX2, bnbw_kernels, bnbw_body,
    bnbw_cpu_body, bnbw_set_body_cap, bnbw_body_name, bnbw_omp_max_threads, bnbw_omp_num_procs,
    bnbw_openmp_version, bnbw_half_simd_path)
from bnbw_native._plan cimport plan_build, plan_free
from bnbw_native._schedules cimport Schedule, schedule_choose, run_elements, SCHED_LAST_SPLIT
from bnbw_native._execute cimport execute
from bnbw_native._formulas cimport forward_recentre, forward_coefficients, running_statistic

import numpy as np


# ---------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------

cdef int _default_threads = 0    # 0: what OpenMP would use now, read per call
cdef int _cpu_model = 0          # 0: the CPUs OpenMP reports, read per call; else assumed
cdef bint _team_started = False  # this process ran a team of 2+ threads
cdef bint _serial_child = False  # forked after a team started: libgomp's pool is gone here


cdef int resolve_threads(int requested) noexcept nogil:
    """The thread count of one call: `requested` when > 0, else the package default (which
    follows OpenMP unless set), at most the CPUs this process may use."""
    cdef int n = requested
    cdef int procs = _cpu_model if _cpu_model > 0 else bnbw_omp_num_procs()
    if _serial_child:
        return 1
    if n <= 0:
        n = _default_threads if _default_threads > 0 else bnbw_omp_max_threads()
    if n > procs:
        n = procs
    return n if n > 0 else 1


cdef void team_started() noexcept nogil:
    global _team_started
    _team_started = True


def set_default_threads(int n):
    """The package default (0: follow OpenMP)."""
    global _default_threads
    _default_threads = n


def default_threads():
    return _default_threads


def threads_for(int requested):
    """The thread count a call with num_threads=`requested` (0: none given) runs on."""
    return resolve_threads(requested)


def cpu_count():
    """The CPUs this process may use, as OpenMP counts them (1 without OpenMP)."""
    return bnbw_omp_num_procs()


def set_cpu_model(int n):
    """Plan as if this process could use n CPUs (0: the machine's own): for tests and
    benchmarks that show how work splits on other machines.  Results never change."""
    global _cpu_model
    _cpu_model = n


def after_fork_in_child():
    global _serial_child
    _serial_child = _team_started


# ---------------------------------------------------------------------------------------
# The kernel body
# ---------------------------------------------------------------------------------------

cdef bint simd_converters() noexcept nogil:
    return bnbw_body() >= BNBW_BODY_AVX2


def set_body_cap(int cap):
    """Run the kernels and the half converters on the best body up to `cap` (0 portable,
    1 AVX2, 2 AVX-512): one setting for the whole process."""
    bnbw_set_body_cap(cap)


def build_info():
    return {
        "openmp": bnbw_openmp_version(),
        "kernels": bnbw_body_name(bnbw_body()).decode(),
        "cpu_kernels": bnbw_body_name(bnbw_cpu_body()).decode(),
        "half_path": bnbw_half_simd_path(simd_converters()).decode(),
    }


# ---------------------------------------------------------------------------------------
# Running a validated call
# ---------------------------------------------------------------------------------------

cdef bnbw_status engine_plan(const Layout *l, Plan *p) noexcept nogil:
    """The plan of a validated layout (plan_free releases it), or out of memory."""
    return BNBW_OK if plan_build(p, l) == 0 else BNBW_ERROR_OUT_OF_MEMORY


cdef void engine_release(Plan *p) noexcept nogil:
    """What engine_plan held."""
    plan_free(p)


cdef bnbw_status engine_execute(const Plan *p, char **ptr, int op, double eps, double momentum,
                                double count, double *sums, int requested) noexcept nogil:
    """Schedule and run plan `p` on the operands ptr[N_SLOTS] with `requested` threads (0: the
    default).  count < 0: the plan's own M.  Nothing is written when memory runs out."""
    cdef Schedule s
    schedule_choose(p, op, resolve_threads(requested), &s)
    if s.nthreads > 1:
        team_started()
    if execute(p, &s, bnbw_kernels(), ptr, op, eps, momentum,
               <double> p.count if count < 0 else count, sums) != 0:
        return BNBW_ERROR_OUT_OF_MEMORY
    return BNBW_OK


cdef bnbw_status engine_run(const Layout *l, char **ptr, int op, double eps, double momentum,
                            double count, double *sums, int requested) noexcept nogil:
    """engine_plan, then engine_execute: one call from its layout to its results."""
    cdef Plan p
    cdef bnbw_status rc = engine_plan(l, &p)
    if rc != BNBW_OK:
        return rc
    rc = engine_execute(&p, ptr, op, eps, momentum, count, sums, requested)
    plan_free(&p)
    return rc


cdef dict engine_describe(const Layout *l, int op, int requested):
    """What engine_run would do with this layout, without running it (tests, benchmarks)."""
    from bnbw_native._schedules import SCHEDULE_NAMES
    cdef Plan p
    cdef Schedule s
    # the forward plans with x in dy's place too: one temporary serves both
    reads_x_twice = (op & OP_FORWARD) and not (op & OP_ADD_RESIDUAL)
    if engine_plan(l, &p) != BNBW_OK:
        raise MemoryError("bnbw_native: out of memory while planning")
    try:
        schedule_choose(&p, op, resolve_threads(requested), &s)
        return {
            "layout": "empty" if p.empty else ("channel-last" if p.channel_last else
                                               "channel-major"),
            "channels": p.channels,
            "count": p.count,
            "row": p.inner_size,
            "rows_per_block" if p.channel_last else "block": p.block,
            "blocks": p.nblocks,
            "via_temp": [name for t, name in enumerate(("x", "dy", "dx", "relu_dst",
                                                        "diff_residual"))
                         if p.via_temp[t] and not (t == S_DY and reads_x_twice)],
            "schedule": SCHEDULE_NAMES[s.kind],
            "threads": s.nthreads,
            "sums": ("exact", "blocked", "blocked-even-odd")[s.sums],
            "streaming": bool(s.streaming),
            "stream_dx": bool(s.stream_dx),
            "from_line": bool(s.from_line),
            "group": s.group,
            "items": s.items,
            "apply_rows": bool(s.apply_rows),
            # the split: the elements of each thread's run of items
            "thread_elements": ([int(run_elements(&p, &s, t)) for t in range(s.nthreads)]
                                if s.kind == SCHED_LAST_SPLIT else None),
        }
    finally:
        plan_free(&p)


def recentred_shifts(const float[:] shift, const double[:, :] sums, double count):
    """The forward's re-centre rule (bnbw_native._formulas) on sums taken outside one call (the
    torch layers' process groups: Sum d and Sum d^2 around `shift`, over `count` elements per
    channel): the float32 shifts to take them again around, or None when they are final."""
    cdef Py_ssize_t c
    cdef bint moved = False
    cdef float[::1] out = np.array(shift, dtype=np.float32)
    for c in range(shift.shape[0]):
        moved = forward_recentre(shift[c], sums[0, c], sums[1, c], count, &out[c]) or moved
    return np.asarray(out) if moved else None


def torch_running_statistics(const float[:] shift, const double[:, :] sums, double count,
                             const double[:] old_mean, const double[:] old_var, double momentum):
    """PyTorch's running mean and variance (f64, [2][C]) after a batch whose forward sums
    around `shift` over `count` > 1 elements per channel are `sums`: the rule the engine's
    forward applies (bnbw_native._formulas), for the torch layers' process groups."""
    cdef Py_ssize_t c
    cdef float mean_hi, k, b
    cdef double mean, var
    out = np.empty((2, shift.shape[0]), np.float64)
    cdef double[:, ::1] o = out
    for c in range(shift.shape[0]):
        forward_coefficients(shift[c], sums[0, c], sums[1, c], count, 1.0, 0.0, 1.0, &mean_hi,
                             &k, &b, &mean, &var)
        o[0, c] = running_statistic(old_mean[c], mean, momentum, count, True, False)
        o[1, c] = running_statistic(old_var[c], var, momentum, count, True, True)
    return out
