from libc.stdint cimport int64_t

from bnbw_native._vocabulary cimport Plan

cdef enum:
    TILE = 2048           # channel-major rows reach the kernels in pieces of at most this many
                          # elements; channel-last items span at most this many channels
    COMBINE_CHUNK = 256   # channels per parallel item of the combine

cdef enum ScheduleKind:
    SCHED_NOTHING = 0          # nothing to read: an empty batch, or constants only
    SCHED_LAST_SPLIT = 1
    SCHED_MAJOR_SWEEP = 2
    SCHED_MAJOR_BLOCKS = 3
    SCHED_MAJOR_SWEEP_FUSED = 4
    SCHED_MAJOR_CHANNEL_FUSED = 5
    SCHED_LAST_SLAB = 6

ctypedef struct Schedule:
    # Everything execute() needs to know beyond the plan: chosen once per call by
    # schedule_choose from the plan, what the call does and the thread count.
    int kind                   # ScheduleKind
    int nthreads               # threads that run the items (1: the calling thread alone)
    int sums                   # the kernels' sum mode: exact, or f32 blocks (and lane order)
    bint streaming             # channel-last rows taken to come from memory (the call outgrows
                               # its threads' L2s): a hint for the visiting order
    bint stream_dx             # the call's data outgrow the caches: dx past them (f32)
    bint from_line             # channel-last data within the threads' L2s: rows of whole lines
                               # may be walked from x's first line
    int64_t group              # channels per item (channel-last slices, sweeps, fused groups)
    int64_t ngroups
    int64_t items              # work items of the first pass
    bint weighted_runs         # LAST_SPLIT: threads take runs of equal elements (first_item),
                               # else of equal item counts
    bint apply_rows            # channel-last on several threads: the apply after the sums goes
                               # by equal runs of whole rows, not by the items (threads writing
                               # slices of the same rows at once slow each other down)
    int64_t partial_doubles    # the block sums it keeps (at most the plan's scratch holds)

cdef void schedule_choose(const Plan *p, int op, int nthreads, Schedule *s) noexcept nogil
cdef int64_t first_item(const Plan *p, const Schedule *s, int t) noexcept nogil
cdef double run_elements(const Plan *p, const Schedule *s, int t) noexcept nogil
# What schedule_choose assumes of the machine (read at import; tests may set them)
cdef int64_t cache_l2_bytes, cache_l3_bytes, cache_l3_sharers
