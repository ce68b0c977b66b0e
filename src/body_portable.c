/* The kernels in plain C: the body that defines every result (see bnbw_kernels.h). */
#include "bnbw_simd_portable.h"

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
/* Scheduling before register allocation, minding register pressure: SSE2 has 16 registers,
 * which the 32 f64 lanes of the sums alone fill; the kernels then spill a fifth less (22%
 * fewer instructions in the exact sums' loop with GCC 12).  Scheduling only: the same
 * operations, the same bits. */
#pragma GCC optimize("schedule-insns", "sched-pressure")
#endif

#define K__NAME(name) bnbw_portable_##name
#include "bnbw_kernels_impl.h"

const bnbw_kernel_table bnbw_kernels_portable = K__TABLE_ENTRIES;
